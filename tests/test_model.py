"""STDiT3 against Open-Sora 1.2's own outputs (../shared/fixtures/opensora12, README §1), plus
the properties the fixtures do not pin: trimmed captions, caption dropout, checkpointing, init,
and the weight loaders of train/weights.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reelcache.train.model import PRESETS, STDiT3, STDiT3Config, flops_per_sample

FIX = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "opensora12"
if not FIX.exists():  # checkouts outside /work
    FIX = Path("/work/shared/fixtures/opensora12")

pytestmark = pytest.mark.skipif(not (FIX / "stdit3_tiny.safetensors").exists(), reason="no Open-Sora fixtures")


def fixture_config() -> STDiT3Config:
    return STDiT3Config.from_open_sora(json.loads((FIX / "stdit3_config.json").read_text())["config"])


@pytest.fixture(scope="module")
def tiny():
    from safetensors.torch import load_file

    model = STDiT3(fixture_config()).eval()
    model.load_state_dict(load_file(FIX / "stdit3_tiny.safetensors"), strict=True)
    return model


@pytest.fixture(scope="module")
def cases():
    from safetensors.torch import load_file

    flat = load_file(FIX / "stdit3_cases.safetensors")
    out: dict[str, dict] = {}
    for key, value in flat.items():
        case, name = key.split(".", 1)
        out.setdefault(case, {})[name] = value
    return out


def test_fixture_config_is_the_tiny_preset():
    assert fixture_config() == PRESETS["tiny"]


@pytest.mark.parametrize("case", ["plain", "xmask", "oddsize"])
def test_reproduces_open_sora_outputs(tiny, cases, case):
    kw = dict(cases[case])
    ref = kw.pop("out")
    with torch.no_grad():
        out = tiny(**kw)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_trimmed_captions_equal_open_sora_layout(tiny, cases):
    """reelcache's loader gives (B, L, D) trimmed to the longest caption, zero padded."""
    kw = dict(cases["plain"])
    ref = kw.pop("out")
    lengths = kw["mask"].sum(1)
    longest = int(lengths.max())
    y = kw["y"][:, 0, :longest].clone()
    y[0, lengths[0]:] = 0.0
    kw.update(y=y, mask=kw["mask"][:, :longest])
    with torch.no_grad():
        out = tiny(**kw)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_padding_ignored_and_samples_independent(tiny, cases):
    kw = dict(cases["plain"])
    kw.pop("out")
    with torch.no_grad():
        base = tiny(**kw)
        y = kw["y"].clone()
        y[0, 0, 5:] = 100.0  # sample 0 has 5 valid tokens: change only its padding
        torch.testing.assert_close(tiny(**{**kw, "y": y}), base, atol=0, rtol=0)
        y[0, 0, 2] += 1.0  # a valid token of sample 0 changes sample 0 only
        out = tiny(**{**kw, "y": y})
    torch.testing.assert_close(out[1], base[1], atol=0, rtol=0)
    assert (out[0] - base[0]).abs().max() > 1e-3


def test_caption_drop_uses_null_embedding(tiny, cases):
    kw = dict(cases["plain"])
    kw.pop("out")
    null = tiny.y_embedder.y_embedding[: kw["y"].shape[2]]
    y_null = kw["y"].clone()
    y_null[0, 0] = null
    with torch.no_grad():
        dropped = tiny(**kw, caption_drop=torch.tensor([True, False]))
        manual = tiny(**{**kw, "y": y_null})
        base = tiny(**kw)
    torch.testing.assert_close(dropped, manual, atol=0, rtol=0)
    torch.testing.assert_close(dropped[1], base[1], atol=0, rtol=0)
    assert (dropped[0] - base[0]).abs().max() > 1e-3


def test_caption_without_valid_tokens_is_finite(tiny, cases):
    kw = dict(cases["plain"])
    kw.pop("out")
    mask = kw["mask"].clone()
    mask[0] = 0
    with torch.no_grad():
        out = tiny(**{**kw, "mask": mask})
    assert torch.isfinite(out).all()


