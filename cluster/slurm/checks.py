"""Before anything is submitted: what would make sbatch refuse a job, or leave it pending for ever, or
fail every unit inside the cluster, as one line (a UserError); what cannot be checked, as a warning.

Each is one line: no Slurm controller answering, a partition that does not exist, a ``--time`` that
is not Slurm's, more nodes than the partition has, more GPUs or CPUs per node or task than its nodes
have, an account that ``sacctmgr`` does not know, more units than ``MaxArraySize`` allows in one
array, a command that does not exist here (every unit would exit 127; ``--no-command-check`` where it
exists only on the compute nodes), and for training a time limit (``--time``, else the partition's
``DefaultTime``, else its ``MaxTime``) not longer than ``--signal-s`` (the job would stop and requeue
itself every few steps). Where accounting is off Slurm accepts any ``--account``: that is a warning.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from reelcache import UserError
from reelcache.cluster.slurm.client import (
    cluster_config,
    default_partition,
    partition_cpus,
    partition_fields,
    partition_gpus,
    said,
    slurm,
)
from reelcache.cluster.slurm.options import Resources


def check(res: Resources, *, signal_s: int | None = None, tasks: int | None = None) -> list[str]:
    """Every check of the cluster a job of any kind gets (``tasks``: an array's; ``signal_s``: a training's).
    Raises UserError; returns warnings."""
    if res.time:
        time_seconds(res.time)
    if not res.partition:  # sinfo says nothing useful without a controller: say that first
        check_controller(slurm("scontrol", "show", "partition", "--oneliner"))
    name = res.partition or default_partition()
    fields, warnings = check_partition(name)
    config = cluster_config()
    if tasks is not None:
        check_array_size(tasks, config)
    if signal_s is not None and not res.time:
        check_default_time(name, fields, signal_s)
    for what, cpus in (
        ("--cpus-per-task", res.cpus_per_task),
        ("--sbatch-arg=--cpus-per-task", cpus_in(res.sbatch_args)),
    ):
        if cpus and cpus > 1:
            check_cpus(cpus, name, what)
    check_gpus(res, name)
    if res.account:
        warnings += check_account(res.account, config)
    return warnings


def check_controller(done: subprocess.CompletedProcess) -> None:
    """A UserError when a client's answer says that no controller answered, or that it found no Slurm
    configuration to ask one (not what the client asked about)."""
    text = done.stderr + done.stdout
    if done.returncode and (
        "Could not establish a configuration source" in text or "Unable to process configuration" in text
    ):
        conf = os.environ.get("SLURM_CONF")
        where = (
            f"SLURM_CONF={conf} is not a readable slurm.conf" if conf else "no slurm.conf here and SLURM_CONF is unset"
        )
        raise UserError(
            f"no Slurm configuration ({said(done)}): {where}; run this on a node of the cluster (a login node), "
            "or export SLURM_CONF=<the cluster's slurm.conf>"
        )
    if done.returncode and ("Unable to contact slurm controller" in text or "Unable to establish" in text):
        conf = os.environ.get("SLURM_CONF", "the default slurm.conf")
        raise UserError(f"no Slurm controller answers ({said(done)}): is slurmctld up, and is {conf} this cluster's?")


def check_partition(partition: str) -> tuple[dict[str, str], list[str]]:
    """The partition's fields (``scontrol show partition``) and warnings (it is not UP); a UserError if no
    controller answers or the partition does not exist."""
    done = slurm("scontrol", "show", "partition", partition, "--oneliner")
    check_controller(done)
    if done.returncode or not done.stdout.strip():
        names = slurm("sinfo", "--noheader", "--format", "%R").stdout.split()
        raise UserError(
            f"partition {partition!r} does not exist on this cluster (partitions: {', '.join(names) or 'none'})"
        )
    fields = partition_fields(done.stdout)
    state = fields.get("State", "UP")
    return fields, [] if state == "UP" else [f"partition {partition} is {state}: the jobs wait until it is UP"]


def check_array_size(tasks: int, config: dict[str, str]) -> None:
    most = int(config.get("MaxArraySize", "1001"))
    if tasks > most:
        raise UserError(
            f"{tasks} units are more than one job array may hold here (MaxArraySize={most}, "
            f"indices 0..{most - 1}): plan larger units, or submit the units in parts of {most}"
        )


def cpus_in(sbatch_args) -> int | None:
    """``--cpus-per-task`` among verbatim sbatch options (``--cpus-per-task=N``, ``-c N``, ``-cN``)."""
    found, args = None, list(sbatch_args)
    for i, x in enumerate(args):
        m = re.fullmatch(r"(?:--cpus-per-task=|-c)(\d+)", x)
        if m:
            found = int(m[1])
        elif x in ("--cpus-per-task", "-c") and i + 1 < len(args) and args[i + 1].isdigit():
            found = int(args[i + 1])
    return found


def check_cpus(cpus: int, partition: str, what: str = "--cpus-per-task") -> None:
    """A UserError when no node of the partition has `cpus` CPUs (the job would pend for ever)."""
    most = max(partition_cpus(partition), default=0)
    if cpus > most:
        raise UserError(f"{what} {cpus}: no node of partition {partition} has more than {most} CPUs")


def check_gpus(res: Resources, partition: str) -> None:
    """Enough nodes, and nodes with the GPUs asked for (per node, per task)."""
    gpus = partition_gpus(partition)
    if res.nodes > len(gpus):
        raise UserError(f"--nodes {res.nodes}: partition {partition} has {len(gpus)} node(s)")
    fit = sum(1 for g in gpus if g >= res.gpus_per_node)
    most = max(gpus, default=0)
    if res.gpus_per_node and fit < res.nodes:
        raise UserError(
            f"--gpus-per-node {res.gpus_per_node} on {res.nodes} node(s): partition {partition} has {fit} node(s) "
            f"with {res.gpus_per_node} GPUs (at most {most} per node)"
        )
    if res.gpus_per_task and res.gpus_per_task > most:
        raise UserError(
            f"--gpus-per-task {res.gpus_per_task}: no node of partition {partition} has more than "
            f"{most} GPU{'s' if most != 1 else ''}"
        )


def check_command(command: list[str]) -> None:
    """A UserError when the units' program does not exist here: every unit would fail with 127."""
    if shutil.which(command[0]) is None:
        raise UserError(
            f"command {command[0]!r} not found here (not a file, not on PATH): every unit would fail with "
            "exit status 127; give the program's path, run where it is installed, or --no-command-check "
            "where it exists only on the compute nodes"
        )


