"""Slurm's own commands (``scontrol``, ``sinfo``, ``squeue``, ``sacctmgr``, ``sbatch``) run and read: the only
way reelcache talks to a cluster."""

from __future__ import annotations

import re
import shutil
import subprocess

from reelcache import UserError


def slurm(*cmd: str) -> subprocess.CompletedProcess:
    """Run one of Slurm's commands; a UserError when it is not installed here or hangs."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise UserError(f"{cmd[0]} not found: run this where Slurm's commands are (a login node)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{' '.join(cmd)} did not answer in 120 s: is slurmctld up?") from None


def said(done: subprocess.CompletedProcess) -> str:
    """The last line a command said (its error, usually)."""
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def answers() -> bool:
    """Whether a cluster answers here (a dry run checks only then)."""
    return shutil.which("sinfo") is not None and slurm("sinfo", "-h").returncode == 0


def cluster_config() -> dict[str, str]:
    """``scontrol show config`` as a dict (``Key = value`` lines)."""
    done = slurm("scontrol", "show", "config")
    if done.returncode:
        raise UserError(f"scontrol show config: {said(done)}")
    return {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in done.stdout.splitlines()) if v}


def partition_fields(text: str) -> dict[str, str]:
    """``scontrol show partition P --oneliner`` as a dict (``Key=value`` words)."""
    return dict(w.split("=", 1) for w in text.split() if "=" in w)


def default_partition() -> str:
    names = slurm("sinfo", "--noheader", "--format", "%P").stdout.split()
    default = next((n.rstrip("*") for n in names if n.endswith("*")), None)
    if default is None:
        raise UserError("this cluster has no default partition: give --partition")
    return default


def node_gpus(gres: str) -> int:
    """GPUs in a node's Gres string: ``gpu:2``, ``gpu:a100:8(S:0-1)``, ``gpu:a100:4,gpu:v100:2``, ``(null)``."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_gpus(partition: str) -> list[int]:
    """The GPUs of each node of the partition."""
    return [node_gpus(g) for g in _per_node(partition, "%G")]


def partition_cpus(partition: str) -> list[int]:
    """The CPUs of each node of the partition."""
    return [int(c) for c in _per_node(partition, "%c") if c.strip().isdigit()]


def _per_node(partition: str, field: str) -> list[str]:
    nodes = slurm("sinfo", "--noheader", "--Node", "--partition", partition, "--format", f"%N|{field}").stdout
    return list(dict(line.split("|", 1) for line in nodes.splitlines() if "|" in line).values())  # a node once


def job_ended(job: str) -> bool | None:
    """Whether a job (and every requeue of it) has ended: True, False (pending, running, requeued), or
    None when the controller does not answer (the caller asks again later)."""
    done = slurm("squeue", "--noheader", "--jobs", str(job), "--format", "%T")
    if done.returncode:
        return True if "Invalid job id" in done.stderr else None
    return not done.stdout.strip()
