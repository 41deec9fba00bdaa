"""The GPU headline, on paper: training from reelcache's latent cache vs Open-Sora's online encode, per H100.

No GPU, no real memory: each model is built on the meta device from its real configuration (bench/meta_flops.py), and
torch's FlopCounterMode counts its matmuls, convolutions and attention (norms, softmax, elementwise
ops are left out: well under 1% here). Per sample, at base/buckets.py's buckets (Open-Sora 1.2's
sizes for H:W = 9:16, key "0.56" at 144p-1080p, "0.57" at 256-2048; a resolution is a pixel budget,
so other aspect ratios cost about the same):
- DiT step: STDiT3-XL/2 as configs/train/opensora12/stage*.toml build it (frozen y_embedder, gradient
  checkpointing; 300 T5-XXL caption tokens of 4096) with a real .backward() on meta: forward +
  backward + the checkpointed blocks' recompute, about 4x the forward. Depth-1 and depth-2 models
  are counted and extrapolated to 28 identical block pairs (exact); the cross-check runs all 28.
- VAE encode: cache/opensora_vae.py at its published sizes, Open-Sora's path: every frame through
  the SDXL encoder, then 17-frame chunks through the temporal encoder (17 frames -> 5 latents).
- T5-v1.1-XXL encoder (transformers, from a T5Config, 4.7B parameters): one caption, 300 tokens.
Time = FLOPs / (MFU x peak), per part. Stages: the replication as OPENSORA12.md:232-234 records it.
- GPU-hours = steps x 192 H100 x the mean micro-batch time over the table's video buckets. Open-Sora
  tuned batch sizes for equal step time (DATASETS.md:32), so the unknown bucket mix matters only as
  far as micro-batch FLOPs differ (printed). Image buckets are left out: the data are videos.
- Samples = epochs x clips: each table's first stage (1, 2, 3) ran 5 full epochs over 1M clips
  (1.33M from stage 3 on); later stages on that table keep its samples per step.
- Cached: the DiT step only; the cache is encoded once per table (at stages 1, 2, 3) for all 1.33M
  clips and reused by stages 4-7. Online: DiT + VAE + T5 for every sample of every step (Open-Sora).
- Reported numbers come from the docs, else "n/a". "upstream" is derived: Open-Sora's step times
  ("12s/it", "20s/it") x steps x 192; over stages 1-6 it sums to about the reported 28k H100-hours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: meta_flops, when loaded by path
from meta_flops import (  # noqa: E402, F401 (T5XXL and count: re-exported for bench/gpu_parts.py)
    CAPTION,
    REPO,
    T5XXL,
    build_dit,
    build_vae,
    count,
    dit_extrapolated,
    dit_step,
    stage_config,
    t5_encode,
    vae_encode,
)

AR, PARTS = (9, 16), ("dit", "vae", "t5")  # AR: (H, W) of the clip whose bucket is counted
GPUS = 192  # OPENSORA12.md:234 "Hardware: 192 H100 (24×8)"
CLIPS = 1_330_000  # DATASETS.md:5 OpenVid-1M "~1M clips" + DATASETS.md:12 MiraData "330k clips"
# Final global step per stage, from the tutorial's checkpoint chain (OPENSORA12.md:232). Stage 7 did
# not run there: None = its epochs x stage 3's steps per epoch (same B3 table, same data).
STEPS = {1: 2210, 2: 7099, 3: 14778, 4: 2100, 5: 3300, 6: 2900, 7: None}
# Each table's first stage, and the clips in one epoch of it: OpenVid1M.csv for stages 1-2,
# OpenVid1M-MiraData330k.csv from stage 3 on (OPENSORA12.md:234).
FIRST = {"B1": (1, 1_000_000), "B2": (2, 1_000_000), "B3": (3, CLIPS)}
# Open-Sora's step time per table: B1 "12s/it" (OPENSORA12.md:237), B2 "about 12 s/step in
# stages 1–2" (DATASETS.md:32), B3 "20s/it" (OPENSORA12.md:267).
STEP_S = {"B1": 12.0, "B2": 12.0, "B3": 20.0}
REPORTED_H = 28_000  # DESIGN.md:95 "the Open-Sora 1.2 replication at 28k H100-hours" (stages 1-6)


def project(args) -> dict:
    from reelcache.base.buckets import RESOLUTIONS, BucketConfig
    from reelcache.train.model import STDiT3Config

    batch = {
        tb: {
            f"{r}/{t}": b
            for r, t, _, _, b in BucketConfig.from_toml(REPO / f"configs/buckets/opensora12-stage{tb[1]}.toml").table
            if b > 0
        }
        for tb in FIRST
    }
    keys = sorted(
        {k for tb in batch.values() for k in tb if not args.buckets or k in args.buckets},
        key=lambda k: (RESOLUTIONS[k.split("/")[0]], int(k.split("/")[1])),
    )
    pair, vae, (t5, t5_params) = (build_dit(depth=1), build_dit(depth=2)), build_vae(), t5_encode()
    doc = stage_config(1)["model"]
    depth = STDiT3Config.preset(doc["preset"], **doc.get("overrides", {})).depth
    rows = _bucket_rows(keys, batch, args, depth, (pair, vae, t5))
    stages, total = {}, dict.fromkeys(("samples", "gpuh_cached", "gpuh_cache", "gpuh_online", "gpuh_upstream"), 0.0)
    for n in args.stages:
        s = _stage(n, rows, batch, args)
        if s is None:
            continue
        stages[n] = s
        for k in total if not s["estimated"] else ():
            total[k] += s[k]
    ran = [n for n in stages if not stages[n]["estimated"]]
    out = dict(
        buckets=rows,
        stages=stages,
        t5_params=t5_params,
        depth=depth,
        crosscheck=crosscheck(depth, rows) if args.check and rows else None,
    )
    if ran:
        total |= dict(
            stages=ran,
            ratio=total["gpuh_online"] / total["gpuh_cached"],
            ratio_with_cache=total["gpuh_online"] / (total["gpuh_cached"] + total["gpuh_cache"]),
            gpuh_reported=REPORTED_H if ran == list(range(1, 7)) else None,
        )
        label = "1-6" if total["gpuh_reported"] else ",".join(map(str, ran))
        out |= dict(
            total=total,
            headline=(
                f"headline: cached / online = {total['ratio']:.1f}x samples/s per H100 at MFU DiT "
                f"{args.mfu_dit:.2f} / VAE {args.mfu_vae:.2f} / T5 {args.mfu_t5:.2f} (stages {label}; "
                f"{total['ratio_with_cache']:.1f}x counting the one-time cache encode, "
                f"{total['gpuh_cache']:.0f} GPU-hours)"
            ),
        )
    return out


def _bucket_rows(keys: list[str], batch: dict, args, depth: int, models) -> dict:
    """Per bucket: its pixel and latent size, the FLOPs of a DiT training step (extrapolated from the
    depth-1 and depth-2 ``models``), a VAE encode and a T5 caption, and the seconds of a cached and of
    an online sample at the given MFUs."""
    from reelcache.base.buckets import bucket_hw, nearest_ratio
    from reelcache.cache.opensora_vae import latent_frames

    pair, vae, t5 = models
    rate = {p: getattr(args, f"mfu_{p}") * args.peak_tflops * 1e12 for p in PARTS}
    rows = {}
    for k in keys:
        res, frames = k.split("/")
        H, W = bucket_hw(res, nearest_ratio(*AR, res))
        geo = (latent_frames(int(frames)), H // 8, W // 8, H, W)
        fwd, step = dit_extrapolated(pair, depth, *geo)
        f = dict(dit=step, vae=vae_encode(vae, int(frames), H, W), t5=t5)
        rows[k] = dict(
            px=f"{H}x{W}",
            latent="x".join(map(str, geo[:3])),
            dit_fwd=fwd,
            **f,
            s_cached=f["dit"] / rate["dit"],
            s_online=sum(f[p] / rate[p] for p in PARTS),
            batch={tb: batch[tb].get(k) for tb in FIRST},
        )
    return rows


def _stage(n: int, rows: dict, batch: dict, args) -> dict | None:
    """One training stage's samples, GPU-hours (cached, online, upstream) and upstream MFU, from its
    bucket mix; None when none of its buckets is among the rows."""
    tb = "B" + Path(stage_config(n)["data"]["buckets"]).stem[-1]
    mix = [(rows[k], b) for k, b in batch[tb].items() if k in rows and not k.endswith("/1")]
    if not mix:
        return None
    first, clips = FIRST[tb]
    steps = STEPS[n] or round(stage_config(n)["run"]["epochs"] * STEPS[3] / stage_config(3)["run"]["epochs"])
    samples = steps * stage_config(first)["run"]["epochs"] * clips / STEPS[first]
    gpu_s = {p: steps * GPUS * sum(b * r[f"s_{p}"] for r, b in mix) / len(mix) for p in ("cached", "online")}
    gpu_s["upstream"] = steps * GPUS * STEP_S[tb]
    mb = [b * r["dit"] for r, b in mix]
    return dict(
        table=tb,
        steps=steps,
        estimated=STEPS[n] is None,
        samples=samples,
        **{f"sps_{p}": samples / v for p, v in gpu_s.items()},
        **{f"gpuh_{p}": v / 3600 for p, v in gpu_s.items()},
        gpuh_cache=CLIPS * (gpu_s["online"] - gpu_s["cached"]) / samples / 3600 if n == first else 0.0,
        gpuh_reported=None,
        dit_microbatch_vs_mean=(min(mb) * len(mb) / sum(mb), max(mb) * len(mb) / sum(mb)),
        upstream_mfu=sum(b * (r["dit"] + r["vae"] + r["t5"]) for r, b in mix)
        / len(mix)
        / STEP_S[tb]
        / (args.peak_tflops * 1e12),
    )


def crosscheck(depth: int, rows: dict) -> dict:
    """The full-depth model's forward on meta vs the extrapolation and train/model.py's flops_per_sample."""
    from reelcache.train import model

    key = "240p/51" if "240p/51" in rows else next(iter(rows))
    (t, h, w), (H, W) = (map(int, rows[key][f].split("x")) for f in ("latent", "px"))
    full = build_dit()
    fwd = dit_step(full, t, h, w, H, W, backward=False)[0]
    analytic = model.flops_per_sample(full.config, t, h, w, CAPTION) if hasattr(model, "flops_per_sample") else None
    return dict(bucket=key, meta_forward=fwd, extrapolated_forward=rows[key]["dit_fwd"], analytic=analytic)


def report(res: dict, args) -> str:
    T, st, tot = 1e12, res["stages"], res.get("total")
    out = [
        f"per sample, TFLOP (DiT step = fwd + bwd + checkpoint recompute; T5-XXL {res['t5_params'] / 1e9:.2f}B, "
        f"{CAPTION} tokens); online/cached: time per sample at the MFUs",
        f"{'bucket':9} {'pixels':>9} {'latent':>10} {'DiT fwd':>8} {'DiT step':>9} {'VAE':>7} {'T5':>5} "
        f"{'online/cached':>14}  batch B1/B2/B3",
    ]
    for k, r in res["buckets"].items():
        out.append(
            f"{k:9} {r['px']:>9} {r['latent']:>10} {r['dit_fwd'] / T:8.2f} {r['dit'] / T:9.2f} "
            f"{r['vae'] / T:7.2f} {r['t5'] / T:5.2f} {r['s_online'] / r['s_cached']:13.2f}x  "
            + "/".join(str(b or "-") for b in r["batch"].values())
        )

    def row(stage, steps, s, ratio, reported):
        sps = [f"{s[f'sps_{p}']:.2f}" if "table" in s else "" for p in ("cached", "online", "upstream")]
        gpuh = [s["gpuh_cached"], s["gpuh_cached"] + s["gpuh_cache"], s["gpuh_online"], s["gpuh_upstream"]]
        return (
            f"{stage:6}{s.get('table', ''):6}{steps:>7}{s['samples'] / 1e6:8.2f}M | {sps[0]:>7}{sps[1]:>7}"
            f"{ratio:6.2f}x{sps[2]:>9} | " + "".join(f"{v:7.0f}" for v in gpuh[:3]) + f"{gpuh[3]:9.0f}{reported:>9}"
        )

    if st:
        out += [
            "",
            f"per stage: {GPUS} H100 at {args.peak_tflops:.0f} TFLOP/s dense bf16 ('~' = steps estimated)",
            f"{'':36}{'samples/s per H100':^31}  {'GPU-hours':^38}".rstrip(),
            f"{'stage':6}{'table':6}{'steps':>7}{'samples':>9} | {'cached':>7}{'online':>7}{'ratio':>7}"
            f"{'upstream':>9} | {'cached':>7}{'+cache':>7}{'online':>7}{'upstream':>9}{'reported':>9}",
        ]
        out += [
            row(str(n), "~" * s["estimated"] + str(s["steps"]), s, s["sps_cached"] / s["sps_online"], "n/a")
            for n, s in st.items()
        ]
        if tot:
            label = "1-6" if tot["gpuh_reported"] else ",".join(map(str, tot["stages"]))
            out.append(row(label, "", tot, tot["ratio"], f"{REPORTED_H / 1e3:.0f}k" if tot["gpuh_reported"] else "n/a"))
        tables = {s["table"]: s for s in st.values()}
        spread = ", ".join(
            f"{tb} {s['dit_microbatch_vs_mean'][0]:.2f}-{s['dit_microbatch_vs_mean'][1]:.2f}"
            for tb, s in tables.items()
        )
        implied = ", ".join(f"{tb} {s['upstream_mfu']:.0%}" for tb, s in tables.items())
        out += textwrap.wrap(
            f"samples: epochs x clips of each table's first stage. upstream: Open-Sora's s/it x steps x {GPUS}. "
            "+cache: the one-time encode of all 1.33M clips into the table's cache. reported: the docs give 28k "
            "H100-hours for stages 1-6 (DESIGN.md:95), nothing per stage, and no Open-Sora samples/s per GPU (n/a). "
            f"Video micro-batches' DiT-step FLOPs over their mean: {spread}. Open-Sora's step times imply {implied} "
            "of H100 peak (online FLOPs).",
            120,
        )
    if c := res["crosscheck"]:
        analytic = (
            f"{c['analytic'] / T:.4f}: meta / analytic = {c['meta_forward'] / c['analytic']:.5f}"
            if c["analytic"]
            else "n/a (not defined)"
        )
        out.append(
            f"cross-check {c['bucket']} forward, TFLOP: full depth-{res['depth']} model on meta "
            f"{c['meta_forward'] / T:.4f}, extrapolated {c['extrapolated_forward'] / T:.4f}, "
            f"train/model.py flops_per_sample {analytic}"
        )
    return "\n".join(out + ([res["headline"]] if "headline" in res else []))


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--mfu-dit",
        type=float,
        default=0.40,
        help="DiT training step, recompute included: what "
        "well-tuned bf16 transformer training with flash attention reaches on H100 (35-45%%)",
    )
    p.add_argument(
        "--mfu-vae",
        type=float,
        default=0.30,
        help="VAE encode: convolutions separated by GroupNorm/SiLU "
        "passes and a single-head attention are more memory-bound than transformer GEMMs",
    )
    p.add_argument(
        "--mfu-t5",
        type=float,
        default=0.40,
        help="T5-XXL encode: inference GEMMs (4096 x 10240 over 300 tokens per caption), as large as the DiT's",
    )
    p.add_argument("--peak-tflops", type=float, default=989.0, help="H100 SXM dense bf16 peak, TFLOP/s")
    p.add_argument(
        "--stages",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(STEPS),
        help="comma-separated stages of configs/train/opensora12/",
    )
    p.add_argument(
        "--buckets",
        type=lambda s: s.split(","),
        default=None,
        help="only these buckets, e.g. 240p/51,360p/102 (quick runs; the stages' mixes shrink to them)",
    )
    p.add_argument(
        "--no-check", dest="check", action="store_false", help="skip the full-depth cross-check (check=%(default)s)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("BENCH_OUT", "bench-out")) / "gpu_projection.json",
        help="the JSON of every number printed",
    )
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    t0 = time.perf_counter()
    res = project(args)
    print(report(res, args))
    res |= dict(
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, seconds=time.perf_counter() - t0
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"({res['seconds']:.1f} s; {args.out})")
    return res


if __name__ == "__main__":
    main()
