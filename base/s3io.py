"""An object in S3 as a seekable, read-only file: what PyAV (``av.open(fileobj)``) and ``tarfile`` read without
downloading the object (docs/STORAGE.md, "Source videos in S3").

``S3File(url, size)`` reads aligned blocks of ``block`` bytes by ranged GETs through base/s3.py's exact
``get_range`` (the length of each checked, a reset or short body read again, a stall one line naming the object)
and keeps the last ``keep`` blocks (least recently used dropped first). A read that needs several blocks none of
which is kept fetches them in one GET. A probe reads the container's header and index (an MP4's moov atom, often
at the end) and the first frame's packet: a few blocks of a large file, never the whole of it. ``bytes_read`` and
``requests`` count what was fetched (the ingest unit's summary reports them against the files' sizes).
"""

from __future__ import annotations

import io
from collections import OrderedDict

from reelcache.base import s3

BLOCK = 256 * 1024
KEEP = 16  # blocks kept: 4 MB


class S3File(io.RawIOBase):
    def __init__(self, url, size: int | None = None, *, block: int = BLOCK, keep: int = KEEP):
        self.url = s3.parse(url)
        if size is None:
            h = s3.head(self.url)
            if h is None:
                raise FileNotFoundError(f"{self.url}: no such object")
            size = int(h["ContentLength"])
        self.size, self.block, self.keep = int(size), int(block), int(keep)
        self.pos = 0
        self.blocks: OrderedDict[int, bytes] = OrderedDict()
        self.bytes_read = 0
        self.requests = 0

    @property
    def name(self) -> str:
        return str(self.url)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        pos = base + int(offset)
        if pos < 0:
            raise ValueError(f"{self.url}: seek to {pos}")
        self.pos = pos
        return pos

    def _fetch(self, first: int, last: int) -> None:
        """Blocks first..last (inclusive) into the kept ones: the missing ones, a run of neighbours in one GET."""
        i = first
        while i <= last:
            if i in self.blocks:
                self.blocks.move_to_end(i)
                i += 1
                continue
            j = i
            while j + 1 <= last and j + 1 not in self.blocks:
                j += 1
            start = i * self.block
            end = min(self.size, (j + 1) * self.block)
            data = s3.get_range(self.url, start, end - start)
            self.bytes_read += len(data)
            self.requests += 1
            for k in range(i, j + 1):
                self.blocks[k] = data[(k - i) * self.block : (k - i + 1) * self.block]
            i = j + 1
        while len(self.blocks) > max(self.keep, last - first + 1):
            self.blocks.popitem(last=False)

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.size:
            return b""
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        if n == 0:
            return b""
        first, last = self.pos // self.block, (self.pos + n - 1) // self.block
        self._fetch(first, last)
        buf = b"".join(self.blocks[k] for k in range(first, last + 1))
        off = self.pos - first * self.block
        out = buf[off : off + n]
        self.pos += len(out)
        return out

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)
