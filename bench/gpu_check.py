"""make gpu-check: the real-size GPU paths measured on one GPU, within a wall-clock budget (8 minutes).

    python bench/gpu_check.py [OUT]            # one GPU: STDiT3-XL/2, the Open-Sora 1.2 VAE, T5-XXL
    python bench/gpu_check.py --tiny [OUT]     # CPU, toy sizes, the same code (tests/bench/test_gpu_check.py)

Parts (bench/gpu_parts.py, bench/gpu_train.py say what each measures): versions, kernels (HybridAdam's,
built by ColossalAI's loaders in a thread while the encoders run), vae, t5, train, online (cached vs
online, interleaved), loader, projection. Each runs in its own try: the table says for each "ran",
"skipped: why" or "failed: error", and is rewritten after every part (OUT/gpu_check.md and .json), so
a crash or a kill loses only the part that was running. A part that needs more time than is left is
skipped, and says so. Random weights; nothing is downloaded. README ("GPU check") has the device
command that installs the carried wheels (bench/gpu_wheels.py) and runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0
PARTS = ("versions", "vae", "t5", "kernels", "train", "online", "loader", "projection")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", type=Path, default=Path(os.environ.get("BENCH_OUT", "bench-out")))
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU, the same code (the test suite's run)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget of the whole check")
    p.add_argument("--parts", default="", help="comma-separated parts to run (default: all)")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error(f"--budget-s {args.budget_s}: give seconds > 0")
    args.parts = [x for x in args.parts.split(",") if x] or list(PARTS)
    if unknown := sorted(set(args.parts) - set(PARTS)):
        p.error(f"--parts: unknown {unknown}; known: {', '.join(PARTS)}")
    return args


class Table:
    """Rows of (part, bucket, status, numbers), written as markdown and JSON after every part."""

    def __init__(self, out: Path, head: dict):
        self.out, self.head, self.rows, self.errors = out, head, [], {}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, part: str, rows: list[dict], status: str = "ran", seconds: float = 0.0) -> None:
        for r in rows or [{"bucket": "", "numbers": {}}]:
            self.rows.append({"part": part, "bucket": r["bucket"], "status": r.get("status", status),
                              "seconds": round(seconds, 1), "numbers": r["numbers"]})  # fmt: skip

    def markdown(self) -> str:
        h = self.head
        lines = [
            f"GPU check ({h['profile']}): {h.get('device', '?')}, torch {h.get('torch', '?')}, "
            f"budget {h['budget_s']:.0f} s, {h.get('elapsed_s', 0):.0f} s used",
            "",
            "| part | bucket | status | s | result |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in self.rows:
            nums = ", ".join(f"{k} {fmt(v)}" for k, v in r["numbers"].items() if k != "ratio")
            lines.append(f"| {r['part']} | {r['bucket']} | {r['status']} | {r['seconds']} | {nums} |")
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        (self.out / "gpu_check.md").write_text(self.markdown())
        doc = {**self.head, "rows": self.rows, "errors": self.errors}
        (self.out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))


def fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} {fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def main(argv=None) -> int:
    args = parse(argv)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    sys.path.insert(0, str(Path(__file__).parent))  # bench/ modules (interleave, the projection)
    os.environ.setdefault("REELCACHE_PROGRESS", "0")
    if args.tiny:
        os.environ["REELCACHE_DEVICE"] = "cpu"  # Parallel.setup: the CPU ZeRO mode, never a GPU

    import gpu_parts as gp

    origin = gp.bootstrap()
    import gpu_train as gt
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    profile = gp.tiny() if args.tiny else gp.full()
    head = {"profile": profile.name, "budget_s": args.budget_s, "torch": torch.__version__, "reelcache": origin,
            "device": torch.cuda.get_device_name(0) if cuda else "CPU"}  # fmt: skip
    table = Table(args.out, head)
    if not cuda and not args.tiny:
        print("gpu-check: no CUDA device here; the real sizes need one (--tiny runs the toy sizes on the CPU)")
    ctx = gp.Ctx(profile, device, deadline)
    chosen = set(args.parts) if cuda or args.tiny else {"versions"}  # the rest say "skipped: no CUDA device"
    if chosen - {"versions"}:
        ctx.count_flops()  # in a process of its own, before ColossalAI is imported here (see Ctx.count_flops)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    parts = [  # (name, function, seconds it needs at least; None: runs whatever is left)
        ("versions", gp.versions, None),
        ("vae", gp.vae, 30),
        ("t5", gp.t5, 30),
        ("kernels", gt.kernels, None),
        ("train", gt.train, 60),
        ("online", gt.online, 60),
        ("loader", gt.loader, 30),
        ("projection", gt.projection, 5),
    ]
    assert [n for n, *_ in parts] == list(PARTS)
    if chosen & {"kernels", "train", "online", "loader"}:
        try:
            gt.quiet_colossalai()
            gt.start_kernels(ctx)
        except Exception:  # the parts that need ColossalAI fail and say why; the others run
            table.errors["colossalai"] = traceback.format_exc()
            print(table.errors["colossalai"], file=sys.stderr)
    for name, fn, need in parts:
        if name not in args.parts:
            continue
        _run_part(table, ctx, name, fn, need, chosen, cuda)
        ctx.fill_mfu(wait=False)
        table.head["elapsed_s"] = time.monotonic() - t_start
        table.write()
    if ctx.kernels is not None and ctx.kernels.is_alive():  # let a rerun on this machine load them
        ctx.kernels.join(timeout=max(0.0, ctx.left()))
        late = "ran (after the training parts)" if not ctx.kernels.is_alive() else "failed: still compiling at the end"
        table.add("kernels", [{"bucket": "", "numbers": dict(ctx.kernel_result)}], late)
    ctx.fill_mfu(wait=True)
    table.write()
    ctx.close()
    print(table.markdown())
    print(f"gpu-check: {args.out / 'gpu_check.md'}, {args.out / 'gpu_check.json'}")
    return 0


def _run_part(table, ctx, name: str, fn, need: float | None, chosen: set, cuda: bool) -> None:
    """One part into the table: skipped (not chosen here, or too little of the budget left), its rows,
    or failed with its first line (the traceback in table.errors and on stderr); the rest still runs."""
    import gpu_parts as gp
    import torch

    t0 = time.monotonic()
    if name not in chosen:
        table.add(name, [], "skipped: no CUDA device")
    elif need is not None and ctx.left() < need:
        table.add(name, [], f"skipped: {ctx.left():.0f} s of the budget left, needs {need}")
    else:
        print(f"gpu-check: {name} ({ctx.left():.0f} s left)", flush=True)
        try:
            table.add(name, fn(ctx), seconds=time.monotonic() - t0)
        except gp.Skip as e:
            table.add(name, [], f"skipped: {e}")
        except Exception as e:  # the table says which part failed; the rest still runs
            first = str(e).splitlines()[0][:200] if str(e) else ""
            table.add(name, [], f"failed: {type(e).__name__}: {first}", seconds=time.monotonic() - t0)
            table.errors[name] = traceback.format_exc()
            print(table.errors[name], file=sys.stderr)
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
