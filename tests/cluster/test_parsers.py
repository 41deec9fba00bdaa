"""Parsers of ``reelcache cluster`` on outputs copied from the tools' documentation (chronyc, timedatectl,
nvidia-smi, py-spy, faulthandler), and Slurm node lists written out by hand from Slurm's hostlist rules.
"""

from __future__ import annotations

import socket

import pytest
from support import APPS_CSV, GPU_CSV

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


def test_a_slurm_node_list_expands_like_scontrol(monkeypatch):
    """Expected lists written out by hand from Slurm's hostlist rules (tests/cluster/test_slurm_train.py compares
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
