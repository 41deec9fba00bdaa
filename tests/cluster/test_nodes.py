"""``reelcache cluster gpus|clocks``: real commands through real GNU parallel against ':' (this machine).

References are independent of the code under test: the same-clock property for the offset (a read
bracketed by two reads of one clock lies inside the bracket, so |offset| <= uncertainty exactly), and a
stand-in nvidia-smi printing the tool's documented output.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from support import APPS_CSV, FAKE_NVIDIA_SMI, cluster_cli

pytestmark = pytest.mark.slow  # each runs the command, or GNU parallel and an agent, as processes


def test_clocks_against_this_machine(tmp_path):
    from reelcache.cluster.clocks import clock_check, daemon_summary

    r = clock_check([":"], sys.executable, samples=8, reads=100_000)[":"]
    assert "error" not in r, r
    # one clock read inside a bracket of two reads of the same clock: the midpoint offset is
    # within half the round trip (it is 0 up to where in the bracket the read fell)
    assert abs(r["offset_ns"]) <= r["uncertainty_ns"] and r["uncertainty_ns"] < 50e6
    assert r["backwards"]["reads"] == 100_000 and r["backwards"]["back"] == 0
    assert r["host"] == socket.gethostname()
    tools = [t for t in ("chronyc", "timedatectl") if shutil.which(t)]
    works = (
        tools
        and subprocess.run(
            ["chronyc", "-n", "tracking"] if tools[0] == "chronyc" else ["timedatectl", "show"], capture_output=True
        ).returncode
        == 0
    )
    cell, _ = daemon_summary(r["daemon"])
    if works:
        assert r["daemon"]["tool"] in tools and cell != "no sync daemon answers"
    else:  # issue 30.6: said so, not a cut-off message of systemd's
        assert r["daemon"]["tool"] is None and cell == "no sync daemon answers"
    (tmp_path / "nodes").write_text(":\n")
    p = cluster_cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f": ({socket.gethostname()})" in p.stdout and "0 error(s)" in p.stdout
    # a threshold no bracket can meet (its round trip is > 0): a warning, fatal only with --strict
    p = cluster_cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000, "--warn-ms", 0)
    assert p.returncode == 0 and "WARNING" in p.stdout and "1 warning(s)" in p.stdout, p.stdout
    p = cluster_cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000, "--warn-ms", 0, "--strict")
    assert p.returncode == 1, p.stdout


def test_unreachable_node_fails_the_check(tmp_path):
    (tmp_path / "nodes").write_text(":\nno-such-node.invalid\n")
    for cmd in ("gpus", "clocks"):
        p = cluster_cli(cmd, "--hostfile", tmp_path / "nodes", "--timeout", 30)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "no-such-node.invalid" in p.stdout and ("UNREACHABLE" in p.stdout or "unreachable" in p.stdout)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_gpus_without_nvidia_smi_says_no_gpu(tmp_path):
    (tmp_path / "nodes").write_text(":\n")
    p = cluster_cli("gpus", "--hostfile", tmp_path / "nodes", "--expect-idle")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no GPU" in p.stdout


def test_gpus_expect_idle_fails_on_a_gpu_process(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_ / "nvidia-smi").chmod(0o755)
    (tmp_path / "nodes").write_text(":\n")
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    p = cluster_cli("gpus", "--hostfile", tmp_path / "nodes", "--expect-idle", "--reads", 2, env=env)
    assert p.returncode == 0 and "2 x NVIDIA H100 80GB HBM3" in p.stdout and "ERROR" not in p.stdout, (
        p.stdout + p.stderr
    )

    (bin_ / "apps.csv").write_text(APPS_CSV.splitlines()[0] + "\n")  # pid 40213 on GPU 0
    p = cluster_cli("gpus", "--hostfile", tmp_path / "nodes", "--expect-idle", "--reads", 2, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "ERROR: 1 GPU process(es) running (--expect-idle)" in p.stdout
    assert any(ln.split()[:3] == ["0", "40213", "71220"] for ln in p.stdout.splitlines()), p.stdout
    p = cluster_cli("gpus", "--hostfile", tmp_path / "nodes", "--reads", 2, env=env)  # listed, not an error
    assert p.returncode == 0 and "40213" in p.stdout and "ERROR" not in p.stdout, p.stdout
