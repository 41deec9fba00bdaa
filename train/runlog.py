"""What a run reports, on rank 0: a console line, wandb, and per-step metrics as parquet.

The console line and wandb carry the same numbers (loss, lr, grad norm, throughput, MFU, step
time, data wait). The metrics parquet (``runs/<run>/metrics/*.parquet``) has one row per step
with the buckets the step trained on, so a loss spike joins to the clips it saw:

    SELECT m.step, m.loss, c.clip_id, c.bucket, k.level, k.text
    FROM 'runs/stage1/metrics/*.parquet' m
    JOIN 'runs/stage1/consumed/*.parquet' c
      ON c.generation = m.generation AND c.epoch = m.epoch AND c.step = m.epoch_step
    JOIN clips k ON k.clip_id = c.clip_id
    WHERE m.step = 1234 AND NOT c.pad
    QUALIFY m.generation = max(m.generation) OVER (PARTITION BY m.step)

(``step`` is the global step, ``epoch_step`` the loader's step in its epoch, ``generation`` the
number of resumes before the row was written: it also separates the passes of a ``--reset-data``.)

Parts are written at every checkpoint (before its rename) and at the end, each tagged with the
run's generation (resumes so far): after a resume, steps past the checkpoint are logged again
and the newest generation of each step is the one that trained, as in the consumed log. wandb
runs offline by default (``wandb sync runs/<run>/wandb/offline-run-*`` uploads later); the run
id is stored once, in ``runs/<run>/wandb_id``, and every later start of the run (``--load``,
``--resume``, a requeue) logs into it, so a stage is one wandb run.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from reelcache.files import atomic_path
from reelcache.log import say
from reelcache.progress import fmt_eta
from reelcache.settings import TEXT, setting

# what other stages may use (train/__init__.py: PUBLIC)
__all__ = ["LogConfig", "RunLog", "read_run_id", "wandb_settings"]

# wandb (optional: the [train] extra; 0.3 s to import) and pyarrow are imported where used:
# train/config.py imports this module (LogConfig), and importing a config module stays light.


@dataclass
class LogConfig:
    """[log]: how often a step's metrics are gathered and where they go."""

    every: int = setting(10, "steps between metric rows (console, wandb, metrics parquet); skipped steps always", ge=1)
    wandb_project: str = setting("reelcache", "wandb project", pattern=TEXT)
    wandb_mode: str = setting("offline", "offline | online | disabled", choices=("offline", "online", "disabled"))

    def build(self, *, run_dir, enabled: bool, name: str, config: dict, generation: int, total_steps: int):
        """Rank 0's log (``enabled``; the others' log nothing), in the run's wandb run: the id in
        ``runs/<run>/wandb_id``, else a new one, written there."""
        run_id = read_run_id(run_dir)
        return RunLog(
            self,
            run_dir=run_dir,
            enabled=enabled,
            name=name,
            config=config,
            run_id=run_id,
            generation=generation,
            total_steps=total_steps,
        )


def read_run_id(run_dir) -> str | None:
    """The run's wandb id (``runs/<run>/wandb_id``), or None before its first start with wandb."""
    path = Path(run_dir) / ID_FILE
    return (path.read_text().strip() or None) if path.exists() else None


def wandb_settings(mode: str, *, label: str, primary: bool):
    """wandb.Settings for one writer of a run (the trainer, or an evaluator beside it), quiet.

    Online, the run is wandb's multi-writer "shared" mode, so `reelcache eval serve` logs into the
    training run while it trains: training is the primary writer (it owns the run's metadata,
    files and finish state); a secondary writer leaves those alone. Offline, each writer writes
    its own offline run with the run's id (see eval/runlog.py)."""
    import wandb

    common = dict(console="off", x_disable_stats=True, quiet=True, x_label=label)
    if mode == "online":
        secondary = {} if primary else {"x_update_finish_state": False}
        return wandb.Settings(mode="shared", x_primary=primary, **secondary, **common)
    return wandb.Settings(mode=mode, **common)


ID_FILE = "wandb_id"


class RunLog:
    def __init__(
        self,
        cfg: LogConfig,
        *,
        run_dir,
        enabled: bool,
        name: str,
        config: dict,
        run_id: str | None,
        generation: int,
        total_steps: int,
    ):
        self.run_dir, self.enabled, self.generation = Path(run_dir), enabled, generation
        self.rows: list[dict] = []
        self.total_steps, self.t0, self.first_step = total_steps, time.monotonic(), None
        self.wandb = None
        self.run_id = run_id
        if not enabled:
            return
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        if cfg.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")  # our console line says what matters
            import wandb

            self.run_id = run_id or uuid.uuid4().hex[:12]
            self.wandb = wandb.init(
                project=cfg.wandb_project,
                name=name,
                id=self.run_id,
                resume="allow",
                dir=str(self.run_dir),
                config=config,
                settings=wandb_settings(cfg.wandb_mode, label="train", primary=True),
            )
            if read_run_id(self.run_dir) != self.run_id:  # a new run
                (self.run_dir / ID_FILE).write_text(self.run_id)
            self.wandb.define_metric("global_step")
            for prefix in ("train/*", "buckets/*"):
                self.wandb.define_metric(prefix, step_metric="global_step")

    def log(self, row: dict) -> None:
        """One step's numbers (step, epoch, loss, ...); printed and sent every call, kept for parquet."""
        if not self.enabled:
            return
        row = {**row, "generation": self.generation}
        self.rows.append(row)
        if self.first_step is None:
            self.first_step, self.t0 = row["step"], time.monotonic()
        done = row["step"] - self.first_step + 1
        eta = (time.monotonic() - self.t0) / done * max(0, self.total_steps - row["step"] - 1)
        mfu = f" | mfu {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else ""
        skipped = f" | SKIPPED: {row['skipped']}" if row.get("skipped") else ""
        say(
            f"step {row['step'] + 1}/{self.total_steps} ep {row['epoch']} | loss {row['loss']:.4f} | "
            f"lr {row['lr']:.2e} | gnorm {row['grad_norm']:.3f} | {row['samples_per_s']:.1f} samples/s | "
            f"step {row['step_s']:.2f}s, data {100 * row['data_share']:.0f}%{mfu} | "
            f"ETA {fmt_eta(eta)}{skipped}"
        )
        if self.wandb is not None:
            data = {
                f"train/{k}": v
                for k, v in row.items()
                if k not in ("step", "buckets", "skipped", "generation") and v is not None
            }
            data.update({f"buckets/{b}": n for b, n in json.loads(row.get("buckets") or "{}").items()})
            data["global_step"] = row["step"]
            self.wandb.log(data, step=row["step"])

    def flush(self) -> None:
        """Write the buffered rows as one parquet part (atomic)."""
        if not self.enabled or not self.rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(self.rows)
        name = f"g{self.generation:03d}-s{self.rows[0]['step']:09d}-{self.rows[-1]['step']:09d}.parquet"
        with atomic_path(self.run_dir / "metrics" / name) as tmp:
            pq.write_table(table, tmp)
        self.rows = []

    def finish(self) -> None:
        self.flush()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
