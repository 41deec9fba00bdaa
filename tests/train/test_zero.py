"""The ZeRO-2 path GPU nodes run (ColossalAI's LowLevelZeroPlugin stage 2, HybridAdam, fp32 master
shards, the optimizer checkpoint, the background checkpoint writer), executed on 2 CPU processes over
gloo in its CPU mode (train/zero_cpu.py). The gradient check and the kill -9 resume of the ZeRO
path are parametrized into tests/train/test_train.py beside their DDP twins; here: what only ZeRO has.

References: the checkpoint's own files read independently (safetensors + JSON), the consumed log
against the manifest, the same run without a slow writer, the DDP and ZeRO runs of each other.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from latent_data import write_latents
from support import (
    PLUGINS,
    complete,
    consumed,
    data_args,
    ema_rule_error,
    json_lines,
    manifest_clips,
    metrics,
    train,
    weights,
)

WRITER = ["tests/writer_faults.py"]

pytestmark = pytest.mark.slow  # every test runs ranks in processes of their own


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("zero-root")
    return r, write_latents(r, 24, name="train")


def check_optimizer(r: Path, manifest: Path, ckpt: Path, nproc: int, plugin: str = "zero2", dtype: str = "fp32"):
    args = [str(manifest), str(ckpt), plugin, dtype]
    (out,) = json_lines(train(r, args, nproc=nproc, entry=["tests/optimizer_check.py"]))
    return out


def test_zero_resumes_on_another_world_size(root):
    """A ZeRO checkpoint written by 1 rank, loaded by 2, and theirs loaded by 1 again (one chain of runs, each
    resume on the other world size): each rank holds exactly its ZeRO share of the saved Adam moments and the
    saved step counts; the run then finishes the epoch with every clip of the manifest exactly once."""
    r, manifest = root
    run = r / "runs/ws"
    args = data_args(
        manifest,
        "--run.epochs=1",
        "--checkpoint.every=2",
        "--checkpoint.keep_last=5",
        "--run.name=ws",
        *PLUGINS["zero2-fp32"],
    )
    train(r, args + ["--run.max_steps=2"], nproc=1)
    # 1 rank: 10 steps an epoch, 2 ranks: 5; steps 0-1 on 1 rank, 2-3 on 2 ranks, the rest of the epoch on 1
    for step, after, until in ((2, 2, ["--run.max_steps=4"]), (4, 1, [])):
        got = check_optimizer(r, manifest, run / f"ckpt-{step:08d}", after)
        assert got["world"] == after and got["tensors"] > 100
        assert got["max_abs_diff"] == 0.0 and got["steps"] == [[step, step]], got
        train(r, args + ["--load", "latest", *until], nproc=after)
        newest = json.loads((run / max(p.name for p in run.glob("ckpt-*")) / "state.json").read_text())
        assert newest["world_size"] == after and newest["loader"]["epoch"] == (1 if after == 1 else 0), newest
    rows = consumed(run)
    assert {(e, rank) for e, _, rank, _ in rows} >= {(0, 0), (0, 1)}
    import duckdb

    clips = Counter(
        c
        for (c,) in duckdb.sql(f"""SELECT clip_id FROM '{run}/consumed/*.parquet'
        WHERE NOT pad QUALIFY generation = max(generation) OVER (PARTITION BY epoch, step)""").fetchall()
    )
    assert clips == manifest_clips(manifest)  # no clip twice, none missed in the epoch


# The runs the writer tests compare a slow writer's run with, which other tests here read as well (a launch of
# 2 ranks costs ~16 CPU-s before its first step): ZeRO-2 bf16 with a checkpoint every step (the EMA test's
# consecutive checkpoints), and DDP with the cross-plugin tests' settings (their uninterrupted DDP run).
ZERO_BF16 = [
    "--run.epochs=1",
    "--checkpoint.every=1",
    "--run.max_steps=4",
    "--checkpoint.keep_last=5",
    *PLUGINS["zero2-bf16"],
]
# eps 1e-6: see test_checkpoints_move_between_ddp_and_zero.
CROSS = [
    "--run.epochs=1",
    "--checkpoint.every=2",
    "--run.max_steps=4",
    "--checkpoint.keep_last=5",
    "--optim.adam_eps=1e-6",
]


def prompt_run(r: Path, args: list[str], name: str) -> Path:
    """runs/<name> of `args` with the trainer as it is, trained once for the module; its path."""
    if not (r / f"runs/{name}/ckpt-00000004").exists():
        train(r, args + [f"--run.name={name}"], nproc=2)
    return r / f"runs/{name}"


def _slow_writer_writes_what_a_prompt_one_does(r: Path, args: list[str], prompt: str, tag: str) -> None:
    """The same run with rank 0's writer 2 s late per weights folder holds the same bytes in every
    checkpoint: what was saved is a copy, not the live tensors training went on changing."""
    prompted = prompt_run(r, args, prompt)
    train(r, args + [f"--run.name=slow-{tag}"], nproc=2, entry=WRITER, env={"REELCACHE_TEST_SLOW_WRITE_S": "2"})
    steps = sorted(int(p.name.removeprefix("ckpt-")) for p in prompted.glob("ckpt-*"))
    assert steps == sorted(int(p.name.removeprefix("ckpt-")) for p in (r / f"runs/slow-{tag}").glob("ckpt-*"))
    assert {2, 4} <= set(steps), steps
    for step in steps:
        a, b = prompted / f"ckpt-{step:08d}", r / f"runs/slow-{tag}/ckpt-{step:08d}"
        assert complete(a) and complete(b)
        for part in ("model", "ema"):
            wa, wb = weights(a, part), weights(b, part)
            assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa), (step, part)
        assert (a / "optimizer/state.safetensors").read_bytes() == (b / "optimizer/state.safetensors").read_bytes(), (
            step
        )
    assert [m["loss"] for m in metrics(prompted).values()] == [
        m["loss"] for m in metrics(r / f"runs/slow-{tag}").values()
    ]


def test_background_writer_copies_and_a_failed_write_stops_every_rank(root):
    """Rank 0 writes each checkpoint in a thread while training goes on: written 2 s late per folder,
    the checkpoints hold exactly the state of their step (the same bytes as a run without the
    delay). A write that fails (ENOSPC at step 4) makes both ranks exit non-zero with the reason,
    and no ckpt-00000004 ever appears: only complete checkpoints are visible."""
    r, manifest = root
    _slow_writer_writes_what_a_prompt_one_does(r, data_args(manifest, *ZERO_BF16), "prompt-zero2-bf16", "zero2-bf16")

    args = data_args(manifest, *[a.replace("every=1", "every=2") for a in ZERO_BF16])  # checkpoints 2 and 4
    out = train(
        r, args + ["--run.name=full-disk"], nproc=2, ok=False, entry=WRITER, env={"REELCACHE_TEST_FAIL_WRITE_AT": "4"}
    )
    run = r / "runs/full-disk"
    assert "No space left on device" in out  # rank 0: the reason
    assert "rank 0 failed to write a checkpoint" in out  # rank 1 stops with it
    assert [p.name for p in run.glob("ckpt-*")] == ["ckpt-00000002"] and complete(run / "ckpt-00000002")


def test_background_writer_copies_ddp_optimizer_state(root):
    """Under DDP the optimizer's moments are the live tensors AdamW updates in place (under ZeRO they
    are gathered into new ones): the writer must hold copies, or the step-2 checkpoint written late
    holds the moments of step 4."""
    r, manifest = root
    _slow_writer_writes_what_a_prompt_one_does(r, data_args(manifest, *CROSS, *PLUGINS["ddp"]), "cross-ddp", "ddp")


def test_ema_under_zero2_bf16_follows_its_update_rule(root):
    """ema = d*ema_prev + (1-d)*w between consecutive checkpoints, checked as under DDP
    (test_train.py::test_init_from_load_and_reset_data): under ZeRO each rank updates its own chunk of
    the EMA from its fp32 master shard, and the checkpoint gathers them. model/ holds the fp32 masters."""

    r, manifest = root
    run = prompt_run(r, data_args(manifest, *ZERO_BF16), "prompt-zero2-bf16")  # the writer test's, when it ran
    c = {int(p.name.removeprefix("ckpt-")): p for p in run.glob("ckpt-*")}
    errs = [ema_rule_error(c[k - 1], c[k]) for k in (2, 3, 4)]
    assert max(errs) < 1e-2, errs  # observed <= 3.3e-4 (fp32 rounding); an EMA not updated under ZeRO: 1.0


@pytest.mark.parametrize("source,target", [("ddp", "zero2-fp32"), ("zero2-fp32", "ddp")])
def test_checkpoints_move_between_ddp_and_zero(root, source, target):
    """model/ holds fp32 masters and optimizer/ full moments by name in both: a checkpoint of one
    path resumes on the other and continues the same trajectory (the Adam moments came along: a
    reset optimizer would take a first Adam step instead)."""
    r, manifest = root
    # eps 1e-6 (CROSS): Open-Sora's 1e-15 turns the key biases' float-noise gradients (exactly zero in exact
    # arithmetic) into full Adam steps, which two correct optimizers (torch's AdamW and HybridAdam,
    # two clip roundings) take in different directions (seen: 0.5% of a step at eps 1e-8).
    args = data_args(manifest, *CROSS)
    whole = f"cross-{source}"  # cross-ddp: the DDP writer test's uninterrupted run, when it ran
    prompt_run(r, [*args, *PLUGINS[source]], whole)
    moved = f"cross-{source}-to-{target}"
    train(
        r, args + [f"--run.name={moved}", "--load", str(r / f"runs/{whole}/ckpt-00000002"), *PLUGINS[target]], nproc=2
    )
    a, b = metrics(r / f"runs/{whole}"), metrics(r / f"runs/{moved}")
    assert sorted(b) == [2, 3]
    for s in (2, 3):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-5), (s, a[s]["loss"], b[s]["loss"])
    # Steps 3 and 4 from the same masters and moments: the same weights, to a small fraction of how
    # far those two steps moved them (a reset optimizer takes Adam's first, sign-sized, steps instead).
    w2, wa = weights(r / f"runs/{whole}/ckpt-00000002"), weights(r / f"runs/{whole}/ckpt-00000004")
    wb = weights(r / f"runs/{moved}/ckpt-00000004")
    assert wa.keys() == wb.keys()
    moved_by = max(float((wa[k] - w2[k]).abs().max()) for k in wa)
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert diff < 1e-3 * moved_by, (diff, moved_by)
