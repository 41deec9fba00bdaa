"""make bench (launch part): what starting a 2-rank CPU training costs, `reelcache train --nproc 2` against
`torchrun --nproc_per_node 2 -m reelcache.train` (the baseline), measured in the same run.

Both launch the debug stage (configs/train/debug/stage1.toml) over the demo's tiny latent cache for STEPS steps
(a checkpoint at the end), each in a run of its own, taking turns (the order swaps every round). On a CPU build
of torch `reelcache train --nproc` forks its ranks from a process that imported what a rank imports once
(train/launch.py, train/preload.py); under torchrun each rank is an interpreter that imports torch, the
trainer and ColossalAI (peft, transformers, bitsandbytes) itself.

Measured: the launch's wall time and the CPU time of the whole machine while it runs (user + system from
/proc/stat: a forked rank is the fork server's child, not the launcher's, so no rusage of the launcher counts
it). Run it on a quiet machine: whatever else runs counts too. Printed: each launch's CPU-s and wall s, and the
medians' ratios (reelcache / torchrun). Needs the demo root (`make demo`): DEMO_ROOT=demo-root by default.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("DEMO_ROOT", REPO / "demo-root"))
ROUNDS = int(os.environ.get("BENCH_LAUNCH_ROUNDS", 3))
STEPS = 4
CONFIG = REPO / "configs/train/debug/stage1.toml"


def machine_cpu_s() -> float:
    """CPU seconds the machine has spent busy (user, nice, system, irq, softirq, steal) since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def launch(how: str, run: str) -> tuple[float, float]:
    """One 2-rank launch: (machine CPU-s, wall s)."""
    args = [str(CONFIG), "--root", str(ROOT), f"--run.name={run}", f"--run.max_steps={STEPS}"]
    args += ["--log.wandb_mode=disabled", "--checkpoint.every=0"]
    if how == "reelcache":
        cmd = [sys.executable, "-m", "reelcache", "train", *args, "--nproc", "2"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "reelcache.train", *args]
    shutil.rmtree(ROOT / "runs" / run, ignore_errors=True)
    c0, t0 = machine_cpu_s(), time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.monotonic() - t0
    time.sleep(0.5)  # a forked rank may end a moment after its launcher
    cpu = machine_cpu_s() - c0
    shutil.rmtree(ROOT / "runs" / run, ignore_errors=True)
    if p.returncode != 0:
        sys.exit(f"{how} launch failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return cpu, wall


def main() -> None:
    if not (ROOT / "latents/tiny/cache.json").exists():
        sys.exit(f"no demo cache at {ROOT}: run `make demo` first")
    got: dict[str, list[tuple[float, float]]] = {"torchrun": [], "reelcache": []}
    for i in range(ROUNDS):
        for how in ("torchrun", "reelcache") if i % 2 == 0 else ("reelcache", "torchrun"):
            cpu, wall = launch(how, f"bench-launch-{how}")
            got[how].append((cpu, wall))
            print(f"round {i + 1}/{ROUNDS} {how:>9}: {cpu:5.1f} CPU-s, {wall:5.1f} s wall", flush=True)
    med = {how: [statistics.median(v[k] for v in got[how]) for k in (0, 1)] for how in got}
    (tc, tw), (rc, rw) = med["torchrun"], med["reelcache"]
    print(
        f"2 ranks, {STEPS} steps of the debug stage, median of {ROUNDS}: torchrun {tc:.1f} CPU-s {tw:.1f} s wall; "
        f"reelcache train --nproc 2 {rc:.1f} CPU-s {rw:.1f} s wall: {rc / tc:.2f}x the CPU, {rw / tw:.2f}x the wall"
    )


if __name__ == "__main__":
    main()
