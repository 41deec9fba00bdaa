"""Training and evaluation as Slurm batch jobs: one script template, checked against the cluster first.

    reelcache train configs/train/opensora12/stage1.toml --root /data/rc --init-from /weights/PixArt.pth \
        --slurm --partition h100 --nodes 24 --gpus-per-node 8 --time 2-00:00:00
    reelcache eval serve --root /data/rc --run runs/os12-stage1 ... --slurm --partition h100 --after 4242

Plain ``sbatch`` scripts rendered from one template (``render``) rather than submitit: the jobs
are shell (``srun`` starting one ``torchrun`` per node), a user can read, keep and resubmit the
script we write beside the run (``runs/<run>/slurm/``), and nothing new is installed on the nodes.

Training. One job of N nodes (or ``--nodes MIN-MAX``: Slurm starts it, and every requeue of it, on
as many nodes as are up, at least MIN, and the ranks follow ``SLURM_NNODES``); ``srun`` starts one
``torchrun`` per node (``--node_rank`` = ``SLURM_NODEID``, the master address the first host of
``scontrol show hostnames $SLURM_JOB_NODELIST``, a port derived from the job id), so the ranks are
the same on every attempt on the same nodes.
The trainer always runs with ``--resume``: the first attempt starts the run (from ``--init-from``
if given), every later one continues from the run's newest checkpoint in the same run directory
and the same wandb run, with ``--wait``: a requeued attempt may start while its predecessor's ranks
are still exiting, and waits for the run directory's lease (train/runlease.py) instead of failing.
Attempts come from three places:

- ``#SBATCH --requeue``: Slurm requeues the job after a node failure or a preemption (the run loses
  the steps since its newest checkpoint, at most ``checkpoint.every``);
- a stop-and-requeue: ``--signal=B:USR2@<s>`` makes Slurm signal the batch shell ``s`` seconds before
  the time limit, and ``scancel --batch --signal=USR2 <job>`` does the same by hand; the shell's trap
  writes ``runs/<run>/stop`` (every node sees the run directory), the trainer checkpoints at the next
  step on all ranks and exits 0, and the script requeues its own job (``scontrol requeue``), which
  continues where it stopped;
- ``scontrol requeue <job>`` by hand: the ranks are killed at once, losing the steps since the
  newest checkpoint.

Two ways only stop (checkpoint at the next step, the job ends COMPLETED, nothing requeued):
``touch runs/<run>/stop``, and ``scancel --signal=USR2 <job>``, which signals every process of the
job's steps, not the batch shell. torchrun would die of that signal (its default action), so the
script starts it with USR2 ignored; the ranks install their own handler (a signal that arrives
before a rank's first step is ignored; the stop file is read at every step).

Every attempt appends to the same log, ``runs/<run>/slurm/<job name>-<job id>.out``.

Checks before submitting, one line each: no Slurm controller answering, a partition that does not
exist, an account the cluster does not know (where it keeps accounts: without an accounting
database Slurm checks none, and we say so), more nodes than the partition has, more GPUs or CPUs
(``--sbatch=--cpus-per-task=N``) per node than its nodes have, a ``--time`` not longer than
``--signal-s`` (the job would requeue itself every few steps), a script folder that cannot be
written; the stages check their own inputs (train: the manifests; eval: something to evaluate).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from reelcache import UserError
from reelcache.cluster import slurm
from reelcache.settings import arg

TEMPLATE = """#!/bin/bash
# Written by `reelcache {command} --slurm`; resubmit with: sbatch {script}
{directives}
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{body}
"""

TRAIN_BODY = """requeue=0
trap 'echo "$(date +%T) slurm: SIGUSR2 to the batch shell (the time limit is near, or scancel --batch):" \\
"the run checkpoints at its next step and the job is requeued"; touch {stop}; requeue=1' USR2
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))
echo "$(date +%T) slurm: job $SLURM_JOB_ID attempt ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'trap "" USR2; exec {python} -m torch.distributed.run \\
    --nnodes="$SLURM_NNODES" --node_rank="$SLURM_NODEID" --nproc_per_node={nproc} \\
    --master_addr='"$head"' --master_port='"$port"' -m reelcache train {args}' &
step=$!
while true; do
    wait "$step"
    status=$?
    kill -0 "$step" 2>/dev/null || break   # wait returns early when the trap runs: the step goes on
done
if [ "$requeue" = 1 ] && [ "$status" = 0 ]; then
    echo "$(date +%T) slurm: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""


@dataclass
class Resources:
    """Where a job runs: the sbatch options every command takes."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    nodes: int = 1  # the most nodes the job takes
    min_nodes: int | None = None  # with --nodes MIN-MAX: the fewest it starts on (a node down: fewer ranks)
    gpus_per_node: int = 0
    extra: list[str] = field(default_factory=list)  # more sbatch options, verbatim

    @property
    def node_range(self) -> str:
        """``N``, or Slurm's ``MIN-MAX``."""
        return f"{self.min_nodes}-{self.nodes}" if self.min_nodes and self.min_nodes < self.nodes else str(self.nodes)

    def directives(self) -> list[str]:
        out = [f"--nodes={self.node_range}"]
        for opt, v in (("partition", self.partition), ("account", self.account), ("time", self.time)):
            if v:
                out.append(f"--{opt}={v}")
        if self.gpus_per_node:
            out.append(f"--gpus-per-node={self.gpus_per_node}")
        return out + list(self.extra)


