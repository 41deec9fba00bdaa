"""``reelcache demo train``: the end of ``make demo``. Two tiny stages on CPU, a crash on purpose.

1. stage 1 (configs/train/debug/stage1.toml) on 2 processes (``reelcache train --nproc 2``: torch's
   elastic launch, as torchrun); once its second checkpoint exists, rank 1 is killed with SIGKILL (the
   launch then stops the job, as a node failure would, and says so in one line);
2. ``--load latest`` resumes it and runs it to the end;
3. stage 2 starts from stage 1's last weights (``--init-from``, weights only);
4. ``ROOT/runs/demo-loss.png`` plots both stages' loss per step, with the kill marked.

The demo's two run directories are recreated on every call, so ``make demo`` runs again cleanly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
from matplotlib.figure import Figure

from reelcache import UserError
from reelcache.cluster import ranks
from reelcache.log import say
from reelcache.train.checkpoint import ckpt_step, list_checkpoints
from reelcache.train.config import load_config

STAGES = ("configs/train/debug/stage1.toml", "configs/train/debug/stage2.toml")


def _launch(config: str, root: Path, nproc: int, *extra: str) -> subprocess.Popen:
    """``reelcache train CONFIG --root ROOT --nproc N``: the ranks through torch's elastic launch
    (train/launch.py), so the stage killed on purpose ends in one line, not torchrun's report."""
    args = [config, "--root", str(root), "--nproc", str(nproc), *extra]
    say(f"$ reelcache train {' '.join(args)}")
    return subprocess.Popen(
        [sys.executable, "-m", "reelcache", "train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def _wait(p: subprocess.Popen, what: str) -> None:
    if p.wait() != 0:
        raise UserError(f"{what} failed (exit {p.returncode}); its output is above")


def run(root, nproc: int = 2) -> None:
    root = Path(root)
    names = [load_config(c).run.name for c in STAGES]
    for n in names:
        shutil.rmtree(root / "runs" / n, ignore_errors=True)
    run1 = root / "runs" / names[0]

    p = _launch(STAGES[0], root, nproc)
    deadline = time.monotonic() + 600
    while len(list_checkpoints(run1)) < 2:
        if p.poll() is not None:
            raise UserError(f"stage 1 ended (exit {p.returncode}) before its second checkpoint")
        if time.monotonic() > deadline:
            p.kill()
            raise UserError("stage 1 wrote no second checkpoint in 10 minutes")
        time.sleep(0.2)
    victim = {r.rank: r for r in ranks.read(run1)}[nproc - 1]
    killed_after = list_checkpoints(run1)[-1]
    os.kill(victim.pid, signal.SIGKILL)
    say(f"demo: killed rank {nproc - 1} (pid {victim.pid}) with SIGKILL after {killed_after.name}")
    p.wait()
    say(f"demo: the job stopped (exit {p.returncode}); resuming from the newest checkpoint")
    _wait(_launch(STAGES[0], root, nproc, "--load", "latest"), "resuming stage 1")
    last = list_checkpoints(run1)[-1]
    _wait(_launch(STAGES[1], root, nproc, "--init-from", str(last)), "stage 2")
    png = plot(root, names, ckpt_step(killed_after))
    say(f"demo: trained {names[0]} (killed and resumed) and {names[1]} (from {last.name}); loss plot {png}")


def metrics(run_dir: Path) -> list[dict]:
    """Per step, the newest generation's row (after a resume, what trained)."""
    return (
        duckdb.sql(f"""SELECT step, loss, generation FROM '{run_dir}/metrics/*.parquet'
        QUALIFY generation = max(generation) OVER (PARTITION BY step) ORDER BY step""")
        .to_arrow_table()
        .to_pylist()
    )


def plot(root: Path, names, killed_at: int) -> Path:
    fig = Figure(figsize=(8, 4))  # no pyplot: no backend to choose, no global figure to close
    ax = fig.subplots()
    offset = 0
    for n in names:
        rows = metrics(root / "runs" / n)
        ax.plot([offset + r["step"] for r in rows], [r["loss"] for r in rows], marker=".", label=n)
        if n == names[0]:
            ax.axvline(killed_at, color="grey", ls="--", lw=1)
            ax.text(killed_at, ax.get_ylim()[1], " killed, resumed from here", va="top", fontsize=8)
        offset += len(rows)
    ax.set_xlabel("step (stage 2 continues after stage 1)")
    ax.set_ylabel("rectified-flow loss")
    ax.set_title("demo: two tiny STDiT3 stages on CPU, 2 processes")
    ax.legend()
    out = root / "runs" / "demo-loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out
