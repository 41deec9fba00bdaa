"""``reelcache ingest plan|run`` and ``reelcache demo generate``: the ingest stage's arguments
(reelcache/cli.py only assembles). Nothing heavy is imported here: the parser builds without av."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from reelcache.args import arg, existing_dir, existing_file, option
from reelcache.base.s3 import check_root, is_url, new_root_arg, root_arg
from reelcache.ingest.filters import Thresholds
from reelcache.settings import build, load_toml

# ingest.plan, ingest.run and ingest.demo (pyarrow, duckdb, av) are imported by the command that runs
# them: `reelcache --help` builds every stage's parser.

PLAN_EXAMPLES = """\
examples:
  reelcache ingest plan --root /data/rc --source openvid --meta OpenVid-1M.csv --videos /data/openvid > units.txt
  reelcache ingest plan --root /data/rc --source miradata --caption dense --meta miradata_v1_330k.csv \\
      --videos /data/miradata --config configs/ingest/opensora12.toml > mira-units.txt
  reelcache ingest plan --root /data/rc --source folder --name mine --videos /data/my-clips > units.txt

Prints one unit per line on stdout, ready for GNU parallel:
  parallel --sshloginfile nodes.txt --joblog ingest.log reelcache ingest run --root /data/rc {} :::: units.txt
  reelcache catalog merge --root /data/rc
"""

RUN_EXAMPLES = """\
examples:
  reelcache ingest run --root /data/rc openvid/000012
  parallel -j 8 --joblog ingest.log reelcache ingest run --root /data/rc {} :::: units.txt

A finished unit (its sidecar parquet exists) is skipped; a killed one is cleaned and redone.
"""


def add_commands(top) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    ing = top.add_parser("ingest", help="probe videos, reject bad rows with a reason, write raw shards")
    sub = ing.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser(
        "plan", help="read a source table once and print its work units", epilog=PLAN_EXAMPLES, formatter_class=fmt
    )
    pl.add_argument(
        "--root", required=True, type=new_root_arg, help="data root: a folder, or s3://bucket/prefix (docs/STORAGE.md)"
    )
    pl.add_argument(
        "--source",
        required=True,
        choices=["openvid", "miradata", "csv", "parquet", "folder"],
        help="format of the input table",
    )
    pl.add_argument("--meta", type=existing_file, help="the table: OpenVid/MiraData CSV, or a path,text csv/parquet")
    pl.add_argument(
        "--videos",
        required=True,
        type=_videos_arg,
        help="folder (or s3://bucket/prefix) that the table's paths are relative to",
    )
    pl.add_argument("--name", type=_field("source"), help="source name in the catalog (default: the format)")
    pl.add_argument(
        "--caption",
        type=_field("caption"),
        help="MiraData: which caption trains (short, dense, background, main_object, style, camera); all are kept",
    )
    pl.add_argument(
        "--config", type=existing_file, help="TOML with any of these settings, e.g. configs/ingest/opensora12.toml"
    )
    pl.add_argument("--rows-per-unit", type=_field("rows_per_unit"), help="input rows per work unit (default 1000)")
    pl.add_argument("--shard-mb", type=_field("shard_mb"), help="cap on one shard's size in MB (default 1000)")
    pl.add_argument(
        "--verify",
        choices=["header", "decode"],
        help="header (default): headers, packets, first frame; decode: decode every frame",
    )
    pl.add_argument(
        "--probe-timeout", type=_field("probe_timeout"), help="seconds per file before it is a 'timeout' reject (30)"
    )
    pl.add_argument(
        "--decode-timeout", type=_field("decode_timeout"), help="seconds per file with --verify decode (600)"
    )
    pl.add_argument("--workers", type=_field("workers"), help="probe processes per unit (default 1)")
    pl.add_argument("--worker-memory-mb", type=_field("worker_memory_mb"), help="address-space cap per probe process")
    pl.add_argument("--tagger", choices=["pattern", "spacy"], help="part-of-speech tagger for noun_count")
    pl.add_argument("--max-file-mb", type=_threshold("max_file_mb"), help="reject files larger than this ('too_large')")
    pl.add_argument(
        "--min-frames", type=_threshold("min_frames"), help="reject clips with fewer frames ('too_short', default 17)"
    )
    pl.add_argument(
        "--min-seconds", type=_threshold("min_seconds"), help="reject clips shorter than this ('too_short')"
    )
    pl.add_argument(
        "--replace",
        action="store_true",
        help="the source was planned differently before: delete its shards and plan anew",
    )
    pl.set_defaults(fn=_plan)
    rn = sub.add_parser(
        "run", help="process one or more units printed by `ingest plan`", epilog=RUN_EXAMPLES, formatter_class=fmt
    )
    rn.add_argument("--root", required=True, type=root_arg, help="a folder, or s3://bucket/prefix")
    rn.add_argument("units", nargs="+", metavar="UNIT", help="e.g. openvid/000012")
    rn.add_argument("--wait", action="store_true", help="if another run holds a unit, wait for it instead of exiting")
    rn.set_defaults(fn=_run)


def add_demo(sub) -> None:
    """``reelcache demo generate``: the bundled demo's videos and table."""
    g = sub.add_parser("generate", help="write a small OpenVid-format dataset with some broken files")
    g.add_argument("--out", required=True)
    g.add_argument("--clips", type=arg(int, ge=1), default=240)
    g.add_argument("--seed", type=arg(int, ge=0), default=0)
    g.add_argument("--workers", type=arg(int, ge=1), default=2)
    g.set_defaults(fn=_demo_generate)


