"""The ``reelcache`` command. Subcommands import their stage lazily, so that
``reelcache catalog ...`` starts fast on a laptop with no torch installed."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
import time
from traceback import format_exc

from reelcache import UserError, __version__

# reelcache.log (tqdm) is imported by run_command, once a command runs: `reelcache --help` and a
# mistyped command answer without it.

# The stages, in pipeline order (cluster, the operator's checks, beside train; lineage, over all of
# them): each has a ``cli`` module with ``add_commands(subparsers)`` (its commands and arguments) and may have
# ``add_demo(subparsers)`` (its step of ``reelcache demo``). The modules import nothing heavy;
# their commands import their stage when they run.
STAGES = ("ingest", "catalog", "cache", "train", "cluster", "eval", "lineage", "view")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="reelcache",
        description=textwrap.dedent("""\
        reelcache: text-video datasets -> webdataset shards -> SQL catalog -> latent cache -> training.
        Every heavy step is `plan` (prints units) -> `run UNIT` (anywhere, idempotent) -> `catalog merge`."""),
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"reelcache {__version__}")
    top = p.add_subparsers(dest="stage", required=True)
    stages = [importlib.import_module(f"reelcache.{name}.cli") for name in STAGES]
    for stage in stages:
        stage.add_commands(top)
    demo = top.add_parser(
        "demo", help="the bundled demo: generate its dataset (then `make demo`'s data steps), train on it"
    )
    demo_sub = demo.add_subparsers(dest="cmd", required=True)
    for stage in stages:
        if hasattr(stage, "add_demo"):
            stage.add_demo(demo_sub)
    return p


# What a collective raises when another rank's process is gone (gloo: its socket reset or closed; NCCL and
# torch's own wrappers: these exception types). Under `reelcache train --nproc` a rank that fails so is not
# the cause: the launcher names the rank that died, and this rank's traceback goes to its error file only.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
PEER_GONE_TYPES = ("DistBackendError", "DistNetworkError")


def _launched() -> str | None:
    """The error file of a rank run by `reelcache train --nproc` (train/launch.py), else None."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") if os.environ.get("REELCACHE_LAUNCH") else None


def _peer_gone(e: BaseException) -> bool:
    return any(t.__name__ in PEER_GONE_TYPES for t in type(e).__mro__) or any(m in str(e) for m in PEER_GONE)


def _tell_launcher(path: str, message: str, **extra) -> None:
    with open(path, "w") as f:
        json.dump({"message": message, "timestamp": int(time.time()), **extra}, f)


def run_command(fn) -> int:
    """Run a command: its exit status is what it returns (None: 0); a UserError is a message and
    exit status 2, never a traceback."""
    from reelcache.log import say_error, setup_logging

    setup_logging()
    try:
        return fn() or 0
    except UserError as e:
        if error_file := _launched():  # its launcher says each distinct line once
            _tell_launcher(error_file, str(e))
            return 2
        say_error(str(e))
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if (error_file := _launched()) and _peer_gone(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _tell_launcher(error_file, f"lost a peer in a collective: {first}", peer_gone=True, traceback=format_exc())
            return 1
        raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "takes_overrides", False):  # `train` takes --section.key=value overrides
        return run_command(lambda: args.fn(args, rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return run_command(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
