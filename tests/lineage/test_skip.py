"""The loader's skip (train/loader.py, `--data.skip_withdrawn`): withdrawn clips leave their planned batches,
whose other samples keep their latents and noise, the plan and its fingerprint do not change, resume stays
exact; the skipped samples are holes in their shard (lineage/holes.py), so reading one would fail."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch
from latent_data import write_latents
from support import REPO

from reelcache.base.buckets import BucketConfig
from reelcache.lineage.holes import punch, sample_spans
from reelcache.train.loader import LatentLoader

SIZES = BucketConfig.from_toml(REPO / "configs/buckets/tiny.toml")


def test_skipped_clips_leave_their_batches_and_the_rest_is_exact_across_a_resume(tmp_path):
    manifest = write_latents(tmp_path, 24, shard_bytes=10_000_000)
    ref = list(LatentLoader([manifest], SIZES, root=tmp_path, seed=1))
    skip = set(ref[0]["clip_id"]) | {next(c for b in ref[1:] if len(b["clip_id"]) > 1 for c in b["clip_id"])}
    rows = pq.read_table(manifest).to_pylist()
    for shard in {r["shard"] for r in rows}:
        offsets = [r["shard_offset"] for r in rows if r["shard"] == shard and r["clip_id"] in skip]
        punch(tmp_path / shard, [(s, e) for s, e, _ in sample_spans(tmp_path / shard, offsets).values()])
    ld = LatentLoader([manifest], SIZES, root=tmp_path, seed=1, skip=skip)
    assert ld.fingerprint == LatentLoader([manifest], SIZES, root=tmp_path, seed=1).fingerprint
    it = iter(ld)
    first = [next(it) for _ in range(3)]
    resumed = LatentLoader([manifest], SIZES, root=tmp_path, seed=1, skip=skip)
    resumed.load_state_dict(json.loads(json.dumps(ld.state_dict())))
    got = first + list(resumed)
    assert [(b["step"], b["index"]) for b in got] == [(b["step"], b["index"]) for b in ref]
    for a, b in zip(got, ref):
        kept = [c for c in b["clip_id"] if c not in skip]
        if not kept:  # every clip of the batch withdrawn: a padding batch of one live clip of its bucket
            assert a["weight"] == 0 and len(a["clip_id"]) == 1 and a["clip_id"][0] not in skip
            assert a["bucket"] == b["bucket"]
            continue
        assert a["clip_id"] == kept and a["weight"] == b["weight"]
        for i, c in enumerate(kept):  # same latent, same noise (seeded by its position in the epoch)
            assert torch.equal(a["x"][i], b["x"][b["clip_id"].index(c)])
    assert not skip & {c for b in got if b["weight"] for c in b["clip_id"]}


def test_a_skipped_clips_shard_freed_by_gc_is_not_needed_to_start(tmp_path):
    """After a takedown, `cache gc --delete` frees a store shard whose entries were all withdrawn: a start
    that skips them must not need it (its shard check leaves skipped rows out); without the skip, one line."""
    import pytest

    from reelcache import UserError

    manifest = write_latents(tmp_path, 24, shard_bytes=20_000)
    rows = pq.read_table(manifest).to_pylist()
    shards = sorted({r["shard"] for r in rows})
    assert len(shards) > 2
    gone = shards[1]
    skip = {r["clip_id"] for r in rows if r["shard"] == gone}
    (tmp_path / gone).unlink()
    with pytest.raises(UserError, match=r"latent shard .* is missing|does not exist|missing"):
        LatentLoader([manifest], SIZES, root=tmp_path, seed=1)
    got = list(LatentLoader([manifest], SIZES, root=tmp_path, seed=1, skip=skip))
    trained = {c for b in got if b["weight"] for c in b["clip_id"]}
    assert trained == {r["clip_id"] for r in rows} - skip
