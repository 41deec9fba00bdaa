"""The trainer, end to end on CPU: real launches (`reelcache train --nproc`, torchrun, colossalai run), gloo,
ColossalAI's TorchDDP booster, the real loader over real latent shards, the tiny STDiT3.

References are independent of the code under test: an uninterrupted run for the killed-and-
resumed one, a plain single-process autograd computation for the multi-rank gradient, the
checkpoint files themselves for the load semantics, wandb's own file format for the log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from latent_data import write_latents
from support import (
    PLUGINS,
    REPO,
    WHOLE,
    complete,
    consumed,
    data_args,
    ema_rule_error,
    free_port,
    json_lines,
    metrics,
    poisoned_manifest,
    quiet_env,
    same_data,
    stage_file,
    torchrun,
    train,
    weights,
)
from wandb_files import history, run_files

if TYPE_CHECKING:
    import torch

# Every test here runs the trainer in processes of its own (its launcher, torchrun, colossalai run): the component
# tests beside them are test_guard.py, test_step.py, test_checkpoint.py, test_watchdog.py, test_state.py.
pytestmark = pytest.mark.slow


def spike_clips(run_dir: Path, step: int) -> set[str]:
    """docs/TRAIN.md's metrics x consumed join (without the catalog), for one global step."""
    import duckdb

    return {
        c
        for (c,) in duckdb.sql(f"""
        SELECT c.clip_id FROM '{run_dir}/metrics/*.parquet' m
        JOIN '{run_dir}/consumed/*.parquet' c
          ON c.generation = m.generation AND c.epoch = m.epoch AND c.step = m.epoch_step
        WHERE m.step = {step} AND NOT c.pad
        QUALIFY m.generation = max(m.generation) OVER (PARTITION BY m.step)""").fetchall()
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("train-root")
    return r, write_latents(r, 24, name="train")


def uninterrupted(request, r: Path, args: list[str], plugin: str) -> Path:
    """The run without a kill or stop: under DDP the session's (conftest: ddp_reference, the same data: checked),
    else trained here."""
    if plugin == "ddp":
        whole = request.getfixturevalue("ddp_reference")
        same_data(whole.parents[1], r)
        return whole
    train(r, args + [f"--run.name=whole-{plugin}"], nproc=2)
    return r / f"runs/whole-{plugin}"


@pytest.mark.parametrize("plugin", ["ddp", "zero2-bf16"])
def test_two_ranks_learn_and_a_killed_run_resumes_exactly(request, root, plugin):
    """kill -9 of one rank mid-run, --load latest: the same batches, losses and weights as without the kill."""
    r, manifest = root
    args = data_args(manifest, *WHOLE, *PLUGINS[plugin])
    reference = uninterrupted(request, r, args, plugin)
    whole = metrics(reference)
    steps = sorted(whole)
    assert steps == list(range(len(steps))) and len(steps) == 15  # 10 micro-batches/epoch on 2 ranks
    first, last = [whole[s]["loss"] for s in steps[:5]], [whole[s]["loss"] for s in steps[-5:]]
    assert sum(last) / 5 < 0.8 * sum(first) / 5, (first, last)  # it learns the tiny set

    run = r / f"runs/killed-{plugin}"
    seen_partial = []
    stop = threading.Event()

    def watch():  # a reader never sees a half-written checkpoint
        while not stop.is_set():
            for c in run.glob("ckpt-*"):
                if c.is_dir() and not complete(c):
                    seen_partial.append(c.name)
            time.sleep(0.01)

    w = threading.Thread(target=watch)
    w.start()
    try:
        p = torchrun(r, args + [f"--run.name=killed-{plugin}"], nproc=2)
        deadline = time.monotonic() + 180
        while not (run / "ckpt-00000008").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-3000:]
            time.sleep(0.05)
        victim = json.loads((run / "ranks/rank00001.json").read_text())["pid"]
        os.kill(victim, signal.SIGKILL)
        out, _ = p.communicate(timeout=120)
        assert p.returncode != 0
        assert not (run / "ckpt-00000015").exists()
        train(r, args + [f"--run.name=killed-{plugin}", "--load", "latest"], nproc=2)
    finally:
        stop.set()
        w.join()
    assert not seen_partial
    assert not list(run.glob(".tmp-*"))
    resumed = metrics(run)
    assert sorted(resumed) == steps
    assert [resumed[s]["loss"] for s in steps] == [whole[s]["loss"] for s in steps]
    assert {resumed[s]["generation"] for s in steps if s >= 8} == {1}
    assert consumed(run) == consumed(reference)
    # docs/TRAIN.md's join: which clips did global step 12 (epoch 2) train on, after the kill and resume.
    assert (
        spike_clips(run, 12)
        == spike_clips(reference, 12)
        == {c for (e, st, _, c) in consumed(run) if (e, st) == (2, 12 - 10)}
    )
    a, b = weights(reference / "ckpt-00000015"), weights(run / "ckpt-00000015")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    ea, eb = weights(reference / "ckpt-00000015", "ema"), weights(run / "ckpt-00000015", "ema")
    assert all((ea[k] == eb[k]).all() for k in ea)


