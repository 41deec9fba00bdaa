"""Cached latents are each pipeline's normalized posterior, for EVERY encoder kind.

Each video VAE is a real diffusers model with tiny sizes and latent statistics that are not 0/1,
saved to a folder and loaded the way a real run loads weights (``path``). The reference is the
diffusers model's OWN ``encode(x).latent_dist`` (loaded independently from the same folder) with
the normalization written out here as the kind's diffusers pipeline applies it before its
transformer; the log-variance transforms as logvar + 2 log(scale). T5 is compared with
transformers' ``T5EncoderModel`` run on each caption alone (no padding), the Open-Sora VAE with
its own stages (pinned to Open-Sora's outputs in test_opensora_vae.py) and the published constants.
Decoding (``VideoEncoder.decode``) is compared with diffusers' own pipeline code before ``vae.decode``.
Stored values are bf16: the tolerance is bf16 rounding (2^-8 relative), while a skipped or
wrong normalization moves values by 10-300%.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from opensora_fixtures import FIX

BF16 = dict(rtol=2**-8, atol=1e-6)


def frames(t=5, h=32, w=32, b=2, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (b, t, h, w, 3), dtype=np.uint8)


def as_input(f):
    return torch.from_numpy(f).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def per_channel(values):
    return torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1, 1)


# kind -> (diffusers class, tiny config with non-trivial statistics, buffers to set, normalization rule)
CASES = {
    # wan/pipeline_wan_i2v.py: (z - latents_mean) * (1 / latents_std)
    "wan": (
        "AutoencoderKLWan",
        dict(
            base_dim=16,
            z_dim=4,
            dim_mult=[1, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.5, -0.3, 0.2, 1.1],
            latents_std=[2.0, 0.6, 1.7, 0.4],
        ),
        {},
        lambda m, c, mean: (
            (mean - per_channel(c.latents_mean)) / per_channel(c.latents_std),
            1 / per_channel(c.latents_std),
        ),
    ),
    # ltx/pipeline_ltx.py: (z - vae.latents_mean) * scaling_factor / vae.latents_std, buffers not config
    "ltx": (
        "AutoencoderKLLTXVideo",
        dict(
            block_out_channels=(16, 32),
            decoder_block_out_channels=(16, 32),
            down_block_types=("LTXVideoDownBlock3D",) * 2,
            layers_per_block=(1, 1, 1),
            decoder_layers_per_block=(1, 1, 1),
            spatio_temporal_scaling=(True, False),
            decoder_spatio_temporal_scaling=(True, False),
            upsample_residual=(False, False),
            decoder_inject_noise=(False, False, False),
            upsample_factor=(1, 1),
            latent_channels=4,
            patch_size=4,
            patch_size_t=1,
            scaling_factor=0.8,
        ),
        {"latents_mean": [0.4, -0.6, 0.1, 0.9], "latents_std": [0.3, 1.9, 1.2, 0.7]},
        lambda m, c, mean: (
            (mean - m.latents_mean.view(1, -1, 1, 1, 1)) * c.scaling_factor / m.latents_std.view(1, -1, 1, 1, 1),
            c.scaling_factor / m.latents_std.view(1, -1, 1, 1, 1),
        ),
    ),
    # hunyuan_video/pipeline_hunyuan_video_image2video.py: z * scaling_factor
    "hunyuan": (
        "AutoencoderKLHunyuanVideo",
        dict(
            block_out_channels=(16, 32, 32),
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            norm_num_groups=4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            spatial_compression_ratio=4,
            temporal_compression_ratio=4,
            scaling_factor=0.476986,
        ),
        {},
        lambda m, c, mean: (mean * c.scaling_factor, torch.tensor(c.scaling_factor)),
    ),
    # cogvideo/pipeline_cogvideox_video2video.py: scaling_factor * z (its config's latents_mean/std unused)
    "cogvideox": (
        "AutoencoderKLCogVideoX",
        dict(
            block_out_channels=(16, 32),
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("CogVideoXDownBlock3D",) * 2,
            norm_num_groups=4,
            up_block_types=("CogVideoXUpBlock3D",) * 2,
            scaling_factor=0.7,
        ),
        {},
        lambda m, c, mean: (mean * c.scaling_factor, torch.tensor(c.scaling_factor)),
    ),
    # stable_diffusion_3/pipeline_stable_diffusion_3_img2img.py: (z - shift_factor) * scaling_factor
    "sd-per-frame": (
        "AutoencoderKL",
        dict(
            block_out_channels=(16, 32),
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2,
            norm_num_groups=4,
            up_block_types=("UpDecoderBlock2D",) * 2,
            scaling_factor=1.5305,
            shift_factor=0.0609,
        ),
        {},
        lambda m, c, mean: ((mean - c.shift_factor) * c.scaling_factor, torch.tensor(c.scaling_factor)),
    ),
    # stable_diffusion_xl/pipeline_stable_diffusion_xl_img2img.py: (z - latents_mean) * scaling_factor / latents_std
    "sd-per-frame-sdxl-stats": (
        "AutoencoderKL",
        dict(
            block_out_channels=(16, 32),
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2,
            norm_num_groups=4,
            up_block_types=("UpDecoderBlock2D",) * 2,
            scaling_factor=0.5,
            latents_mean=[0.2, -0.1, 0.3, -0.7],
            latents_std=[1.4, 0.5, 0.9, 2.2],
        ),
        {},
        lambda m, c, mean: (
            (mean - per_channel(c.latents_mean)) * c.scaling_factor / per_channel(c.latents_std),
            c.scaling_factor / per_channel(c.latents_std),
        ),
    ),
}


def posterior(vae, kind, x):
    """The diffusers VAE's own ``encode(x).latent_dist`` (mean, logvar); an image VAE sees each frame alone."""
    with torch.no_grad():
        if kind == "sd-per-frame":
            b, c, t, h, w = x.shape
            dist = vae.encode(x.transpose(1, 2).reshape(b * t, c, h, w)).latent_dist
            return tuple(v.reshape(b, t, *v.shape[1:]).transpose(1, 2) for v in (dist.mean, dist.logvar))
        dist = vae.encode(x).latent_dist
        return dist.mean, dist.logvar


