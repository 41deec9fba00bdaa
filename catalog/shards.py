"""Size-capped webdataset tar shards, written atomically: the one shard writer of every stage.

A shard is a plain POSIX tar that ``webdataset.WebDataset(url)`` reads with no reelcache code:
members ``<key>.<ext>`` grouped by key (ingest: the original video bytes, ``.json`` metadata and
``.txt`` caption; cache: latents). Each shard is written under a hidden temporary name and
renamed when complete; the unit's sidecar parquet is renamed last, so a present sidecar means
every shard it names is complete. The byte offset of every member's data is returned, so
readers can also fetch one sample with a single ranged read.

Video bytes go from the source file to the tar with ``os.sendfile`` (falling back to
``copy_file_range``, then read/write): the kernel copies, nothing passes through Python buffers, which is
what keeps shard writing at the speed of ``cat``. If a file shrinks while being copied, the
shard is cut back to before that sample and the caller records a reject.
"""

from __future__ import annotations

import os
import tarfile
import time
from contextlib import contextmanager
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

    def write_sample(self, key: str, members: list[tuple[str, bytes | str | Path, int | None]]) -> tuple[str, dict]:
        """Append one sample: members are (ext, bytes or a file path, size of that file).

        Returns (shard file name, {ext: byte offset of that member's data}). Files are copied
        by the kernel; a file shorter than its stated size raises ShortRead and leaves the shard
        as it was before this sample.
        """
        sizes = [len(d) if isinstance(d, bytes) else int(n) for _, d, n in members]
        need = sum(BLOCK + s + BLOCK for s in sizes) + len(key) * len(members)
        if self.fd is None or (self.pos > 0 and self.pos + need > self.max_bytes):
            self._open_next()
        start = self.pos
        offsets = {}
        srcs = [os.open(d, os.O_RDONLY) if not isinstance(d, bytes) else None for _, d, _ in members]
        try:                                       # files opened above: a missing one fails before any write
            pos = start
            for (ext, data, _), size, src in zip(members, sizes, srcs):
                head = self._header(f"{key}.{ext}", size)
                _write_all(self.fd, head)
                pos += len(head)
                offsets[ext] = pos
                if src is None:
                    _write_all(self.fd, data)
                else:
                    copied = _copy_fd(src, self.fd, size)
                    if copied != size:
                        raise ShortRead(f"read {copied} of {size} bytes; file changed during ingest")
                _write_all(self.fd, self._pad(size))
                pos += size + len(self._pad(size))
        except BaseException:
            os.ftruncate(self.fd, start)            # cut the shard back to before this sample
            os.lseek(self.fd, start, os.SEEK_SET)
            raise
        finally:
            for src in srcs:
                if src is not None:
                    os.close(src)
        self.pos = pos
        return self.name, offsets

    def close(self) -> list[Path]:
        self._close_current()
        return self.finished

    def abort(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self._tmp().unlink(missing_ok=True)


@contextmanager
def atomic_path(path):
    """Yield a temporary name beside `path`; once the body wrote it, fsync and rename it into place.

    Readers see the old file or the complete new one, never a partial one; a failure leaves nothing.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def parse_unit(unit: str) -> tuple[str, int]:
    """'<name>/<NNNNNN>' (as `plan` prints it) -> (name, index)."""
    from reelcache import UserError

    try:
        name, idx = unit.strip().rsplit("/", 1)
        return name, int(idx)
    except ValueError:
        raise UserError(f"{unit!r} is not a unit: expected '<name>/<NNNNNN>' as printed by `plan`") from None


def begin_unit(directory: Path, index: int) -> Path | None:
    """The unit protocol shared by every stage: None when the unit finished (its sidecar exists),
    else the sidecar path to write last, after removing whatever a killed run left behind."""
    stem = f"{index:06d}"
    sidecar = Path(directory) / f"{stem}.parquet"
    if sidecar.exists():
        return None
    clear_unit(Path(directory), stem)
    return sidecar


def unit_rows(directory: Path, index: int) -> list[dict]:
    """The unit's slice of the frozen plan: row group `index` of `_plan/input.parquet`."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(Path(directory) / "_plan" / "input.parquet").read_row_group(index).to_pylist()


def clear_unit(directory: Path, stem: str) -> int:
    """Remove what a killed run of this unit may have left: temporaries and unclaimed shards."""
    n = 0
    for p in list(directory.glob(f".{stem}-*.tar.tmp*")) + list(directory.glob(f"{stem}-*.tar")) + \
            list(directory.glob(f".{stem}.parquet.tmp*")):
        p.unlink(missing_ok=True)
        n += 1
    return n
