"""The streaming loader: permutation, disjoint equal shares, exact and elastic resume, refusal,
loud small data, seeded noise (checked against shards read with tarfile + safetensors), mixing,
consumed log, SIGKILL (the simulator: test_simulate.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from latent_data import write_latents
from support import REPO, ids, run_ranks

from reelcache.base.buckets import BucketConfig
from reelcache.train.loader import LatentLoader
from reelcache.train.source import read_sample

SIZES = BucketConfig.from_toml(REPO / "configs/buckets/tiny.toml")


def bucket_of(path) -> dict:
    t = pq.read_table(path, columns=["clip_id", "bucket"]).to_pydict()
    return dict(zip(t["clip_id"], t["bucket"]))


def stored(root, manifest) -> dict:
    """clip_id -> its tensors, read with tarfile + safetensors (not through the loader's read path)."""
    from safetensors.torch import load

    out = {}
    for shard in sorted(set(pq.read_table(manifest, columns=["shard"]).column("shard").to_pylist())):
        with tarfile.open(Path(root) / shard) as tar:
            for m in tar:
                assert m.name.endswith(".safetensors")
                out[m.name[: -len(".safetensors")]] = load(tar.extractfile(m).read())
    return out


def expected_x(sample: dict, seed: int, epoch: int, position: int) -> torch.Tensor:
    """The documented rule: x = mean + exp(logvar / 2) * eps, eps ~ N(0, 1) from a torch generator
    seeded with SeedSequence([seed, epoch, position in the epoch's order]).generate_state(1)[0]."""
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch, position]).generate_state(1)[0]))
    eps = torch.randn(sample["mean"].shape, generator=g)
    return (sample["mean"].float() + torch.exp(sample["logvar"].float() / 2) * eps).bfloat16()


def eps_of(x: torch.Tensor, sample: dict) -> torch.Tensor:
    return (x.float() - sample["mean"].float()) / torch.exp(sample["logvar"].float() / 2)


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_epochs_are_permutations_with_disjoint_equal_shares(data, seed, world):
    root, manifest = data
    loaders = [
        LatentLoader([manifest], SIZES, root=root, rank=r, world_size=world, seed=seed, read=False)
        for r in range(world)
    ]
    orders = []
    for epoch in range(3):
        assert all(ld.epoch == epoch for ld in loaders)
        per_rank = run_ranks(loaders)
        assert len({len(b) for b in per_rank}) == 1  # same number of steps on every rank
        real = [c for batches in per_rank for b in batches if b["weight"] == 1 for c in b["clip_id"]]
        assert sorted(real) == sorted(ids(manifest))  # no duplicate, no miss
        for batches in per_rank:
            for b in batches:  # one bucket per batch, the manifest's
                assert {bucket_of(manifest)[c] for c in b["clip_id"]} == {b["bucket"]}
        orders.append(
            [
                c
                for b in sorted((b for rk in per_rank for b in rk if b["weight"] == 1), key=lambda b: b["index"])
                for c in b["clip_id"]
            ]
        )
    assert len({tuple(o) for o in orders}) == 3  # every epoch its own order


def test_global_order_is_independent_of_world_size(data):
    root, manifest = data

    def global_order(world):
        loaders = [
            LatentLoader([manifest], SIZES, root=root, rank=r, world_size=world, seed=3, read=False)
            for r in range(world)
        ]
        batches = [b for rk in run_ranks(loaders) for b in rk if b["weight"] == 1]
        return [tuple(b["clip_id"]) for b in sorted(batches, key=lambda b: b["index"])]

    assert global_order(1) == global_order(2) == global_order(3)


def same(a, b):
    assert a["clip_id"] == b["clip_id"] and a["index"] == b["index"] and a["step"] == b["step"]
    assert (
        torch.equal(a["x"], b["x"])
        and torch.equal(a["text"], b["text"])
        and torch.equal(a["text_mask"], b["text_mask"])
    )


