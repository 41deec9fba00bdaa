"""``reelcache catalog merge|sql|stats|manifest|export``: the catalog stage's arguments
(reelcache/cli.py only assembles). Nothing heavy is imported here: the parser builds without duckdb."""

from __future__ import annotations

import argparse

from reelcache.args import arg
from reelcache.base.s3 import check_root, is_url, mirror_dir, root_arg

# merge, query, stats and manifest (duckdb, pyarrow, matplotlib) are imported by the command that
# runs them: `reelcache --help` builds every stage's parser.

EXAMPLES = """\
examples:
  reelcache catalog merge --root /data/rc
  reelcache catalog sql --root /data/rc "SELECT level, count(*) FROM clips WHERE status='ok' GROUP BY 1"
  reelcache catalog sql --root /data/rc "SELECT * FROM clips WHERE status='rejected'" --out rejects.csv
  reelcache catalog stats --root /data/rc
  reelcache catalog manifest --root /data/rc --name stage1 --where "height >= 240 AND level <= 3 AND noun_pct < 99.99"
  reelcache catalog export --root /data/rc --format opensora --where "status='ok'" --out stage1.csv
"""


def add_commands(top) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    cat = top.add_parser(
        "catalog",
        help="the DuckDB catalog: merge, query, stats, manifests, export",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    sub = cat.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="load finished units' sidecars (idempotent), recompute levels")
    m.add_argument(
        "--root",
        required=True,
        type=root_arg,
        help="a folder, or s3://bucket/prefix: its sidecars are mirrored to a local folder, where the catalog is made",
    )
    m.set_defaults(fn=_merge)
    q = sub.add_parser(
        "sql",
        help="run one SELECT on the catalog (read-only: catalog/sql.py); print or write csv/json/parquet",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    q.add_argument("--root", required=True, type=root_arg, help="a folder, or s3://bucket/prefix (its merged catalog)")
    q.add_argument("query")
    q.add_argument("--out", help="write the result to FILE.csv, .json or .parquet instead of printing")
    q.add_argument("--limit", type=arg(int, ge=0), default=50, help="rows to print (default 50; --out writes all)")
    q.set_defaults(fn=_sql)
    s = sub.add_parser("stats", help="text summary and PNG histograms")
    s.add_argument("--root", required=True, type=root_arg, help="a folder, or s3://bucket/prefix (its merged catalog)")
    s.add_argument("--out", help="folder for the PNGs (default ROOT/stats; for an s3:// root, its local mirror's)")
    s.set_defaults(fn=_stats)
    mf = sub.add_parser("manifest", help="freeze a selection of ok clips into a fingerprinted parquet")
    mf.add_argument(
        "--root",
        required=True,
        type=root_arg,
        help="a folder, or s3://bucket/prefix (made from its merged catalog, uploaded to ROOT/manifests/)",
    )
    mf.add_argument("--name", required=True)
    mf.add_argument(
        "--where", default="true", help="one SQL condition on clips (status='ok' is implied; run read-only)"
    )
    mf.add_argument(
        "--cache",
        help="keep clips this cache encoded and add their latent shard/offset/bucket: "
        "the manifest the training loader reads",
    )
    mf.set_defaults(fn=_manifest)
    ex = sub.add_parser("export", help="write the selection as a table another trainer reads")
    ex.add_argument("--root", required=True, type=root_arg, help="a folder, or s3://bucket/prefix (its merged catalog)")
    ex.add_argument("--format", default="opensora", choices=["opensora"])
    ex.add_argument(
        "--where", default="true", help="one SQL condition on clips (status='ok' is implied; run read-only)"
    )
    ex.add_argument("--out", required=True)
    ex.set_defaults(fn=_export)


def _merge(a) -> None:
    from reelcache.catalog.merge import merge

    if is_url(a.root):
        check_root(a.root, write=False)
    merge(a.root)


def _local(root: str) -> str:
    """The folder whose catalog.duckdb a read-only command opens: the root, or an s3:// root's local mirror, where
    `catalog merge` made it (docs/STORAGE.md)."""
    return str(mirror_dir(root)) if is_url(root) else root


def _sql(a) -> None:
    from reelcache.catalog.query import run_sql

    run_sql(_local(a.root), a.query, out=a.out, limit=a.limit)


def _stats(a) -> None:
    from reelcache.catalog.stats import stats

    stats(_local(a.root), out_dir=a.out)


def _manifest(a) -> None:
    from reelcache.catalog.manifest import make_manifest

    if not is_url(a.root):
        print(make_manifest(a.root, a.name, a.where, cache=a.cache))
        return
    from reelcache.base import s3

    check_root(a.root)
    local = mirror_dir(a.root)
    path = make_manifest(local, a.name, a.where, cache=a.cache)  # from the catalog `catalog merge` made there
    url = s3.parse(a.root) / path.relative_to(local).as_posix()
    s3.upload_file(path.with_suffix(".json"), url.parent / path.with_suffix(".json").name)
    s3.upload_file(path, url)  # whole, after its .json: a manifest's name carries its fingerprint
    print(url)


def _export(a) -> None:
    from reelcache.catalog.query import export

    export(_local(a.root), a.format, a.where, a.out)
