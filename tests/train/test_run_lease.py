"""One run directory, one writer (train/runlease.py), and a refused start leaves nothing behind.

The same 2-rank training started twice (torchrun, the debug stage): the second start refuses in one
line naming the first (its host and rank 0's pid, read from the first's own rank record) and
changes no byte of the run directory; a third start with ``--wait`` waits until the first has
stopped, then resumes from the first's newest checkpoint. The references are the files themselves:
a snapshot of the run directory, the rank record, the metrics' and consumed log's generations (one
per start that trained) and the step each checkpoint's state.json says.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from latent_data import write_latents
from support import consumed, data_args, metrics, torchrun, train


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("lease-root")
    return r, write_latents(r, 24, name="train")


def signal_run(proc, pids: list[int], sig: int) -> None:
    """`sig` to a launch: torchrun (its session) and each rank (torchrun starts every rank in a session of its own)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, sig)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folder`: (size, mtime in ns); a write, a new file or a removal changes it."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


class Output:
    """A running launch's output, read as it comes (so a test can wait for a line)."""

    def __init__(self, proc):
        self.proc, self.text = proc, ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.text += line

    def wait_for(self, words: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while words not in self.text:
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {words!r}:\n{self.text[-3000:]}"
            time.sleep(0.05)

    def end(self, timeout: float = 180) -> tuple[int, str]:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.proc.returncode, self.text


@pytest.mark.slow
def test_a_second_start_of_a_live_run_refuses_in_one_line_and_with_wait_resumes_after_it(root):
    r, manifest = root
    run = r / "runs/twice"
    args = data_args(manifest, "--run.epochs=3", "--checkpoint.every=4", "--checkpoint.keep_last=10")
    args += ["--run.name=twice", "--resume"]  # what a Slurm job runs: the same command, submitted twice
    first = torchrun(r, args, nproc=2)
    procs, ranks = [first], []
    try:
        deadline = time.monotonic() + 180
        while not (run / "ckpt-00000004").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-3000:]
            time.sleep(0.05)
        ranks = [json.loads((run / f"ranks/rank0000{i}.json").read_text())["pid"] for i in (0, 1)]
        holder = ranks[0]
        signal_run(first, ranks, signal.SIGSTOP)  # alive and holding its lease, but writing nothing meanwhile
        before = snapshot(run)

        waiting = torchrun(r, [*args, "--wait"], nproc=2)  # starts beside the refused one (saves a startup)
        procs.append(waiting)
        third = Output(waiting)
        out = train(r, args, nproc=2, ok=False)
        errors = [line for line in out.splitlines() if "reelcache: error:" in line]
        assert len(errors) == 1, out[-3000:]
        assert f"run twice is running: {run}/run.lease is held by host {socket.gethostname()} pid {holder}" in errors[0]
        assert "--wait" in errors[0]
        assert snapshot(run) == before  # its checkpoints, metrics, consumed log, rank records: untouched
        third.wait_for("waiting for it to end (--wait)")
        assert snapshot(run) == before
        (run / "stop").touch()  # the first checkpoints at its next step and exits
        signal_run(first, ranks, signal.SIGCONT)
        first_out, _ = first.communicate(timeout=180)
        assert first.returncode == 0 and "stopped on request at step" in first_out, first_out[-3000:]
        stopped = int(first_out.split("stopped on request at step ")[1].split()[0])
        rc, out = third.end()
        assert rc == 0, out[-3000:]
    finally:
        signal_run(first, ranks, signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                signal_run(p, ranks, signal.SIGKILL)
                p.wait()
    assert 4 < stopped < 15
    assert f"resumed from {run}/ckpt-{stopped:08d}: step {stopped}" in out, out[-3000:]
    rows = metrics(run)
    assert sorted(rows) == list(range(15))
    assert {s: rows[s]["generation"] for s in rows} == {s: int(s >= stopped) for s in range(15)}
    starts = {int(p.name.split("-g")[1][:3]) for p in (run / "consumed").glob("*.parquet")}
    assert starts == {0, 1}  # two starts trained: the refused one wrote nothing
    assert len(consumed(run)) == len(set(consumed(run)))
    steps = {int(c.name[5:]): json.loads((c / "state.json").read_text())["global_step"] for c in run.glob("ckpt-*")}
    assert steps == {s: s for s in (4, 8, 12, stopped, 15)}
    assert not (run / "run.lease").exists() and not list(run.glob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing manifest", "bad init-from", "changed data on resume"])
def test_a_refused_start_leaves_nothing_behind(root, case):
    r, manifest = root
    if case == "changed data on resume":
        name = "twice" if (r / "runs/twice/ckpt-00000015").exists() else "done"  # a run with checkpoints
        if name == "done":  # the test above did not run
            train(r, data_args(manifest, "--run.max_steps=2", "--run.name=done"))
        run = r / "runs" / name
        args = data_args(manifest, f"--run.name={name}", "--run.seed=7", "--resume")
        message = "refusing to resume the data position"
    elif case == "missing manifest":
        run = r / "runs/nomanifest"
        args = data_args(Path("absent"), "--run.name=nomanifest")
        message = "absent"
    else:
        run = r / "runs/badinit"
        args = data_args(manifest, "--run.name=badinit", "--init-from", str(r / "no-such-weights.pth"))
        message = "cannot load weights"
    before = snapshot(run) if run.exists() else None
    out = train(r, args, ok=False)
    assert message in out and "Traceback" not in out, out[-3000:]
    assert (snapshot(run) if run.exists() else None) == before
