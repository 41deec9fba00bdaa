"""The ``reelcache`` command. Subcommands import their stage lazily, so that
``reelcache catalog ...`` starts fast on a laptop with no torch installed."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from reelcache import UserError, __version__

INGEST_PLAN_EXAMPLES = """\
examples:
  reelcache ingest plan --root /data/rc --source openvid --meta OpenVid-1M.csv --videos /data/openvid > units.txt
  reelcache ingest plan --root /data/rc --source miradata --caption dense --meta miradata_v1_330k.csv \\
      --videos /data/miradata --config configs/ingest/opensora12.toml > mira-units.txt
  reelcache ingest plan --root /data/rc --source folder --name mine --videos /data/my-clips > units.txt

Prints one unit per line on stdout, ready for GNU parallel:
  parallel --sshloginfile nodes.txt --joblog ingest.log reelcache ingest run --root /data/rc {} :::: units.txt
  reelcache catalog merge --root /data/rc
"""

INGEST_RUN_EXAMPLES = """\
examples:
  reelcache ingest run --root /data/rc openvid/000012
  parallel -j 8 --joblog ingest.log reelcache ingest run --root /data/rc {} :::: units.txt

A finished unit (its sidecar parquet exists) is skipped; a killed one is cleaned and redone.
"""

CATALOG_EXAMPLES = """\
examples:
  reelcache catalog merge --root /data/rc
  reelcache catalog sql --root /data/rc "SELECT level, count(*) FROM clips WHERE status='ok' GROUP BY 1"
  reelcache catalog sql --root /data/rc "SELECT * FROM clips WHERE status='rejected'" --out rejects.csv
  reelcache catalog stats --root /data/rc
  reelcache catalog manifest --root /data/rc --name stage1 --where "height >= 240 AND level <= 3 AND noun_pct < 99.99"
  reelcache catalog export --root /data/rc --format opensora --where "status='ok'" --out stage1.csv