def check_account(account: str, config: dict[str, str]) -> list[str]:
    """A UserError if the cluster's accounting does not know the account; warnings (it keeps none)."""
    storage = config.get("AccountingStorageType", "accounting_storage/none")
    if storage == "accounting_storage/none":
        return [
            f"accounting is off on this cluster (AccountingStorageType={storage}): Slurm accepts any "
            f"--account, so {account!r} cannot be checked"
        ]
    known = slurm("sacctmgr", "--noheader", "--parsable2", "show", "account", account, "format=Account")
    if known.returncode:
        return [f"--account {account} not checked: sacctmgr: {said(known)}"]
    if account not in known.stdout.split():
        raise UserError(f"account {account!r} does not exist (sacctmgr show account {account})")
    return []


def time_seconds(value: str, what: str = "--time") -> int | None:
    """sbatch's ``--time`` in seconds (None: no limit): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S. As sbatch
    reads it (man sbatch): seconds are rounded up to the next minute, and 0 imposes no limit."""
    value = value.strip()
    if value.upper() in ("INFINITE", "UNLIMITED"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value)
    if not m:
        raise UserError(f"{what} {value}: not a Slurm time (minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-H[:M[:S]]
        s = ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    elif c is not None:
        s = (a * 60 + b) * 60 + c
    else:
        s = a * 60 + (b or 0)
    return -(-s // 60) * 60 or None


def check_time(time: str | None, signal_s: int, what: str = "--time") -> None:
    """A time limit must leave the run time to train before the stop-and-requeue signal."""
    limit = time_seconds(time, what) if time else None
    if limit is not None and limit <= signal_s:
        raise UserError(
            f"{what} {time} ({limit} s) is not longer than --signal-s {signal_s}: the job would be told to stop "
            f"and requeue itself every few steps; give a longer --time or a shorter --signal-s"
        )


def check_default_time(partition: str, fields: dict[str, str], signal_s: int) -> None:
    """Without ``--time`` a job gets the partition's DefaultTime (its MaxTime where it has none)."""
    key = "DefaultTime" if fields.get("DefaultTime", "NONE") != "NONE" else "MaxTime"
    if key in fields:
        check_time(fields[key], signal_s, f"no --time: partition {partition}'s {key}")