def assert_normalized_posterior(got, vae, rule, x):
    mean, logvar = posterior(vae, kind_of(vae), x)
    want_mean, scale = rule(vae, vae.config, mean)
    want_logvar = logvar + 2 * torch.log(scale)
    assert got["mean"].dtype == torch.bfloat16 and got["mean"].shape == want_mean.shape
    torch.testing.assert_close(got["mean"].float(), want_mean, **BF16)
    torch.testing.assert_close(got["logvar"].float(), want_logvar.expand_as(logvar), **BF16)
    # the statistics matter here: without them the stored values would be far off
    assert (want_mean - mean).abs().max() > 0.05


def kind_of(vae) -> str:
    return {"AutoencoderKL": "sd-per-frame"}.get(type(vae).__name__, "video")


@pytest.mark.parametrize("case", list(CASES))
def test_video_latents_are_the_pipelines_normalized_posterior(case, tmp_path):
    import diffusers

    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.spec import EncoderSpec

    cls_name, config, buffers, rule = CASES[case]
    kind = "sd-per-frame" if case.startswith("sd-per-frame") else case
    torch.manual_seed(0)
    model = getattr(diffusers, cls_name)(**config)
    for name, values in buffers.items():
        getattr(model, name).copy_(torch.tensor(values))
    model.save_pretrained(tmp_path / "vae")

    enc = VideoEncoder(EncoderSpec(kind, path=str(tmp_path / "vae"), dtype="float32"))
    f = frames()
    ref = getattr(diffusers, cls_name).from_pretrained(tmp_path / "vae").eval()
    assert_normalized_posterior(enc.encode(f), ref, rule, as_input(f))