"""


def _ingest_plan(a):
    import dataclasses
    import tomllib

    from reelcache.ingest.filters import Thresholds
    from reelcache.ingest.plan import IngestConfig, make_plan

    conf = {}
    if a.config:
        with open(a.config, "rb") as f:
            conf = tomllib.load(f)
    thresholds = {**conf.pop("thresholds", {})}
    known = {f.name for f in dataclasses.fields(IngestConfig)} | {f.name for f in dataclasses.fields(Thresholds)}
    if unknown := set(conf) - known:
        raise UserError(f"{a.config}: unknown keys {sorted(unknown)}")
    for k in [f.name for f in dataclasses.fields(Thresholds)]:
        if k in conf:
            thresholds[k] = conf.pop(k)
        if getattr(a, k) is not None:
            thresholds[k] = getattr(a, k)
    for k in ("caption", "rows_per_unit", "shard_mb", "verify", "probe_timeout", "decode_timeout",
              "workers", "worker_memory_mb", "tagger"):
        if getattr(a, k) is not None:
            conf[k] = getattr(a, k)
    cfg = IngestConfig(source=a.name or a.source, format=a.source, videos=str(Path(a.videos).resolve()),
                       meta=a.meta and str(Path(a.meta).resolve()),
                       thresholds=Thresholds(**thresholds), **conf)
    units = make_plan(a.root, cfg, replace=a.replace)
    sys.stdout.write("".join(u + "\n" for u in units))


def _ingest_run(a):
    from reelcache.ingest.run import run_unit

    for unit in a.units:
        run_unit(a.root, unit, wait=a.wait)


def _catalog_merge(a):
    from reelcache.catalog.merge import merge

    merge(a.root)


def _catalog_sql(a):
    from reelcache.catalog.query import run_sql

    run_sql(a.root, a.query, out=a.out, limit=a.limit)


def _catalog_stats(a):
    from reelcache.catalog.stats import stats

    stats(a.root, out_dir=a.out)


def _catalog_manifest(a):
    from reelcache.catalog.manifest import make_manifest

    path = make_manifest(a.root, a.name, a.where, cache=a.cache)
    print(path)


def _catalog_export(a):
    from reelcache.catalog.query import export

    export(a.root, a.format, a.where, a.out)


def _cache_plan(a):
    from reelcache.cache.plan import CacheConfig, make_plan

    units = make_plan(a.root, CacheConfig.from_toml(a.config))
    sys.stdout.write("".join(u + "\n" for u in units))


def _cache_run(a):
    from reelcache.cache.run import run_unit

    for unit in a.units:
        run_unit(a.root, unit, device=a.device, wait=a.wait)


def _loader_simulate(a):
    from reelcache.catalog.buckets import BucketConfig
    from reelcache.train.simulate import simulate

    given = [w for _, w in a.manifests if w is not None]
    if sum(given) > 1 or (len(given) == len(a.manifests) > 1 and abs(sum(given) - 1) > 1e-6):
        raise UserError(f"--weight values {given} must add up to 1 (unweighted manifests share the rest)")
    rest = (1 - sum(given)) / max(1, sum(1 for _, w in a.manifests if w is None))
    manifests = [(m, w if w is not None else rest) for m, w in a.manifests]
    try:
        simulate(manifests, BucketConfig.from_toml(a.buckets), root=a.root, world_size=a.world_size,
                 workers=a.workers, seed=a.seed, epochs=a.epochs, out=a.out, save_at=a.save_at,
                 resume_world_size=a.resume_world_size)
    except ValueError as e:
        raise UserError(str(e)) from e
    if a.out:
        print(a.out)


class _ManifestArg(argparse.Action):
    """--manifest NAME [--weight W] pairs, in the order given."""

    def __call__(self, parser, ns, value, option=None):
        pairs = getattr(ns, "manifests", None) or []
        if option == "--manifest":
            pairs.append((value, None))
        elif not pairs or pairs[-1][1] is not None:
            parser.error("--weight must follow the --manifest it applies to")
        else:
            pairs[-1] = (pairs[-1][0], float(value))
        ns.manifests = pairs


def _demo_generate(a):
    from reelcache.ingest.demo import generate

    print(generate(a.out, n=a.clips, seed=a.seed, workers=a.workers))


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="reelcache", description=textwrap.dedent("""\
        reelcache: text-video datasets -> webdataset shards -> SQL catalog -> latent cache -> training.
        Every heavy step is `plan` (prints units) -> `run UNIT` (anywhere, idempotent) -> `catalog merge`."""),
        formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"reelcache {__version__}")
    top = p.add_subparsers(dest="stage", required=True)

    ing = top.add_parser("ingest", help="probe videos, reject bad rows with a reason, write raw shards")
    ising = ing.add_subparsers(dest="cmd", required=True)
    pl = ising.add_parser("plan", help="read a source table once and print its work units",
                          epilog=INGEST_PLAN_EXAMPLES, formatter_class=fmt)
    pl.add_argument("--root", required=True, help="data root (catalog, shards, manifests live here)")
    pl.add_argument("--source", required=True, choices=["openvid", "miradata", "csv", "parquet", "folder"],
                    help="format of the input table")
    pl.add_argument("--meta", help="the table: OpenVid/MiraData CSV, or a path,text csv/parquet")
    pl.add_argument("--videos", required=True, help="folder that the table's paths are relative to")
    pl.add_argument("--name", help="source name in the catalog (default: the format)")
    pl.add_argument("--caption", help="MiraData: which caption trains (short, dense, background, "
                                      "main_object, style, camera); all are kept")
    pl.add_argument("--config", help="TOML with any of these settings, e.g. configs/ingest/opensora12.toml")
    pl.add_argument("--rows-per-unit", type=int, help="input rows per work unit (default 1000)")
    pl.add_argument("--shard-mb", type=float, help="cap on one shard's size in MB (default 1000)")
    pl.add_argument("--verify", choices=["header", "decode"],
                    help="header (default): headers, packets, first frame; decode: decode every frame")
    pl.add_argument("--probe-timeout", type=float, help="seconds per file before it is a 'timeout' reject (30)")
    pl.add_argument("--decode-timeout", type=float, help="seconds per file with --verify decode (600)")
    pl.add_argument("--workers", type=int, help="probe processes per unit (default 1)")
    pl.add_argument("--worker-memory-mb", type=int, help="address-space cap per probe process")
    pl.add_argument("--tagger", choices=["pattern", "spacy"], help="part-of-speech tagger for noun_count")
    pl.add_argument("--max-file-mb", type=float, help="reject files larger than this ('too_large')")
    pl.add_argument("--min-frames", type=int, help="reject clips with fewer frames ('too_short', default 17)")
    pl.add_argument("--min-seconds", type=float, help="reject clips shorter than this ('too_short')")
    pl.add_argument("--replace", action="store_true",
                    help="the source was planned differently before: delete its shards and plan anew")
    pl.set_defaults(fn=_ingest_plan)
    rn = ising.add_parser("run", help="process one or more units printed by `ingest plan`",
                          epilog=INGEST_RUN_EXAMPLES, formatter_class=fmt)
    rn.add_argument("--root", required=True)
    rn.add_argument("units", nargs="+", metavar="UNIT", help="e.g. openvid/000012")
    rn.add_argument("--wait", action="store_true", help="if another run holds a unit, wait for it instead of exiting")
    rn.set_defaults(fn=_ingest_run)

    cat = top.add_parser("catalog", help="the DuckDB catalog: merge, query, stats, manifests, export",
                         epilog=CATALOG_EXAMPLES, formatter_class=fmt)
    icat = cat.add_subparsers(dest="cmd", required=True)
    m = icat.add_parser("merge", help="load finished units' sidecars (idempotent), recompute levels")
    m.add_argument("--root", required=True)
    m.set_defaults(fn=_catalog_merge)
    q = icat.add_parser("sql", help="run SQL on the catalog (read-only); print or write csv/json/parquet",
                        epilog=CATALOG_EXAMPLES, formatter_class=fmt)
    q.add_argument("--root", required=True)
    q.add_argument("query")
    q.add_argument("--out", help="write the result to FILE.csv, .json or .parquet instead of printing")
    q.add_argument("--limit", type=int, default=50, help="rows to print (default 50; --out writes all)")
    q.set_defaults(fn=_catalog_sql)
    s = icat.add_parser("stats", help="text summary and PNG histograms")
    s.add_argument("--root", required=True)
    s.add_argument("--out", help="folder for the PNGs (default ROOT/stats)")
    s.set_defaults(fn=_catalog_stats)
    mf = icat.add_parser("manifest", help="freeze a selection of ok clips into a fingerprinted parquet")
    mf.add_argument("--root", required=True)
    mf.add_argument("--name", required=True)
    mf.add_argument("--where", default="true", help="SQL condition on clips (status='ok' is implied)")
    mf.add_argument("--cache", help="keep clips this cache encoded and add their latent shard/offset/bucket: "
                                    "the manifest the training loader reads")
    mf.set_defaults(fn=_catalog_manifest)
    ex = icat.add_parser("export", help="write the selection as a table another trainer reads")
    ex.add_argument("--root", required=True)
    ex.add_argument("--format", default="opensora", choices=["opensora"])
    ex.add_argument("--where", default="true", help="SQL condition on clips (status='ok' is implied)")
    ex.add_argument("--out", required=True)
    ex.set_defaults(fn=_catalog_export)

    ca = top.add_parser("cache", help="VAE and text latents, precomputed once per stage across GPU nodes")
    ica = ca.add_subparsers(dest="cmd", required=True)
    cp = ica.add_parser("plan", help="assign buckets, fix the cache identity, print units", formatter_class=fmt,
                        epilog="""examples:
  reelcache cache plan --root /data/rc --config configs/cache/wan-stage1.toml > units.txt
  parallel --sshloginfile gpu-nodes.txt -j 8 --joblog cache.log \\
      CUDA_VISIBLE_DEVICES='$(({%}-1))' reelcache cache run --root /data/rc {} :::: units.txt
  reelcache catalog merge --root /data/rc
  reelcache catalog sql --root /data/rc "SELECT cache, bucket, count(*) FROM latents GROUP BY ALL"
