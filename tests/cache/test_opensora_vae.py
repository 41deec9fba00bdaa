"""cache/opensora_vae.py against Open-Sora 1.2's own outputs (tests/fixtures/opensora12/vae_*).

The fixtures were made by the fork's own VideoAutoencoderPipeline on a tiny seeded config
(README.md there, section 3): we build our modules from the same sizes, load the same state dict
strictly by the upstream key names, feed the stored video and compare every stage with the
README's tolerances (latents 1e-5, decoded video 1e-4).
"""

from __future__ import annotations

import json

import pytest
import torch
from opensora_fixtures import FIX

LAT = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def upstream():
    from safetensors.torch import load_file

    from reelcache.cache.opensora_vae import OpenSoraVAE

    cfg = json.loads((FIX / "vae_config.json").read_text())
    spatial = {k: v for k, v in cfg["spatial_autoencoderkl_config"].items() if not k.startswith("_")}
    t = cfg["pipeline"]["vae_temporal"]
    assert (t["in_out_channels"], t["latent_embed_dim"], t["embed_dim"], t["activation_fn"]) == (4, 4, 4, "swish")
    temporal = dict(
        filters=t["filters"],
        num_res_blocks=t["num_res_blocks"],
        multipliers=tuple(t["channel_multipliers"]),
        temporal_down=tuple(t["temporal_downsample"]),
        groups=t["num_groups"],
    )
    assert cfg["pipeline"]["micro_frame_size"] == 17 and cfg["spatial_scaling_factor_used"] == 0.18215
    state = load_file(str(FIX / "vae_tiny.safetensors"))
    model = OpenSoraVAE(spatial=spatial, temporal=temporal).eval()
    model.load_upstream(state, source="vae_tiny.safetensors")  # strict: every key consumed
    return model, state, load_file(str(FIX / "vae_cases.safetensors"))


@pytest.mark.slow
def test_mode_path_matches_every_stage(upstream):
    model, _, case = upstream
    with torch.no_grad():
        got = model.encode_stages(case["video"])
    for k in ("spatial_mean", "spatial_logvar", "x_z", "temporal_mean", "temporal_logvar", "z"):
        torch.testing.assert_close(got[k], case[f"mode.{k}"], **LAT, msg=lambda m, k=k: f"mode.{k}: {m}")
    mean, logvar = model.encode(case["video"])  # what the cache stores
    torch.testing.assert_close(mean, case["mode.z"], **LAT)
    scale = torch.tensor([3.85, 2.32, 2.33, 3.06]).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(logvar, case["mode.temporal_logvar"] - 2 * torch.log(scale), **LAT)
    # the first 17 frames alone give the first 5 latents (chunks are independent)
    with torch.no_grad():
        first = model.encode_stages(case["video"][:, :, :17])["z"]
    torch.testing.assert_close(first, case["mode.z"][:, :, :5], **LAT)


@pytest.mark.slow
def test_sampling_path_with_upstream_noise(upstream):
    model, _, case = upstream
    with torch.no_grad():
        got = model.encode_stages(
            case["video"], spatial_eps=case["sample.spatial_eps"], temporal_eps=case["sample.temporal_eps"]
        )
    for k in ("x_z", "temporal_mean", "temporal_logvar", "z"):
        torch.testing.assert_close(got[k], case[f"sample.{k}"], **LAT, msg=lambda m, k=k: f"sample.{k}: {m}")


def test_decode_matches_upstream(upstream):
    model, _, case = upstream
    out = model.decode(case["mode.z"], num_frames=18)
    torch.testing.assert_close(out, case["mode.decoded"], atol=1e-4, rtol=1e-4)


def test_checkpoint_buffers_are_checked_and_every_key_consumed(upstream, tmp_path):
    from safetensors.torch import save_file

    from reelcache.cache.opensora_vae import OpenSoraVAE

    model, state, _ = upstream
    spatial = {
        k: v
        for k, v in json.loads((FIX / "vae_config.json").read_text())["spatial_autoencoderkl_config"].items()
        if not k.startswith("_")
    }
    temporal = dict(filters=4, num_res_blocks=2, multipliers=(1, 2, 2, 4), temporal_down=(False, True, True), groups=2)
    save_file(state, str(tmp_path / "model.safetensors"))
    OpenSoraVAE.from_checkpoint(tmp_path, spatial=spatial, temporal=temporal)  # the file as a folder
    bad = dict(state, scale=state["scale"] * 1.5)
    with pytest.raises(ValueError, match="stored scale"):
        OpenSoraVAE(spatial=spatial, temporal=temporal).load_upstream(bad)
    with pytest.raises(ValueError, match="unexpected keys"):
        OpenSoraVAE(spatial=spatial, temporal=temporal).load_upstream(dict(state, **{"ema.x": state["scale"]}))
    missing = {k: v for k, v in state.items() if not k.startswith("temporal_vae.decoder.conv_out")}
    with pytest.raises(RuntimeError, match="conv_out"):
        OpenSoraVAE(spatial=spatial, temporal=temporal).load_upstream(missing)


def test_fixtures_are_the_published_ones():
    """Every fixture the README lists is here, byte for byte (the suite's references are not edited)."""
    import hashlib

    from opensora_fixtures import checksums

    sums = checksums()
    assert len(sums) == 8
    for name, digest in sums.items():
        assert hashlib.sha256((FIX / name).read_bytes()).hexdigest() == digest, name
