"""bench/bench_gpu_projection.py: its meta-device FLOP counts against real CPU runs, and its main.

The real counts run the tiny STDiT3 with real tensors under FlopCounterMode, with SDPA forced onto
its math backend: torch's CPU flash-attention kernel has no FLOP formula, so the counter would miss
the attention there (about 6% of the tiny model), while on meta and on GPU it is counted.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from support import REPO

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gp():
    path = REPO / "bench" / "bench_gpu_projection.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_projection", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEO = (5, 8, 13, 64, 104)  # latent t, h, w (w = 13: the patch grid is padded) and pixels H, W


def real_cpu_counts(meta_model) -> tuple[int, int]:
    """(forward, training step) FLOPs of the same configuration built for real on CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from reelcache.train.model import STDiT3

    torch.manual_seed(0)
    model = STDiT3(meta_model.config).train()
    model.set_grad_checkpointing(meta_model.grad_checkpointing)
    cfg, (t, h, w, H, W) = model.config, GEO
    x, y = torch.randn(1, cfg.in_channels, t, h, w), torch.randn(1, 1, cfg.model_max_length, cfg.caption_channels)
    s, hh, ww = torch.rand(1) * 1000, torch.full((1,), float(H)), torch.full((1,), float(W))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(x, s, y, fps=torch.full((1,), 24.0), height=hh, width=ww)
        fwd = fc.get_total_flops()
        out[:, : cfg.in_channels].float().pow(2).mean().backward()
    return fwd, fc.get_total_flops()


@pytest.mark.slow
def test_meta_counts_match_a_real_cpu_run(gp):
    model = gp.build_dit("tiny")
    assert model.grad_checkpointing and not model.y_embedder.y_proj.fc1.weight.requires_grad  # as the stage configs
    meta_fwd, meta_step = gp.dit_step(model, *GEO)
    real_fwd, real_step = real_cpu_counts(model)
    assert meta_fwd == pytest.approx(real_fwd, rel=0.02)
    assert meta_step == pytest.approx(real_step, rel=0.02)
    assert 3.5 < meta_step / meta_fwd < 4.0  # forward + backward (~2x) + recompute of the checkpointed blocks


@pytest.mark.slow
def test_depth_extrapolation_is_exact(gp):
    full = gp.build_dit("tiny")
    pair = (gp.build_dit("tiny", depth=1), gp.build_dit("tiny", depth=2))
    for depth in (full.config.depth, 3):
        assert gp.dit_extrapolated(pair, depth, *GEO) == gp.dit_step(gp.build_dit("tiny", depth=depth), *GEO)


def test_vae_count_follows_encode_stages(gp):
    vae = gp.build_vae(tiny=True)
    with torch.no_grad(), torch.device("meta"):
        x = torch.empty(1, 3, 35, 64, 96, dtype=torch.bfloat16)  # two full 17-frame chunks and one frame
        whole = gp.count(lambda: vae.encode_stages(x))
    assert gp.vae_encode(vae, 35, 64, 96) == whole


@pytest.mark.slow
def test_main_prints_the_headline(gp, tmp_path, capsys):
    out = tmp_path / "gp.json"
    res = gp.main(["--buckets", "240p/51", "--stages", "1", "--no-check", "--out", str(out)])
    text = capsys.readouterr().out
    assert "headline: cached / online = " in text and "240p/51" in text
    row = res["buckets"]["240p/51"]
    assert row["latent"] == "15x30x53" and row["dit"] > 3.5 * row["dit_fwd"] and row["vae"] > 0
    assert json.loads(out.read_text())["stages"]["1"]["table"] == "B1"
    assert res["stages"][1]["sps_cached"] > res["stages"][1]["sps_online"]