def test_a_stop_request_to_one_rank_checkpoints_every_rank_and_resume_continues_exactly(request, root):
    """SIGUSR2 to rank 1 only (what Slurm's --signal sends before a time limit): every rank saves at the
    same step, off the checkpoint cadence, and the run exits 0; --resume then ends where an uninterrupted
    run ends, loss for loss and weight for weight."""
    r, manifest = root
    args = data_args(manifest, *WHOLE)
    reference = uninterrupted(request, r, args, "ddp")  # auto: DDP on CPU (train/sections.py)
    run = r / "runs/stop-requested"
    p = torchrun(r, args + ["--run.name=stop-requested"], nproc=2, launcher="torchrun")  # as the README's alternative
    deadline = time.monotonic() + 180
    while not (run / "ckpt-00000004").exists():
        assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-3000:]
        time.sleep(0.05)
    os.kill(json.loads((run / "ranks/rank00001.json").read_text())["pid"], signal.SIGUSR2)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    stopped = max(checkpoints(run))
    assert 4 < stopped < 15 and f"stopped on request at step {stopped}" in out, out[-3000:]
    assert json.loads((run / f"ckpt-{stopped:08d}/state.json").read_text())["global_step"] == stopped
    train(r, args + ["--run.name=stop-requested", "--resume"], nproc=2, launcher="torchrun")
    whole, resumed = metrics(reference), metrics(run)
    assert sorted(resumed) == sorted(whole) and [resumed[s]["loss"] for s in whole] == [whole[s]["loss"] for s in whole]
    a, b = weights(reference / "ckpt-00000015"), weights(run / "ckpt-00000015")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def checkpoints(run_dir: Path) -> dict[int, Path]:
    """step -> the run's checkpoint folder, as listed on disk."""
    return {int(c.name.removeprefix("ckpt-")): c for c in run_dir.glob("ckpt-*")}