def _inner(text: str) -> str:
    """``text`` quoted for the shell, inside a single-quoted ``bash -c '...'``."""
    return shlex.quote(text).replace("'", "'\"'\"'")


def render(command: str, script: Path, directives: list[str], body: str) -> str:
    lines = "\n".join(f"#SBATCH {shlex.quote(d) if ' ' in d else d}" for d in directives)
    return TEMPLATE.format(command=command, script=script, directives=lines, body=body)


def default_partition() -> str:
    names = slurm.slurm("sinfo", "--noheader", "--format", "%P").stdout.split()
    default = next((n.rstrip("*") for n in names if n.endswith("*")), None)
    if default is None:
        raise UserError("this cluster has no default partition: give --partition")
    return default


def time_seconds(value: str) -> int | None:
    """sbatch's ``--time`` in seconds (None: no limit): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S. As sbatch
    reads it (man sbatch): seconds are rounded up to the next minute, and 0 imposes no limit."""
    value = value.strip()
    if value.upper() in ("INFINITE", "UNLIMITED"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value)
    if not m:
        raise UserError(f"--time {value}: not a Slurm time (minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-H[:M[:S]]
        s = ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    elif c is not None:
        s = (a * 60 + b) * 60 + c
    else:
        s = a * 60 + (b or 0)
    return -(-s // 60) * 60 or None


def check_time(time: str | None, signal_s: int) -> None:
    """A time limit must leave the run time to train before the stop-and-requeue signal."""
    limit = time_seconds(time) if time else None
    if limit is not None and limit <= signal_s:
        raise UserError(
            f"--time {time} ({limit} s) is not longer than --signal-s {signal_s}: the job would be told to stop "
            f"and requeue itself every few steps; give a longer --time or a shorter --signal-s"
        )


def cpus_per_task(extra: list[str]) -> int | None:
    """``--cpus-per-task`` among verbatim sbatch options (``--cpus-per-task=N``, ``-c N``, ``-cN``)."""
    found = None
    for i, x in enumerate(extra):
        m = re.fullmatch(r"(?:--cpus-per-task=|-c)(\d+)", x)
        if m:
            found = int(m[1])
        elif x in ("--cpus-per-task", "-c") and i + 1 < len(extra) and extra[i + 1].isdigit():
            found = int(extra[i + 1])
    return found


def check(res: Resources) -> None:
    """What would make sbatch refuse the job, or leave it pending forever, as one line (the partition
    and account rules are the job arrays', cluster/slurm.py); warnings are printed."""
    if not res.partition:  # sinfo says nothing useful without a controller: say that first
        slurm.check_controller(slurm.slurm("scontrol", "show", "partition", "--oneliner"))
    name = res.partition or default_partition()
    warnings = slurm.check_partition(name)
    cpus = cpus_per_task(res.extra)
    if cpus:
        slurm.check_cpus(cpus, name, "--sbatch=--cpus-per-task")
    gpus = slurm.partition_gpus(name)
    if res.nodes > len(gpus):
        raise UserError(f"--nodes {res.nodes}: partition {name} has {len(gpus)} node(s)")
    fit = sum(1 for g in gpus if g >= res.gpus_per_node)
    if res.gpus_per_node and fit < res.nodes:
        raise UserError(
            f"--gpus-per-node {res.gpus_per_node} on {res.nodes} node(s): partition {name} has {fit} node(s) "
            f"with {res.gpus_per_node} GPUs (at most {max(gpus, default=0)} per node)"
        )
    if res.account:
        warnings += slurm.check_account(res.account, slurm.cluster_config())
    for w in warnings:
        print(f"slurm: warning: {w}", file=sys.stderr)


def submit(script: Path, dry_run: bool = False) -> str | None:
    """sbatch the script; its job id (None on a dry run, which only prints the script)."""
    if dry_run:
        print(script.read_text())
        return None
    p = slurm.slurm("sbatch", "--parsable", str(script))
    if p.returncode:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise UserError(f"sbatch refused {script}: {msg[-1] if msg else p.returncode}")
    return p.stdout.strip().split(";")[0]


def train_script(
    config: str,
    root: Path,
    run: str,
    res: Resources,
    *,
    nproc: int,
    signal_s: int,
    train_args: list[str],
    python: str = sys.executable,
) -> tuple[Path, str]:
    """(path, text) of the training job's script, written under ``runs/<run>/slurm/``."""
    run_dir = root / "runs" / run
    folder = run_dir / "slurm"
    script = folder / "train.sbatch"
    args = [str(Path(config).resolve()), "--root", str(root), "--resume", "--wait", f"--run.name={run}", *train_args]
    directives = [
        f"--job-name=train-{run}",
        *res.directives(),  # no task count (it would pin --nodes MIN-MAX to MIN): srun starts one per node
        "--requeue",
        f"--signal=B:USR2@{signal_s}",
        "--open-mode=append",
        f"--output={folder}/%x-%j.out",
    ]
    body = TRAIN_BODY.format(
        python=_inner(python),
        nproc=nproc,
        stop=_inner(str(run_dir / "stop")),
        args=" ".join(_inner(a) for a in args),
    )
    return script, render("train", script, directives, body)


def eval_script(
    run_dir: Path, res: Resources, *, after: str | None, args: list[str], python: str = sys.executable
) -> tuple[Path, str]:
    """(path, text) of an evaluation server job beside a training run: one task, ``eval serve ARGS``."""
    folder = run_dir / "slurm"
    script = folder / "eval.sbatch"
    directives = [
        f"--job-name=eval-{run_dir.name}",
        *res.directives(),
        "--ntasks=1",
        "--requeue",
        "--open-mode=append",
        f"--output={folder}/%x-%j.out",
    ]
    if after:
        directives.append(f"--dependency=after:{after}")
    cmd = [python, "-m", "reelcache", "eval", "serve", *args]
    return script, render("eval serve", script, directives, "exec " + " ".join(shlex.quote(c) for c in cmd))


def slurm_options() -> dict[str, int]:
    """Every option ``add_arguments`` declares, and how many values it takes (read from the parsers it builds)."""
    out = {}
    for training in (True, False):
        p = argparse.ArgumentParser(add_help=False)
        add_arguments(p, training=training)
        out.update({o: 0 if a.nargs == 0 else 1 for a in p._actions for o in a.option_strings})
    return out


def without_slurm_options(argv: list[str]) -> list[str]:
    """A command's own arguments without the Slurm ones: what runs inside the job."""
    options, out, skip = slurm_options(), [], 0
    for x in argv:
        if skip:
            skip -= 1
            continue
        name = x.split("=", 1)[0]
        if name in options:
            skip = options[name] if "=" not in x else 0
            continue
        out.append(x)
    return out


def launch(script: Path, text: str, res: Resources, dry_run: bool = False) -> str | None:
    """Check the resources, write the script and submit it; its job id. A dry run prints it instead
    (checked too where a cluster answers ``sinfo``)."""
    if not dry_run or (shutil.which("sinfo") is not None and slurm.slurm("sinfo", "-h").returncode == 0):
        check(res)
    try:
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write the job script {script}: {e.strerror or e}") from None
    return submit(script, dry_run)


def add_arguments(p, *, training: bool) -> None:
    """The sbatch options of a stage command that submits itself (``train --slurm``, ``eval serve --slurm``)."""
    g = p.add_argument_group("Slurm (with --slurm: submit this command as a batch job instead of running it)")
    g.add_argument("--slurm", action="store_true", help="submit to Slurm (the script is kept under runs/<run>/slurm/)")
    g.add_argument("--partition", help="default: the cluster's default partition")
    g.add_argument("--account", help="the account to charge")
    g.add_argument("--time", help="time limit, e.g. 2-00:00:00")
    g.add_argument("--gpus-per-node", type=arg(int, ge=0), default=1 if not training else 8, help="GPUs per node")
    g.add_argument("--sbatch", action="append", default=[], metavar="OPT", help="more sbatch options, verbatim")
    g.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    if training:
        g.add_argument(
            "--nodes",
            type=node_range,
            default=(1, 1),
            metavar="N|MIN-MAX",
            help="nodes (1); MIN-MAX lets a requeued job start on the nodes that are up, at least MIN",
        )
        g.add_argument("--nproc-per-node", type=arg(int, ge=1), help="ranks per node (default: --gpus-per-node)")
        g.add_argument(
            "--signal-s",
            type=arg(int, ge=10),
            default=300,
            help="seconds before the time limit when the run checkpoints and requeues itself (300)",
        )
    else:
        g.add_argument(
            "--after",
            metavar="JOBID",
            help="start once this job (the training) has started, and end once it has ended (requeues "
            "included) and every checkpoint is evaluated",
        )


def node_range(text: str) -> tuple[int, int]:
    """``--nodes N`` or ``MIN-MAX`` as (MIN, MAX)."""
    lo, dash, hi = str(text).partition("-")
    try:
        least, most = int(lo), int(hi if dash else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or MIN-MAX, e.g. 24 or 20-24") from None
    if not 1 <= least <= most:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= MIN <= MAX")
    return least, most


def resources(a) -> Resources:
    return Resources(
        partition=a.partition,
        account=a.account,
        time=a.time,
        min_nodes=getattr(a, "nodes", (1, 1))[0],
        nodes=getattr(a, "nodes", (1, 1))[1],
        gpus_per_node=a.gpus_per_node,
        extra=list(a.sbatch),
    )