""")
    cp.add_argument("--root", required=True)
    cp.add_argument("--config", required=True, help="cache config TOML, e.g. configs/cache/tiny.toml")
    cp.set_defaults(fn=_cache_plan)
    cr = ica.add_parser("run", help="decode and encode one or more units printed by `cache plan`")
    cr.add_argument("--root", required=True)
    cr.add_argument("units", nargs="+", metavar="UNIT", help="e.g. wan-stage1/000012")
    cr.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    cr.add_argument("--wait", action="store_true", help="if another run holds a unit, wait for it instead of exiting")
    cr.set_defaults(fn=_cache_run)

    ld = top.add_parser("loader", help="the streaming loader: simulate a stage's data order without GPUs")
    ild = ld.add_subparsers(dest="cmd", required=True)
    sim = ild.add_parser("simulate", help="plan every rank's batches (no model, no reads), optionally resume",
                         formatter_class=fmt, epilog="""examples:
  reelcache loader simulate --root /data/rc --manifest stage3-openvid --manifest stage3-mira --weight 0.3 \
      --buckets configs/buckets/opensora12-stage1.toml --world-size 16 --workers 8 --seed 42 --epochs 2 \
      --out consumed.parquet --save-at 1000 --resume-world-size 24
  reelcache catalog sql --root /data/rc "SELECT epoch, count(DISTINCT clip_id), count(*) FROM 'consumed.parquet'
      WHERE NOT pad GROUP BY 1"