def test_init_from_load_and_reset_data(root):
    r, manifest = root
    args = data_args(manifest, "--checkpoint.every=1", "--checkpoint.keep_last=10")
    train(r, args + ["--run.name=a", "--run.max_steps=4"])
    a4 = r / "runs/a/ckpt-00000004"
    state = json.loads((a4 / "state.json").read_text())
    assert (state["global_step"], state["loader"]["epoch"], state["loader"]["consumed"]) == (4, 0, 4)
    a = checkpoints(r / "runs/a")
    errs = [ema_rule_error(a[k - 1], a[k]) for k in (2, 3, 4)]
    assert max(errs) < 1e-2, errs  # observed <= 3.4e-4

    # --init-from: weights only. With lr 0 the weights stay as loaded; the EMA starts as them.
    train(r, args + ["--run.name=b", "--run.max_steps=1", "--optim.lr=0.0", "--init-from", str(a4)])
    b1 = r / "runs/b/ckpt-00000001"
    sb = json.loads((b1 / "state.json").read_text())
    assert (sb["global_step"], sb["opt_steps"], sb["loader"]["consumed"]) == (1, 1, 1)
    wa, wb, eb = weights(a4), weights(b1), weights(b1, "ema")
    assert all((wa[k] == wb[k]).all() for k in wa)
    import torch

    assert all(torch.allclose(eb[k], wa[k], rtol=1e-6, atol=1e-7) for k in eb)  # 0.99 x + 0.01 x, rounded

    # --load latest: everything, the data position and the EMA included (its update rule holds across the
    # resume), here on another world size (one launch for both; the same world size resumes exactly in
    # test_two_ranks_learn_and_a_killed_run_resumes_exactly): run a's newest checkpoint, written by 1 rank,
    # resumes on 2 ranks where the loader's global position says.
    train(r, args + ["--run.name=a", "--run.max_steps=6", "--load", "latest"], nproc=2)
    s6 = json.loads((r / "runs/a/ckpt-00000006/state.json").read_text())
    got = (s6["global_step"], s6["opt_steps"], s6["world_size"], s6["loader"]["consumed"], s6["loader"]["generation"])
    assert got == (6, 6, 2, 4 + 2 * 2, 1)
    assert weights(r / "runs/a/ckpt-00000006", "ema").keys() == weights(a4, "ema").keys()
    a = checkpoints(r / "runs/a")  # the 1-rank EMA, cut into 2 ranks' chunks, updated, gathered
    errs = [ema_rule_error(a[k - 1], a[k]) for k in (5, 6)]
    assert max(errs) < 1e-2, errs

    # --load --reset-data: optimizer and schedule continue, the data restarts at epoch 0.
    train(r, args + ["--run.name=c", "--run.max_steps=5", "--load", str(a4), "--reset-data"])
    s5 = json.loads((r / "runs/c/ckpt-00000005/state.json").read_text())
    assert (s5["global_step"], s5["opt_steps"], s5["loader"]["epoch"], s5["loader"]["consumed"]) == (5, 5, 0, 1)

    # Another manifest: refused, naming the flag that resets the data.
    other = write_latents(r, 20, name="other", seed=3)
    out = train(r, data_args(other, "--run.name=d", "--load", str(a4)), ok=False)
    assert "--reset-data" in out and "refusing to resume" in out
    # Other batch sizes (144p/17: 4 -> 3), same manifest: refused the same way.
    buckets = r / "buckets-bs3.toml"
    buckets.write_text((REPO / "configs/buckets/tiny.toml").read_text().replace("17 = [1.0, 4]", "17 = [1.0, 3]"))
    assert buckets.read_text() != (REPO / "configs/buckets/tiny.toml").read_text()
    out = train(
        r, args + ["--run.name=d", "--run.max_steps=5", "--load", str(a4), f'--data.buckets="{buckets}"'], ok=False
    )
    assert "--reset-data" in out and "refusing to resume" in out and "batch sizes" in out
    # A run directory with checkpoints is never trained over by accident.
    out = train(r, args + ["--run.name=a"], ok=False)
    assert "--load latest" in out


def wandb_history(run_dir: Path) -> list[dict]:
    (f,) = run_files(run_dir)
    return history(f)


