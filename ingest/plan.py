"""``ingest plan``: read a source table once, freeze it, and print one work unit per line.

The plan lives in ``ROOT/raw/<source>/_plan/``: ``plan.json`` (the resolved configuration and
the input's fingerprint) and ``input.parquet`` (the normalized input table, one row group per
unit). A unit line is ``<source>/<NNNNNN>``; ``ingest run`` reads only its own row group, so a
million-row table is parsed once, not once per unit. Re-planning the same input with the same
configuration is a no-op; a different one is refused while finished units exist, unless
``--replace`` (which deletes the source's shards, and is refused while a unit runs) is given; the
next ``catalog merge`` then drops the rows of units whose sidecars are gone.

A root in S3 (``s3://bucket/prefix``, docs/STORAGE.md): the plan is made in the root's local mirror
(base/s3.py: ``mirror_dir``) and uploaded whole, ``input.parquet`` first and ``plan.json`` last; ``load_plan``
brings both down again where the mirror's copies differ. ``--replace`` is not done on S3 yet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.base import s3
from reelcache.base.lease import live_holders
from reelcache.catalog.levels import TAGGERS
from reelcache.files import atomic_path
from reelcache.ingest.filters import Thresholds
from reelcache.ingest.sources import FORMATS, MIRADATA_CAPTIONS, read_source
from reelcache.log import say
from reelcache.settings import NAME, TEXT, build, check, setting

PLAN_VERSION = 1


CAPTIONS = tuple(c.removesuffix("_caption") for c in MIRADATA_CAPTIONS) + tuple(MIRADATA_CAPTIONS)


# A worker maps ~240 MB once its imports are done; with a cap below ~400 MB a 1080p decode fails
# (measured: 300 MB makes a good file an `undecodable` reject), so a cap below 1 GiB is refused.
WORKER_MEMORY_DOC = "address-space cap per probe process in MB (None: no cap); at least 1024: a good file must not fail"


@dataclass
class IngestConfig:
    """Everything a unit needs, resolved once at plan time and written to plan.json."""

    source: str = setting(doc="name of this source in the catalog (default: the format)", pattern=NAME)
    format: str = setting(doc="the input table's format", choices=FORMATS)
    videos: str = setting(doc="folder that relative paths resolve against", pattern=TEXT)
    meta: str | None = setting(None, "the table (not used by the folder format)", pattern=TEXT)
    caption: str | None = setting(None, "MiraData: which caption column is `text`", choices=CAPTIONS)
    rows_per_unit: int = setting(1000, "input rows per work unit (one retryable job)", ge=1)
    shard_mb: float = setting(1000.0, "cap on one tar shard's size", gt=0)
    verify: str = setting("header", "header: headers + first frame; decode: full decode", choices=("header", "decode"))
    probe_timeout: float = setting(30.0, "seconds per file (header probe)", gt=0)
    decode_timeout: float = setting(600.0, "seconds per file with --verify decode", gt=0)
    workers: int = setting(1, "probe processes per unit (GNU parallel gives the rest)", ge=1)
    worker_memory_mb: int | None = setting(None, WORKER_MEMORY_DOC, ge=1024)
    tagger: str = setting("pattern", "part-of-speech tagger for noun_count", choices=TAGGERS)
    thresholds: Thresholds = setting(doc="[thresholds]: which probed clips are rejects", factory=Thresholds)

    def __post_init__(self):
        check(self)


def source_dir(root, source: str) -> Path:
    """The source's local folder: in the root, or for a root in S3 in its local mirror (shards staged there)."""
    return (s3.mirror_dir(root) if s3.is_url(root) else Path(root)) / "raw" / source


def remote_dir(root, source: str) -> s3.Url | None:
    """The source's folder in S3 (None for a local root)."""
    return s3.parse(root) / "raw" / source if s3.is_url(root) else None


def finished_units(root, source: str) -> list[str]:
    """The stems of the source's finished units (their sidecars exist), in order."""
    if (remote := remote_dir(root, source)) is not None:
        names = [o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects(f"{remote}/")]
    else:
        src = source_dir(root, source)
        names = [p.name for p in src.glob("[0-9]*.parquet")] if src.exists() else []
    return sorted(n.removesuffix(".parquet") for n in names if n[:1].isdigit() and n.endswith(".parquet"))


