"""What the Run and Stage pages read from ``ROOT/runs/<run>/``: metrics, bad steps, eval samples, the
clips each step trained on, and the loader's plan of the run's stage per epoch.

Parquet logs are read by an in-memory DuckDB of their own (the catalog's connection has file access
off, store.py), with paths built here from a run name confined to ROOT/runs. The clips of a step are
the README's post-mortem join of the metrics and consumed logs: per step, the rows of the newest
generation (the one that trained after a resume), padding excluded. The stage's per-epoch contents
come from the loader itself (train/loader.py's LatentLoader with ``read=False``, its ``plan(epoch)``):
mixing weights that ramp over epochs are applied exactly as training applies them.
"""

from __future__ import annotations

import json
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
    """(step, epoch, loss, skipped) of every logged step, the newest generation's row of each."""
    files = _files(d, "metrics")
    if not files:
        return []
    con = duckdb.connect()
    try:
        rel = con.execute(
            """SELECT step, epoch, loss, coalesce(skipped, false) AS skipped FROM read_parquet(?)
               QUALIFY generation = max(generation) OVER (PARTITION BY step) ORDER BY step""",
            [files],
        )
        return [dict(zip(("step", "epoch", "loss", "skipped"), r)) for r in rel.fetchall()]
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
        loss = json.loads(val.read_text()).get("loss") if val.exists() else None
        videos = sorted(str(p.relative_to(root)) for p in ck.rglob("*.mp4"))
        out.append({"checkpoint": ck.name, "val_loss": loss, "videos": videos})
    return out


def step_clips(d: Path, step: int) -> list[dict]:
    """The clips global step ``step`` trained on, every rank's, padding excluded (README's join)."""
    metrics, consumed = _files(d, "metrics"), _files(d, "consumed")
    if not metrics or not consumed:
        return []
    con = duckdb.connect()
    try:
        rel = con.execute(STEP_SQL, [metrics, consumed, step])
        return [dict(zip(("rank", "clip_id", "bucket", "view"), r)) for r in rel.fetchall()]
    finally:
        con.close()


def stage(root: Path, d: Path, store) -> dict:
    """The run's stage per epoch, from the loader's own plan: samples per manifest, bucket, level, source."""
    from reelcache.catalog.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    cfg = json.loads((d / "config.json").read_text())
    data, run = cfg["data"], cfg["run"]
    path = Path(data["buckets"])
    if not path.exists() and (root / path).exists():
        path = root / path
    if not path.exists():
        return {
            "error": f"the run's bucket config {data['buckets']!r} is not here (relative to this directory or ROOT)"
        }
    pairs = [(m["name"], m.get("weight", 1.0)) for m in data["manifests"]]
    loader = LatentLoader(
        pairs, BucketConfig.from_toml(path), root=root, seed=run["seed"], block=data.get("block", 64), read=False
    )
    names = np.repeat(np.array([n for n, _ in pairs], dtype=object), [len(s) for s in loader.sources])
    bucket = np.concatenate([s.bucket for s in loader.sources])
    epochs = []
    for e in range(int(run.get("epochs", 1))):
        plan = loader.plan(e)
        idx = plan.order
        table = pa.table({"clip_id": loader.clip_id[idx].tolist(), "bucket": bucket[idx].tolist()})
        counts = store.breakdown(table)
        man: dict = {}
        for n in names[idx]:
            man[n] = man.get(n, 0) + 1
        counts["manifest"] = [{"key": k, "n": v} for k, v in sorted(man.items())]
        weights = [s.weight for s in loader.epoch_sources(e)]
        epochs.append(
            {"epoch": e, "samples": len(idx), "batches": plan.num_batches, "weights": weights, "counts": counts}
        )
    return {"manifests": pairs, "buckets": data["buckets"], "seed": run["seed"], "epochs": epochs}