def test_colossalai_run_launches_and_wandb_logs_offline(root, tmp_path):
    """`colossalai run` from the venv (its launcher re-joins arguments unquoted, so the test root's
    settings go in a config file), and the offline wandb file holds every step's numbers."""
    r, manifest = root
    cfg = stage_file(tmp_path / "stage.toml", manifest)
    bindir = Path(sys.executable).parent
    env = quiet_env(PATH=f"{bindir}:{os.environ['PATH']}")
    p = subprocess.run(
        [
            str(bindir / "colossalai"),
            "run",
            "--nproc_per_node",
            "1",
            "--master_port",
            str(free_port()),
            "-m",
            "reelcache.train",
            str(cfg),
            "--root",
            str(r),
            "--run.name=logged",
            "--run.max_steps=3",
            "--log.wandb_mode=offline",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0 and "success" in p.stdout, (p.stdout + p.stderr)[-4000:]
    rows = wandb_history(r / "runs/logged")
    assert [row["global_step"] for row in rows] == [0, 1, 2]
    for key in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/weight_norm",
        "train/samples_per_s",
        "train/tokens_per_s",
        "train/step_s",
        "train/data_wait_s",
    ):
        assert all(key in row for row in rows), key
    assert all(any(k.startswith("buckets/") for k in row) for row in rows)
    m = metrics(r / "runs/logged")
    assert [m[s]["loss"] for s in range(3)] == [row["train/loss"] for row in rows]
    assert (r / "runs/logged/wandb_id").read_text() in str(next((r / "runs/logged/wandb").glob("offline-run-*")))


def adam_step_gradient(before: Path | None, after: Path) -> torch.Tensor:
    """The gradient the optimizer stepped with between two consecutive checkpoints (None: the first
    step), from AdamW's first moments m_k = b1 m_(k-1) + (1 - b1) g_k, all parameters flattened."""
    import torch
    from safetensors.torch import load_file

    b1 = json.loads((after / "config.json").read_text())["optim"]["betas"][0]
    m1 = {k: v for k, v in load_file(after / "optimizer/state.safetensors").items() if k.endswith("::exp_avg")}
    m0 = load_file(before / "optimizer/state.safetensors") if before else {k: 0 * v for k, v in m1.items()}
    assert len(m1) > 80
    return torch.cat([((m1[k] - b1 * m0[k]) / (1 - b1)).flatten() for k in sorted(m1)])


CONSOLE = re.compile(
    r"^\d\d:\d\d:\d\d r0 step (\d+)/(\d+) ep (\d+) \| loss (\S+) \| lr (\S+) \| gnorm (\S+) \| (\S+) samples/s \| "
    r"step (\S+)s, data (\d+)% \| ETA (\d+[smhd]\S*)$",
    re.M,
)


def console_lines(out: str, rows: dict[int, dict], total: int) -> list[int]:
    """The steps of the console lines in a run's output, each checked field by field against its
    metrics row (docs/TRAIN.md: loss, lr, grad norm, samples/s, step time, data-wait share, ETA; no MFU on CPU)."""
    steps = []
    for m in CONSOLE.finditer(out):
        step, t, ep, loss, lr, gnorm, sps, step_s, share, _ = m.groups()
        row = rows[int(step) - 1]
        assert (int(t), int(ep)) == (total, row["epoch"]), m.group(0)
        assert (loss, lr, gnorm) == (f"{row['loss']:.4f}", f"{row['lr']:.2e}", f"{row['grad_norm']:.3f}"), m.group(0)
        assert (sps, step_s, share) == (
            f"{row['samples_per_s']:.1f}",
            f"{row['step_s']:.2f}",
            f"{100 * row['data_share']:.0f}",
        ), m.group(0)
        steps.append(int(step) - 1)
    assert "mfu" not in out
    return steps


def test_requeued_run_resumes_prunes_logs_one_wandb_run_and_clips_at_1(root):
    """A job started with --resume, stopped after step 2 and started again the same way, as the
    docs/TRAIN.md's requeued job (with --init-from /nowhere: used only while the run has no checkpoint):
    keep-last 2 plus keep-every 3 pruning, one wandb run across both launches, the console line's
    fields, and the debug stage's own grad clip 1.0: every step's gradient norm is logged before
    clipping (observed 3.8-6.3) while AdamW's moments show it stepped with norm 1."""
    r, manifest = root
    run = r / "runs/requeued"
    nowhere = r / "no-such-weights"
    args = data_args(
        manifest,
        "--run.name=requeued",
        "--checkpoint.every=1",
        "--checkpoint.keep_last=2",
        "--checkpoint.keep_every=3",
        "--log.wandb_mode=offline",
        "--resume",
    )
    out = train(r, args + ["--run.max_steps=2", "--init-from", str(nowhere)], ok=False)  # no checkpoint: --init-from
    assert f"cannot load weights from {nowhere}" in out
    first = train(r, args + ["--run.max_steps=2"])  # no checkpoint: a fresh start
    assert "resumed from" not in first
    norms = {
        k: adam_step_gradient(run / f"ckpt-{k - 1:08d}" if k > 1 else None, run / f"ckpt-{k:08d}").norm()
        for k in (1, 2)
    }
    assert sorted(checkpoints(run)) == [1, 2]
    second = train(r, args + ["--run.max_steps=5", "--init-from", str(nowhere)])  # a checkpoint: resumed
    assert f"resumed from {run / 'ckpt-00000002'}: step 2" in second
    assert sorted(checkpoints(run)) == [3, 4, 5]  # the last 2, and 3 as a multiple of keep_every
    norms |= {k: adam_step_gradient(run / f"ckpt-{k - 1:08d}", run / f"ckpt-{k:08d}").norm() for k in (4, 5)}

    rows = metrics(run)
    assert sorted(rows) == [0, 1, 2, 3, 4] and [rows[s]["generation"] for s in rows] == [0, 0, 1, 1, 1]
    state = json.loads((run / "ckpt-00000005/state.json").read_text())
    assert (state["global_step"], state["opt_steps"], state["loader"]["consumed"]) == (5, 5, 5)
    assert all(rows[k - 1]["grad_norm"] > 1.5 for k in norms), [rows[s]["grad_norm"] for s in rows]  # before clipping
    assert all(abs(n - 1.0) < 1e-3 for n in norms.values()), norms  # stepped: clipped to 1 (observed 0.99998)
    assert console_lines(first, rows, 2) == [0, 1] and console_lines(second, rows, 5) == [2, 3, 4]

    files = run_files(run)
    wandb_id = (run / "wandb_id").read_text()
    assert len(files) == 2 and {f.name for f in files} == {f"run-{wandb_id}.wandb"}
    assert "wandb_id" not in state  # stored once: the run directory's file
    logged = [history(f) for f in files]
    assert [[row["global_step"] for row in h] for h in logged] == [[0, 1], [2, 3, 4]]
    assert [row["train/loss"] for h in logged for row in h] == [rows[s]["loss"] for s in range(5)]


GRAD_CHECKS = {"ddp": ["fp32"], "zero2": ["fp32", "bf16"]}  # each plugin's working dtypes


@pytest.fixture(scope="module")
def grad_cases(root) -> list[dict]:
    """tests/grad_check.py's cases, every plugin and dtype of GRAD_CHECKS in one 2-rank launch."""
    r, manifest = root
    words = [w for plugin, dtypes in GRAD_CHECKS.items() for w in (plugin, *dtypes)]
    return json_lines(train(r, [str(manifest), *words], nproc=2, entry=["tests/grad_check.py"]))


@pytest.mark.parametrize("plugin", list(GRAD_CHECKS))
def test_step_gradient_and_clipped_step_match_plain_torch(grad_cases, plugin):
    """2 ranks with different buckets, then with a padding rank, both loss reductions: the gradient
    (under ZeRO, gathered from ZeRO's grad store) equals plain single-process autograd of the
    configured mean over the real samples only; two steps at ~100x parallel.grad_clip move the fp32
    masters as torch's AdamW after clip_grad_norm_ does, and far from where the unclipped ones go."""
    dtypes = GRAD_CHECKS[plugin]
    assert {c["plugin"] for c in grad_cases} == set(GRAD_CHECKS)
    cases = [c for c in grad_cases if c["plugin"] == plugin]
    assert {(c["dtype"], c["case"], c.get("reduction")) for c in cases} == {
        (d, case, red) for d in dtypes for case in ("two buckets", "padding rank") for red in ("sample", "rank")
    } | {(d, "clipping", None) for d in dtypes}
    for c in cases:
        if c["case"] == "clipping":
            # Observed: 0 (DDP), 3e-4 (ZeRO fp32: its clip factor rounds differently), 1e-5 (ZeRO bf16).
            assert c["err_vs_clipped"] < 2e-3 and c["err_vs_unclipped"] > 0.3, c
            assert min(c["grad_norms"]) > 50 * c["clip"], c
        else:
            # The same reduction order as one process: observed exactly 0 in fp32 and bf16.
            assert c["max_rel_err"] < 1e-5, c
    for d in dtypes:
        by = {(c["case"], c.get("reduction")): c for c in cases if c["dtype"] == d}
        assert by[("padding rank", "sample")]["samples"] < by[("two buckets", "sample")]["samples"]


# The trainer with its background checkpoint writer 3 s slower: a checkpoint is still being written when
# the steps after it run.
SLOW_CHECKPOINT_WRITER = """
import sys, time
from reelcache.train import checkpoint
write = checkpoint.Checkpointer._write
def slow(self, *a, **kw):
    time.sleep(3)
    return write(self, *a, **kw)
checkpoint.Checkpointer._write = slow
from reelcache.train.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def guarded(root) -> dict:
    """One 2-rank epoch over the manifest plus a NaN sample (support.poisoned_manifest), one of its samples'
    shard read through a pipe that sleeps 6 s (a stuck storage read in a data worker), the watchdog's threshold
    low: the divergence guard's test and the watchdog's read the same run (a 2-rank launch is ~20 CPU-s).
    Its run folder, output, the manifest with the NaN sample alone, the NaN clip and the slow one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    r, manifest = root
    bad_manifest, clip = poisoned_manifest(r, manifest)
    rows = pq.read_table(bad_manifest).to_pylist()
    slow = rows[5]
    slow["shard"] = f"pipe:sleep 6; cat {r / slow['shard']}"
    path = r / "manifests/poisoned-slow.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    args = [
        "--run.name=guarded",
        "--run.epochs=1",
        "--checkpoint.every=0",
        "--watchdog.floor_s=2",
        "--watchdog.factor=3",
    ]
    out = train(r, data_args(path, *args), nproc=2)
    return {"run": r / "runs/guarded", "out": out, "manifest": bad_manifest, "clip": clip, "slow": slow["clip_id"]}


