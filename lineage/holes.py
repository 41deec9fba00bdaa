"""Removing samples from a tar shard without moving any other byte: each removed sample becomes a hole.

A sample is the consecutive members of one key (ingest: ``<clip>.mp4``, ``.json``, ``.txt``; the store:
``<key>.safetensors``). Its headers and data are replaced, in place of exactly the same bytes, by one regular
member named ``__withdrawn__`` whose data are zeros: webdataset skips a top-level ``__...__`` member (its
metadata convention), tarfile lists it, and every other member keeps its offset, so every offset recorded
anywhere (the catalog, sidecars, the store's indexes, frozen manifests and cache plans, a run's resume
position) stays right, and the other samples stay byte-identical. The removed bytes are gone from the file;
its size does not change.

A shard is rewritten atomically: copied to a temporary beside it, the holes written into the copy, fsync'd,
given the old file's mtime (the store's raw-location stamps, size:mtime, stay valid: nothing else changed)
and renamed over it. Readers see the old file or the new one; a kill at any point leaves one of them, and
running again finds the holes already made and skips them.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
from pathlib import Path

from reelcache.base.shards import BLOCK, HOLE
from reelcache.files import OutputError, fsync_path

_KEY = re.compile(r"^((?:.*/|)[^./]+)[.]")  # webdataset's sample key: folder + the base name up to its first dot


def _end(m: tarfile.TarInfo) -> int:
    return m.offset_data + -(-m.size // BLOCK) * BLOCK


def sample_spans(path, data_offsets) -> dict[int, tuple[int, int, str]]:
    """data offset of a member -> (start, end, key) of its whole sample in the shard at `path`: from the first
    header of the key's members to the end of the last one's data. An offset whose sample is a hole already
    maps to (start, end, HOLE); one that is no member's data start is absent."""
    wanted = set(int(o) for o in data_offsets)
    members = []
    with tarfile.open(path) as t:
        for m in t:
            members.append(m)
    out = {}
    for i, m in enumerate(members):
        if m.offset_data not in wanted:
            continue
        if m.name == HOLE:
            out[m.offset_data] = (m.offset, _end(m), HOLE)
            continue
        key = (_KEY.match(m.name) or [None, m.name])[1]
        lo = hi = i
        while lo > 0 and (_KEY.match(members[lo - 1].name) or [None, None])[1] == key:
            lo -= 1
        while hi + 1 < len(members) and (_KEY.match(members[hi + 1].name) or [None, None])[1] == key:
            hi += 1
        out[m.offset_data] = (members[lo].offset, _end(members[hi]), key)
    # a hole starts where the sample's first header started: map later offsets of a hole too
    return out


def hole_header(length: int) -> bytes:
    """The one header of a hole of `length` bytes (header included; a multiple of 512)."""
    ti = tarfile.TarInfo(HOLE)
    ti.size, ti.mtime, ti.mode, ti.type = length - BLOCK, 0, 0o644, tarfile.REGTYPE
    head = ti.tobuf(format=tarfile.GNU_FORMAT)
    assert len(head) == BLOCK and length % BLOCK == 0 and length >= BLOCK
    return head


def is_hole(path, start: int) -> bool:
    with open(path, "rb") as f:
        f.seek(start)
        head = f.read(BLOCK)
    return head[: len(HOLE) + 1] == HOLE.encode() + b"\0"


def punch(path, spans: list[tuple[int, int]]) -> int:
    """Rewrite the shard at `path` with each (start, end) span a hole; returns the bytes newly removed (0 when
    every span was a hole already: nothing is rewritten)."""
    path = Path(path)
    todo = sorted({(s, e) for s, e in spans if not is_hole(path, s)})
    if not todo:
        return 0
    tmp = path.parent / f".{path.name}.takedown{os.getpid()}"
    st = path.stat()
    try:
        shutil.copyfile(path, tmp)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            zeros = b"\0" * (1 << 20)
            for start, end in todo:
                os.pwrite(fd, hole_header(end - start), start)
                pos = start + BLOCK
                while pos < end:
                    pos += os.pwrite(fd, zeros[: min(len(zeros), end - pos)], pos)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as e:
        raise OutputError(path, e, unit=False) from e
    finally:
        tmp.unlink(missing_ok=True)
    return sum(e - s for s, e in todo)
