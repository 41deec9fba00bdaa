"""``reelcache train CONFIG --root R --nproc N``: N ranks of one training on this machine, started through
torch's elastic launch API (``torch.distributed.launcher.api``: ``LaunchConfig`` and ``elastic_launch``,
what ``torchrun`` itself runs), with a failed start said in one line.

Under ``torchrun`` every one-line refusal of a rank (a run already running, a missing shard, a refused
resume) is followed by torchrun's own ``ChildFailedError`` report: a wall of traceback and a table of the
failed ranks after the line that mattered. Here the ranks run the same ``python -m reelcache.train`` with
the same arguments and their output goes straight to this terminal, but for their refusals:

- a rank that refused (a one-line UserError, exit 2) hands its line to the launcher (the error file torch's
  agent gives each rank, ``TORCHELASTIC_ERROR_FILE``; reelcache/cli.py's ``run_command``), which says each
  distinct line once: N ranks refusing alike are one line; exit 2;
- a rank that died (a signal, or a crash whose traceback it printed) is one line naming it, its pid and
  how it ended, and that the launch stopped the others; exit 1. The others' collectives fail when its process
  goes (gloo: "Connection reset by peer"): those ranks put their traceback in their error file, print
  nothing, and are never named as the cause.

On a CPU build of torch the ranks are forked from one process (multiprocessing's fork server) that imported
what a rank imports (train/preload.py: torch, the trainer, ColossalAI) once, instead of each rank importing it
again: a rank's imports are most of a short run's work. With a CUDA or ROCm build each rank is its own
interpreter, as under torchrun: ColossalAI's imports touch the GPUs (bitsandbytes probes them), and a
process forked after that cannot use them. Either way a rank runs ``python -m reelcache.train`` with the same
arguments, its own ``sys.argv`` and its interpreter's exit (its ``atexit`` functions run).

The rendezvous is torchrun's single-node one (``static``, rank 0 of one node, a free local port); no
restarts (a failed training is resumed with ``--resume``, not replayed by the launcher). For many nodes
use ``torchrun``/``colossalai run`` or ``train --slurm`` (docs/CLUSTER.md).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.process
import os
import runpy
import signal
import sys
import traceback

# torch is imported by `launch`, when a launch runs: `reelcache train --help` builds without it.


def launch(rank_args: list[str], nproc: int) -> int:
    """Run ``python -m reelcache.train *rank_args`` on `nproc` local ranks; the exit status (0, 2: a rank
    refused and said why, 1: a rank died, said here in one line)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from reelcache.log import say_error
    from reelcache.train.parallel import free_port

    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # its per-rank warnings: the line below says it
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks share the cores
    # a rank's refusal goes to its error file, said here once; its record names this process as its launcher
    # (cluster/ranks.py: a forked rank's parent is the fork server)
    os.environ["REELCACHE_LAUNCH"] = str(os.getpid())
    fork = forked()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"reelcache-{os.getpid()}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver" if fork else "spawn",
    )
    if fork:
        multiprocessing.set_forkserver_preload(["reelcache.train.preload"])
        entry, args = _rank, rank_args
    else:
        entry, args = sys.executable, ["-m", "reelcache.train", *rank_args]
    try:
        elastic_launch(config, entry)(*args)
    except SignalException as e:  # Ctrl-C or a TERM to this launcher: the ranks were stopped with it
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        # a rank whose collective failed because another's process was gone (reelcache/cli.py) is not the
        # cause: the line names the rank that died first among the others
        gone = {r for r, f in failures if f.error_file_data.get("peer_gone")}
        said = []  # each distinct refusal once, in rank order (every rank may refuse alike)
        for r, failure in failures:
            if r not in gone and os.path.isfile(failure.error_file) and failure.message not in said:
                said.append(failure.message)
        for message in said:
            say_error(message)
        # in the order torch's agent saw them end: on a tie of its whole-second timestamps the first seen is
        # the cause, not a rank the agent then stopped with SIGTERM (which it records too)
        causes = [(r, f) for r, f in e.failures.items() if r not in gone] or list(e.failures.items())
        rank, failure = min(causes, key=lambda rf: rf[1].timestamp)
        if said and failure.exitcode == 2:  # the first to end refused: the others were stopped after it
            return 2
        if rank in gone:
            how = failure.message
        elif failure.exitcode < 0:
            how = f"was killed by {signal.Signals(-failure.exitcode).name}"
        else:
            how = f"exited with status {failure.exitcode}" + ("" if said else " (its output is above)")
        others = f"; the launch stopped the other {nproc - 1} rank(s)" if nproc > 1 else ""
        say_error(f"rank {rank} (pid {failure.pid}) {how}{others}")
        return 1
    return 0


def forked() -> bool:
    """Whether ranks are forked from one process that imported theirs (a build of torch without CUDA or ROCm)."""
    import torch

    return torch.version.cuda is None and torch.version.hip is None


def _rank(*rank_args: str) -> None:
    """A forked rank: ``python -m reelcache.train *rank_args`` run in this process, as its interpreter would.
    Its exit status is the module's; a crash prints its traceback and exits 1 (torch's wrapper would keep it
    in a file: the launcher says "its output is above"); the atexit functions run, as at an interpreter's exit
    (multiprocessing's children leave without them)."""
    sys.argv = ["reelcache.train", *rank_args]
    # multiprocessing as in a fresh interpreter: its own default start method (the fork server's children
    # inherit "forkserver": a DataLoader's workers would each be a new interpreter) and its own temp dir (not
    # the launcher's, which the launcher removes when it ends, perhaps before this rank)
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.process.current_process()._config.pop("tempdir", None)
    code = 0
    try:
        runpy.run_module("reelcache.train", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        sys.exit(code)
