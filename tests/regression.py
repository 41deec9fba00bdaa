"""A regression record of the debug stage: the loss of every step of one reference run on CPU.

    .venv/bin/python tests/regression.py            # run it, compare with the record
    .venv/bin/python tests/regression.py --update   # run it, rewrite tests/regression/debug-stage1-losses.json

The reference run is configs/train/debug/stage1.toml as committed (its lr and warm-up, grad clip
1.0, EMA, frame masks, caption dropout, gradient checkpointing; DDP over gloo) on 2 ranks under
torchrun for 8 steps: 24 samples of tests/latent_data.py (seed 0, 8-wide captions) in
configs/buckets/tiny.toml make 5 steps an epoch, so the loader crosses into epoch 1. Every draw is
seeded and each rank computes on one thread, so with the pinned torch (2.13.0) the losses are
bit-identical from run to run on this machine, and tests/test_train.py compares them exactly.

Whatever changes the numbers (the model, the flow, the data order, the optimizer, a config value)
fails that test. A change that is meant is recorded with --update, and the commit that makes it
says why the losses moved.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CONFIG = REPO / "configs/train/debug/stage1.toml"
RECORD = TESTS / "regression/debug-stage1-losses.json"
RANKS, STEPS = 2, 8


def run(work: Path) -> dict:
    """The reference run in `work` (latents, then the trainer): its torch version and per-step losses."""
    import pyarrow.parquet as pq
    import torch
    from latent_data import write_latents  # tests/ is on the path: the script's folder, or pytest's

    manifest = write_latents(work, 24, name="train", seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REELCACHE_PROGRESS": "0"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(RANKS),
            "--master_port",
            str(port),
            "-m",
            "reelcache.train",
            str(CONFIG),
            "--root",
            str(work),
            f'--data.manifests=[{{name="{manifest}"}}]',
            '--data.buckets="configs/buckets/tiny.toml"',
            "--model.overrides={caption_channels=8, model_max_length=300}",
            "--data.workers=0",
            "--log.wandb_mode=disabled",
            "--run.name=regression",
            f"--run.max_steps={STEPS}",
            "--checkpoint.every=0",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{(p.stdout + p.stderr)[-4000:]}")
    parts = sorted((work / "runs/regression/metrics").glob("*.parquet"))
    rows = sorted((r for f in parts for r in pq.read_table(f).to_pylist()), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(STEPS)), [r["step"] for r in rows]
    return {"torch": torch.__version__, "ranks": RANKS, "losses": [r["loss"] for r in rows]}


def differences(record: dict, got: dict) -> list[str]:
    """What differs between the record and a run, one line each (empty: identical)."""
    out = [f"{k}: recorded {record.get(k)}, now {got[k]}" for k in ("torch", "ranks") if record.get(k) != got[k]]
    old, new = record["losses"], got["losses"]
    if len(old) != len(new):
        out.append(f"steps: recorded {len(old)}, now {len(new)}")
    out += [f"step {i}: recorded {a!r}, now {b!r} ({b - a:+.3e})" for i, (a, b) in enumerate(zip(old, new)) if a != b]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help=f"rewrite {RECORD.relative_to(REPO)}")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = run(Path(tmp))
    if a.update:
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(got, indent=1) + "\n")
        print(f"wrote {RECORD.relative_to(REPO)}: {len(got['losses'])} losses")
        return 0
    diff = differences(json.loads(RECORD.read_text()), got)
    print("\n".join(diff) or f"identical to {RECORD.relative_to(REPO)}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