""")
    sim.add_argument("--root", help="data root (manifest names resolve to ROOT/manifests/NAME-*.parquet)")
    sim.add_argument("--manifest", dest="manifests", action=_ManifestArg, required=True,
                     help="loader manifest name or path; repeat to mix")
    sim.add_argument("--weight", action=_ManifestArg, help="share of the preceding --manifest (0..1)")
    sim.add_argument("--buckets", required=True, help="bucket config TOML (batch size per resolution/frames)")
    sim.add_argument("--world-size", type=int, required=True)
    sim.add_argument("--workers", type=int, default=1, help="data workers per rank (recorded; order is independent)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--epochs", type=int, default=1)
    sim.add_argument("--out", help="write (epoch, step, rank, worker, clip_id, bucket, pad) parquet")
    sim.add_argument("--save-at", type=int, help="save the data state at this global step, then resume")
    sim.add_argument("--resume-world-size", type=int, help="world size to resume on (default: the same)")
    sim.set_defaults(fn=_loader_simulate)

    from reelcache.train import cli as train_cli

    tr = top.add_parser("train", help="train a stage (STDiT3 + rectified flow) on the latent cache",
                        epilog=train_cli.EXAMPLES, formatter_class=fmt)
    train_cli.add_arguments(tr)
    tr.set_defaults(fn=train_cli.run, takes_overrides=True)
    from reelcache.train import cluster as cluster_cli

    cluster_cli.add_commands(top)

    from reelcache.eval import cli as eval_cli

    eval_cli.add_commands(top)

    demo = top.add_parser("demo", help="the bundled demo dataset")
    idemo = demo.add_subparsers(dest="cmd", required=True)
    g = idemo.add_parser("generate", help="write a small OpenVid-format dataset with some broken files")
    g.add_argument("--out", required=True)
    g.add_argument("--clips", type=int, default=240)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workers", type=int, default=2)
    g.set_defaults(fn=_demo_generate)
    train_cli.add_demo(idemo)
    return p


def run_command(fn) -> int:
    """Run a command: a UserError is a message and exit status 2, never a traceback."""
    import warnings

    warnings.formatwarning = lambda msg, category, *a, **k: f"warning: {msg}\n"
    try:
        fn()
    except UserError as e:
        print(f"reelcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "takes_overrides", False):        # `train` takes --section.key=value overrides
        return run_command(lambda: args.fn(args, rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return run_command(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
