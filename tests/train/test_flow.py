"""Rectified flow against Open-Sora 1.2's own numbers (tests/fixtures/opensora12, README §2),
and the sampler and mask generator properties."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from opensora_fixtures import FIX

from reelcache.train.flow import (
    MASK_NAMES,
    Conditioning,
    MaskGenerator,
    add_noise,
    euler_sample,
    sample_timesteps,
    timestep_transform,
    training_losses,
)
from reelcache.train.model import STDiT3, STDiT3Config
from reelcache.train.sections import ConditioningConfig

STAGE1 = {
    "random": 0.05,
    "intepolate": 0.005,
    "quarter_random": 0.005,
    "quarter_head": 0.005,
    "quarter_tail": 0.005,
    "quarter_head_tail": 0.005,
    "image_random": 0.025,
    "image_head": 0.05,
    "image_tail": 0.025,
    "image_head_tail": 0.025,
}


@pytest.fixture(scope="module")
def tiny():
    from safetensors.torch import load_file

    cfg = STDiT3Config.from_open_sora(json.loads((FIX / "stdit3_config.json").read_text())["config"])
    model = STDiT3(cfg).eval()
    model.load_state_dict(load_file(FIX / "stdit3_tiny.safetensors"), strict=True)
    return model


@pytest.fixture(scope="module")
def rf():
    from safetensors.torch import load_file

    return load_file(FIX / "rflow_cases.safetensors")


def test_timestep_transform_table():
    table = json.loads((FIX / "rflow_timestep_transform.json").read_text())
    for row in table["rows"]:
        n = len(row["t_in"])
        out = timestep_transform(
            torch.tensor(row["t_in"]),
            torch.full((n,), float(row["height"])),
            torch.full((n,), float(row["width"])),
            torch.full((n,), float(row["num_frames"])),
        )
        ref = torch.tensor([float("nan") if v is None else v for v in row["t_out"]])
        torch.testing.assert_close(out, ref, atol=0, rtol=0, equal_nan=True, msg=str(row))


def test_losses_and_intermediates(tiny, rf):
    t = timestep_transform(rf["t_raw"], rf["height"], rf["width"], rf["num_frames"])
    torch.testing.assert_close(t, rf["t"], atol=0, rtol=1e-6)
    kwargs = {k: rf[k] for k in ("y", "mask", "fps", "height", "width", "num_frames")}
    for case, x_mask in (("loss_nomask", None), ("loss_xmask", rf["x_mask"])):
        seen = {}

        def recording(x_t, t, seen=seen, **kw):  # the real model, with its input and output kept
            seen["x_t"], seen["out"] = x_t, tiny(x_t, t, **kw)
            return seen["out"]

        with torch.no_grad():
            loss = training_losses(recording, rf["x_start"], kwargs, rf["noise"], rf["t"], x_mask=x_mask)
        torch.testing.assert_close(loss, rf[f"{case}.loss"], atol=0, rtol=1e-5)
        torch.testing.assert_close(seen["x_t"], rf[f"{case}.x_t"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(seen["out"], rf[f"{case}.model_out"], atol=1e-4, rtol=1e-4)
    # sample 1's mask is all True: its masked loss is the plain loss
    torch.testing.assert_close(rf["loss_xmask.loss"][1], rf["loss_nomask.loss"][1])


def test_add_noise_endpoints():
    x0, eps = torch.randn(3, 4, 2, 4, 4), torch.randn(3, 4, 2, 4, 4)
    out = add_noise(x0, eps, torch.tensor([0.0, 1000.0, 250.0]))
    torch.testing.assert_close(out[0], x0[0])
    torch.testing.assert_close(out[1], eps[1])
    torch.testing.assert_close(out[2], 0.75 * x0[2] + 0.25 * eps[2])


def test_logit_normal_timesteps():
    t = sample_timesteps(200_000, torch.Generator().manual_seed(0))
    assert t.min() >= 0 and t.max() < 1000
    assert abs(t.mean().item() - 500) < 3 and abs(t.median().item() - 500) < 3
    # sigmoid(N(0,1)): P(t < 1000 * sigmoid(1)) = Phi(1) = 0.8413
    assert abs((t < 1000 * torch.sigmoid(torch.tensor(1.0))).float().mean().item() - 0.8413) < 0.005
    again = sample_timesteps(200_000, torch.Generator().manual_seed(0))
    assert torch.equal(t, again)
    u = sample_timesteps(100_000, torch.Generator().manual_seed(1), method="uniform")
    assert abs(u.mean().item() - 500) < 5 and abs((u < 100).float().mean().item() - 0.1) < 0.005
    with pytest.raises(ValueError, match="sampling method"):
        sample_timesteps(3, method="normal")


def test_mask_generator_validation():
    assert MaskGenerator(STAGE1).ratios["identity"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="unknown mask names"):
        MaskGenerator({"interpolate": 0.1})
    with pytest.raises(ValueError, match="sum to 1"):
        MaskGenerator({"identity": 0.5, "random": 0.1})
    with pytest.raises(ValueError, match="> 1"):
        MaskGenerator({"random": 0.7, "image_head": 0.6})


@pytest.mark.parametrize("make_gen", [lambda s: np.random.default_rng(s), lambda s: torch.Generator().manual_seed(s)])
def test_mask_generator_ratios_and_shapes(make_gen):
    gen = MaskGenerator(STAGE1)
    t = 15
    from reelcache.train.flow import Draw

    draw = Draw(make_gen(0))
    counts = dict.fromkeys(MASK_NAMES, 0)
    n = 20_000
    for _ in range(n):
        name, m = gen.get_mask(t, draw)
        counts[name] += 1
        assert m.dtype == torch.bool and m.shape == (t,) and m.any()
        off = (~m).nonzero().flatten().tolist()
        if name == "identity":
            assert not off
        elif name == "image_head":
            assert off == [0]
        elif name == "image_tail":
            assert off == [t - 1]
        elif name == "image_head_tail":
            assert off == [0, t - 1]
        elif name == "image_random":
            assert len(off) == 1
        elif name == "quarter_head":
            assert 1 <= len(off) <= t // 4 and off == list(range(len(off)))
        elif name == "quarter_tail":
            assert 1 <= len(off) <= t // 4 and off == list(range(t - len(off), t))
        elif name == "quarter_random":
            assert 1 <= len(off) <= t // 4 and off == list(range(off[0], off[0] + len(off)))
        elif name == "intepolate":
            assert off in (list(range(0, t, 2)), list(range(1, t, 2)))
    for name, p in gen.ratios.items():
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(counts[name] / n - p) < 5 * sigma + 1e-9, (name, counts[name] / n, p)

    masks = gen.get_masks(64, t, make_gen(7))
    assert masks.shape == (64, t) and masks.dtype == torch.bool
    assert torch.equal(masks, gen.get_masks(64, t, make_gen(7)))  # deterministic per generator state
    assert gen.get_masks(4, 1, make_gen(0)).all()  # one latent frame: nothing to condition on
    assert MaskGenerator({}).get_masks(8, t, make_gen(0)).all()  # identity only


def _sampler_inputs(model):
    g = torch.Generator().manual_seed(3)
    b, length = 2, 9
    mask = torch.zeros(b, length, dtype=torch.long)
    mask[0, :4] = 1
    mask[1, :] = 1
    return dict(
        z=torch.randn(b, 4, 5, 8, 12, generator=g),
        y=torch.randn(b, length, 32, generator=g),
        mask=mask,
        height=[64.0, 64.0],
        width=[96.0, 96.0],
        num_frames=[17.0, 17.0],
        fps=[24.0, 24.0],
    )


def test_sampler_first_and_last_steps_are_euler_updates(tiny):
    inp = _sampler_inputs(tiny)
    calls = []

    def recording(x, t, **kw):
        calls.append((x.clone(), t.clone()))
        return tiny(x, t, **kw)

    steps, s = 4, 7.0
    b = inp["z"].shape[0]
    null = tiny.y_embedder.y_embedding[:9][None].expand(b, -1, -1)
    z = euler_sample(recording, **inp, null_y=null, steps=steps, cfg_scale=s)
    assert len(calls) == steps
    torch.testing.assert_close(z, euler_sample(tiny, **inp, steps=steps, cfg_scale=s), atol=0, rtol=0)
    hw = dict(height=torch.tensor(inp["height"]), width=torch.tensor(inp["width"]), fps=torch.tensor(inp["fps"]))
    ts = [
        timestep_transform(
            torch.full((b,), 1000.0 * (1 - i / steps)), hw["height"], hw["width"], torch.tensor(inp["num_frames"])
        )
        for i in range(steps)
    ]
    with torch.no_grad():
        v_c = tiny(inp["z"], ts[0], y=inp["y"], mask=inp["mask"], **hw)[:, :4]
        v_u = tiny(inp["z"], ts[0], y=null, mask=inp["mask"], **hw)[:, :4]
    z1 = inp["z"] + (v_u + s * (v_c - v_u)) * ((ts[0] - ts[1]) / 1000)[:, None, None, None, None]
    torch.testing.assert_close(calls[0][1], torch.cat([ts[0], ts[0]]))
    torch.testing.assert_close(calls[1][0][:b], z1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(calls[1][0][b:], z1, atol=1e-5, rtol=1e-5)
    zl, tl = calls[-1][0][:b], ts[-1]
    with torch.no_grad():
        v_c = tiny(zl, tl, y=inp["y"], mask=inp["mask"], **hw)[:, :4]
        v_u = tiny(zl, tl, y=null, mask=inp["mask"], **hw)[:, :4]
    torch.testing.assert_close(
        z, zl + (v_u + s * (v_c - v_u)) * (tl / 1000)[:, None, None, None, None], atol=1e-5, rtol=1e-5
    )


def test_sampler_cfg_one_equals_unguided_and_holds_condition_frames(tiny):
    inp = _sampler_inputs(tiny)
    guided = euler_sample(tiny, **inp, steps=3, cfg_scale=1.0)
    plain = euler_sample(tiny, **inp, steps=3, cfg_scale=None)
    torch.testing.assert_close(guided, plain, atol=1e-5, rtol=1e-5)
    assert (guided - inp["z"]).abs().max() > 0.1
    x_mask = torch.tensor([[False, True, True, True, True], [True, True, True, True, False]])
    z = euler_sample(tiny, **inp, steps=3, cfg_scale=4.0, x_mask=x_mask)
    assert torch.equal(z[0, :, 0], inp["z"][0, :, 0]) and torch.equal(z[1, :, 4], inp["z"][1, :, 4])
    assert (z[0, :, 1] - inp["z"][0, :, 1]).abs().max() > 0.1


def test_image_fps_replaces_an_image_buckets_fps_only():
    nan = float("nan")
    image, video = "144p/1/0.56", "144p/17/0.56"
    assert Conditioning(ConditioningConfig(24.0), frame_interval=1)(image, [nan, 25.0])["fps"].tolist() == [
        24.0,
        25.0,
    ]  # default: as videos
    assert Conditioning(ConditioningConfig(24.0, image_fps=120.0), frame_interval=2)(image, [nan, 25.0])[
        "fps"
    ].tolist() == [120.0, 120.0]
    assert Conditioning(ConditioningConfig(24.0, image_fps=120.0), frame_interval=1)(video, [nan, 25.0])[
        "fps"
    ].tolist() == [24.0, 25.0]
    assert Conditioning(ConditioningConfig(24.0, image_fps=120.0), frame_interval=2)(video, [30.0])["fps"].tolist() == [
        15.0
    ]


def test_conditioning_gives_the_buckets_pixel_size_and_the_sampler_its_own():
    """A bucket's inputs are its pixel geometry (144p 9:16 = 144 x 256, 17 frames), fps floored by the frame
    interval (30000/1001 / 2 = 14.98 -> 14); the sampler's are the sizes and fps it asks for, as given."""
    got = ConditioningConfig().build(frame_interval=2)("144p/17/0.56", [30000 / 1001, float("nan")])
    want = {"fps": [14.0, 12.0], "height": [144.0] * 2, "width": [256.0] * 2, "num_frames": [17.0] * 2}
    assert {k: v.tolist() for k, v in got.items()} == want and all(v.dtype == torch.float32 for v in got.values())
    sampled = Conditioning.inputs(3, 102, 360, 640, 24.0)
    assert {k: v.tolist() for k, v in sampled.items()} == {
        "fps": [24.0] * 3,
        "height": [360.0] * 3,
        "width": [640.0] * 3,
        "num_frames": [102.0] * 3,
    }
