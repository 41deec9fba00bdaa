"""What the ``reelcache cluster`` tests share: the command as a subprocess, a stand-in for ssh, and a
rank record of another process as the trainer would have written it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from support import REPO, proc_stat

from reelcache.cluster.ranks import RankRecord


def cli(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    """``reelcache cluster ARGS`` in a process of its own, from the repository."""
    return subprocess.run(
        [sys.executable, "-m", "reelcache.cli", "cluster", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def record(run: Path, rank: int, pid: int, host: str, stacks: Path | None = None) -> RankRecord:
    """The record of another process (a stand-in rank), as the trainer would have written it."""
    rec = RankRecord(
        rank=rank,
        world_size=2,
        local_rank=rank,
        host=host,
        pid=pid,
        proc_start=proc_stat(pid)[1],
        boot_id=boot_id(),
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
