"""lineage/holes.py: a removed sample becomes a hole; every other member keeps its offset and bytes, and
webdataset reads the shard without it."""

from __future__ import annotations

import os
import tarfile

from reelcache.base.shards import ShardWriter
from reelcache.lineage.holes import HOLE, punch, sample_spans


def _members(path):
    with tarfile.open(path) as t:
        return {m.name: (m.offset_data, t.extractfile(m).read()) for m in t}


def _shard(tmp_path):
    w = ShardWriter(tmp_path, "000000", 10_000_000)
    keys = ["a0", "b" * 150, "c2", "d3"]  # b...: a name longer than ustar's 100 bytes (a pax header before it)
    offsets = {}
    for i, k in enumerate(keys):
        data = os.urandom(1000 + 700 * i)
        _, off = w.write_sample(k, [("mp4", data, None), ("json", b'{"i": %d}' % i, None), ("txt", b"caption", None)])
        offsets[k] = off
    (path,) = w.close()
    return path, keys, offsets


def test_a_punched_sample_is_gone_and_nothing_else_moves(tmp_path):
    import webdataset as wds

    path, keys, offsets = _shard(tmp_path)
    before, size, mtime = _members(path), path.stat().st_size, path.stat().st_mtime_ns
    gone = [keys[1], keys[2]]
    spans = sample_spans(path, [offsets[k]["mp4"] for k in gone])
    assert sorted(v[2] for v in spans.values()) == sorted(gone)
    removed = punch(path, [(s, e) for s, e, _ in spans.values()])
    after = _members(path)
    assert removed == sum(e - s for s, e, _ in spans.values())
    assert path.stat().st_size == size and path.stat().st_mtime_ns == mtime
    kept = {n: v for n, v in before.items() if not n.startswith(tuple(gone))}
    assert {n: v for n, v in after.items() if n != HOLE} == kept  # same names, same offsets, same bytes
    assert all(k not in after for k in before if k not in kept)
    assert [s["__key__"] for s in wds.WebDataset(str(path), shardshuffle=False)] == [keys[0], keys[3]]
    with open(path, "rb") as f:  # the removed bytes are zeros now
        for s, e, _ in spans.values():
            f.seek(s + 512)
            assert f.read(e - s - 512) == bytes(e - s - 512)
    assert punch(path, [(s, e) for s, e, _ in spans.values()]) == 0  # again: nothing to do, nothing rewritten
    assert _members(path) == after and not list(tmp_path.glob(".*"))


def test_gc_counts_no_hole_as_a_live_entry(tmp_path):
    """A store shard whose entries are holes and garbage holds nothing live (cache gc may delete it)."""
    from reelcache.cache.gc import has_live

    w = ShardWriter(tmp_path, "000000", 10_000_000)
    offsets = [w.write_sample(k, [("safetensors", os.urandom(700), None)])[1]["safetensors"] for k in ("a", "b", "c")]
    (path,) = w.close()
    rel = str(path.relative_to(tmp_path))
    assert has_live(tmp_path, rel, 1)  # two entries besides the garbage one
    punch(path, [(s, e) for s, e, _ in sample_spans(path, offsets[:2]).values()])  # a takedown took two
    assert not has_live(tmp_path, rel, 1)  # the garbage one is all that is left
    assert has_live(tmp_path, rel, 0)
