"""The evaluator's small parts alone, in milliseconds, on files written here (no model, no cache run):
its val_loss.parquet against rows written out by hand, which cache a manifest was made from, and a
checkpoint whose shards are not all there refused before any work. The server end to end is in
tests/eval/test_serve.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reelcache import UserError
from reelcache.eval.checkpoints import check_weights
from reelcache.eval.encoders import made_from
from reelcache.eval.records import VAL_LOSS_PARQUET, write_json, write_val_loss_parquet

INDEX = "model.safetensors.index.json"


def _val_loss(step, weights, overall, buckets, timesteps, clips=6):
    return {
        "checkpoint": f"ckpt-{step:08d}",
        "global_step": step,
        "weights": weights,
        "manifest_fingerprint": "fp",
        "overall": overall,
        "clips": clips,
        "buckets": buckets,
        "timesteps": timesteps,
    }


def test_val_loss_parquet_has_a_row_per_checkpoint_bucket_and_timestep(tmp_path):
    bucket = {"144p/5": {"loss": 0.4, "clips": 2}}
    write_json(tmp_path / "ckpt-00000020" / "val_loss.json", _val_loss(20, "ema", 0.5, bucket, {"250": 0.3}))
    write_json(tmp_path / "ckpt-00000010" / "val_loss-model.json", _val_loss(10, "model", 0.9, {}, {"750": 1.1}))
    write_val_loss_parquet(tmp_path)

    def base(step, weights):
        return {"global_step": step, "checkpoint": f"ckpt-{step:08d}", "weights": weights, "manifest_fingerprint": "fp"}

    assert pq.read_table(tmp_path / VAL_LOSS_PARQUET).to_pylist() == [
        {**base(10, "model"), "bucket": "all", "t": None, "loss": 0.9, "clips": 6},
        {**base(10, "model"), "bucket": "all", "t": 750.0, "loss": 1.1, "clips": 6},
        {**base(20, "ema"), "bucket": "all", "t": None, "loss": 0.5, "clips": 6},
        {**base(20, "ema"), "bucket": "144p/5", "t": None, "loss": 0.4, "clips": 2},
        {**base(20, "ema"), "bucket": "all", "t": 250.0, "loss": 0.3, "clips": 6},
    ]
    assert not list(tmp_path.rglob("*.tmp*"))  # the temporary names were renamed into place


def test_the_cache_a_manifest_was_made_from(tmp_path):
    def manifest(name, shard, sidecar=None):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"shard": [shard]}), path)
        if sidecar is not None:
            path.with_suffix(".json").write_text(json.dumps(sidecar))
        return path

    raw = manifest("raw", "raw/src/000000-00.tar")
    by_path = manifest("lat", "latents/tiny/000000/000000-00.tar")
    by_sidecar = manifest("side", "raw/src/000000-00.tar", {"cache": "wan-240p"})
    assert made_from([raw, by_path]) == "tiny"  # the first that names one
    assert made_from([by_sidecar, by_path]) == "wan-240p"
    with pytest.raises(UserError, match="pass --cache NAME"):
        made_from([raw])


def test_a_checkpoint_missing_a_shard_or_its_folder_is_refused_in_one_line(tmp_path):
    ckpt = tmp_path / "ckpt-00000010"
    for folder in ("model", "ema"):
        (ckpt / folder).mkdir(parents=True)
        names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        (ckpt / folder / INDEX).write_text(json.dumps({"weight_map": {"a": names[0], "b": names[1]}}))
        for n in names:
            (ckpt / folder / n).write_bytes(b"x")
    check_weights(ckpt, "ema")  # whole: nothing said
    (ckpt / "model" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match=r"model/model-00002-of-00002.safetensors is missing \(1 of the 2 shards"):
        check_weights(ckpt, "ema")  # an EMA load reads model/ too
    (ckpt / "ema" / INDEX).write_text('{"weight_map": ')
    with pytest.raises(UserError, match="ema/model.safetensors.index.json is not a shard index"):
        check_weights(ckpt, "ema")
    with pytest.raises(UserError, match="no nothing/ folder"):
        check_weights(ckpt, "nothing")
