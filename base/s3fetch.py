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

import hashlib
import os
import tarfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

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


def shard_heads(urls, threads: int = 8) -> dict:
    """url -> (object size, its version: ETag and size) for each S3 shard, (None, None) where absent, by HEADs
    on `threads` threads."""
    urls = sorted(set(urls))
    if not urls:
        return {}
    with ThreadPoolExecutor(max(1, min(threads, len(urls)))) as pool:
        heads = list(pool.map(s3.head, urls))
    return {
        u: (None, None) if h is None else (int(h["ContentLength"]), f"{h.get('ETag', '')}/{h['ContentLength']}")
        for u, h in zip(urls, heads)
    }


class MemberCache:
    """Members read from S3 kept in a local folder up to `limit` bytes, least recently used evicted first.

    A member is a file named by the digest of (shard URL, the shard's ETag and size, data offset): a shard
    rewritten in S3 has another ETag, so its old members are never used again (they age out). A file is
    written under a temporary name and published by rename, so a reader sees a whole member or none; a hit's
    mtime is set to now (the LRU order). Eviction lists the folder for its real total and removes the oldest
    files until it holds at most 90% of `limit`; a process evicts at its start and whenever it would pass 10% of
    the limit added since it last did, so one process alone never leaves more than `limit` behind. Several
    processes may share the folder (the data workers, the ranks of a node): then it may briefly hold up to 10% of
    the limit more per process."""

    def __init__(self, directory, limit: int):
        self.dir, self.limit = Path(directory), int(limit)
        self.added = 0
        self._lock = threading.Lock()

    def __getstate__(self):  # a process of its own counts what it adds
        return {"dir": self.dir, "limit": self.limit}

    def __setstate__(self, state):
        self.__init__(state["dir"], state["limit"])

    def _path(self, url: str, version: str, offset: int) -> Path:
        h = hashlib.sha256(f"{url}\0{version}\0{offset}".encode()).hexdigest()
        return self.dir / h[:2] / h[2:]

    def get(self, url: str, version: str, offset: int) -> bytes | None:
        p = self._path(url, version, offset)
        try:
            data = p.read_bytes()
            os.utime(p)
        except FileNotFoundError:
            return None
        return data

    def put(self, url: str, version: str, offset: int, data: bytes) -> None:
        p = self._path(url, version, offset)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with self._lock:
            if self.added + len(data) >= self.limit // 10:
                self.added = 0
                self.evict(self.limit - len(data))
            tmp.write_bytes(data)
            os.replace(tmp, p)
            self.added += len(data)

    def evict(self, room: int | None = None) -> None:
        """Remove the least recently used members until the folder holds at most 90% of the limit (and at most
        `room` bytes)."""
        keep = min(self.limit * 9 // 10, self.limit if room is None else room)
        files = []
        for p in self.dir.glob("*/*"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(f[1] for f in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= keep:
                break
            p.unlink(missing_ok=True)
            total -= size


class Fetcher:
    """A thread pool of this process's own (made on first use, again after a fork) that reads members ahead,
    through a MemberCache when given one (`versions`: shard URL -> its ETag and size)."""

    def __init__(self, threads: int, cache: MemberCache | None = None, versions: dict | None = None):
        self.threads, self.cache, self.versions = threads, cache, versions or {}
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def read(self, url: str, offset: int, end: int) -> bytes:
        if self.cache is None:
            return read_member(url, offset, end)
        version = self.versions.get(url, "")
        data = self.cache.get(url, version, offset)
        if data is None:
            data = read_member(url, offset, end)
            self.cache.put(url, version, offset, data)
        return data

    def submit(self, url: str, offset: int, end: int) -> Future:
        if self._pool is None or self._pid != os.getpid():
            with self._lock:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="s3fetch")
                self._pid = os.getpid()
        return self._pool.submit(self.read, url, offset, end)

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def __getstate__(self):  # a DataLoader worker makes its own pool
        return {"threads": self.threads, "cache": self.cache, "versions": self.versions}

    def __setstate__(self, state):
        self.__init__(state["threads"], state["cache"], state["versions"])
