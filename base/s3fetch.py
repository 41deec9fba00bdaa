"""Tar members of shards in S3, read by exact ranged GETs, and fetched ahead by a small thread pool.

A manifest knows where each member's data starts (``shard_offset``, ``text_offset``), not how long it is.
Its 512-byte tar header sits just before the data, so one GET of ``[offset - 512, end)`` holds the header
and the data, where ``end`` bounds the member from above:

- the start of the next member of the same shard that the manifest names, less its own 512-byte header
  (a member's data is padded to 512 bytes: at most 511 bytes of padding are read with it);
- for the last member the manifest names in a shard, the shard's size (one HEAD per shard, when the loader
  checks the shards before a run) less the 1024 zero bytes that end every tar.

The header is parsed (its checksum checked by ``tarfile``) and the member's ``size`` bytes are returned:
a header that does not parse is one line naming the shard and the byte (rewritten since the manifest was
made?); a member longer than the span read (a tar written with other padding) is completed by a second
exact GET. A span longer than ``MAX_SPAN`` (a manifest naming only a few members of a shard), or no bound
at all, costs two requests instead: the header, then exactly the data. Every GET is ``base/s3.py``'s
``get_range``: its length checked, a reset or short body read again with backoff, a stall one line.

Nothing is coalesced across members: a store sample's latent and caption lie in two objects (two GETs),
and two samples in one batch are rarely neighbours in a shard once block-shuffled; fetching ahead hides
the latency instead (``Fetcher``).
"""

from __future__ import annotations

import os
import tarfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from reelcache.base import s3

HEADER = 512
TAR_END = 1024  # two zero blocks end every tar
MAX_SPAN = 8 * 1024 * 1024  # longer than this, a member is read as header + data (two exact GETs)


def member_ends(shards, offsets, sizes: dict) -> np.ndarray:
    """For each (shard, data offset), the end of the one GET that holds its header and data (exclusive), or -1
    where unknown (not an S3 shard, or its size not known). `sizes`: shard URL -> object size."""
    shards = np.asarray(shards, dtype=object)
    offsets = np.asarray(offsets, dtype=np.int64)
    ends = np.full(len(offsets), -1, dtype=np.int64)
    is_s3 = np.array([isinstance(s, str) and s.startswith("s3://") for s in shards], dtype=bool)
    if not is_s3.any():
        return ends
    rows = np.flatnonzero(is_s3)
    names, codes = np.unique(shards[rows].astype(str), return_inverse=True)
    order = np.lexsort((offsets[rows], codes))
    c, o = codes[order], offsets[rows][order]
    nxt = np.empty_like(o)
    same = np.zeros(len(o), dtype=bool)
    if len(o) > 1:
        same[:-1] = c[:-1] == c[1:]
        nxt[:-1] = o[1:]
    last = np.array([sizes.get(names[k], -1) for k in range(len(names))], dtype=np.int64)
    tail = np.where(last[c] >= 0, last[c] - TAR_END, -1)
    # duplicates (two views at one offset) share the next distinct offset: walk back from the end
    end = np.where(same & (nxt != o), nxt - HEADER, tail)
    for k in range(len(o) - 2, -1, -1):
        if same[k] and nxt[k] == o[k]:
            end[k] = end[k + 1]
    ends[rows[order]] = end
    return ends


def read_member(url: str, offset: int, end: int = -1) -> bytes:
    """The data of the tar member of object `url` whose data starts at `offset`, exactly (see the module)."""
    start = offset - HEADER
    if start < 0:
        raise s3.S3Error(f"reading {url}: no tar member can start at byte {offset}")
    span = end - start
    if end < 0 or span < HEADER or span > MAX_SPAN:
        size = _size(url, offset, s3.get_range(url, start, HEADER))
        return s3.get_range(url, offset, size)
    buf = s3.get_range(url, start, span)
    size = _size(url, offset, buf[:HEADER])
    if HEADER + size > len(buf):
        buf += s3.get_range(url, start + len(buf), HEADER + size - len(buf))
    return buf[HEADER : HEADER + size]


def _size(url: str, offset: int, head: bytes) -> int:
    try:
        return tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape").size
    except tarfile.HeaderError:
        raise s3.S3Error(
            f"reading {url}: no tar member starts at byte {offset} (rewritten since the manifest was made?)"
        ) from None


def shard_sizes(urls, threads: int = 8) -> dict:
    """url -> object size (None: absent) for each S3 shard, by HEADs on `threads` threads."""
    urls = sorted(set(urls))
    if not urls:
        return {}
    with ThreadPoolExecutor(max(1, min(threads, len(urls)))) as pool:
        heads = list(pool.map(s3.head, urls))
    return {u: (None if h is None else int(h["ContentLength"])) for u, h in zip(urls, heads)}


class Fetcher:
    """A thread pool of this process's own (made on first use, again after a fork) that reads members ahead."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def submit(self, url: str, offset: int, end: int) -> Future:
        if self._pool is None or self._pid != os.getpid():
            with self._lock:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="s3fetch")
                self._pid = os.getpid()
        return self._pool.submit(read_member, url, offset, end)

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def __getstate__(self):  # a DataLoader worker makes its own pool
        return {"threads": self.threads}

    def __setstate__(self, state):
        self.__init__(state["threads"])
