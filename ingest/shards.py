"""Size-capped webdataset tar shards, written atomically.

A shard is a plain POSIX tar that ``webdataset.WebDataset(url)`` reads with no reelcache code:
members ``<key>.<ext>`` (original video bytes), ``<key>.json`` (metadata) and ``<key>.txt``
(caption), grouped by key. Each shard is written under a hidden temporary name and renamed when
complete; the unit's sidecar parquet is renamed last, so a present sidecar means every shard it
names is complete.

Video bytes go from the source file to the tar with ``os.sendfile`` (falling back to
``copy_file_range``, then read/write): the kernel copies, nothing passes through Python buffers, which is
what keeps shard writing at the speed of ``cat``. If a file shrinks while being copied, the
shard is cut back to before that member and the caller records a reject.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

BLOCK = 512


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class ShortRead(OSError):
    """The source file ended before the size it had when it was probed."""


def _copy_fd(src: int, dst: int, n: int) -> int:
    """Copy n bytes in the kernel (sendfile, else copy_file_range, else read/write)."""
    done = 0
    while done < n:
        try:
            k = os.sendfile(dst, src, None, n - done)
        except OSError:
            try:
                k = os.copy_file_range(src, dst, n - done)
            except OSError:
                buf = os.read(src, min(1 << 20, n - done))
                _write_all(dst, buf)
                k = len(buf)
        if k == 0:
            break
        done += k
    return done


class ShardWriter:
    """Writes members into ``<stem>-KK.tar`` files of at most ``max_bytes`` each."""

    def __init__(self, directory: Path, stem: str, max_bytes: int, fsync: bool = True):
        self.dir, self.stem, self.max_bytes, self.fsync = Path(directory), stem, max_bytes, fsync
        self.index = -1
        self.fd = None
        self.pos = 0
        self.finished: list[Path] = []
        self.mtime = int(time.time())

    @property
    def name(self) -> str:
        return f"{self.stem}-{self.index:02d}.tar"

    def _tmp(self) -> Path:
        return self.dir / f".{self.name}.tmp{os.getpid()}"

    def _open_next(self):
        self._close_current()
        self.index += 1
        self.fd = os.open(self._tmp(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0

    def _close_current(self):
        if self.fd is None:
            return
        _write_all(self.fd, b"\0" * (2 * BLOCK))   # end-of-archive marker
        if self.fsync:             # durable before it becomes visible under its final name
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self._tmp(), self.dir / self.name)
        self.finished.append(self.dir / self.name)

    def _header(self, name: str, size: int) -> bytes:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode = size, self.mtime, 0o644
        return ti.tobuf(format=tarfile.PAX_FORMAT)

    def _pad(self, size: int) -> bytes:
        return b"\0" * (-size % BLOCK)

    def write_sample(self, key: str, video_path: str, video_size: int, ext: str,
                     json_bytes: bytes, txt_bytes: bytes) -> tuple[str, int]:
        """Append one sample; returns (shard file name, byte offset of the video data)."""
        need = sum(len(self._header("x" * 40, 0)) + s + BLOCK for s in (video_size, len(json_bytes), len(txt_bytes)))
        if self.fd is None or (self.pos > 0 and self.pos + need > self.max_bytes):
            self._open_next()
        start = self.pos
        src = os.open(video_path, os.O_RDONLY)     # fails before anything is written
        try:
            head = self._header(f"{key}.{ext}", video_size)
            _write_all(self.fd, head)
            offset = start + len(head)
            copied = _copy_fd(src, self.fd, video_size)
            if copied != video_size:
                raise ShortRead(f"read {copied} of {video_size} bytes; file changed during ingest")
            buf = io.BytesIO()
            buf.write(self._pad(video_size))
            for name, data in ((f"{key}.json", json_bytes), (f"{key}.txt", txt_bytes)):
                buf.write(self._header(name, len(data)))
                buf.write(data)
                buf.write(self._pad(len(data)))
            _write_all(self.fd, buf.getvalue())
        except BaseException:
            os.ftruncate(self.fd, start)            # cut the shard back to before this sample
            os.lseek(self.fd, start, os.SEEK_SET)
            raise
        finally:
            os.close(src)
        self.pos = offset + video_size + len(buf.getvalue())
        return self.name, offset

    def close(self) -> list[Path]:
        self._close_current()
        return self.finished

    def abort(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self._tmp().unlink(missing_ok=True)


def clear_unit(directory: Path, stem: str) -> int:
    """Remove what a killed run of this unit may have left: temporaries and unclaimed shards."""
    n = 0
    for p in list(directory.glob(f".{stem}-*.tar.tmp*")) + list(directory.glob(f"{stem}-*.tar")) + \
            list(directory.glob(f".{stem}.parquet.tmp*")):
        p.unlink(missing_ok=True)
        n += 1
    return n
