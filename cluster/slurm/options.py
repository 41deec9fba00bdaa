"""The option set of every command that submits to Slurm, and ``Resources``, what it asks for, typed.

Every kind takes the same eight: ``--partition``, ``--account``, ``--time``, ``--mem``,
``--cpus-per-task``, ``--job-name``, ``--sbatch-arg`` (one more sbatch option, verbatim) and
``--dry-run``; each kind adds its own: a job array (``reelcache slurm submit``) ``--gpus-per-task``,
``--max-running``, ``--retries``, ``--dir``, ``--then``, ``--units``, ``--no-command-check``; a training
job (``train --slurm``) ``--nodes``, ``--gpus-per-node``, ``--nproc-per-node``, ``--signal-s``; an
evaluation job (``eval serve --slurm``) ``--gpus-per-node``, ``--after``. The stages add them with
``add_arguments(parser, kind)`` and read them back with ``resources(args)``; none repeats them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from reelcache.args import arg

KINDS = ("array", "train", "eval")
DEFAULT_NAMES = {"array": "rc-<stage>-<command>, e.g. rc-ingest-run", "train": "train-<run>", "eval": "eval-<run>"}


@dataclass
class Resources:
    """Where a job runs and what it may use: the options every kind shares, and the GPUs and nodes."""

    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    time: str | None = None
    mem: str | None = None
    cpus_per_task: int | None = None
    job_name: str | None = None  # None: the kind's own (rc-ingest-run, train-<run>, eval-<run>)
    sbatch_args: tuple[str, ...] = ()  # more sbatch options, verbatim, last (they win)
    nodes: int = 1  # the most nodes the job takes
    min_nodes: int | None = None  # with --nodes MIN-MAX: the fewest it starts on (a node down: fewer ranks)
    gpus_per_node: int = 0
    gpus_per_task: int | None = None

    @property
    def node_range(self) -> str:
        """``N``, or Slurm's ``MIN-MAX``."""
        return f"{self.min_nodes}-{self.nodes}" if self.min_nodes and self.min_nodes < self.nodes else str(self.nodes)

    def directives(self) -> list[str]:
        """The sbatch options these resources are (not the job's name, nodes or tasks: the kind's own)."""
        given = {
            "partition": self.partition,
            "account": self.account,
            "time": self.time,
            "mem": self.mem,
            "cpus-per-task": self.cpus_per_task,
            "gpus-per-node": self.gpus_per_node or None,
            "gpus-per-task": self.gpus_per_task,
        }
        return [f"--{k}={v}" for k, v in given.items() if v is not None] + list(self.sbatch_args)

    def options(self) -> list[str]:
        """The command-line words that ask for these resources again (an array's "run the failed units")."""
        given = {
            "--partition": self.partition,
            "--account": self.account,
            "--time": self.time,
            "--mem": self.mem,
            "--cpus-per-task": self.cpus_per_task,
            "--gpus-per-task": self.gpus_per_task,
            "--job-name": self.job_name,
        }
        words = [w for k, v in given.items() if v is not None for w in (k, str(v))]
        return words + [f"--sbatch-arg={x}" for x in self.sbatch_args]


class Removed(argparse.Action):
    """A spelling that is no option any more, refused in one line naming the option to use. Without it argparse
    would take ``--sbatch`` as an abbreviation of ``--sbatch-arg`` (docs/CHANGELOG.md)."""

    def __init__(self, option_strings, dest, use: str, **kwargs):
        self.use = use
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"is no option any more: write {self.use}")


def add_arguments(p, kind: str) -> None:
    """The Slurm options of a command that submits: the shared eight, then the kind's own."""
    if kind == "array":
        g = p
    else:
        g = p.add_argument_group("Slurm (with --slurm: submit this command as a batch job instead of running it)")
        g.add_argument(
            "--slurm", action="store_true", help="submit to Slurm (the script is kept under runs/<run>/slurm/)"
        )
    g.add_argument("--partition", help="the partition (default: the cluster's default partition)")
    g.add_argument("--account", help="the account to charge (checked with sacctmgr where accounting is on)")
    g.add_argument("--time", help="time limit, sbatch's format (e.g. 2:00:00, 2-00:00:00)")
    g.add_argument("--mem", help="memory per node, sbatch's --mem (e.g. 16G)")
    g.add_argument("--cpus-per-task", type=arg(int, ge=1), help="CPUs per task: per unit, or per node's torchrun")
    g.add_argument("--job-name", help=f"the job's name (default {DEFAULT_NAMES[kind]})")
    g.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="OPT",
        help="one more sbatch option, verbatim, e.g. --sbatch-arg=--qos=high (repeatable)",
    )
    g.add_argument("--sbatch", action=Removed, use="--sbatch-arg=OPT", help=argparse.SUPPRESS)
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="check (where a cluster answers), write the script(s), print them; submit nothing",
    )
    {"array": _array, "train": _train, "eval": _eval}[kind](g)


def _array(g) -> None:
    g.add_argument(
        "--gpus-per-task", type=arg(int, ge=1), help="GPUs per unit (the cache: 1; Slurm sets CUDA_VISIBLE_DEVICES)"
    )
    g.add_argument("--max-running", type=arg(int, ge=1), help="at most N units at once (the array's %%N)")
    g.add_argument(
        "--retries", type=arg(int, ge=0), default=1, help="a failed unit requeues its task up to K times (1)"
    )
    g.add_argument("--dir", help="job directory, on storage every node sees (default slurm-jobs/<name>-<time>)")
    g.add_argument(
        "--then", help="a shell command run once every unit has ended, e.g. 'reelcache catalog merge --root R'"
    )
    g.add_argument("--units", help="read the units from this file (one a line) instead of stdin")
    g.add_argument(
        "--no-command-check",
        action="store_true",
        help="the command exists only on the compute nodes: do not look for it here first",
    )
    g.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...: each task runs COMMAND UNIT")


def _train(g) -> None:
    g.add_argument("--gpus-per-node", type=arg(int, ge=0), default=8, help="GPUs per node (8)")
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


def _eval(g) -> None:
    g.add_argument("--gpus-per-node", type=arg(int, ge=0), default=1, help="GPUs (1)")
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
    """The parsed options of any kind, typed."""
    least, most = getattr(a, "nodes", (1, 1))
    return Resources(
        partition=a.partition,
        account=a.account,
        time=a.time,
        mem=a.mem,
        cpus_per_task=a.cpus_per_task,
        job_name=a.job_name,
        sbatch_args=tuple(a.sbatch_arg),
        min_nodes=least,
        nodes=most,
        gpus_per_node=getattr(a, "gpus_per_node", 0),
        gpus_per_task=getattr(a, "gpus_per_task", None),
    )


def without_slurm_options(argv: list[str], kind: str) -> list[str]:
    """A command's own arguments without its Slurm ones: what runs inside the job."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p, kind)
    takes = {o: 0 if a.nargs == 0 else 1 for a in p._actions for o in a.option_strings}
    out, skip = [], 0
    for x in argv:
        if skip:
            skip -= 1
            continue
        name = x.split("=", 1)[0]
        if name in takes:
            skip = takes[name] if "=" not in x else 0
            continue
        out.append(x)
    return out