def test_gradient_checkpointing_same_gradients(cases):
    from safetensors.torch import load_file

    kw = dict(cases["xmask"])
    kw.pop("out")
    grads = []
    for ckpt in (False, True):
        model = STDiT3(fixture_config()).train()
        model.load_state_dict(load_file(FIX / "stdit3_tiny.safetensors"))
        model.set_grad_checkpointing(ckpt)
        model(**kw)[:, :4].square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 80
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_fresh_init_as_open_sora():
    torch.manual_seed(0)
    model = STDiT3(STDiT3Config.preset("tiny")).eval()
    for blk in model.temporal_blocks:  # temporal blocks start as exact identities
        for lin in (blk.attn.proj, blk.cross_attn.proj, blk.mlp.fc2):
            assert lin.weight.abs().max() == 0 and lin.bias.abs().max() == 0
    assert model.fps_embedder.mlp[2].weight.abs().max() == 0
    assert model.rope.freqs.requires_grad is False
    torch.testing.assert_close(model.rope.freqs, 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    assert "y_embedder.y_embedding" in model.state_dict()
    assert not any(n == "y_embedder.y_embedding" for n, _ in model.named_parameters())
    # identity: the model with temporal blocks removed computes the same output
    b = 2
    kw = dict(x=torch.randn(b, 4, 3, 8, 8), timestep=torch.tensor([10.0, 900.0]), y=torch.randn(b, 16, 32),
              mask=torch.ones(b, 16, dtype=torch.long), fps=torch.tensor([24.0, 24.0]),
              height=torch.tensor([64.0, 64.0]), width=torch.tensor([64.0, 64.0]))
    with torch.no_grad():
        full = model(**kw)
        for blk in model.temporal_blocks:
            blk.forward = lambda x, *a: x
        spatial_only = model(**kw)
    torch.testing.assert_close(full, spatial_only, atol=0, rtol=0)


def test_freeze_flags():
    m = STDiT3(STDiT3Config.preset("tiny", freeze_y_embedder=True))
    assert not any(p.requires_grad for p in m.y_embedder.parameters())
    assert m.t_block[1].weight.requires_grad
    m = STDiT3(STDiT3Config.preset("tiny", only_train_temporal=True))
    trainable = {n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {"temporal_blocks"}


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        STDiT3Config(hidden_size=100, num_heads=16)
    with pytest.raises(ValueError, match="drop_path"):
        STDiT3Config(drop_path=0.1)
    with pytest.raises(ValueError, match="unknown STDiT3 preset"):
        STDiT3Config.preset("STDiT3-XXL")


@pytest.mark.parametrize("name, total", [("STDiT3-XL/2", 1_207_643_936), ("STDiT3-3B/2", 3_182_211_536)])
def test_parameter_count_on_meta(name, total):
    with torch.device("meta"):
        model = STDiT3(STDiT3Config.preset(name))
    trainable = sum(p.numel() for n, p in model.named_parameters() if n != "rope.freqs")
    assert trainable == total
    assert model.rope.freqs.numel() == 36  # head_dim 72 in both
    if name == "STDiT3-XL/2":
        with torch.device("meta"):
            frozen = STDiT3(STDiT3Config.preset(name, freeze_y_embedder=True))
        assert sum(p.numel() for p in frozen.parameters() if p.requires_grad) == 1_201_595_936


def test_flops_formula_matches_torch_flop_counter():
    """Independent count: torch's FlopCounterMode over the real forward (math SDPA so attention
    matmuls are visible). It also counts the timestep/fps embedders, which the formula omits."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = STDiT3Config.preset("tiny")
    model = STDiT3(cfg).eval()
    t, h, w, length = 5, 8, 11, 16
    kw = dict(x=torch.randn(1, 4, t, h, w), timestep=torch.tensor([500.0]), y=torch.randn(1, length, 32),
              mask=torch.ones(1, length, dtype=torch.long), fps=torch.tensor([24.0]),
              height=torch.tensor([64.0]), width=torch.tensor([88.0]))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**kw)
    c = cfg.hidden_size
    embedders = 2 * (2 * 256 * c + 2 * c * c) + 2 * c * 6 * c  # t, fps, t_block
    assert counter.get_total_flops() == pytest.approx(flops_per_sample(cfg, t, h, w, length) + embedders, rel=1e-9)
