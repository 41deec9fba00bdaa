"""``reelcache cluster dump|stop``: exactly a run's recorded ranks. References: the kernel's /proc for which
processes live, py-spy's "Process <pid>" header for whose stack a dump holds.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from latent_data import write_latents
from support import cluster_cli, data_args, proc_alive, proc_stat, record, torchrun

from reelcache.cluster import ranks

pytestmark = pytest.mark.slow  # ranks, stand-ins and the command as processes


def test_dump_falls_back_to_the_signal_stacks_when_py_spy_fails(tmp_path):
    """py-spy present but failing (ptrace refused in a container, an unsupported Python): the rank's
    faulthandler stacks (SIGUSR1, as the trainer registers it) are used, and the py-spy error is noted."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "py-spy").write_text("#!/bin/sh\necho 'Error: Permission denied (os error 13)' >&2\nexit 1\n")
    (bin_ / "py-spy").chmod(0o755)
    stacks = tmp_path / "stacks.txt"
    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import faulthandler, signal, time
faulthandler.register(signal.SIGUSR1, file=open({str(stacks)!r}, "a"), all_threads=True)
def waiting_for_the_collective():
    print("ready", flush=True)
    time.sleep(300)
waiting_for_the_collective()
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout.readline().strip() == "ready"
        run = tmp_path / "run"
        record(run, 0, rank.pid, socket.gethostname(), stacks)
        p = cluster_cli(
            "dump", "--run", run, "--timeout", 10, env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
        )
        assert p.returncode == 0, p.stdout + p.stderr
        assert "rank 0: py-spy: Error: Permission denied (os error 13); used the SIGUSR1 stacks instead" in p.stdout
        (dump,) = (run / "dumps").iterdir()
        text = (dump / "rank00000.txt").read_text()
        assert "signal" in text.splitlines()[0] and "(most recent call first)" in text
        assert "in waiting_for_the_collective" in text
        assert "waiting_for_the_collective" in (dump / "summary.txt").read_text()
        assert rank.poll() is None  # SIGUSR1 only made it write its stacks
    finally:
        rank.kill()
        rank.wait()


def test_stop_escalates_to_sigkill_after_the_grace(tmp_path):
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(1, flush=True)\ntime.sleep(300)",
        ],
        stdout=subprocess.PIPE,
    )
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        stubborn.stdout.readline()  # SIGTERM is ignored from here on
        record(tmp_path, 0, stubborn.pid, socket.gethostname())
        record(tmp_path, 1, polite.pid, socket.gethostname())
        p = cluster_cli("stop", "--run", tmp_path, "--grace", 1)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"pid {stubborn.pid}: stopped by SIGKILL" in p.stdout
        assert f"pid {polite.pid}: stopped by SIGTERM" in p.stdout
        assert stubborn.wait(timeout=10) == -signal.SIGKILL and polite.wait(timeout=10) == -signal.SIGTERM
    finally:
        for q in (stubborn, polite):
            q.kill()
            q.wait()


# --- dump and stop on a real 2-rank training ------------------------------------------------


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-root")
    manifest = write_latents(root, 16, name="train")
    args = data_args(manifest, "--run.epochs=1000", "--checkpoint.every=0", "--log.every=1", "--run.name=live")
    p = torchrun(root, args, nproc=2)
    run = root / "runs/live"
    lines: list[str] = []  # the launcher's output, read aside (the ranks must never block on a full pipe)
    threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True).start()
    deadline = time.monotonic() + 180
    # in the loop: the ranks' records written and a step done (the booster, ColossalAI's import, comes
    # after the records: a rank dumped before has a stack deeper than faulthandler's 100 frames)
    while not (
        all((run / f"ranks/rank{r:05d}.json").exists() for r in (0, 1)) and any(" step 2/" in ln for ln in lines)
    ):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"training did not start: {''.join(lines)[-3000:]}")
        time.sleep(0.2)
    yield run, p
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)  # only our own session: the launcher and its ranks
    p.wait()


def test_dump_and_stop_act_on_exactly_the_recorded_ranks(training, tmp_path):
    run, launcher = training
    recs = ranks.read(run)  # the records the trainer wrote
    assert [r.rank for r in recs] == [0, 1] and all(r.world_size == 2 for r in recs)
    assert all(proc_alive(r.pid, r.proc_start) for r in recs)
    assert all((r.launcher_pid, r.launcher_proc_start) == (launcher.pid, proc_stat(launcher.pid)[1]) for r in recs)

    # A decoy whose command line equals rank 0's byte for byte (what `pkill -f` would also match):
    # the same argv, kept asleep by a sitecustomize before it ever reaches the trainer.
    argv = Path(f"/proc/{recs[0].pid}/cmdline").read_bytes().split(b"\0")[:-1]
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(300)\n")
    decoy = subprocess.Popen(
        [a.decode() for a in argv],
        cwd=Path(f"/proc/{recs[0].pid}/cwd").resolve(),
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    try:
        time.sleep(0.5)
        assert Path(f"/proc/{decoy.pid}/cmdline").read_bytes() == Path(f"/proc/{recs[0].pid}/cmdline").read_bytes()
        decoy_start = proc_stat(decoy.pid)[1]
        # a stale record: the decoy's pid, but another process's start time (the pid was reused)
        dataclasses.replace(recs[1], rank=2, pid=decoy.pid, proc_start=decoy_start - 1).save(run)

        p = cluster_cli("dump", "--run", run)
        assert p.returncode == 0, p.stdout + p.stderr
        (out,) = (run / "dumps").iterdir()
        assert sorted(f.name for f in out.iterdir()) == ["rank00000.txt", "rank00001.txt", "summary.txt"]
        for r in recs:
            text = (out / f"rank{r.rank:05d}.txt").read_text()
            assert f"Process {r.pid}:" in text  # py-spy's own header: that process
            assert "reelcache.train" in text and "trainer.py" in text and "MainThread" in text
        summary = (out / "summary.txt").read_text()
        assert "2 of 3 ranks dumped" in summary and "rank 2: pid gone or reused" in summary
        assert "frames on the main thread of all 2 dumped ranks" in summary
        assert "rank 2: pid gone or reused" in p.stdout

        time.sleep(1.1)  # a new dump folder (they are named by the second)
        p = cluster_cli("dump", "--run", run, "--method", "signal")
        assert p.returncode == 0, p.stdout + p.stderr
        newest = sorted((run / "dumps").iterdir())[-1]
        for r in recs:
            text = (newest / f"rank{r.rank:05d}.txt").read_text()
            assert "(most recent call first)" in text and "trainer.py" in text
        assert proc_alive(decoy.pid, decoy_start)

        p = cluster_cli("stop", "--run", run, "--grace", 10)
        assert p.returncode == 0, p.stdout + p.stderr
        for r in recs:
            assert f"rank {r.rank:05d} host {r.host} pid {r.pid}: stopped by SIG" in p.stdout
            assert not proc_alive(r.pid, r.proc_start)
        assert "rank 00002" in p.stdout and "pid gone or reused" in p.stdout
        assert proc_alive(decoy.pid, decoy_start), "the decoy with the same command line was stopped"
        launcher.wait(timeout=60)  # its workers gone, the launcher gives up by itself

        p = cluster_cli("stop", "--run", run, "--grace", 1)  # again: nothing left to stop
        assert p.returncode == 0 and p.stdout.count("already gone") == 2, p.stdout
    finally:
        decoy.kill()
        decoy.wait()