def test_divergence_guard_skips_a_nan_step_on_every_rank_and_stops_after_n(root, guarded):
    r, _ = root
    run, out, bad_manifest, clip = guarded["run"], guarded["out"], guarded["manifest"], guarded["clip"]
    args = data_args(bad_manifest, "--run.epochs=1", "--checkpoint.every=3")
    (rec,) = [json.loads(ln) for ln in (run / "bad_steps.jsonl").read_text().splitlines()]
    assert clip in rec["clip_ids"] and "loss is nan" in rec["reason"]
    m = metrics(run)
    assert m[rec["step"]]["skipped"] and all(not m[s]["skipped"] for s in m if s != rec["step"])
    assert all(v.isfinite().all() for v in weights(run / f"ckpt-{max(m) + 1:08d}").values())
    assert "skipped" in out
    # With max_bad_steps = 1 the same step stops the run, naming the checkpoint to resume from: the one
    # still being written then too (its writer is slowed by 3 s here, as a loaded machine slows it).
    stop = ["--run.name=stopped", "--guard.max_bad_steps=1"]
    (r / "slow_writer.py").write_text(SLOW_CHECKPOINT_WRITER)  # torchrun runs a file, not -c
    out = train(r, args + stop, nproc=2, ok=False, entry=[str(r / "slow_writer.py")])
    assert "consecutive bad steps" in out and f"--load {r / 'runs/stopped/ckpt-00000003'}" in out, out[-3000:]