# The statistics each tiny VAE must carry, read from the VAE's own config (LTX: its buffers), so
# that a skipped normalization shows: a rule with a shift needs one that is not all 0, and no scale is 1.
TINY_STATS = {
    "wan": lambda m, c: (c.latents_mean, [1 / s for s in c.latents_std]),
    "ltx": lambda m, c: (m.latents_mean.tolist(), [c.scaling_factor / s for s in m.latents_std.tolist()]),
    "hunyuan": lambda m, c: ([], [c.scaling_factor]),
    "cogvideox": lambda m, c: ([], [c.scaling_factor]),
    "sd-per-frame": lambda m, c: ([c.shift_factor], [c.scaling_factor]),
}


@pytest.mark.parametrize("kind", list(TINY_STATS))
def test_tiny_configs_normalize_with_nontrivial_statistics(kind):
    """The tiny encoders (tests, the demo) store the pipeline's normalization of their own VAE's
    posterior, with statistics that are not 0/1 (read from the VAE's config and buffers)."""
    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.spec import EncoderSpec

    enc = VideoEncoder(EncoderSpec(kind, tiny=True, dtype="float32"))
    shift, scale = TINY_STATS[kind](enc.model, enc.model.config)
    assert (not shift or any(abs(s) > 1e-3 for s in shift)) and all(abs(s - 1) > 1e-3 for s in scale), (shift, scale)
    f = frames()
    assert_normalized_posterior(enc.encode(f), enc.model, CASES[kind][3], as_input(f))


def test_t5_stores_each_captions_own_hidden_states(tmp_path):
    from transformers import T5Config, T5EncoderModel

    from reelcache.cache.encoders import TextEncoder, tiny_tokenizer
    from reelcache.cache.spec import EncoderSpec

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    T5EncoderModel(
        T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0)
    ).save_pretrained(tmp_path / "t5")
    tok.save_pretrained(tmp_path / "t5")
    captions = ["a dog", "a red car drives through the city at night while the camera pans", "a dog"]
    got = TextEncoder(EncoderSpec("t5", path=str(tmp_path / "t5"), dtype="float32")).encode(captions)
    ref = T5EncoderModel.from_pretrained(tmp_path / "t5").eval()
    for caption, g in zip(captions, got):
        ids = tok([caption], return_tensors="pt").input_ids  # alone: every token is real
        with torch.no_grad():
            want = ref(input_ids=ids).last_hidden_state[0]
        assert g.dtype == torch.bfloat16 and g.shape == want.shape
        torch.testing.assert_close(g.float(), want, **BF16)
    assert len(got[0]) < len(got[1])


def test_opensora_encoder_stores_the_published_normalization():
    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.spec import EncoderSpec

    cfg = json.loads((FIX / "vae_config.json").read_text())
    spatial = {k: v for k, v in cfg["spatial_autoencoderkl_config"].items() if not k.startswith("_")}
    temporal = dict(filters=4, num_res_blocks=2, multipliers=[1, 2, 2, 4], temporal_down=[False, True, True], groups=2)
    enc = VideoEncoder(
        EncoderSpec(
            "opensora-v1.2",
            path=str(FIX / "vae_tiny.safetensors"),
            dtype="float32",
            extra={"spatial": spatial, "temporal": temporal},
        )
    )
    f = frames(t=18)
    got = enc.encode(f)
    with torch.no_grad():
        stages = enc.model.encode_stages(as_input(f))  # pinned to Open-Sora's outputs elsewhere
    shift, scale = per_channel([-0.10, 0.34, 0.27, 0.98]), per_channel([3.85, 2.32, 2.33, 3.06])
    assert got["mean"].shape == (2, 4, 6, 4, 4)
    torch.testing.assert_close(got["mean"].float(), (stages["temporal_mean"] - shift) / scale, **BF16)
    torch.testing.assert_close(got["logvar"].float(), stages["temporal_logvar"] - 2 * torch.log(scale), **BF16)


