"""Nodes reached through ssh: a stand-in ssh (support.FAKE_SSH) that does what sshd does with a
command, so GNU parallel's ssh wrapper, our held session and the agent's quoting run without an ssh
server; a node's clock of its own, ahead or stepping back; a node that never answers.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support import FAKE_SSH, cluster_cli, record

pytestmark = pytest.mark.slow  # GNU parallel, ssh stand-ins and agents as processes


# A node's own clock, set by the stand-in ssh (support.FAKE_SSH) from a per-host env file:
# `time.time_ns` (what the agent reads) runs RC_FAKE_CLOCK_AHEAD_NS ahead of this machine's, and after
# RC_FAKE_CLOCK_BACK_AFTER reads it is stepped back once by RC_FAKE_CLOCK_BACK_NS (an NTP step, as on
# the replication's node).
CLOCK_SITECUSTOMIZE = """
import os, time
_real, _ahead = time.time_ns, int(os.environ.get("RC_FAKE_CLOCK_AHEAD_NS", "0"))
_after, _back = int(os.environ.get("RC_FAKE_CLOCK_BACK_AFTER", "0")), int(os.environ.get("RC_FAKE_CLOCK_BACK_NS", "0"))
_reads = 0

def time_ns():
    global _reads
    _reads += 1
    return _real() + _ahead - (_back if _after and _reads > _after else 0)

