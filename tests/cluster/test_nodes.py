"""``reelcache cluster``: real commands through real GNU parallel against ':' (this machine).

References are independent of the code under test: the tools' own published outputs for the
parsers, the kernel's /proc for which processes live, py-spy's "Process <pid>" header for whose
stack a dump holds, and the same-clock property for the offset (a read bracketed by two reads of
one clock lies inside the bracket, so |offset| <= uncertainty exactly).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from latent_data import write_latents
from support import APPS_CSV, FAKE_NVIDIA_SMI, GPU_CSV, REPO, free_port, proc_alive, proc_stat

from reelcache import UserError
from reelcache.cluster import agent, ranks
from reelcache.cluster.ranks import RankRecord

CONFIG = REPO / "configs/train/debug/stage1.toml"


def cli(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reelcache.cli", "cluster", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# --- parsers, on outputs copied from the tools' documentation ---------------------------------

# chronyc tracking as printed in the AWS EC2 User Guide, "Set the time reference on your EC2
# instance" (Amazon Time Sync Service, chrony on Amazon Linux), verbatim.
CHRONYC_AWS = """\
Reference ID    : A9FEA97B (169.254.169.123)
Stratum         : 4
Ref time (UTC)  : Wed Nov 22 13:18:34 2017
System time     : 0.000000626 seconds slow of NTP time
Last offset     : +0.002852759 seconds
RMS offset      : 0.002852759 seconds
Frequency       : 1.187 ppm fast
Residual freq   : +0.020 ppm
Skew            : 24.388 ppm
Root delay      : 0.000504752 seconds
Root dispersion : 0.001112565 seconds
Update interval : 64.4 seconds
Leap status     : Normal
"""

# A node chrony has not synchronised (the 'Leap status' chronyc(1) documents as "Not synchronised";
# the same field layout as above, as a fresh chronyd prints it before its first measurement).
CHRONYC_UNSYNCED = """\
Reference ID    : 00000000 ()
Stratum         : 0
Ref time (UTC)  : Thu Jan 01 00:00:00 1970
System time     : 0.000000000 seconds fast of NTP time
Last offset     : +0.000000000 seconds
RMS offset      : 0.000000000 seconds
Frequency       : 0.000 ppm slow
Residual freq   : +0.000 ppm
Skew            : 0.000 ppm
Root delay      : 1.000000000 seconds
Root dispersion : 1.000000000 seconds
Update interval : 0.0 seconds
Leap status     : Not synchronised
"""

# `timedatectl show`: the org.freedesktop.timedate1 properties timedatectl(1) prints as key=value.
TIMEDATECTL = """\
Timezone=Etc/UTC
LocalRTC=no
CanNTP=yes
NTP=yes
NTPSynchronized=no
TimeUSec=Sun 2026-11-22 04:42:48 UTC
RTCTimeUSec=Sun 2026-11-22 04:42:48 UTC
"""


def test_chronyc_tracking_is_parsed():
    from reelcache.cluster.clocks import daemon_summary, parse_chronyc

    c = parse_chronyc(CHRONYC_AWS)
    assert c["offset_s"] == pytest.approx(-0.000000626)  # "slow of NTP time": behind, negative
    assert c["leap"] == "Normal" and c["stratum"] == 4 and c["synced"]
    assert c["reference"] == "A9FEA97B (169.254.169.123)"
    u = parse_chronyc(CHRONYC_UNSYNCED)
    assert not u["synced"] and u["offset_s"] == 0
    assert daemon_summary({"tool": "chronyc", "out": CHRONYC_AWS})[1] is None
    assert "Not synchronised" in daemon_summary({"tool": "chronyc", "out": CHRONYC_UNSYNCED})[1]
    cell, warn = daemon_summary({"tool": "timedatectl", "out": TIMEDATECTL})
    assert cell == "timedatectl: NTPSynchronized=no" and warn


def test_nvidia_smi_csv_is_parsed():
    from reelcache.cluster.gpus import gpu_report, parse_apps_csv, parse_gpu_csv

    gpus = parse_gpu_csv(GPU_CSV)
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and gpus[0]["mem_used"] == 71234
    assert gpus[0]["power"] == 512.37 and gpus[1]["power"] is None
    apps = parse_apps_csv(APPS_CSV)
    assert [(a["pid"], a["name"], a["mem"]) for a in apps] == [
        (40213, "/opt/conda/bin/python3.10", 71220),
        (40299, "python -c import a,b", None),
    ]
    ok = {"rc": 0, "err": ""}
    res = {
        "nvidia_smi": "/usr/bin/nvidia-smi",
        "gpu_reads": [{**ok, "out": GPU_CSV}] * 3,
        "apps": {**ok, "out": APPS_CSV},
    }
    lines, problems, nproc = gpu_report(res)
    assert nproc == 2 and not problems
    assert "2 x NVIDIA H100 80GB HBM3" in lines[0]
    assert any("512.4" in ln for ln in lines) and any("n/a" in ln for ln in lines)
    none = {"nvidia_smi": "/usr/bin/nvidia-smi", "gpu_reads": [{"rc": 6, "out": "No devices were found\n", "err": ""}]}
    assert gpu_report(none)[0][0].startswith("  no GPU") and not gpu_report(none)[1]
    broken = {
        "nvidia_smi": "/usr/bin/nvidia-smi",
        "gpu_reads": [{"rc": 18, "out": "Failed to initialize NVML: Driver/library version mismatch\n", "err": ""}],
    }
    assert gpu_report(broken)[1]


def test_hostfile_is_read_like_an_sshloginfile(tmp_path):
    from reelcache import UserError
    from reelcache.cluster.hosts import read_hostfile

    f = tmp_path / "nodes.txt"
    f.write_text("# head\n:\n8/gpu01\n  user@gpu02  \nssh -p 2222 gpu03   # other port\n\n")
    assert read_hostfile(f) == [":", "gpu01", "user@gpu02", "ssh -p 2222 gpu03"]
    f.write_text("# nothing\n")
    with pytest.raises(UserError):
        read_hostfile(f)


def test_stack_summary_names_the_odd_rank():
    from reelcache.cluster.procs import main_frames, summarize

    pyspy = (
        "Process 7: python -m reelcache.train\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
        'Thread 7 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:2050)\n'
        "    step (train/trainer.py:300)\n    train (train/trainer.py:380)\n"
        'Thread 9 (idle): "Thread-1"\n    wait (threading.py:324)\n'
    )
    odd = (
        'Current thread 0x00007f (most recent call first):\n  File "/x/train/loader.py", line 50 in __next__\n'
        '  File "/x/train/trainer.py", line 380 in train\n'
    )
    stacks = {0: main_frames(pyspy), 1: main_frames(pyspy), 2: main_frames(odd)}
    assert stacks[2] == [("__next__", "/x/train/loader.py", 50), ("train", "/x/train/trainer.py", 380)]
    text = "\n".join(summarize(stacks))
    assert "2 of 3 ranks in all_reduce (distributed_c10d.py): ranks 0 1" in text
    assert "1 of 3 ranks in __next__ (loader.py): ranks 2" in text
    assert "all ranks but 2 are in: all_reduce (distributed_c10d.py)" in text
    assert text.split("dumped ranks (innermost first):\n")[1].splitlines()[0] == "  train (trainer.py)"


# --- the rank record --------------------------------------------------------------------------

# The keys of a record as the trainer has written them since it records its launcher: read() must
# keep reading them, and write() writes exactly these.
TRAINER_KEYS = [
    "rank",
    "world_size",
    "local_rank",
    "host",
    "pid",
    "proc_start",
    "boot_id",
    "started",
    "launcher_pid",
    "launcher_proc_start",
    "stacks",
]


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_a_rank_record_names_this_process_as_the_kernel_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = ranks.write("run", 1, 2, 1, "stacks/rank00001.txt")
    assert path.resolve() == tmp_path / "run/ranks/rank00001.json"
    doc = json.loads(path.read_text())
    assert list(doc) == TRAINER_KEYS
    assert (doc["rank"], doc["world_size"], doc["local_rank"]) == (1, 2, 1)
    assert (doc["pid"], doc["proc_start"]) == (os.getpid(), proc_stat(os.getpid())[1])
    assert (doc["launcher_pid"], doc["launcher_proc_start"]) == (os.getppid(), proc_stat(os.getppid())[1])
    assert doc["host"] == socket.gethostname() and doc["boot_id"] == _boot_id()
    assert doc["stacks"] == str(tmp_path / "stacks/rank00001.txt") and abs(doc["started"] - time.time()) < 60
    assert ranks.proc_start(os.getpid()) == proc_stat(os.getpid())[1]
    (rec,) = ranks.read("run")
    assert rec.to_json() == doc
    # the agent on a node judges the record it is sent by /proc, as ranks.py wrote it: this process,
    # alive; the same pid with another start time is another process
    assert agent.verify(rec.to_json()) == ""
    assert "reused" in agent.verify(dataclasses.replace(rec, proc_start=rec.proc_start - 1).to_json())


def test_rank_0_removes_the_records_of_an_earlier_larger_launch(tmp_path):
    for r in (10, 2, 0, 1):
        ranks.write(tmp_path, r, 12, r % 8, None)
    assert [r.rank for r in ranks.read(tmp_path)] == [0, 1, 2, 10]  # by rank
    ranks.write(tmp_path, 1, 2, 1, None)  # a relaunch on 2 ranks: rank 1 removes nothing
    assert [r.rank for r in ranks.read(tmp_path)] == [0, 1, 2, 10]
    ranks.write(tmp_path, 0, 2, 0, None)
    assert [(r.rank, r.world_size) for r in ranks.read(tmp_path)] == [(0, 2), (1, 2)]


def test_a_malformed_rank_record_is_refused_by_name(tmp_path):
    path = ranks.write(tmp_path, 0, 1, 0, None)
    doc = json.loads(path.read_text())
    for text, why in (
        ("{", "Expecting property name"),
        (json.dumps([doc]), "a rank record is a JSON object, not list"),
        (json.dumps({**doc, "pid": "123"}), "pid must be an integer >= 0, not '123'"),
        (json.dumps({**doc, "proc_start": 1.5}), "proc_start must be an integer >= 0 or null, not 1.5"),
        (json.dumps({k: v for k, v in doc.items() if k not in ("host", "stacks")}), "no host, stacks"),
        (json.dumps({**doc, "rank": 3}), "it records rank 3"),
    ):
        path.write_text(text)
        with pytest.raises(UserError) as e:
            ranks.read(tmp_path)
        assert f"malformed rank record {path}: " in str(e.value) and why in str(e.value), str(e.value)
    # a record from before the launcher was recorded reads; a newer writer's extra key is ignored
    path.write_text(json.dumps({**{k: v for k, v in doc.items() if not k.startswith("launcher")}, "gpu": 3}))
    (rec,) = ranks.read(tmp_path)
    assert rec.launcher_pid is None and rec.launcher_proc_start is None and rec.pid == doc["pid"]
    path.unlink()
    with pytest.raises(UserError, match="no rank records in"):
        ranks.read(tmp_path)


# --- real runs against ':' ------------------------------------------------------------------


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
        assert r["daemon"]["tool"] in tools and not cell.startswith("unavailable")
    else:
        assert r["daemon"]["tool"] is None and cell.startswith("unavailable")
    (tmp_path / "nodes").write_text(":\n")
    p = cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f": ({socket.gethostname()})" in p.stdout and "0 error(s)" in p.stdout
    # a threshold no bracket can meet (its round trip is > 0): a warning, fatal only with --strict
    p = cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000, "--warn-ms", 0)
    assert p.returncode == 0 and "WARNING" in p.stdout and "1 warning(s)" in p.stdout, p.stdout
    p = cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 1000, "--warn-ms", 0, "--strict")
    assert p.returncode == 1, p.stdout


def test_unreachable_node_fails_the_check(tmp_path):
    (tmp_path / "nodes").write_text(":\nno-such-node.invalid\n")
    for cmd in ("gpus", "clocks"):
        p = cli(cmd, "--hostfile", tmp_path / "nodes", "--timeout", 30)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "no-such-node.invalid" in p.stdout and ("UNREACHABLE" in p.stdout or "unreachable" in p.stdout)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_gpus_without_nvidia_smi_says_no_gpu(tmp_path):
    (tmp_path / "nodes").write_text(":\n")
    p = cli("gpus", "--hostfile", tmp_path / "nodes", "--expect-idle")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no GPU" in p.stdout


def test_gpus_expect_idle_fails_on_a_gpu_process(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_ / "nvidia-smi").chmod(0o755)
    (tmp_path / "nodes").write_text(":\n")
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    p = cli("gpus", "--hostfile", tmp_path / "nodes", "--expect-idle", "--reads", 2, env=env)
    assert p.returncode == 0 and "2 x NVIDIA H100 80GB HBM3" in p.stdout and "ERROR" not in p.stdout, (
        p.stdout + p.stderr
    )

    (bin_ / "apps.csv").write_text(APPS_CSV.splitlines()[0] + "\n")  # pid 40213 on GPU 0
    p = cli("gpus", "--hostfile", tmp_path / "nodes", "--expect-idle", "--reads", 2, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "ERROR: 1 GPU process(es) running (--expect-idle)" in p.stdout
    assert any(ln.split()[:3] == ["0", "40213", "71220"] for ln in p.stdout.splitlines()), p.stdout
    p = cli("gpus", "--hostfile", tmp_path / "nodes", "--reads", 2, env=env)  # listed, not an error
    assert p.returncode == 0 and "40213" in p.stdout and "ERROR" not in p.stdout, p.stdout


# --- processes: the kernel's view, and rank records as the trainer writes them ----------------


def _record(run: Path, rank: int, pid: int, host: str, stacks: Path | None = None) -> RankRecord:
    """The record of another process (a stand-in rank), as the trainer would have written it."""
    rec = RankRecord(
        rank=rank,
        world_size=2,
        local_rank=rank,
        host=host,
        pid=pid,
        proc_start=proc_stat(pid)[1],
        boot_id=_boot_id(),
        started=time.time(),
        launcher_pid=os.getpid(),
        launcher_proc_start=proc_stat(os.getpid())[1],
        stacks=None if stacks is None else str(stacks),
    )
    rec.save(run)
    return rec


# A stand-in for ssh to another node that is this machine. It does what sshd does with a command:
# SHELL set to the user's login shell (GNU parallel's remote worker execs $SHELL; CI runs with no
# SHELL in its environment, sshd always sets it) and the words after the host joined by spaces, run
# by that shell with -c. So the path a remote node takes (GNU parallel's ssh wrapper, our own held
# session, the quoting of the agent through both) is exercised without an ssh server. A file
# <host>.env beside it, if present, is that node's environment (e.g. a clock of its own).
FAKE_SSH = """#!/bin/bash
echo "$*" >> "$(dirname "$0")/ssh.log"
while [ $# -gt 0 ]; do case "$1" in -l|-p|-o) shift 2;; -*) shift;; *) break;; esac; done
host="${1##*@}"
shift
[ "$1" = "--" ] && shift
if [ -f "$(dirname "$0")/$host.env" ]; then set -a; . "$(dirname "$0")/$host.env"; set +a; fi
SHELL="$(getent passwd "$(id -u)" | cut -d: -f7)"
export SHELL="${SHELL:-/bin/sh}"
exec "$SHELL" -c "$*"
"""


# A node's own clock, set by the fake ssh below from a per-host env file: `time.time_ns` (what the
# agent reads) runs RC_FAKE_CLOCK_AHEAD_NS ahead of this machine's, and after RC_FAKE_CLOCK_BACK_AFTER
# reads it is stepped back once by RC_FAKE_CLOCK_BACK_NS (an NTP step, as on the replication's node).
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
    p = cli("clocks", "--hostfile", tmp_path / "nodes", "--reads", 20_000)
    assert p.returncode == 1, p.stdout + p.stderr
    rows = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln.startswith("node-")}
    off, _, unc = rows["node-ahead"].split()[1:4]  # "node-ahead  +250.002 +- 0.004 ms  0 ..."
    assert abs(float(off) - ahead / 1e6) <= float(unc) + 0.001, p.stdout
    assert "WARNING: offset +2" in p.stdout and "exceeds --warn-ms 50" in p.stdout
    back = p.stdout.split("node-steps", 1)[1]
    assert "ERROR: the realtime clock went back 1 time(s) in 20000 reads (at most 5.0" in back, p.stdout
    assert "1 error(s)" in p.stdout


def test_a_node_that_never_answers_costs_its_timeout_not_more(tmp_path):
    """An ssh that hangs (a dead node behind a live jump host) holds parallel's pipes: the node is
    reported unreachable after --timeout, with parallel and its ssh killed together."""
    ssh = tmp_path / "ssh"
    ssh.write_text("#!/bin/bash\nsleep 60\n")
    ssh.chmod(0o755)
    (tmp_path / "nodes").write_text("node-hung\n")
    t0 = time.monotonic()
    p = cli("gpus", "--hostfile", tmp_path / "nodes", "--timeout", 2, env={**os.environ, "PARALLEL_SSH": str(ssh)})
    assert time.monotonic() - t0 < 30, "the command waited for the hung ssh"
    assert p.returncode == 1 and "no answer within 2 s" in p.stdout, p.stdout + p.stderr


def test_remote_nodes_go_through_ssh(tmp_path):
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    env = {**os.environ, "PARALLEL_SSH": str(ssh)}
    nodes = tmp_path / "nodes"
    nodes.write_text(f"node-a\n4/{ssh} -p 2222 user@node-b\n")
    p = cli("gpus", "--hostfile", nodes, env=env)
    assert p.returncode == (1 if shutil.which("nvidia-smi") else 0), p.stdout + p.stderr
    assert "node node-a" in p.stdout and f"node {ssh} -p 2222 user@node-b" in p.stdout
    p = cli("clocks", "--hostfile", nodes, "--reads", 1000, env=env)
    assert p.returncode == 0 and "0 error(s)" in p.stdout, p.stdout + p.stderr
    log = (tmp_path / "ssh.log").read_text()
    assert log.count("node-a") == 2 and log.count("node-b") == 2  # parallel passes user@ as -l user

    # dump and stop of a process recorded on node-a, reached through the hostfile's line for it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        time.sleep(0.3)
        run = tmp_path / "run"
        _record(run, 0, sleeper.pid, "node-a.cluster.example")
        p = cli("dump", "--run", run, "--hostfile", nodes, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        (dump,) = (run / "dumps").iterdir()
        assert f"Process {sleeper.pid}:" in (dump / "rank00000.txt").read_text()
        p = cli("stop", "--run", run, "--hostfile", nodes, "--grace", 5, env=env)
        assert p.returncode == 0 and "stopped by SIGTERM" in p.stdout, p.stdout + p.stderr
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
        assert (tmp_path / "ssh.log").read_text().count("node-a") == 4
    finally:
        sleeper.kill()
        sleeper.wait()


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
        _record(run, 0, rank.pid, socket.gethostname(), stacks)
        p = cli("dump", "--run", run, "--timeout", 10, env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
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
        _record(tmp_path, 0, stubborn.pid, socket.gethostname())
        _record(tmp_path, 1, polite.pid, socket.gethostname())
        p = cli("stop", "--run", tmp_path, "--grace", 1)
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
    args = [
        f'--data.manifests=[{{name="{manifest}"}}]',
        '--data.buckets="configs/buckets/tiny.toml"',
        "--model.overrides={caption_channels=8, model_max_length=300}",
        "--data.workers=1",
        "--log.wandb_mode=disabled",
        "--run.epochs=1000",
        "--checkpoint.every=0",
        "--run.name=live",
    ]
    env = {**os.environ, "REELCACHE_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "reelcache.train",
            str(CONFIG),
            "--root",
            str(root),
            *args,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    run = root / "runs/live"
    deadline = time.monotonic() + 120
    while not all((run / f"ranks/rank{r:05d}.json").exists() for r in (0, 1)):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"training did not start: {p.stdout.read()[-3000:]}")
        time.sleep(0.2)
    time.sleep(2)  # into the loop
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

        p = cli("dump", "--run", run)
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
        p = cli("dump", "--run", run, "--method", "signal")
        assert p.returncode == 0, p.stdout + p.stderr
        newest = sorted((run / "dumps").iterdir())[-1]
        for r in recs:
            text = (newest / f"rank{r.rank:05d}.txt").read_text()
            assert "(most recent call first)" in text and "trainer.py" in text
        assert proc_alive(decoy.pid, decoy_start)

        p = cli("stop", "--run", run, "--grace", 10)
        assert p.returncode == 0, p.stdout + p.stderr
        for r in recs:
            assert f"rank {r.rank:05d} host {r.host} pid {r.pid}: stopped by SIG" in p.stdout
            assert not proc_alive(r.pid, r.proc_start)
        assert "rank 00002" in p.stdout and "pid gone or reused" in p.stdout
        assert proc_alive(decoy.pid, decoy_start), "the decoy with the same command line was stopped"
        launcher.wait(timeout=60)  # its workers gone, the launcher gives up by itself

        p = cli("stop", "--run", run, "--grace", 1)  # again: nothing left to stop
        assert p.returncode == 0 and p.stdout.count("already gone") == 2, p.stdout
    finally:
        decoy.kill()
        decoy.wait()


# -- nodes from a Slurm allocation -------------------------------------------------------------------------------


def test_a_slurm_node_list_expands_like_scontrol(monkeypatch):
    """Expected lists written out by hand from Slurm's hostlist rules (tests/test_slurm_train.py compares
    with `scontrol show hostnames` itself where a local Slurm runs)."""
    from reelcache import UserError
    from reelcache.cluster.hosts import expand_nodelist, node_logins

    assert expand_nodelist("gpu[01-03,7],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]
    assert expand_nodelist("n[001-002]-ib[1-2]") == ["n001-ib1", "n001-ib2", "n002-ib1", "n002-ib2"]
    assert expand_nodelist("a[8-11]") == ["a8", "a9", "a10", "a11"]
    assert expand_nodelist("solo") == ["solo"]
    for bad in ("gpu[3-1]", "gpu[x]", "gpu[1", ""):
        with pytest.raises(UserError, match="node list"):
            expand_nodelist(bad)
    here = socket.gethostname().split(".")[0]
    monkeypatch.setenv("SLURM_JOB_NODELIST", f"{here},other[1-2]")
    assert node_logins() == [":", "other1", "other2"]
    assert node_logins(nodelist="x[1-2]") == ["x1", "x2"]
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    with pytest.raises(UserError, match="--hostfile"):
        node_logins()
