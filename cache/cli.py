"""``reelcache cache plan|run|gc``: the cache stage's arguments (reelcache/cli.py only assembles).
Nothing heavy is imported here: the parser builds without torch."""

from __future__ import annotations

import argparse
import sys

from reelcache.args import existing_file
from reelcache.base.s3 import check_root, is_url, root_arg

# cache.plan and cache.run (pyarrow, duckdb, av, torch) are imported by the command that runs them:
# `reelcache --help` builds every stage's parser.

PLAN_EXAMPLES = """\
examples:
  reelcache cache plan --root /data/rc --config configs/cache/wan-stage1.toml > units.txt
  parallel --sshloginfile gpu-nodes.txt -j 8 --joblog cache.log \\
      CUDA_VISIBLE_DEVICES='$(({%}-1))' reelcache cache run --root /data/rc {} :::: units.txt
  reelcache catalog merge --root /data/rc
  reelcache catalog sql --root /data/rc "SELECT cache, bucket, count(*) FROM latents GROUP BY ALL"
"""


def add_commands(top) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    ca = top.add_parser("cache", help="VAE and text latents, precomputed once per stage across GPU nodes")
    sub = ca.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser(
        "plan", help="assign buckets, fix the cache identity, print units", formatter_class=fmt, epilog=PLAN_EXAMPLES
    )
    cp.add_argument(
        "--root",
        required=True,
        type=root_arg,
        help="data root (its catalog manifests): a folder, or s3://bucket/prefix",
    )
    cp.add_argument(
        "--config", required=True, type=existing_file, help="cache config TOML, e.g. configs/cache/tiny.toml"
    )
    cp.set_defaults(fn=_plan)
    cr = sub.add_parser("run", help="decode and encode one or more units printed by `cache plan`")
    cr.add_argument("--root", required=True, type=root_arg, help="a folder, or s3://bucket/prefix (docs/STORAGE.md)")
    cr.add_argument("units", nargs="+", metavar="UNIT", help="e.g. wan-stage1/000012")
    cr.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    cr.add_argument("--wait", action="store_true", help="if another run holds a unit, wait for it instead of exiting")
    cr.set_defaults(fn=_run)
    cg = sub.add_parser("gc", help="list (and with --delete remove) store latents and captions nothing references")
    cg.add_argument("--root", required=True, type=root_arg, help="a folder, or s3://bucket/prefix (docs/STORAGE.md)")
    cg.add_argument(
        "--delete",
        action="store_true",
        help="remove them (shards all of whose entries are unreferenced); on S3 also abort the incomplete multipart "
        "uploads of units that are not running",
    )
    cg.set_defaults(fn=_gc)


def _plan(a) -> None:
    from reelcache.cache.plan import CacheConfig, make_plan

    cfg = CacheConfig.from_toml(a.config)
    if is_url(a.root):
        check_root(a.root)
    units = make_plan(a.root, cfg)
    sys.stdout.write("".join(u + "\n" for u in units))


def _run(a) -> None:
    from reelcache.cache.run import run_unit

    if is_url(a.root):
        check_root(a.root)
    for unit in a.units:
        run_unit(a.root, unit, device=a.device, wait=a.wait)


def _gc(a) -> None:
    from reelcache.cache.gc import gc

    if is_url(a.root):
        check_root(a.root, write=a.delete)
    gc(a.root, delete=a.delete)