def test_watchdog_writes_every_ranks_stack_when_a_read_hangs(guarded):
    """A sample whose shard is read through a pipe that sleeps (a stuck storage read in a data worker):
    the step exceeds the watchdog's threshold and both ranks write their stacks and what they were on."""
    assert "WATCHDOG" in guarded["out"]
    (hang,) = (guarded["run"] / "hangs").glob("step-*")
    reports = sorted(hang.glob("rank*.txt"))
    assert [p.name for p in reports] == ["rank00000.txt", "rank00001.txt"]
    infos = [json.loads(p.read_text().splitlines()[0]) for p in reports]
    # past the threshold (2 s), written rounded to ms: 2.0 is possible (the slow sample is in step 0, which begins as
    # the watchdog starts polling every 0.2 s, so its reports come at 2 s and a few ms or less; seen: 2.002)
    assert {i["rank"] for i in infos} == {0, 1} and all(i["elapsed_s"] >= 2 for i in infos), infos
    assert any(guarded["slow"] in (i.get("clip_ids") or []) for i in infos)  # the batch it waits for
    for p in reports:
        text = p.read_text()
        assert "Thread" in text and "reelcache" in text and "train" in text  # a real Python stack


def test_debug_stage_losses_equal_the_regression_record(tmp_path):
    """tests/regression.py's reference run of the debug stage (2 ranks, 8 steps) against its committed
    per-step losses, within regression.TOLERANCE (5e-6) at every step: another processor's kernels
    rounded them by <= 7e-7, AdamW eps 1e-8 moves them by 1.8e-5, the warm-up off by one by 5e-2
    (the measurements are in tests/regression.py; `tests/regression.py --measure` repeats them).
    A meant change: `.venv/bin/python tests/regression.py --update`, and the commit says why the
    losses moved."""
    import regression

    diff = regression.differences(json.loads(regression.RECORD.read_text()), regression.run(tmp_path))
    assert not diff, "\n".join(["the debug stage's losses moved (tests/regression.py):", *diff])


