"""Plain file helpers of every floor and stage: a file published whole or not at all (``atomic_path``), and
the one error for a failure to write our own output (``OutputError``).

Errors are a policy, kept here for every stage: a failure *writing our own output* (disk full, quota,
file-size limit, I/O error on a shard, sidecar, plan, manifest, checkpoint or preview) is ``OutputError``:
never a reject of the input that was being written. A unit's files are published through its claim
(base/units.py: ``Claim.publish``), which checks the unit's lease and then uses ``atomic_path``.
"""

from __future__ import annotations

import errno
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from reelcache import UserError

# Errors that can only come from the side being written.
OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class OutputError(UserError):
    """Writing our own output failed: the unit fails (no sidecar), nothing is recorded as a reject."""

    def __init__(self, path, err: OSError, unit: bool = True):
        code = errno.errorcode.get(err.errno, "") if isinstance(err.errno, int) else ""
        what = err.strerror or str(err)
        consequence = "the unit is not finished and none of its clips was recorded; " if unit else ""
        super().__init__(
            f"cannot write {path}: {what}"
            + (f" [errno {err.errno} {code}]" if code else "")
            + ". Our own output failed (disk full, quota, file-size limit or I/O error): "
            + consequence
            + "free space and run it again."
        )
        self.path, self.errno = str(path), err.errno


def tmp_name(path: Path) -> Path:
    """A hidden temporary name beside `path`, unique to this writer: ``.<name>.tmp<pid>-<tag>``."""
    return path.parent / f".{path.name}.tmp{os.getpid()}-{secrets.token_hex(4)}"


def fsync_path(path) -> None:
    """Make a file's data, or a folder's entries (a rename into it), durable: fsync on a read-only handle."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path):
    """Yield a temporary name beside `path`; once the body wrote it, fsync and rename it into place.

    Readers see the old file or the complete new one, never a partial one; a failure leaves nothing, and an
    OSError while writing is an OutputError naming `path`. A plain file helper: a unit's files are published
    through its claim (base/units.py: ``Claim.publish``), which checks the unit's lease first.
    """
    path = Path(path)
    tmp = tmp_name(path)
    try:
        try:
            yield tmp
            fsync_path(tmp)
            os.replace(tmp, path)
        except OSError as e:
            raise OutputError(path, e, unit=False) from e
    finally:
        tmp.unlink(missing_ok=True)
