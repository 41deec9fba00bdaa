"""What the Run and Stage pages read from ``ROOT/runs/<run>/``: metrics, bad steps, eval samples, the
clips each step trained on, and the loader's plan of the run's stage per epoch.

Parquet logs are read by an in-memory DuckDB of their own (the catalog's connection has file access
off, store.py), with paths built here from a run name confined to ROOT/runs. The clips of a step are
docs/TRAIN.md's post-mortem join of the metrics and consumed logs: per step, the rows of the newest
generation (the one that trained after a resume), padding excluded. The stage's per-epoch contents
come from the loader itself (train/loader.py's LatentLoader with ``read=False``, its ``plan(epoch)``):
mixing weights that ramp over epochs are applied exactly as training applies them.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from reelcache.view.files import confined

STEP_SQL = """
SELECT c.rank, c.clip_id, c.bucket, c.view
FROM read_parquet(?) m
JOIN read_parquet(?) c ON c.generation = m.generation AND c.epoch = m.epoch AND c.step = m.epoch_step
WHERE m.step = ? AND NOT c.pad
QUALIFY m.generation = max(m.generation) OVER (PARTITION BY m.step)
ORDER BY c.rank, c.clip_id
"""


def run_dir(root: Path, name: str) -> Path:
    return confined(root / "runs", name)


def list_runs(root: Path) -> list[dict]:
    out = []
    for d in sorted((root / "runs").glob("*/")) if (root / "runs").is_dir() else []:
        if any((d / x).exists() for x in ("metrics", "consumed", "config.json")):
            ckpts = sorted(p.name for p in d.glob("ckpt-*") if not p.name.startswith(".tmp"))
            out.append({"name": d.name, "checkpoints": len(ckpts), "latest": ckpts[-1] if ckpts else None})
    return out


def _files(d: Path, sub: str) -> list[str]:
    return sorted(str(p) for p in (d / sub).glob("*.parquet"))


def losses(d: Path) -> list[dict]:
    """(step, epoch, loss, skipped, generation) of every logged step, the newest generation's row of each."""
    files = _files(d, "metrics")
    if not files:
        return []
    con = duckdb.connect()
    try:
        rel = con.execute(
            """SELECT step, epoch, loss, coalesce(skipped, false) AS skipped, generation FROM read_parquet(?)
               QUALIFY generation = max(generation) OVER (PARTITION BY step) ORDER BY step""",
            [files],
        )
        return [dict(zip(("step", "epoch", "loss", "skipped", "generation"), r)) for r in rel.fetchall()]
    finally:
        con.close()


def bad_steps(d: Path) -> list[dict]:
    path = d / "bad_steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_samples(root: Path, d: Path) -> list[dict]:
    """Per evaluated checkpoint: its validation loss (if any) and its sample videos (paths under ROOT)."""
    out = []
    for ck in sorted((d / "eval").glob("ckpt-*/")):
        val = ck / "val_loss.json"
        loss = json.loads(val.read_text()).get("overall") if val.exists() else None  # eval/evaluate.py
        videos = sorted(str(p.relative_to(root)) for p in ck.rglob("*.mp4"))
        out.append({"checkpoint": ck.name, "val_loss": loss, "videos": videos})
    return out


def step_clips(d: Path, step: int) -> list[dict]:
    """The clips global step ``step`` trained on, every rank's, padding excluded (docs/TRAIN.md's join)."""
    metrics, consumed = _files(d, "metrics"), _files(d, "consumed")
    if not metrics or not consumed:
        return []
    con = duckdb.connect()
    try:
        rel = con.execute(STEP_SQL, [metrics, consumed, step])
        return [dict(zip(("rank", "clip_id", "bucket", "view"), r)) for r in rel.fetchall()]
    finally:
        con.close()


class Stage:
    """The run's stage per epoch, from the loader's own plan: samples per manifest, bucket, level, source.

    Built lazily, so a page can stream its head before the loader has read its manifests (seconds at
    1.3M samples), and kept in ``_STAGES`` by the content of config.json and the manifests' sizes and
    times: a second look at the same stage is free. Each sample's level and source come from one join
    of the stage's clips with the catalog; an epoch's counts are then numpy bincounts over its plan."""

    def __init__(self, root: Path, d: Path, store):
        self.root, self.store = root, store
        cfg = json.loads((d / "config.json").read_text())
        self.data, self.run = cfg["data"], cfg["run"]
        self.pairs = [(m["name"], m.get("weight", 1.0)) for m in self.data["manifests"]]
        self.seed, self.buckets = self.run["seed"], self.data["buckets"]
        self.error = None
        self.path = Path(self.buckets)
        if not self.path.exists() and (root / self.path).exists():
            self.path = root / self.path
        if not self.path.exists():
            self.error = f"the run's bucket config {self.buckets!r} is not here (relative to this directory or ROOT)"
        self._epochs: list[dict] = []
        self._lock = threading.Lock()

    @functools.cached_property
    def loader(self):
        from reelcache.base.buckets import BucketConfig
        from reelcache.train.loader import LatentLoader

        return LatentLoader(
            self.pairs, BucketConfig.from_toml(self.path), root=self.root, seed=self.seed,
            block=self.data.get("block", 64), read=False,
        )  # fmt: skip

    @functools.cached_property
    def codes(self) -> dict:
        """Per sample of the concatenated sources: (names, code) of its manifest, bucket, level and source."""
        loader = self.loader
        out = {
            "manifest": (
                [n for n, _ in self.pairs],
                np.repeat(np.arange(len(self.pairs)), [len(s) for s in loader.sources]),
            )
        }
        names, code = np.unique(np.concatenate([s.bucket for s in loader.sources]), return_inverse=True)
        out["bucket"] = (list(names), code)
        out.update(self.store.lookup(pa.array(loader.clip_id, pa.string()), ("level", "source")))
        return out

    def epochs(self):
        for e in range(int(self.run.get("epochs", 1))):
            with self._lock:  # two pages of one stage: each epoch planned once
                if e == len(self._epochs):
                    self._plan_epoch(e)
            yield self._epochs[e]

    def _plan_epoch(self, e: int) -> None:
        plan = self.loader.plan(e)
        counts = {}
        for what in ("level", "source", "bucket", "manifest"):
            names, code = self.codes[what]
            n = np.bincount(code[plan.order], minlength=len(names))
            counts[what] = [{"key": k, "n": int(c)} for k, c in zip(names, n) if c]
        weights = [s.weight for s in self.loader.epoch_sources(e)]
        self._epochs.append(
            {"epoch": e, "samples": len(plan.order), "batches": plan.num_batches, "weights": weights, "counts": counts}
        )


_STAGES: dict[tuple, Stage] = {}


def stage(root: Path, d: Path, store) -> Stage:
    """The run's Stage, the same object while config.json and its manifests are unchanged."""
    from reelcache.catalog.manifest import resolve_manifest

    cfg = (d / "config.json").read_bytes()
    files = []
    for m in json.loads(cfg)["data"]["manifests"]:
        try:
            p = resolve_manifest(root, m["name"])
            files.append((str(p), p.stat().st_size, p.stat().st_mtime_ns))
        except Exception:  # noqa: BLE001 - the loader names what is missing when the page is built
            files.append((m["name"],))
    key = (str(d), cfg, tuple(files))
    if key not in _STAGES:
        if len(_STAGES) >= 8:
            _STAGES.pop(next(iter(_STAGES)))
        _STAGES[key] = Stage(root, d, store)
    return _STAGES[key]
