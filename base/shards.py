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

Errors are a policy, kept here for every stage: a failure *reading a source* (``SourceError``) is
that sample's problem and the caller records a reject; a failure *writing our own output* (disk
full, quota, file-size limit, I/O error on a shard, sidecar, plan or manifest) is ``OutputError``:
the unit fails loudly, writes no sidecar, removes its shards, and its re-run after space is freed
gives the clean result. A full disk must never turn good clips into rejects.

A unit's files are written through its claim (base/units.py: ``Claim``): ``ShardWriter(..., claim=)`` checks
the unit's lease before it renames each shard into place and removes its shards through the claim, so a run
that lost its lease (frozen past the TTL on another node, its unit taken over) neither publishes over nor
deletes the new holder's files. ``atomic_path`` (reelcache/files.py) is the plain file helper beneath them
all: a temporary name, fsync, rename. Temporary names are unique to the writer (pid and a random tag), so a run
only ever removes its own.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import time
from pathlib import Path

from reelcache.files import OUTPUT_ERRNOS, OutputError, tmp_name

# Nothing here imports tqdm or pyarrow: `reelcache --help` and `reelcache cluster` (head nodes) start without them.

BLOCK = 512
# The one member a sample removed by a takedown becomes (lineage/holes.py): not a sample, a hole of zeros.
HOLE = "__withdrawn__"


class SourceError(OSError):
    """Reading a source file failed: that sample's problem, recorded as a reject by the caller."""


def content_hash(path, offset: int = 0, size: int | None = None) -> str:
    """blake2b-256 of a video's raw bytes: `size` bytes of `path` from `offset` (a member of a raw shard),
    or the whole file. The one content hash of a root: the catalog's ``clips.content_hash`` (ingest),
    the store's (cache/store.py) and a takedown's (lineage/)."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size - offset if size is None else size
        done = 0
        while done < size:
            chunk = os.pread(f.fileno(), min(1 << 24, size - done), offset + done)
            if not chunk:
                raise ShortRead(f"{path}: short read at {offset + done} of {offset + size} bytes")
            h.update(chunk)
            done += len(chunk)
    return h.hexdigest()


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class ShortRead(SourceError):
    """The source file ended before the size it had when it was probed."""


def _copy_fd(src: int, dst: int, n: int) -> int:
    """Copy n bytes in the kernel (sendfile, else copy_file_range), else by read/write.

    A kernel copy that fails with an error that can only come from the destination is re-raised;
    any other failure falls back to read/write for the rest, which tells a failed read of the
    source (SourceError) from a failed write of ours (a plain OSError).
    """
    done = 0
    kernel = [os.sendfile, lambda d, s, off, k: os.copy_file_range(s, d, k)]
    while done < n:
        k = None
        while kernel and k is None:
            try:
                k = kernel[0](dst, src, None, n - done)
            except OSError as e:
                if e.errno in OUTPUT_ERRNOS:
                    raise
                kernel.pop(0)
        if k is None:
            try:
                buf = os.read(src, min(1 << 20, n - done))
            except OSError as e:
                raise SourceError(e.errno, f"reading the source failed: {e.strerror}") from e
            write_all(dst, buf)
            k = len(buf)
        if k == 0:
            break
        done += k
    return done


class ShardWriter:
    """Writes members into ``<stem>-KK.tar`` files of at most ``max_bytes`` each.

    ``claim``: the claim of the unit the shards belong to (base/units.py: ``Claim``): its lease is checked
    (``claim.verify()``) before each shard is renamed into place, and ``abort`` removes the shards through it
    (``claim.unlink``); None outside a unit."""

    def __init__(self, directory: Path, stem: str, max_bytes: int, fsync: bool = True, claim=None):
        self.dir, self.stem, self.max_bytes, self.fsync = Path(directory), stem, max_bytes, fsync
        self.claim = claim
        self.tmp: Path | None = None
        self.index = -1
        self.fd = None
        self.pos = 0
        self.finished: list[Path] = []
        self.mtime = int(time.time())

    @property
    def name(self) -> str:
        return f"{self.stem}-{self.index:02d}.tar"

    def _open_next(self):
        self._close_current()
        self.index += 1
        self.tmp = tmp_name(self.dir / self.name)
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise OutputError(self.tmp, e) from e
        self.pos = 0

    def _close_current(self):
        if self.fd is None:
            return
        try:
            write_all(self.fd, b"\0" * (2 * BLOCK))  # end-of-archive marker
            if self.fsync:  # durable before it becomes visible under its final name
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
            if self.claim is not None:  # the lease checked first: a run frozen past its TTL must not replace
                self.claim.place(self.tmp, self.dir / self.name)  # the new holder's shard (an S3 unit: uploaded)
            else:
                os.replace(self.tmp, self.dir / self.name)
        except OSError as e:
            raise OutputError(self.tmp, e) from e
        self.tmp = None
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
        srcs = []
        try:  # sources opened first: a missing one fails before any write
            for _, d, _ in members:
                srcs.append(os.open(d, os.O_RDONLY) if not isinstance(d, bytes) else None)
        except OSError as e:
            for fd in srcs:
                if fd is not None:
                    os.close(fd)
            raise SourceError(e.errno, f"cannot open {e.filename}: {e.strerror}") from e
        try:
            pos = start
            for (ext, data, _), size, src in zip(members, sizes, srcs):
                head = self._header(f"{key}.{ext}", size)
                write_all(self.fd, head)
                pos += len(head)
                offsets[ext] = pos
                if src is None:
                    write_all(self.fd, data)
                else:
                    copied = _copy_fd(src, self.fd, size)
                    if copied != size:
                        raise ShortRead(f"read {copied} of {size} bytes; file changed during ingest")
                write_all(self.fd, self._pad(size))
                pos += size + len(self._pad(size))
        except BaseException as e:
            try:
                os.ftruncate(self.fd, start)  # cut the shard back to before this sample
                os.lseek(self.fd, start, os.SEEK_SET)
            except OSError:
                pass  # the unit fails anyway; its shards go with it
            if isinstance(e, OSError) and not isinstance(e, SourceError):
                raise OutputError(self.tmp, e) from e
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
        """Give up: remove the shard being written (its temporary name is this writer's own) and the
        finished ones (no sidecar will name them), through the unit's claim: once another run took the unit
        over, the finished names are that run's shards."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None
        if self.claim is not None:
            self.claim.unlink(self.finished)
        else:
            for p in self.finished:
                p.unlink(missing_ok=True)
        self.finished = []
