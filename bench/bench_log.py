"""make bench (logging part): what a logged step costs against the step itself, and the cadence it allows.

A logged step (``log.every``) does, beyond the step: an all-gather of every rank's (bucket,
samples, latent shape, caption length) for tokens/s and MFU, a norm over every weight, and rank 0's
row (console line, wandb, parquet buffer). This bench runs the real trainer on the debug stage with
2 ranks (torchrun, gloo on CPU, ``log.every = 1``), times each step and each logged row on every
rank, and reports the medians, the cost as a share of the step, and the smallest ``log.every`` that
keeps the cost under 1% of step time. Needs the demo root (``make demo``).

    .venv/bin/torchrun --nproc_per_node 2 bench/bench_log.py
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from pathlib import Path

from reelcache.train.config import load_config
from reelcache.train.metrics import metrics_row
from reelcache.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("DEMO_ROOT", REPO / "demo-root"))
STEPS = int(os.environ.get("BENCH_LOG_STEPS", 40))
WARMUP = 5


def main() -> None:
    name = "bench-log"
    if int(os.environ.get("RANK", 0)) == 0:
        shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)
    cfg = load_config(
        REPO / "configs/train/debug/stage1.toml",
        [f'run.name="{name}"', "run.epochs=100", 'log.wandb_mode="offline"', "checkpoint.every=0", "log.every=1"],
    )
    tr = Trainer(cfg, ROOT)
    tr.model.train()
    steps, logs = [], []
    it = iter(tr.loader)
    while len(steps) < STEPS:
        batch = next(it, None)
        if batch is None:
            it = iter(tr.loader)
            continue
        t0 = time.perf_counter()
        out = tr.step(batch, tr.state)
        t1 = time.perf_counter()
        tr.state.global_step += 1
        row = metrics_row(tr.par, tr.module, tr.module.config, out, step_s=t1 - t0, wait_s=0.0, peak=tr.peak)
        tr.log.log({"step": tr.state.global_step - 1, "epoch": 0, "epoch_step": int(batch["step"]), **row})
        t2 = time.perf_counter()
        steps.append(t1 - t0)
        logs.append(t2 - t1)
    both = tr.par.gather_objects((steps[WARMUP:], logs[WARMUP:]))
    tr.log.finish()
    tr.par.close()
    if tr.rank0:
        step = statistics.median(s for st, _ in both for s in st)
        cost = statistics.median(c for _, cs in both for c in cs)
        every = max(1, math.ceil(cost / (0.01 * step)))
        print(
            f"\n== logging cost (debug STDiT3, {len(both)} ranks, {STEPS - WARMUP} steps each after {WARMUP} warm-up)\n"
            f"  step {step * 1e3:.1f} ms, logged row {cost * 1e3:.2f} ms (medians): {100 * cost / step:.2f}% of a "
            f"step at log.every = 1; under 1% from log.every = {every}"
        )


if __name__ == "__main__":
    main()