# -- decoding (VideoEncoder.decode, the inverse of encode) --------------------------------------------------


def assert_exported_like_the_pipeline(got, video):
    """`got` (uint8 [B, T, H, W, 3]) is what diffusers' pipelines export for the VAE output `video`
    ([B, 3, T, H, W] in [-1, 1]): ``VideoProcessor.postprocess_video(output_type="pil")``, i.e.
    (x * 0.5 + 0.5).clamp(0, 1) * 255, rounded. Exactly, except within 1e-3 of a rounding tie, where
    float order (ours (x + 1) * 127.5) may decide either way."""
    from diffusers.video_processor import VideoProcessor

    vp = VideoProcessor()
    want = np.stack(
        [np.stack([np.asarray(im) for im in clip]) for clip in vp.postprocess_video(video, output_type="pil")]
    )
    exact = vp.postprocess_video(video, output_type="np") * 255
    tie = np.abs(exact - np.floor(exact) - 0.5) < 1e-3
    got = got.numpy()
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got[~tie], want[~tie]), f"{np.mean(got != want):.1%} of values differ"
    assert np.abs(got.astype(int) - want).max() <= 1


def test_ltx_decode_equals_the_pipeline_denormalize_then_vae_decode():
    """VideoEncoder.decode(z') against diffusers' own LTXPipeline._denormalize_latents + vae.decode and
    its export to uint8 frames, and the round trip video -> cache normalization -> decode against
    decoding the raw posterior mean."""
    import torch
    from diffusers import LTXPipeline

    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.spec import EncoderSpec

    enc = VideoEncoder(EncoderSpec("ltx", tiny=True, dtype="float32"))
    vae = enc.model
    g = torch.Generator().manual_seed(0)
    zn = torch.randn((2, 4, 3, 4, 5), generator=g)
    raw = LTXPipeline._denormalize_latents(zn, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    with torch.no_grad():
        video = vae.decode(raw).sample
    got = enc.decode(zn, num_frames=5)
    assert got.shape == (2, 5, 32, 40, 3) and got.dtype == torch.uint8
    assert_exported_like_the_pipeline(got, video[:, :, :5])

    frames = torch.randint(0, 256, (1, 5, 32, 40, 3), dtype=torch.uint8, generator=g)
    x = frames.permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    stored = enc.encode(frames)["mean"]
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean
        exact = vae.decode(mean).sample
        video = vae.decode(
            LTXPipeline._denormalize_latents(
                stored.float(), vae.latents_mean, vae.latents_std, vae.config.scaling_factor
            )
        ).sample
    got = enc.decode(stored.float(), num_frames=5)
    assert_exported_like_the_pipeline(got, video)
    # the cache stores bf16: decoding it stays close to decoding the float posterior mean
    assert (got.float() / 127.5 - 1 - exact.permute(0, 2, 3, 4, 1).clamp(-1, 1)).abs().mean() < 1 / 127.5


def test_per_frame_decode_matches_the_sd3_pipeline_formula():
    """sd-per-frame: z = z' / scaling_factor + shift_factor (diffusers' SD3 pipeline before vae.decode),
    every frame decoded on its own and exported as the pipeline's image processor exports it."""
    import torch

    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.spec import EncoderSpec

    enc = VideoEncoder(EncoderSpec("sd-per-frame", tiny=True, dtype="float32"))
    vae = enc.model
    zn = torch.randn((1, 4, 3, 4, 4), generator=torch.Generator().manual_seed(1))
    got = enc.decode(zn, num_frames=3)
    with torch.no_grad():
        video = torch.stack(
            [vae.decode(zn[:, :, t] / vae.config.scaling_factor + vae.config.shift_factor).sample for t in range(3)],
            dim=2,
        )
    assert_exported_like_the_pipeline(got, video)
