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


def run_command(fn) -> int:
    """Run a command: its exit status is what it returns (None: 0); a UserError is a message and
    exit status 2, never a traceback."""
    from reelcache.log import setup_logging

    setup_logging()
    try:
        return fn() or 0
    except UserError as e:
        if os.environ.get("REELCACHE_LAUNCH") and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # a rank of `reelcache train --nproc` (train/launch.py): its launcher says each distinct line once
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": str(e), "timestamp": int(time.time())}, f)
            return 2
        print(f"reelcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


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
