"""Training under Slurm, for real: `reelcache train --slurm` on a one-node local Slurm (tests/slurm_local.py).

A 2-rank CPU training of the debug stage is requeued mid-run (`scontrol requeue`) and resumes from its
newest checkpoint in the same run directory, ending loss for loss and weight for weight where an
uninterrupted run (torchrun, no Slurm) ends; a job that reaches its time limit checkpoints at the
warning signal and requeues itself; bad resources are refused in one line before anything is
submitted; `reelcache cluster` expands the allocation's node list as `scontrol show hostnames` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from latent_data import write_latents
from slurm_local import local_slurm_or_skip
from test_train import data_args, metrics, train, weights

from reelcache.cluster.hosts import expand_nodelist

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/train/debug/stage1.toml"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with local_slurm_or_skip(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("slurm-train-root")
    return r, write_latents(r, 24, name="train")


def submit(slurm, root: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reelcache", "train", CONFIG, "--root", str(root), "--slurm", *args]
    p = subprocess.run(cmd, env=slurm.env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p


def job_id(p: subprocess.CompletedProcess) -> str:
    return p.stdout.split("submitted job ")[1].split(":")[0]


def wait_for(cond, what: str, slurm, job: str, run: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        gone = not slurm.run("squeue", "--noheader", "--jobs", job, check=False).stdout.strip()
        assert not gone and time.monotonic() < deadline, f"waiting for {what}: job {job} ended\n{job_log(run)[-3000:]}"
        time.sleep(0.2)


def job_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "slurm").glob("*.out")))


def test_a_requeued_job_resumes_from_its_newest_checkpoint_and_ends_like_an_uninterrupted_run(slurm, root):
    r, manifest = root
    args = data_args(manifest, "--run.epochs=3", "--checkpoint.every=4", "--checkpoint.keep_last=10")
    train(r, args + ["--run.name=whole"], nproc=2)
    p = submit(slurm, r, "--gpus-per-node=0", "--nproc-per-node=2", *args, "--run.name=requeued")
    job, run = job_id(p), r / "runs/requeued"
    wait_for(lambda: (run / "ckpt-00000004").exists(), "the first checkpoint", slurm, job, run)
    slurm.run("scontrol", "requeue", job)
    (record,) = slurm.wait(job, timeout=300)
    log = job_log(run)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, log[-3000:])
    assert "attempt 0" in log and "attempt 1" in log and "resumed from" in log, log[-3000:]
    whole, resumed = metrics(r / "runs/whole"), metrics(run)
    assert sorted(resumed) == sorted(whole) == list(range(15))
    assert [resumed[s]["loss"] for s in whole] == [whole[s]["loss"] for s in whole]
    assert max(row["generation"] for row in resumed.values()) == 1  # the second attempt trained the rest
    for which in ("model", "ema"):
        a, b = weights(r / "runs/whole/ckpt-00000015", which), weights(run / "ckpt-00000015", which)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_the_time_limits_warning_signal_checkpoints_and_requeues(slurm, root):
    """--time=1 (a minute) and the warning 40 s before it: the run checkpoints off its cadence (every
    1000 steps), exits 0, the script requeues the job and the next attempt resumes from there."""
    r, manifest = root
    args = data_args(manifest, "--run.epochs=200", "--checkpoint.every=1000", "--checkpoint.keep_last=10")
    p = submit(slurm, r, "--gpus-per-node=0", "--nproc-per-node=2", "--time=1", "--signal-s=40", *args, "--run.name=tl")
    job, run = job_id(p), r / "runs/tl"
    try:
        wait_for(lambda: "resumed from" in job_log(run), "the requeued attempt", slurm, job, run, timeout=300)
    finally:
        slurm.run("scancel", job, check=False)
    log = job_log(run)
    assert "time limit near" in log and "stopped on request at step" in log and "requeueing job" in log, log[-3000:]
    (ckpt,) = [c for c in run.glob("ckpt-*") if int(c.name[5:]) % 1000]  # written at the signal, not the cadence
    step = json.loads((ckpt / "state.json").read_text())["global_step"]
    assert f"stopped on request at step {step}" in log and f"resumed from {ckpt}: step {step}" in log, log[-3000:]
    assert not (run / "stop").exists()  # consumed by the run that honoured it


@pytest.mark.parametrize(
    "args,message",
    [
        (["--partition=nope"], "partition 'nope' does not exist on this cluster (partitions: debug)"),
        (
            ["--gpus-per-node=64"],
            "--gpus-per-node 64 on 1 node(s): partition debug has 0 node(s) with 64 GPUs (at most 2 per node)",
        ),
        (["--nodes=3", "--gpus-per-node=1"], "--nodes 3: partition debug has 1 node(s)"),
        (["--gpus-per-node=0"], "--gpus-per-node 0 (CPU nodes): give --nproc-per-node, the ranks per node"),
    ],
)
def test_bad_resources_are_one_line_before_anything_is_submitted(slurm, root, args, message):
    r, manifest = root
    p = submit(slurm, r, *args, *data_args(manifest), "--run.name=bad", ok=False)
    assert p.returncode == 2 and p.stderr.strip() == f"reelcache: error: {message}", p.stderr
    assert not slurm.run("squeue", "--noheader", "--name=train-bad").stdout.strip()


def test_an_account_is_passed_on_unchecked_where_slurm_keeps_no_accounts(slurm, root):
    r, manifest = root
    p = submit(slurm, r, "--gpus-per-node=1", "--account=nobody", "--dry-run", *data_args(manifest), "--run.name=acc")
    assert (
        "accounting is off on this cluster" in p.stderr
        and "'nobody' cannot be checked" in p.stderr
        and "#SBATCH --account=nobody" in p.stdout
    )


def test_node_lists_expand_as_scontrol_does(slurm):
    for expr in ("gpu[01-03,7],cpu5", "n[001-002]-ib[1-2]", "a[8-11],b", slurm.node):
        want = slurm.run("scontrol", "show", "hostnames", expr).stdout.split()
        assert expand_nodelist(expr) == want, expr


def test_eval_serve_runs_as_its_own_job_beside_the_run(slurm, root):
    """eval serve --slurm: one task with one (fake) GPU, following the trained run until it is idle."""
    r, manifest = root
    if not (r / "runs/whole/ckpt-00000012").exists():  # made by the requeue test when it ran
        train(r, data_args(manifest, "--run.epochs=3", "--checkpoint.every=4", "--run.name=whole"), nproc=2)
    cmd = [sys.executable, "-m", "reelcache", "eval", "serve", "--root", str(r), "--run", "runs/whole"]
    cmd += ["--preset", "debug", "--device", "cpu", "--val-manifest", str(manifest), "--val-max-clips", "4"]
    cmd += ["--every", "3", "--poll", "1", "--exit-idle", "3", "--wandb-mode", "disabled"]
    p = subprocess.run(
        [*cmd, "--slurm", "--gpus-per-node", "1"], env=slurm.env, cwd=REPO, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    (record,) = slurm.wait(p.stdout.split("submitted job ")[1].split(":")[0], timeout=240)
    log = "".join(f.read_text() for f in (r / "runs/whole/slurm").glob("eval-*.out"))
    assert record["JobState"] == "COMPLETED", (record, log[-3000:])
    assert (r / "runs/whole/eval/ckpt-00000012/val_loss.json").exists(), log[-3000:]
    assert "#SBATCH --gpus-per-node=1" in (r / "runs/whole/slurm/eval.sbatch").read_text()
