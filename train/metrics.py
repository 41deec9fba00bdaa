"""A logged step's metrics row: throughput in samples and tokens, MFU, the weight norm, the buckets.

Ranks hold different buckets, so tokens and FLOPs are summed over every rank's own shapes (one
small all-gather of (bucket, samples, latent shape, caption length) per logged step). The
weight norm reads every parameter once. Both run only on logged steps (``log.every``); what they
cost per step on the debug model is measured by bench/bench_log.py (make bench;
docs/TRAIN.md, "Logging").
"""

from __future__ import annotations

import json
import math

import torch

from reelcache.train.model import STDiT3Config, flops_per_sample
from reelcache.train.step import StepResult

# Dense bf16 peak of the GPU, for MFU (FLOP/s). Unknown devices report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


@torch.no_grad()
def weight_norm(module: torch.nn.Module) -> float:
    params = [p.detach() for p in module.parameters()]
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(params))))


def metrics_row(
    par, module, model_cfg: STDiT3Config, out: StepResult, *, step_s: float, wait_s: float, peak: float | None
) -> dict:
    """A collective (every rank calls it on a logged step): the row's step-independent numbers."""
    ranks = par.gather_objects((out.bucket, out.local_samples, out.latent_shape, out.text_len))
    tokens = flops = 0.0
    hist: dict[str, int] = {}
    for bucket, n, (t, h, w), length in ranks:
        hist[bucket] = hist.get(bucket, 0) + 1
        tokens += n * t * math.ceil(h / 2) * math.ceil(w / 2)
        flops += 3 * flops_per_sample(model_cfg, t, h, w, length) * n
    return {
        "loss": out.loss,
        "lr": out.lr if out.lr is not None else float("nan"),
        "grad_norm": out.grad_norm,
        "weight_norm": weight_norm(module),
        "samples": out.samples,
        "samples_per_s": out.samples / step_s,
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "data_wait_s": wait_s,
        "data_share": wait_s / step_s,
        "mfu": flops / step_s / (peak * par.world) if peak else None,
        "buckets": json.dumps(hist, sort_keys=True),
        "skipped": out.skipped,
    }