# The trainer (python -m reelcache.train) with its first checkpoint call held until a hang report
# exists: a rank stuck in the collectives after a step (the log, checkpoint and stop agreement), there
# on purpose. Gives up after 60 s, saying so: the watchdog never reported that window.
HELD_AFTER_STEP = """
import sys, time
from reelcache.train import trainer
save = trainer.Trainer._save
def held(self, last=False):
    if not getattr(self, "held", False):
        self.held = True
        deadline = time.monotonic() + 60
        while not list((self.run_dir / "hangs").glob("step-*/rank*.txt")):
            if time.monotonic() > deadline:
                print("no hang report while held after the step", flush=True)
                break
            time.sleep(0.05)
    return save(self, last)
trainer.Trainer._save = held
from reelcache.train.cli import main
sys.exit(main())
"""


def test_the_watchdog_watches_the_collectives_after_a_step(root):
    """A rank held in the window after its first step, where the log, checkpoint and stop-agreement
    collectives run (a frozen peer hangs it there as surely as in the step): the watchdog reports it, as
    that step's after-step span, not as the step, and the run then ends normally."""
    r, manifest = root
    out = train(
        r,
        data_args(
            manifest,
            "--run.name=held",
            "--run.max_steps=1",
            "--data.workers=0",
            "--checkpoint.every=0",
            "--watchdog.floor_s=1",
            "--watchdog.factor=1.5",
        ),  # fmt: skip
        entry=["-c", HELD_AFTER_STEP],
    )
    assert "no hang report" not in out and "WATCHDOG" in out, out[-3000:]
    (report,) = (r / "runs/held/hangs").glob("step-*/rank*.txt")
    info = json.loads(report.read_text().splitlines()[0])
    assert report.parent.name == "step-00000001" and info["after_step"] is True, info
    stacks = report.read_text()
    assert "in held" in stacks and "trainer.py" in stacks  # the stack of a rank held in that window


def test_watchdog_limit_ends_a_stuck_run_with_a_message(root):
    """watchdog.limit_s: a step that lasts longer (every read sleeps 8 s) ends the run after the
    limit, not when the read returns, saying why and where the stacks are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    r, manifest = root
    rows = pq.read_table(manifest).to_pylist()
    for row in rows:  # the shell's stderr goes away, so the sleeper left behind does not hold our pipe
        row["shard"] = f"pipe:exec 2>/dev/null; sleep 8; cat {r / row['shard']}"
    path = r / "manifests/stuck.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    p = torchrun(
        r, data_args(path, "--run.name=stuck", "--run.max_steps=1", "--data.workers=0", "--watchdog.limit_s=2")
    )
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 3, out[-3000:]
    assert "step 0 exceeded the hard limit" in out and "watchdog.limit_s = 2 s" in out, out[-3000:]
    (report,) = (r / "runs/stuck/hangs/step-00000000").glob("rank*.txt")
    assert str(report) in out
    info = json.loads(report.read_text().splitlines()[0])
    # past the limit (elapsed > 2, written rounded to ms, so 2.0 is possible) and before the read returned
    assert 2 <= info["elapsed_s"] < 8 and info["waiting_for_data"], info


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA (NCCL, CUDA streams, fused HybridAdam)"
)
def test_zero2_on_cuda_resumes_with_the_same_losses(root):
    """What the CPU mode of ZeRO-2 (tests/train/test_zero.py) cannot run: NCCL, communication overlapped on
    CUDA streams, HybridAdam's fused CUDA kernel, bf16 kernels on the GPU. A resume from the step-2
    checkpoint (written by the background writer) repeats steps 2 and 3 with the same losses."""
    import torch

    r, manifest = root
    nproc = min(2, torch.cuda.device_count())
    args = data_args(
        manifest, "--checkpoint.every=2", "--run.max_steps=4", "--checkpoint.keep_last=5", *PLUGINS["zero2-bf16"]
    )
    train(r, args + ["--run.name=gpu"], nproc=nproc)
    train(r, args + ["--run.name=gpu-resumed", "--load", str(r / "runs/gpu/ckpt-00000002")], nproc=nproc)
    a, b = metrics(r / "runs/gpu"), metrics(r / "runs/gpu-resumed")
    assert sorted(a) == [0, 1, 2, 3] and sorted(b) == [2, 3]
    for s in (2, 3):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-3), (s, a[s]["loss"], b[s]["loss"])
    state = json.loads((r / "runs/gpu-resumed/ckpt-00000004/state.json").read_text())
    assert state["global_step"] == 4 and complete(r / "runs/gpu-resumed/ckpt-00000004")