def _videos_arg(text: str) -> str:
    """--videos: an existing folder, or a well-formed s3://bucket/prefix (the bucket checked once the command runs)."""
    return new_root_arg(text) if text.startswith("s3://") else existing_dir(text)


def _field(name: str):
    return option(f"reelcache.ingest.plan:IngestConfig.{name}")


def _threshold(name: str):
    return option(f"reelcache.ingest.filters:Thresholds.{name}")


def _plan(a) -> None:
    from reelcache.ingest.plan import IngestConfig, make_plan

    conf = load_toml(a.config) if a.config else {}
    thresholds = conf.pop("thresholds", {})
    for k in [f.name for f in dataclasses.fields(Thresholds)] if isinstance(thresholds, dict) else ():
        if k in conf:  # flat in the file, or under [thresholds]
            thresholds[k] = conf.pop(k)
        if getattr(a, k) is not None:
            thresholds[k] = getattr(a, k)
    for k in (
        "caption",
        "rows_per_unit",
        "shard_mb",
        "verify",
        "probe_timeout",
        "decode_timeout",
        "workers",
        "worker_memory_mb",
        "tagger",
    ):
        if getattr(a, k) is not None:
            conf[k] = getattr(a, k)
    videos = a.videos.rstrip("/") if is_url(a.videos) else str(Path(a.videos).resolve())
    conf.update(source=a.name or a.source, format=a.source, videos=videos, thresholds=thresholds)
    if a.meta:
        conf["meta"] = str(Path(a.meta).resolve())
    if is_url(a.root):
        check_root(a.root)  # the bucket, the credentials, conditional writes: one line before any work
    if is_url(a.videos):
        check_root(a.videos, write=False)  # the videos' bucket exists and the credentials read it
    units = make_plan(a.root, build(IngestConfig, conf, source=a.config), replace=a.replace)
    sys.stdout.write("".join(u + "\n" for u in units))


def _run(a) -> None:
    from reelcache.ingest.run import run_unit

    if is_url(a.root):
        check_root(a.root)
    for unit in a.units:
        run_unit(a.root, unit, wait=a.wait)


def _demo_generate(a) -> None:
    from reelcache.ingest.demo import generate

    print(generate(a.out, n=a.clips, seed=a.seed, workers=a.workers))
