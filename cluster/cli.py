"""``reelcache cluster gpus|clocks|dump|stop``: the cluster commands' arguments (reelcache/cli.py only
assembles). The command modules are imported at the top: they need the standard library only, so
the parser still builds in milliseconds without torch."""

from __future__ import annotations

import argparse
import sys

from reelcache.args import arg
from reelcache.cluster import clocks, gpus, procs
from reelcache.cluster.slurm import array, options

EXAMPLES = """\
examples:
  reelcache cluster gpus   --hostfile nodes.txt --expect-idle     # before launching: no stale GPU processes
  reelcache cluster clocks --hostfile nodes.txt --warn-ms 50     # offsets vs this node, sync daemon, clock steps back
  srun -N4 --ntasks=1 reelcache cluster gpus --expect-idle       # in a Slurm allocation: its nodes (SLURM_JOB_NODELIST)
  reelcache cluster dump   --run /data/rc/runs/stage1           # py-spy of every rank of THIS run
  reelcache cluster stop   --run /data/rc/runs/stage1 --grace 30 # SIGTERM, then SIGKILL, to exactly its recorded pids

The hostfile is GNU parallel's sshloginfile (the one ingest and cache use; ':' = this machine). Without one,
gpus and clocks take a Slurm node list: --nodelist, else the allocation's SLURM_JOB_NODELIST.
Exit status 1: a node unreachable, a GPU process with --expect-idle, a clock error (or a warning
with --strict), a rank that could not be dumped, a process that survived stop.
"""


def add_commands(top) -> None:
    """``cluster`` and its subcommands under the top-level ``reelcache`` parser."""
    fmt = argparse.RawDescriptionHelpFormatter
    cl = top.add_parser(
        "cluster",
        help="per-node checks over a hostfile; dump or stop exactly one run's ranks",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    sub = cl.add_subparsers(dest="cmd", required=True)

    def nodes(p):
        p.add_argument("--hostfile", help="GNU parallel sshloginfile (':' = this machine)")
        p.add_argument(
            "--nodelist",
            help="a Slurm node list (gpu[01-04]); default, without --hostfile: the allocation's SLURM_JOB_NODELIST",
        )

    def common(p):
        p.add_argument(
            "--python",
            default=sys.executable,
            help="Python on the nodes that runs the agent (default: this one's path)",
        )
        p.add_argument("--timeout", type=arg(float, gt=0), default=60.0, help="seconds a node has to answer (60)")

    g = sub.add_parser(
        "gpus", help="GPUs, memory, mean power and GPU processes per node", epilog=EXAMPLES, formatter_class=fmt
    )
    nodes(g)
    g.add_argument("--expect-idle", action="store_true", help="exit 1 if any GPU process runs (stale jobs)")
    g.add_argument("--reads", type=arg(int, ge=1), default=5, help="power reads to average (5)")
    common(g)
    g.set_defaults(fn=gpus.cmd_gpus)
    c = sub.add_parser(
        "clocks",
        help="offset vs this node, sync daemon state, a clock that went back",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    nodes(c)
    c.add_argument("--warn-ms", type=arg(float, ge=0), default=50.0, help="warn above this offset (50)")
    c.add_argument(
        "--error-ms",
        type=arg(float, ge=0),
        default=clocks.ERROR_MS,
        help=f"an error above this offset ({clocks.ERROR_MS:g}: beyond it a sync daemon steps the clock)",
    )
    c.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    c.add_argument("--samples", type=arg(int, ge=1), default=16, help="round trips per node; the shortest counts (16)")
    c.add_argument("--reads", type=arg(int, ge=1), default=200_000, help="tight-loop clock reads per node (200000)")
    common(c)
    c.set_defaults(fn=clocks.cmd_clocks)
    _add_run_commands(sub)
    add_slurm(top)


def _add_run_commands(sub) -> None:
    """``cluster dump`` and ``cluster stop``: they act on one run's recorded ranks, not on a hostfile's nodes."""
    fmt = argparse.RawDescriptionHelpFormatter
    d = sub.add_parser(
        "dump",
        help="py-spy dump of every recorded rank of a run into RUN/dumps/<time>/",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    d.add_argument("--run", required=True, help="the run directory, e.g. ROOT/runs/stage1")
    d.add_argument("--timeout", type=arg(float, gt=0), default=30.0, help="seconds per rank's dump (30)")
    d.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too; slower)")
    d.add_argument(
        "--method",
        choices=["auto", "py-spy", "signal"],
        default="auto",
        help="auto: py-spy, else SIGUSR1 (the trainer's faulthandler stack file)",
    )
    d.add_argument("--python", default=sys.executable, help="Python on the nodes that runs the agent")
    d.add_argument(
        "--hostfile",
        help="sshloginfile whose lines say how to reach the recorded hosts "
        "(user@host, ssh -p ...); default: ssh to the recorded host name",
    )
    d.set_defaults(fn=procs.cmd_dump)
    s = sub.add_parser(
        "stop",
        help="SIGTERM, then SIGKILL after --grace, to exactly a run's recorded pids",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    s.add_argument("--run", required=True)
    s.add_argument("--grace", type=arg(float, ge=0), default=30.0, help="seconds between SIGTERM and SIGKILL (30)")
    s.add_argument("--python", default=sys.executable, help="Python on the nodes that runs the agent")
    s.add_argument("--hostfile", help="sshloginfile whose lines say how to reach the recorded hosts")
    s.set_defaults(fn=procs.cmd_stop)


def add_slurm(top) -> None:
    """``reelcache slurm submit``: a plan's units as one Slurm job array (cluster/slurm/array.py); its options are
    the ones every command that submits takes (cluster/slurm/options.py)."""
    fmt = argparse.RawDescriptionHelpFormatter
    sl = top.add_parser(
        "slurm",
        help="run a plan's units on Slurm: one job array, retries, a merge after",
        epilog=array.EXAMPLES,
        formatter_class=fmt,
    )
    sub = sl.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "submit",
        help="units from stdin as one job array: task i runs COMMAND UNIT_i",
        epilog=array.EXAMPLES,
        formatter_class=fmt,
    )
    options.add_arguments(p, "array")
    p.set_defaults(fn=array.cmd_submit)