def test_resume_is_exact_and_workers_do_not_change_batches(data):
    root, manifest = data
    ref = list(LatentLoader([manifest], SIZES, root=root, seed=1, workers=0))
    ld = LatentLoader([manifest], SIZES, root=root, seed=1, workers=2)
    it = iter(ld)
    first = [next(it) for _ in range(6)]
    state = json.loads(json.dumps(ld.state_dict()))  # survives serialization
    resumed = LatentLoader([manifest], SIZES, root=root, seed=1, workers=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(first) + len(rest) == len(ref)
    for a, b in zip(first + rest, ref):
        same(a, b)
    assert resumed.epoch == 1 and state["consumed"] == 6
    truth = stored(root, manifest)  # text and mask against the shards
    for b in ref:
        assert b["x"].dtype == torch.bfloat16
        lens = [truth[c]["text"].shape[0] for c in b["clip_id"]]
        assert b["text_len"].tolist() == lens and b["text"].shape[1] == max(lens)
        for i, c in enumerate(b["clip_id"]):
            assert b["text_mask"][i].tolist() == [True] * lens[i] + [False] * (max(lens) - lens[i])
            assert torch.equal(b["text"][i, : lens[i]], truth[c]["text"]) and not b["text"][i, lens[i] :].any()


def test_elastic_resume_from_two_to_three_ranks_misses_and_repeats_nothing(data):
    root, manifest = data
    two = [LatentLoader([manifest], SIZES, root=root, rank=r, world_size=2, seed=5, read=False) for r in range(2)]
    before = run_ranks(two, steps=4)
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["consumed"] == 8
    three = [LatentLoader([manifest], SIZES, root=root, rank=r, world_size=3, seed=5, read=False) for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    after = run_ranks(three)
    assert len({len(b) for b in after}) == 1
    seen = [c for rk in before + after for b in rk if b["weight"] == 1 for c in b["clip_id"]]
    assert Counter(seen) == Counter(ids(manifest))
    assert all(ld.epoch == 1 for ld in three)


def test_changed_manifest_is_refused_unless_data_is_reset(data, tmp_path):
    root, manifest = data
    ld = LatentLoader([manifest], SIZES, root=root, seed=0, read=False)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    smaller = tmp_path / "smaller.parquet"
    pq.write_table(pq.read_table(manifest).slice(1), smaller)
    other = LatentLoader([smaller], SIZES, root=root, seed=0, read=False)
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    msg = str(e.value)
    assert state["fingerprint"][:16] in msg and other.fingerprint[:16] in msg and "reset_data" in msg
    other.load_state_dict(state, reset_data=True)
    assert (other.epoch, other.consumed, other.step) == (0, 0, 0)


def test_small_or_lost_data_is_loud(tmp_path):
    manifest = write_latents(tmp_path, 5, buckets=["144p/17/0.56", "240p/33/0.56"])
    t = pq.read_table(manifest)
    with pytest.warns(UserWarning, match="fewer than its batch size"):
        LatentLoader([manifest], SIZES, root=tmp_path, read=False, world_size=1)
    with pytest.warns(UserWarning, match="padding"):
        LatentLoader([manifest], SIZES, root=tmp_path, read=False, world_size=8, rank=0)
    lost = tmp_path / "lost.parquet"
    import pyarrow as pa

    pq.write_table(t.set_column(1, "bucket", pa.array([None, None, None, None, "144p/17/0.56"], pa.string())), lost)
    with pytest.warns(UserWarning, match="only 1 of 5 clips have latents"):
        LatentLoader([lost], SIZES, root=tmp_path, read=False)
    none = tmp_path / "none.parquet"
    pq.write_table(t.set_column(1, "bucket", pa.array([None] * 5, pa.string())), none)
    with pytest.raises(ValueError, match="none of its 5 clips has latents"):
        LatentLoader([none], SIZES, root=tmp_path, read=False)


def test_x_is_mean_plus_seeded_noise_fresh_per_sample_and_epoch_and_same_after_resume(data):
    root, manifest = data
    truth = stored(root, manifest)
    ld = LatentLoader([manifest], SIZES, root=root, seed=2)
    eps, pairs = {}, 0
    for epoch in (0, 1):
        starts = ld.plan(epoch).starts
        for b in ld:
            assert b["epoch"] == epoch
            for i, c in enumerate(b["clip_id"]):
                torch.testing.assert_close(b["x"][i], expected_x(truth[c], 2, epoch, int(starts[b["index"]]) + i))
                eps[epoch, c] = eps_of(b["x"][i], truth[c])
            for c0, c1 in zip(b["clip_id"], b["clip_id"][1:]):  # neighbours in a batch: other noise
                assert (eps[epoch, c0] - eps[epoch, c1]).abs().mean() > 0.5
                pairs += 1
    assert pairs > 50
    assert all((eps[0, c] - eps[1, c]).abs().mean() > 0.5 for c in truth)  # every clip: new noise next epoch
    noise = torch.cat([e.flatten() for e in eps.values()])
    assert abs(float(noise.mean())) < 0.05 and abs(float(noise.std()) - 1) < 0.05
    # a resume in the middle of epoch 1 (with workers) draws the same noise at the same positions
    first = LatentLoader([manifest], SIZES, root=root, seed=2, read=False)
    list(first)
    it = iter(first)
    for _ in range(4):
        next(it)
    resumed = LatentLoader([manifest], SIZES, root=root, seed=2, workers=2)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert rest and rest[0]["epoch"] == 1 and rest[0]["step"] == 4
    for b in rest:
        for i, c in enumerate(b["clip_id"]):
            assert torch.equal(eps_of(b["x"][i], truth[c]), eps[1, c])


def test_mixing_weights_draw_the_asked_shares(tmp_path):
    a = write_latents(tmp_path, 60, name="a", seed=1)
    b = write_latents(tmp_path, 40, name="b", seed=2)
    ld = LatentLoader([(a, 0.7), (b, 0.3)], SIZES, root=tmp_path, read=False)
    got = [c for bt in ld for c in bt["clip_id"]]
    assert len(got) == 100
    from_a = sum(c in set(ids(a)) for c in got)
    assert from_a == 70 and len(set(got) & set(ids(a))) == 60  # a upsampled: every clip, some twice


def test_upsampled_and_shared_clips_never_repeat_inside_a_batch(tmp_path):
    a = write_latents(tmp_path, 60, name="a", seed=1)
    hq = tmp_path / "manifests" / "hq.parquet"  # a filtered subset of a: the same members
    pq.write_table(pq.read_table(a).take(list(range(0, 60, 4))), hq)
    for mix in ([(a, 0.3), (hq, 0.7)], [(a, 1.0), (hq, 1.0)]):
        ld = LatentLoader(mix, SIZES, root=tmp_path, read=False, world_size=2)
        batches = [
            b
            for rk in run_ranks([ld, LatentLoader(mix, SIZES, root=tmp_path, read=False, world_size=2, rank=1)])
            for b in rk
            if b["weight"] == 1
        ]
        seen = Counter(c for b in batches for c in b["clip_id"])
        drawn = sum(round(w / sum(w for _, w in mix) * 75) for _, w in mix)  # round(w * total) each
        assert max(seen.values()) > 1 and sum(seen.values()) == drawn  # repeats exist ...
        assert all(len(set(b["clip_id"])) == len(b["clip_id"]) for b in batches)  # ... never in one batch


def test_consumed_log_answers_which_clips_a_step_saw(data, tmp_path):
    import duckdb

    root, manifest = data
    log = tmp_path / "consumed"
    ld = LatentLoader([manifest], SIZES, root=root, seed=0, read=False, consumed_log=log, log_every=3)
    batches = list(ld)
    rows = duckdb.sql(
        f"SELECT step, list(clip_id ORDER BY clip_id) FROM '{log}/*.parquet' GROUP BY step ORDER BY step"
    ).fetchall()
    assert [sorted(b["clip_id"]) for b in batches] == [r[1] for r in rows]
    # a manifest of one view per clip: every row is view 0 (tests/cache/test_views.py: caches of several)
    assert duckdb.sql(f"SELECT DISTINCT view FROM '{log}/*.parquet'").fetchall() == [(0,)]
    assert all(set(b["view"]) == {0} for b in batches)


def test_streamed_url_reads_the_same_sample(data):
    root, manifest = data
    t = pq.read_table(manifest)
    shard, offset = str(root / t.column("shard")[3].as_py()), t.column("shard_offset")[3].as_py()
    a, b = read_sample(shard, offset), read_sample(f"pipe:cat {shard}", offset)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # a reader process started and killed
def test_sigkill_mid_epoch_then_resume_continues_exactly(data, tmp_path):
    root, manifest = data
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, os, sys
        from reelcache.train.loader import LatentLoader
        from reelcache.base.buckets import BucketConfig
        sizes = BucketConfig.from_toml({str(REPO / "configs/buckets/tiny.toml")!r})
        ld = LatentLoader([{str(manifest)!r}], sizes, root={str(root)!r}, seed=9, workers=2)
        state = {str(tmp_path / "state.json")!r}
        if os.path.exists(state):
            ld.load_state_dict(json.load(open(state)))
        with open({str(tmp_path / "log.txt")!r}, "a") as log:
            for b in ld:
                log.write(json.dumps([b["step"], b["clip_id"], float(b["x"].float().sum())]) + "\\n")
                log.flush()
                tmp = state + ".tmp"
                json.dump(ld.state_dict(), open(tmp, "w"))
                os.replace(tmp, state)
                if int(os.environ.get("SLOW", "0")):
                    import time; time.sleep(0.05)
    """)
    )
    env = {**os.environ, "SLOW": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    log = tmp_path / "log.txt"
    deadline = time.monotonic() + 60
    while (not log.exists() or len(log.read_text().splitlines()) < 5) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads((tmp_path / "state.json").read_text())
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    kept = [x for x in lines if x[0] < state["step"]]  # the log may run one batch past the state
    assert 0 < state["step"] < 20
    log.write_text("".join(json.dumps(x) + "\n" for x in kept))
    subprocess.run([sys.executable, str(script)], check=True, env={**os.environ, "SLOW": "0"})
    got = [json.loads(x) for x in log.read_text().splitlines()]
    ref = [
        [b["step"], b["clip_id"], float(b["x"].float().sum())]
        for b in LatentLoader([manifest], SIZES, root=root, seed=9)
    ]
    assert got == ref


def test_a_state_from_another_plan_version_is_refused(data):
    root, manifest = data
    ld = LatentLoader([manifest], SIZES, root=root, seed=0, read=False)
    old = {**ld.state_dict(), "plan_version": 1, "consumed": 3}  # saved by plan version 1 (repeats side by side)
    with pytest.raises(ValueError, match="plan version 1.*reset_data"):
        LatentLoader([manifest], SIZES, root=root, seed=0, read=False).load_state_dict(old)


def test_each_sample_carries_its_manifest_fps(tmp_path):
    with_fps = write_latents(tmp_path, 30, name="f", fps=True)
    t = pq.read_table(with_fps).to_pydict()
    fps = dict(zip(t["clip_id"], t["fps"]))
    seen = 0
    for b in LatentLoader([with_fps], SIZES, root=tmp_path, seed=0):
        assert b["fps"].dtype == torch.float64 and b["fps"].tolist() == [fps[c] for c in b["clip_id"]]
        seen += len(b["clip_id"])
    assert seen == 30 and len(set(fps.values())) == 3
    without = write_latents(tmp_path, 10, name="g")
    assert all(torch.isnan(b["fps"]).all() for b in LatentLoader([without], SIZES, root=tmp_path, seed=0))


def test_a_weight_schedule_sets_each_epochs_shares_and_is_part_of_the_position(tmp_path):
    a = write_latents(tmp_path, 60, name="a", seed=1)
    b = write_latents(tmp_path, 40, name="b", seed=2)
    from_a = set(ids(a))
    ramp = [(a, [0.9, 0.6, 0.5]), (b, [0.1, 0.4, 0.5])]
    ld = LatentLoader(ramp, SIZES, root=tmp_path, read=False)
    shares = []
    for _ in range(4):  # the last weight holds after the list
        got = [c for bt in ld for c in bt["clip_id"]]
        shares.append((len(got), sum(c in from_a for c in got)))
    assert shares == [(100, 90), (100, 60), (100, 50), (100, 50)]
    # resuming inside epoch 1 continues with epoch 1's weights, exactly
    ref = LatentLoader(ramp, SIZES, root=tmp_path, read=False)
    list(ref)
    it = iter(ref)
    head = [next(it)["clip_id"] for _ in range(3)]
    resumed = LatentLoader(ramp, SIZES, root=tmp_path, read=False)
    resumed.load_state_dict(ref.state_dict())
    rest = [bt["clip_id"] for bt in resumed]
    ref_epoch1 = LatentLoader(ramp, SIZES, root=tmp_path, read=False)
    list(ref_epoch1)
    assert head + rest == [bt["clip_id"] for bt in ref_epoch1]
    # a state saved under the ramp is refused by a loader with constant weights
    flat = LatentLoader([(a, 0.9), (b, 0.1)], SIZES, root=tmp_path, read=False)
    with pytest.raises(ValueError, match="reset_data"):
        flat.load_state_dict(ref.state_dict())
