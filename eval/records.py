"""What an evaluation leaves on disk besides its videos: JSON records written atomically (a reader never
sees half of one), and the run's val_loss.parquet gathered from every checkpoint's val_loss*.json."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.files import atomic_path

VAL_LOSS_PARQUET = "val_loss.parquet"


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(doc, indent=2, default=str))


def write_val_loss_parquet(out: Path) -> None:
    """``out``/val_loss.parquet: every val_loss*.json under ``out`` (one per checkpoint and weights) as
    rows (step, weights, bucket, t, loss, clips): overall, per bucket, and per timestep."""
    rows = []
    for f in sorted(out.glob("ckpt-*/val_loss*.json")):
        doc = json.loads(f.read_text())
        base = {
            "global_step": doc["global_step"],
            "checkpoint": doc["checkpoint"],
            "weights": doc["weights"],
            "manifest_fingerprint": doc["manifest_fingerprint"],
        }
        rows.append({**base, "bucket": "all", "t": None, "loss": doc["overall"], "clips": doc["clips"]})
        rows += [
            {**base, "bucket": b, "t": None, "loss": v["loss"], "clips": v["clips"]} for b, v in doc["buckets"].items()
        ]
        rows += [
            {**base, "bucket": "all", "t": float(t), "loss": v, "clips": doc["clips"]}
            for t, v in doc["timesteps"].items()
        ]
    with atomic_path(out / VAL_LOSS_PARQUET) as tmp:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