time.time_ns = time_ns
"""


def _fake_node(tmp_path, host: str, **env) -> None:
    """The environment the fake ssh gives commands on `host` (a file it sources)."""
    shim = tmp_path / "clockshim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(CLOCK_SITECUSTOMIZE)
    (tmp_path / f"{host}.env").write_text(f"PYTHONPATH={shim}\n" + "".join(f"{k}={v}\n" for k, v in env.items()))


def test_clocks_measure_a_node_ahead_and_catch_one_that_steps_back(tmp_path, monkeypatch):
    """Independent reference: the offset the node's clock was given. A read bracketed by the head's
    two reads is the head's time + AHEAD + (its place in the bracket), so the measured offset is
    AHEAD to within the uncertainty, with its sign (> 0: the node is ahead)."""
    from reelcache.cluster.clocks import clock_check

    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    ahead, step = 250_000_000, 5_000_000  # 250 ms ahead; a 5 ms step back
    _fake_node(tmp_path, "node-ahead", RC_FAKE_CLOCK_AHEAD_NS=ahead)
    _fake_node(tmp_path, "node-steps", RC_FAKE_CLOCK_BACK_AFTER=1000, RC_FAKE_CLOCK_BACK_NS=step)
    monkeypatch.setenv("PARALLEL_SSH", str(ssh))
    res = clock_check(["node-ahead", "node-steps"], sys.executable, samples=8, reads=20_000)
    a, s = res["node-ahead"], res["node-steps"]
    assert "error" not in a and "error" not in s, res
    assert a["uncertainty_ns"] < 50e6
    assert abs(a["offset_ns"] - ahead) <= a["uncertainty_ns"] + 1, (a["offset_ns"], a["uncertainty_ns"])
    assert a["backwards"]["back"] == 0
    assert abs(s["offset_ns"]) <= s["uncertainty_ns"] + 1  # same clock until the step
    assert s["backwards"]["back"] == 1 and step - 1e6 < s["backwards"]["worst_ns"] <= step, s["backwards"]

    (tmp_path / "nodes").write_text("node-ahead\nnode-steps\n")
    p = cluster_cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 20_000)
    assert p.returncode == 1, p.stdout + p.stderr
    rows = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln.startswith("node-")}
    off, _, unc = rows["node-ahead"].split()[1:4]  # "node-ahead  +250.002 +- 0.004 ms  0 ..."
    assert abs(float(off) - ahead / 1e6) <= float(unc) + 0.001, p.stdout
    assert "WARNING: offset +2" in p.stdout and "exceeds --warn-ms 50" in p.stdout
    back = p.stdout.split("node-steps", 1)[1]
    went = re.search(r"ERROR: the realtime clock went back 1 time\(s\) in 20000 reads \(at most ([0-9.]+) ms\)", back)
    assert went and (step - 1e6) / 1e6 < float(went[1]) <= step / 1e6, p.stdout  # the reads between cost time
    assert "1 error(s)" in p.stdout


def test_a_node_seconds_ahead_is_an_error_by_default(tmp_path, monkeypatch):
    """Issue 30.6: a node 7 s ahead (the replication's case) fails the check without --strict, naming the
    bound (--error-ms, 1000) and why; one 300 ms ahead stays a warning. Reference: the offsets the nodes'
    clocks were given."""
    from reelcache.cluster.clocks import ERROR_MS, WHY_ERROR

    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    _fake_node(tmp_path, "node-7s", RC_FAKE_CLOCK_AHEAD_NS=7_000_000_000)
    _fake_node(tmp_path, "node-300ms", RC_FAKE_CLOCK_AHEAD_NS=300_000_000)
    monkeypatch.setenv("PARALLEL_SSH", str(ssh))
    (tmp_path / "nodes").write_text("node-7s\nnode-300ms\n")
    p = cluster_cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000)
    assert p.returncode == 1, p.stdout + p.stderr
    ahead, slight = p.stdout.split("node-300ms", 1)
    lines = [ln.strip() for ln in ahead.split("node-7s", 1)[1].splitlines() if "ERROR" in ln]
    assert len(lines) == 1 and ERROR_MS == 1000, p.stdout
    off = float(lines[0].split()[2])
    assert abs(off - 7000) < 50 and lines[0] == f"ERROR: offset {off:+.3f} ms is beyond --error-ms 1000: {WHY_ERROR}"
    warn = [ln.strip() for ln in slight.splitlines() if "WARNING: offset" in ln]  # +299.998 is as right as +300.001
    assert "ERROR" not in slight and len(warn) == 1 and abs(float(warn[0].split()[2]) - 300) < 50, p.stdout
    assert "1 error(s), 1 warning(s)" in p.stdout
    p = cluster_cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000, "--error-ms", 10_000)
    assert p.returncode == 0 and "0 error(s), 2 warning(s)" in p.stdout, p.stdout


def test_a_node_that_never_answers_costs_its_timeout_not_more(tmp_path):
    """An ssh that hangs (a dead node behind a live jump host) holds parallel's pipes: the node is
    reported unreachable after --timeout, with parallel and its ssh killed together."""
    ssh = tmp_path / "ssh"
    ssh.write_text("#!/bin/bash\nsleep 60\n")
    ssh.chmod(0o755)
    (tmp_path / "nodes").write_text("node-hung\n")
    t0 = time.monotonic()
    p = cluster_cli(
        "gpus", "--hostfile", tmp_path / "nodes", "--timeout", 2, env={**os.environ, "PARALLEL_SSH": str(ssh)}
    )
    assert time.monotonic() - t0 < 30, "the command waited for the hung ssh"
    assert p.returncode == 1 and "no answer within 2 s" in p.stdout, p.stdout + p.stderr


def test_remote_nodes_go_through_ssh(tmp_path):
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    env = {**os.environ, "PARALLEL_SSH": str(ssh)}
    nodes = tmp_path / "nodes"
    nodes.write_text(f"node-a\n4/{ssh} -p 2222 user@node-b\n")
    p = cluster_cli("gpus", "--hostfile", nodes, env=env)
    assert p.returncode == (1 if shutil.which("nvidia-smi") else 0), p.stdout + p.stderr
    assert "node node-a" in p.stdout and f"node {ssh} -p 2222 user@node-b" in p.stdout
    p = cluster_cli("clocks", "--hostfile", nodes, "--reads", 1000, env=env)
    assert p.returncode == 0 and "0 error(s)" in p.stdout, p.stdout + p.stderr
    log = (tmp_path / "ssh.log").read_text()
    assert log.count("node-a") == 2 and log.count("node-b") == 2  # parallel passes user@ as -l user

    # dump and stop of a process recorded on node-a, reached through the hostfile's line for it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        time.sleep(0.3)
        run = tmp_path / "run"
        record(run, 0, sleeper.pid, "node-a.cluster.example")
        p = cluster_cli("dump", "--run", run, "--hostfile", nodes, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        (dump,) = (run / "dumps").iterdir()
        assert f"Process {sleeper.pid}:" in (dump / "rank00000.txt").read_text()
        p = cluster_cli("stop", "--run", run, "--hostfile", nodes, "--grace", 5, env=env)
        assert p.returncode == 0 and "stopped by SIGTERM" in p.stdout, p.stdout + p.stderr
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
        assert (tmp_path / "ssh.log").read_text().count("node-a") == 4
    finally:
        sleeper.kill()
        sleeper.wait()
