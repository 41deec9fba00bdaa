"""``reelcache train --nproc N`` (train/launch.py): the ranks started through torch's elastic launch API, a failed
start said in one line, never torchrun's ChildFailedError report (issue 30.6).

Three real 2-rank launches of the debug stage: one refused (a live process on this machine holds the run's lease:
both ranks refuse alike, one line), one whose rank 1 is killed with SIGKILL once it runs (what `make demo`
does on purpose: one line naming the rank, its pid read from its own rank record, and the signal), one whose
rank crashes on a sample that is not a latent (its traceback shown, then one line). On this CPU build of torch
the ranks are forked from the launcher's fork server (train/launch.py); tests/train/test_train.py compares
runs started so with torchrun's and with the session's reference, loss for loss.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from latent_data import write_latents
from support import data_args, torchrun

from reelcache.base.lease import boot_id, pid_start

pytestmark = pytest.mark.slow  # three 2-rank launches

LAUNCH = ("-m", "reelcache", "train")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("launch")
    return r, write_latents(r, 24, name="train")


def lines(out: str) -> list[str]:
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-4000:]
    return [ln for ln in out.splitlines() if ln.strip()]


def test_two_ranks_refusing_alike_are_one_line(root):
    r, manifest = root
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        run = r / "runs/held"
        run.mkdir(parents=True)
        lease = {"host": os.uname().nodename, "boot_id": boot_id(), "pid": holder.pid, "started_at": "then"}
        lease.update(pid_start=pid_start(holder.pid), token="t")
        (run / "run.lease").write_text(json.dumps(lease))
        p = torchrun(r, [*data_args(manifest, "--run.name=held"), "--nproc", "2"], entry=LAUNCH)
        out, _ = p.communicate(timeout=240)
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 2, out[-4000:]
    said = lines(out)
    assert len(said) == 1, out[-4000:]
    assert re.fullmatch(
        rf"reelcache: error: run held is running: {run}/run.lease is held by host {os.uname().nodename} pid "
        rf"{holder.pid} \(started then, heartbeat \d+ s ago\): wait for it with --wait, or stop it first \(touch "
        rf"{run}/stop\), or train under another run.name",
        said[0],
    ), said[0]
    assert sorted(os.listdir(run)) == ["run.lease"]


def test_a_rank_killed_mid_run_is_one_line(root):
    r, manifest = root
    run = r / "runs/killed"
    p = torchrun(r, [*data_args(manifest, "--run.name=killed", "--run.epochs=50"), "--nproc", "2"], entry=LAUNCH)
    try:
        deadline = time.monotonic() + 240
        while not (run / "ranks/rank00001.json").exists():  # written once the rank runs
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-4000:]
            time.sleep(0.1)
        victim = json.loads((run / "ranks/rank00001.json").read_text())["pid"]
        os.kill(victim, signal.SIGKILL)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1, out[-4000:]
    assert (
        lines(out)[-1]
        == f"reelcache: error: rank 1 (pid {victim}) was killed by SIGKILL; the launch stopped the other 1 rank(s)"
    )


def test_a_rank_that_crashes_shows_its_traceback_and_is_named_in_one_line(tmp_path):
    """A sample whose bytes are not a latent (its safetensors header overwritten, the shard's length unchanged,
    so the start's checks pass): the rank that reads it crashes. Its traceback is in the output, as its
    interpreter prints it (a forked rank prints it itself: torch's wrapper would keep it in a file), and the
    launcher's last line names that rank and points at it."""
    manifest = write_latents(tmp_path, 24, name="train")
    shard = sorted((tmp_path / "latents/train").glob("*.tar"))[0]
    with tarfile.open(shard) as t:
        member = t.getmembers()[0]
    with open(shard, "r+b") as f:
        f.seek(member.offset_data)
        f.write(b"\xff" * 8)  # safetensors' header length: far beyond the member
    p = torchrun(tmp_path, [*data_args(manifest, "--run.name=crash"), "--nproc", "2"], entry=LAUNCH)
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 1, out[-4000:]
    assert "Traceback (most recent call last)" in out and "SafetensorError" in out, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"reelcache: error: rank [01] \(pid \d+\) exited with status 1 \(its output is above\); the launch stopped "
        r"the other 1 rank\(s\)",
        last,
    ), out[-4000:]
