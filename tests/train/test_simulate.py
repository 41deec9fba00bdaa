"""`loader simulate` (train/simulate.py): the CLI with a save and an elastic resume, its worker column
against the real DataLoader workers, and a --save-at past the end refused before any simulating."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pyarrow.parquet as pq
import pytest
from support import REPO, ids, run_ranks

from reelcache.base.buckets import BucketConfig
from reelcache.train.loader import LatentLoader

SIZES = BucketConfig.from_toml(REPO / "configs/buckets/tiny.toml")


def test_simulator_cli_with_save_and_elastic_resume(data, tmp_path):
    root, manifest = data
    out = tmp_path / "consumed.parquet"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "reelcache",
            "loader",
            "simulate",
            "--root",
            str(root),
            "--manifest",
            str(manifest),
            "--buckets",
            str(REPO / "configs/buckets/tiny.toml"),
            "--world-size",
            "4",
            "--workers",
            "3",
            "--seed",
            "42",
            "--epochs",
            "2",
            "--out",
            str(out),
            "--save-at",
            "3",
            "--resume-world-size",
            "6",
        ],
        check=True,
        capture_output=True,
    )
    t = pq.read_table(out).to_pylist()
    for epoch in (0, 1):
        real = [r["clip_id"] for r in t if r["epoch"] == epoch and not r["pad"]]
        assert Counter(real) == Counter(ids(manifest))
    assert {r["world_size"] for r in t if r["epoch"] == 1} == {6}
    assert {r["world_size"] for r in t if r["epoch"] == 0} == {4, 6}


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 3 workers on a 2-core CI box
def test_simulator_worker_column_names_the_real_dataloader_worker_after_a_resume(data, monkeypatch):
    from torch.utils.data import get_worker_info

    import reelcache.train.loader as loader_module
    from reelcache.train.simulate import simulate

    real_collate = loader_module.collate

    def collate_and_say_who(*args):  # runs in the forked DataLoader worker that makes the batch
        out = real_collate(*args)
        out["made_by"] = get_worker_info().id
        return out

    monkeypatch.setattr(loader_module, "collate", collate_and_say_who)
    root, manifest = data
    workers = 3
    truth = {}

    def record(per_rank, world):
        for r, batches in enumerate(per_rank):
            for b in batches:
                truth[b["epoch"], b["step"], r, world] = b["made_by"]

    two = [LatentLoader([manifest], SIZES, root=root, rank=r, world_size=2, seed=4, workers=workers) for r in range(2)]
    record(run_ranks(two, steps=5), 2)
    state = two[0].state_dict()
    three = [
        LatentLoader([manifest], SIZES, root=root, rank=r, world_size=3, seed=4, workers=workers) for r in range(3)
    ]
    for ld in three:
        ld.load_state_dict(state)
    record(run_ranks(three), 3)  # the rest of epoch 0, from step 5
    record(run_ranks(three), 3)  # epoch 1, from step 0
    table, _, _ = simulate(
        [manifest], SIZES, root=root, world_size=2, workers=workers, seed=4, epochs=2, save_at=5, resume_world_size=3
    )
    sim = {(r["epoch"], r["step"], r["rank"], r["world_size"]): r["worker"] for r in table.to_pylist()}
    assert sim == truth
    # the resumed part is where `step % workers` was wrong: worker 0 makes the first resumed step
    assert truth[0, 5, 0, 3] == 0 and any(w != s % workers for (e, s, _, _), w in truth.items() if e == 0 and s >= 5)


def test_simulator_save_at_past_the_end_is_refused_and_writes_nothing(data, tmp_path, capsys):
    from reelcache.cli import main
    from reelcache.train.simulate import simulate

    root, manifest = data
    _, summary, _ = simulate([manifest], SIZES, root=root, world_size=2, seed=1, epochs=2)
    total = sum(s["steps"] for s in summary)  # the steps the same run makes, counted without --save-at
    args = ["loader", "simulate", "--root", str(root), "--manifest", str(manifest), "--world-size", "2", "--seed", "1",
            "--buckets", str(REPO / "configs/buckets/tiny.toml"), "--epochs", "2"]  # fmt: skip
    out = tmp_path / "consumed.parquet"
    for at in (total + 1, 0):
        assert main([*args, "--out", str(out), "--save-at", str(at)]) == 2
        err = [e for e in capsys.readouterr().err.splitlines() if "error" in e]
        assert len(err) == 1 and f"--save-at {at}" in err[0], err
        assert not out.exists()
    assert main([*args, "--save-at", str(total + 1)]) == 2
    assert f"are {total} steps; give a step from 1 to {total}" in capsys.readouterr().err
    assert main([*args, "--out", str(out), "--save-at", str(total)]) == 0 and out.exists()  # the last step is fine
