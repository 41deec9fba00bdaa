"""A regression record of the debug stage: the loss of every step of one reference run on CPU.

    .venv/bin/python tests/regression.py            # run it, compare with the record
    .venv/bin/python tests/regression.py --update   # run it, rewrite tests/regression/debug-stage1-losses.json

The reference run is configs/train/debug/stage1.toml as committed (its lr and warm-up, grad clip
1.0, EMA, frame masks, caption dropout, gradient checkpointing; DDP over gloo) on 2 ranks under
torchrun for 8 steps: 24 samples of tests/latent_data.py (seed 0, 8-wide captions) in
configs/buckets/tiny.toml make 5 steps an epoch, so the loader crosses into epoch 1. Every draw is
seeded and each rank computes on one thread, so with the pinned torch (2.13.0) the losses are
bit-identical from run to run on one machine; tests/train/test_train.py compares them within TOLERANCE.

TOLERANCE: |loss - recorded| <= 5e-6 at every step (losses are ~3, float32: one ulp is 2.4e-7).
Another processor rounds differently in its CPU kernels (vector width, MKL's code path), and that
moves the losses by a few ulps: measured with ``--measure`` (2026-11, torch 2.13.0, AMD EPYC with
AVX-512), ATen's kernels without SIMD moved them by at most 2.9e-7, ATen on AVX2 1.9e-7, MKL and
oneDNN on their AVX2 path 3.2e-7, 2 threads per rank 0; an AVX-512 Xeon ran the suite 3e-7..7e-7
off. Real changes move them by far more: AdamW eps 1e-8 instead of 1e-15 by up to 1.8e-5 (the
smallest change we know the record must catch: 3e-6 at step 1, 1.8e-5 at step 5), lr 1% higher
4.6e-3, no grad clip 3.0e-2, a warm-up one step longer 9.5e-2 (the warm-up off by one in code
moved step 1 by 5e-2). 5e-6 is 7x the largest rounding difference seen and 3.5x below the
smallest real change's largest step, and it is checked at every step, so a real change fails
where it shows most.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CONFIG = REPO / "configs/train/debug/stage1.toml"
RECORD = TESTS / "regression/debug-stage1-losses.json"
RANKS, STEPS = 2, 8
TOLERANCE = 5e-6  # |loss - recorded| at any step: kernel rounding stays within it, real changes do not


def run(work: Path, env: dict | None = None, args: tuple = ()) -> dict:
    """The reference run in `work` (latents, then the trainer): its torch version and per-step losses.
    `env` (e.g. another kernel choice) and `args` (config overrides) serve --measure."""
    import pyarrow.parquet as pq
    import torch
    from latent_data import write_latents  # tests/ is on the path: the script's folder, or pytest's
    from support import data_args, torchrun  # the suite's one launch of the trainer

    manifest = write_latents(work, 24, name="train", seed=0)
    extra = ["--data.workers=0", "--run.name=regression", f"--run.max_steps={STEPS}", "--checkpoint.every=0", *args]
    p = torchrun(work, data_args(manifest, *extra), nproc=RANKS, config=CONFIG, env=env)
    try:
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:  # the launcher and every rank
            os.killpg(p.pid, signal.SIGKILL)
    if p.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{out[-4000:]}")
    parts = sorted((work / "runs/regression/metrics").glob("*.parquet"))
    rows = sorted((r for f in parts for r in pq.read_table(f).to_pylist()), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(STEPS)), [r["step"] for r in rows]
    return {"torch": torch.__version__, "ranks": RANKS, "losses": [r["loss"] for r in rows]}


def differences(record: dict, got: dict) -> list[str]:
    """What differs between the record and a run beyond rounding, one line each (empty: the same)."""
    out = [f"{k}: recorded {record.get(k)}, now {got[k]}" for k in ("torch", "ranks") if record.get(k) != got[k]]
    old, new = record["losses"], got["losses"]
    if len(old) != len(new):
        out.append(f"steps: recorded {len(old)}, now {len(new)}")
    out += [
        f"step {i}: recorded {a!r}, now {b!r} ({b - a:+.3e}, more than {TOLERANCE:.0e})"
        for i, (a, b) in enumerate(zip(old, new))
        if not abs(b - a) <= TOLERANCE
    ]
    return out


# --measure: what moves the losses by rounding only, and what by a real change (see the docstring).
ROUNDING = {
    "ATen kernels without SIMD": {"ATEN_CPU_CAPABILITY": "default"},
    "ATen kernels AVX2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "MKL and oneDNN as on an AVX2 processor": {"MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "2 threads per rank": {"OMP_NUM_THREADS": "2"},
}
CHANGES = {
    "warm-up one step longer": ["--optim.warmup_steps=5"],
    "AdamW eps 1e-8": ["--optim.adam_eps=1e-8"],
    "lr 1% higher": ["--optim.lr=1.616e-3"],
    "no grad clip": ["--parallel.grad_clip=0"],
}


def measure() -> int:
    """Run the record under each rounding variant and each real change; print the largest |difference|."""
    with tempfile.TemporaryDirectory() as tmp:
        base = run(Path(tmp) / "base")["losses"]
        for kind, cases in (("rounding", ROUNDING), ("change", CHANGES)):
            for i, (name, case) in enumerate(cases.items()):
                w = Path(tmp) / f"{kind}{i}"
                got = run(w, env=case) if kind == "rounding" else run(w, args=tuple(case))
                d = [abs(b - a) for a, b in zip(base, got["losses"])]
                print(f"{kind:8s} {name:42s} max |d| {max(d):.2e} at step {d.index(max(d))}; per step "
                      + " ".join(f"{x:.0e}" for x in d), flush=True)  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help=f"rewrite {RECORD.relative_to(REPO)}")
    ap.add_argument("--measure", action="store_true", help="how far rounding and real changes move the losses")
    a = ap.parse_args()
    if a.measure:
        return measure()
    with tempfile.TemporaryDirectory() as tmp:
        got = run(Path(tmp))
    if a.update:
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(got, indent=1) + "\n")
        print(f"wrote {RECORD.relative_to(REPO)}: {len(got['losses'])} losses")
        return 0
    diff = differences(json.loads(RECORD.read_text()), got)
    print("\n".join(diff) or f"within {TOLERANCE:.0e} of {RECORD.relative_to(REPO)}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