def sync_plan(root, source: str) -> None:
    if (remote := remote_dir(root, source)) is not None:
        s3.sync_down(
            remote,
            source_dir(root, source),
            lambda rel: rel in ("_plan/plan.json", "_plan/input.parquet"),
            under=("_plan/",),
        )


def plan_dir(root, source: str) -> Path:
    return source_dir(root, source) / "_plan"


def unit_name(source: str, index: int) -> str:
    return f"{source}/{index:06d}"


def load_plan(root, source: str) -> tuple[IngestConfig, dict]:
    sync_plan(root, source)
    path = plan_dir(root, source) / "plan.json"
    if not path.exists():
        raise UserError(f"no plan for source {source!r} under {root}: run `reelcache ingest plan` first")
    doc = json.loads(path.read_text())
    if doc.get("plan_version") != PLAN_VERSION:
        raise UserError(f"{path} was written by another reelcache version; re-run `ingest plan --replace`")
    return build(IngestConfig, doc["config"], source=path), doc


def _fingerprint(cfg: IngestConfig, table) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    h.update(sink.getvalue())
    return h.hexdigest()


def make_plan(root: str, cfg: IngestConfig, *, replace: bool = False) -> list[str]:
    say(f"reading {cfg.meta or cfg.videos} as {cfg.format} ...")
    table = read_source(cfg.format, cfg.source, cfg.meta, cfg.videos, cfg.caption)
    if table.num_rows == 0:
        raise UserError(f"{cfg.meta or cfg.videos} has no rows: nothing to ingest")
    fp = _fingerprint(cfg, table)
    src, pdir = source_dir(root, cfg.source), plan_dir(root, cfg.source)
    remote = remote_dir(root, cfg.source)
    num_units = -(-table.num_rows // cfg.rows_per_unit)
    units = [unit_name(cfg.source, i) for i in range(num_units)]
    sync_plan(root, cfg.source)
    done = finished_units(root, cfg.source)
    old = pdir / "plan.json"
    if old.exists():
        prev = json.loads(old.read_text())
        if prev.get("fingerprint") == fp:
            say(f"plan for {cfg.source!r} unchanged: {len(units)} units, {len(done)} finished")
            return units
        if done and not replace:
            raise UserError(
                f"source {cfg.source!r} was planned from a different table or configuration and "
                f"{len(done)} units are finished. Use another --name, or --replace to delete "
                f"{src} and start over."
            )
    if replace and remote is not None and (done or old.exists()):
        raise UserError(
            f"--replace on a root in S3 is not supported yet: delete {remote}/ with your S3 tool "
            "(no unit may run meanwhile), or use another --name"
        )
    if replace and src.exists():
        if busy := live_holders(src):
            raise UserError(
                f"--replace would delete {src} while {len(busy)} of its units are running, e.g. "
                f"{busy[0][0].stem} by {busy[0][1].describe()}: stop them first"
            )
        shutil.rmtree(src)
    pdir.mkdir(parents=True, exist_ok=True)
    with atomic_path(pdir / "input.parquet") as tmp:
        pq.write_table(table, tmp, row_group_size=cfg.rows_per_unit, compression="zstd")
    doc = {
        "plan_version": PLAN_VERSION,
        "fingerprint": fp,
        "num_rows": table.num_rows,
        "num_units": num_units,
        "config": dataclasses.asdict(cfg),
    }
    with atomic_path(old) as tmp:
        tmp.write_text(json.dumps(doc, indent=2))
    if remote is not None:  # the table first, plan.json last: a present plan.json names a whole plan
        for name in ("input.parquet", "plan.json"):
            s3.upload_file(pdir / name, remote / "_plan" / name)
        sync_plan(root, cfg.source)  # the mirror's copies now carry the objects' times: not downloaded again
    errs = sum(1 for e in table.column("row_error").to_pylist() if e)
    dups = table.num_rows - table.column("duplicate_of").null_count
    say(
        f"planned {cfg.source!r}: {table.num_rows} rows in {num_units} units of {cfg.rows_per_unit} "
        f"({errs} malformed rows, {dups} duplicate rows: recorded as rejects)"
    )
    return units
