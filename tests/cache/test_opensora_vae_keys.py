"""The Open-Sora 1.2 VAE (cache/opensora_vae.py) loads the published checkpoint's key layout."""

from __future__ import annotations

import numpy as np
import pytest
from support import REPO


@pytest.mark.slow  # the tiny VAE encodes 51 and 2 x 17 frames on the CPU (~20 s)
def test_opensora_vae_loads_the_public_key_layout_and_chunks_17_frames(tmp_path):
    import torch
    from safetensors.torch import save_file

    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.opensora_vae import OpenSoraVAE, latent_frames
    from reelcache.cache.spec import EncoderSpec

    assert [latent_frames(t) for t in (17, 51, 102, 204)] == [5, 15, 30, 60]  # DATASETS.md
    torch.manual_seed(3)
    model = OpenSoraVAE(tiny=True).eval()
    # the file under the published prefixes; that the names under them are the published ones is
    # test_opensora_vae_names_its_tensors_as_the_published_checkpoint's (against the written-out layout)
    state = {f"spatial_vae.module.{k}": v for k, v in model.spatial.state_dict().items()}
    state |= {f"temporal_vae.{k}": v for k, v in model.temporal.state_dict().items()}
    state |= {"scale": model.scale.clone(), "shift": model.shift.clone()}  # the published buffers
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    from reelcache.cache import opensora_vae

    loaded = OpenSoraVAE.from_checkpoint(
        tmp_path, spatial=opensora_vae.TINY_SPATIAL, temporal=opensora_vae.TINY_TEMPORAL
    ).eval()
    x = torch.rand(1, 3, 51, 32, 48) * 2 - 1
    a, b = model.encode(x), loaded.encode(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].shape == (1, 4, 15, 16, 24)
    enc = VideoEncoder(EncoderSpec("opensora-v1.2", tiny=True, dtype="float32"))
    out = enc.encode(np.random.default_rng(0).integers(0, 255, (2, 17, 32, 48, 3), dtype=np.uint8))
    assert out["mean"].shape == (2, 4, 5, 16, 24) and out["mean"].dtype == torch.bfloat16


def test_opensora_vae_names_its_tensors_as_the_published_checkpoint():
    """At the published sizes (built on the meta device: no memory, no init), every tensor the public
    dump lists has that name and shape here, and the per-prefix counts are the published file's, so
    its model.safetensors loads strictly. The reference is the published layout written out
    (tests/opensora_vae12_keys.txt, OPENSORA12.md section 10), not our module's own keys."""
    import ast
    from collections import Counter

    import torch

    from reelcache.cache.opensora_vae import OpenSoraVAE

    with torch.device("meta"):
        model = OpenSoraVAE()
    ours = {f"spatial_vae.module.{k}": tuple(v.shape) for k, v in model.spatial.state_dict().items()}
    ours |= {f"temporal_vae.{k}": tuple(v.shape) for k, v in model.temporal.state_dict().items()}
    ours |= {"scale": tuple(model.scale.shape), "shift": tuple(model.shift.shape)}
    published = dict(
        line.split("#")
        for line in (REPO / "tests/opensora_vae12_keys.txt").read_text().splitlines()
        if not line.startswith("#")
    )
    published = {k: ast.literal_eval(v) for k, v in published.items()}
    assert len(published) == 117 and {k: ours.get(k) for k in published} == published
    attention = "spatial_vae.module.encoder.mid_block.attentions.0"
    for name in ("group_norm", "to_q", "to_k", "to_v", "to_out.0"):
        assert f"{attention}.{name}.weight" in ours and f"{attention}.{name}.bias" in ours
    assert "spatial_vae.module.encoder.conv_norm_out.weight" in ours
    assert any(k.startswith("spatial_vae.module.decoder.up_blocks.") for k in ours)

    def part(k):
        for prefix, what in (
            ("spatial_vae.module.", "spatial"),
            ("temporal_vae.encoder.", "encode"),
            ("temporal_vae.quant_conv.", "encode"),
            ("temporal_vae.decoder.", "decode"),
            ("temporal_vae.post_quant_conv.", "decode"),
        ):
            if k.startswith(prefix):
                return what
        return k

    assert Counter(map(part, ours)) == {"scale": 1, "shift": 1, "spatial": 248, "encode": 133, "decode": 134}
