"""Open-Sora 1.2's training behaviours offered as options (the ``opensora12-original`` configs turn
them on), and checkpoints that travel both ways between Open-Sora and reelcache.

References are independent of the code under test: upstream's PositionEmbedding2D rewritten here
from its source (opensora/models/layers/blocks.py) and cast the way ``model.to(bf16)`` casts it,
Open-Sora's own state-dict keys (the fixture's ``stdit3_tiny.safetensors``), plain
``load_state_dict(strict=True)`` as an upstream loader calls it, and the checkpoint files on disk.
The guard, the step and the checkpointer alone are in test_guard.py, test_step.py and
test_checkpoint.py; here one single-process run (slow) checks the trainer's snapshot and the
options together, one more a NaN step that is not skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from opensora_fixtures import FIX
from support import REPO, data_args, poisoned_manifest, train
from torch import nn

from reelcache import UserError
from reelcache.train.config import load_config
from reelcache.train.layers import pos_embed_2d
from reelcache.train.model import STDiT3, STDiT3Config

ORIGINAL = sorted((REPO / "configs/train/opensora12-original").glob("*.toml")) + sorted(
    (REPO / "configs/train/debug").glob("original-*.toml")
)


def _cfg(name: str = "debug/original-stage1", *overrides: str):
    return load_config(REPO / "configs/train" / f"{name}.toml", list(overrides))


# -- every original config turns Open-Sora's behaviour on; the replication's keep reelcache's -----


@pytest.mark.parametrize("path", ORIGINAL, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_original_configs_train_as_upstream(path):
    cfg = load_config(path)
    assert (cfg.guard.spike_z, cfg.guard.skip_nonfinite) == (0.0, False)
    assert cfg.model.stdit3().pos_embed_bf16_freqs is True
    assert cfg.conditioning.image_fps == 120.0
    assert cfg.checkpoint.at_start is True


def test_defaults_keep_reelcaches_behaviour():
    cfg = _cfg("debug/stage1")
    assert (cfg.guard.spike_z, cfg.guard.skip_nonfinite) == (6.0, True)
    assert (cfg.model.stdit3().pos_embed_bf16_freqs, cfg.conditioning.image_fps, cfg.checkpoint.at_start) == (
        False,
        0.0,
        False,
    )


# -- 1. the guard: a non-finite step that is not skipped -------------------------------------------


# -- 2. the position embedding's frequencies, rounded to bf16 as upstream's buffer is ---------------


class UpstreamPositionEmbedding2D(nn.Module):
    """opensora/models/layers/blocks.py PositionEmbedding2D (v1.2), as written there."""

    def __init__(self, dim: int):
        super().__init__()
        half_dim = dim // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(0, half_dim, 2).float() / half_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _get_sin_cos_emb(self, t):
        out = torch.einsum("i,d->id", t, self.inv_freq)
        return torch.cat((torch.sin(out), torch.cos(out)), dim=-1)

    def forward(self, device, dtype, h, w, scale=1.0, base_size=None):
        grid_h = torch.arange(h, device=device) / scale
        grid_w = torch.arange(w, device=device) / scale
        if base_size is not None:
            grid_h *= base_size / h
            grid_w *= base_size / w
        grid_h, grid_w = torch.meshgrid(grid_w, grid_h, indexing="ij")  # here w goes first
        grid_h = grid_h.t().reshape(-1)
        grid_w = grid_w.t().reshape(-1)
        emb_h = self._get_sin_cos_emb(grid_h)
        emb_w = self._get_sin_cos_emb(grid_w)
        return torch.concat([emb_h, emb_w], dim=-1).unsqueeze(0).to(dtype)


def upstream_pos_embed(hidden, h, w, height, width, input_sq_size, device, dtype, bf16_freqs=False):
    """What STDiT3.forward adds upstream: the module cast with the model (bf16: its inv_freq rounded)."""
    module = UpstreamPositionEmbedding2D(hidden)
    if bf16_freqs:
        module = module.to(torch.bfloat16)
    scale = (float(height[0]) * float(width[0])) ** 0.5 / input_sq_size
    return module(device, torch.float32, h, w, scale=scale, base_size=round((h * w) ** 0.5))[0].to(dtype)


# (pixel height, width, patch grid h', w') at XL/2's width: 240p, 360p, 720p 9:16 and a square image
SIZES = [(240, 426, 15, 27), (360, 640, 23, 40), (720, 1280, 45, 80), (512, 512, 32, 32)]


@pytest.mark.parametrize("height,width,h,w", SIZES)
def test_pos_embed_bf16_freqs_equals_upstreams_cast_buffer(height, width, h, w):
    size = (torch.tensor([float(height)]), torch.tensor([float(width)]))
    ours = pos_embed_2d(1152, h, w, *size, 512, "cpu", torch.float32, bf16_freqs=True)
    theirs = upstream_pos_embed(1152, h, w, *size, 512, "cpu", torch.float32, bf16_freqs=True)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
    fp32 = pos_embed_2d(1152, h, w, *size, 512, "cpu", torch.float32)
    torch.testing.assert_close(
        fp32, upstream_pos_embed(1152, h, w, *size, 512, "cpu", torch.float32), atol=2e-5, rtol=0
    )
    assert 0.04 < (fp32 - ours).abs().max() < 0.06  # what the option changes: up to 0.058


def test_the_model_option_adds_the_rounded_embedding(monkeypatch):
    from opensora_fixtures import FIX as fix
    from safetensors.torch import load_file

    cases = load_file(fix / "stdit3_cases.safetensors")
    kw = {k.split(".", 1)[1]: v for k, v in cases.items() if k.startswith("plain.") and not k.endswith(".out")}
    state = load_file(fix / "stdit3_tiny.safetensors")
    rounded = STDiT3(STDiT3Config.preset("tiny", pos_embed_bf16_freqs=True)).eval()
    plain = STDiT3(STDiT3Config.preset("tiny")).eval()
    rounded.load_state_dict(state, strict=True)
    plain.load_state_dict(state, strict=True)
    with torch.no_grad():
        got, fp32 = rounded(**kw), plain(**kw)
        # the plain model with upstream's bf16-cast module in place of its positions
        monkeypatch.setattr(
            "reelcache.train.model.pos_embed_2d", lambda *a: upstream_pos_embed(*a[:8], bf16_freqs=True)
        )
        want = plain(**kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - fp32).abs().max() > 1e-3


# -- 3. images conditioned on upstream's IMG_FPS ---------------------------------------------------


# -- 4. a checkpoint before the first step --------------------------------------------------------


# -- checkpoints both ways: Open-Sora folders in, complete ema/ out ---------------------------------


def _open_sora_folder(tmp_path: Path, config: dict | None) -> Path:
    """An Open-Sora ``epochN-global_stepM/``: model/ (bf16 shards) with transformers' config.json, ema.pt."""
    from safetensors.torch import load_file

    ref = load_file(FIX / "stdit3_tiny.safetensors")
    folder = tmp_path / "epoch0-global_step100"
    (folder / "model").mkdir(parents=True)
    (folder / "running_states.json").write_text(json.dumps({"epoch": 0, "step": 100, "global_step": 100}))
    torch.save({k: v.bfloat16() for k, v in ref.items()}, folder / "model/pytorch_model.bin")
    (folder / "model/pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(ref, "pytorch_model.bin")})
    )
    if config is not None:
        (folder / "model/config.json").write_text(json.dumps({**config, "model_type": "STDiT3"}))
    torch.save({k: v + 1 for k, v in ref.items()}, folder / "ema.pt")
    return folder


def _fixture_config_json() -> dict:
    return json.loads((FIX / "stdit3_config.json").read_text())["config"]


def test_an_open_sora_folders_config_is_compared_with_the_model(tmp_path):
    from reelcache.train.weights import load_weights

    folder = _open_sora_folder(tmp_path, _fixture_config_json())
    report = load_weights(STDiT3(STDiT3Config.preset("tiny")), folder)
    assert report.complete and "non-EMA" in report.kind
    assert any("pos_embed_bf16_freqs = true" in n for n in report.notes)  # how to compute what upstream did
    assert not load_weights(STDiT3(STDiT3Config.preset("tiny", pos_embed_bf16_freqs=True)), folder).notes
    ema = load_weights(STDiT3(STDiT3Config.preset("tiny")), folder, which="ema")
    assert ema.complete and "ema.pt" in ema.kind

    # a field that changes no tensor: the load would succeed and compute something else
    other = _open_sora_folder(tmp_path / "o", {**_fixture_config_json(), "input_sq_size": 256, "num_heads": 2})
    model = STDiT3(STDiT3Config.preset("tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"input_sq_size = 256 \(this model: 512\), num_heads = 2 \(this model: 4\)"):
        load_weights(model, other)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    # named in model.overrides: on purpose, said and loaded
    report = load_weights(model, other, chosen={"input_sq_size", "num_heads"})
    assert report.complete and any("input_sq_size = 256" in n for n in report.notes)
    # a shape field that differs: the load says which tensors did not fit, the note says why
    wide = _open_sora_folder(tmp_path / "w", {**_fixture_config_json(), "model_max_length": 8})
    report = load_weights(STDiT3(STDiT3Config.preset("tiny")), wide)
    assert any("model_max_length = 8" in n for n in report.notes)


def test_ema_is_for_checkpoint_folders_only(tmp_path):
    from reelcache.train.weights import load_weights

    with pytest.raises(ValueError, match="no EMA"):
        load_weights(STDiT3(STDiT3Config.preset("tiny")), FIX / "stdit3_tiny.safetensors", which="ema")
    folder = _open_sora_folder(tmp_path, None)
    (folder / "ema.pt").unlink()
    with pytest.raises(FileNotFoundError, match="no ema.pt"):
        load_weights(STDiT3(STDiT3Config.preset("tiny")), folder, which="ema")


def test_init_from_weights_goes_with_init_from(tmp_path):
    from reelcache.train.cli import parser, run

    a, rest = parser().parse_known_args(
        ["configs/train/debug/stage1.toml", "--root", str(tmp_path), "--init-from-weights", "ema"]
    )
    with pytest.raises(UserError, match="--init-from-weights goes with --init-from"):
        run(a, rest)


ORIGINAL_STAGE1 = REPO / "configs/train/debug/original-stage1.toml"


def _data_args(manifest: Path, *extra: str) -> list[str]:
    """support.data_args with Open-Sora's rounded position embedding (the original stages' model)."""
    overrides = "--model.overrides={caption_channels=8, model_max_length=300, pos_embed_bf16_freqs=true}"
    return data_args(manifest, overrides, "--data.workers=0", *extra)


def _read(folder: Path) -> dict:
    from reelcache.train.weights import read_sharded

    return read_sharded(folder)


@pytest.mark.slow
def test_an_original_run_saves_at_start_and_a_complete_ema_that_travels(tmp_path):
    """One run of the original stage-1 twin: ckpt-0 before the first step; every ema/ a complete state
    dict with Open-Sora's keys that loads strictly into a fresh STDiT3; a new run starts from it."""
    from latent_data import write_latents
    from safetensors.torch import load_file

    from reelcache.train.config import from_dict

    manifest = write_latents(tmp_path, 12, name="t")
    train(
        tmp_path,
        _data_args(manifest, "--run.name=o", "--run.max_steps=2", "--checkpoint.every=2"),
        config=ORIGINAL_STAGE1,
    )
    run = tmp_path / "runs/o"
    c0, c2 = run / "ckpt-00000000", run / "ckpt-00000002"
    assert sorted(p.name for p in c0.iterdir()) == ["config.json", "ema", "model", "state.json"]
    assert json.loads((c0 / "state.json").read_text())["global_step"] == 0
    upstream_keys = set(load_file(FIX / "stdit3_tiny.safetensors"))  # Open-Sora's own STDiT3 state dict
    for ckpt in (c0, c2):
        model, ema = _read(ckpt / "model"), _read(ckpt / "ema")
        assert set(ema) == set(model) == upstream_keys and len(ema) == 89
        for k in ("rope.freqs", "y_embedder.y_embedding", "y_embedder.y_proj.fc1.weight"):  # frozen: model/'s
            assert torch.equal(ema[k], model[k])
        fresh = STDiT3(from_dict(json.loads((ckpt / "config.json").read_text())).model.stdit3())
        fresh.load_state_dict(ema, strict=True)  # what an upstream loader does with ema/ alone
    e0, m0 = _read(c0 / "ema"), _read(c0 / "model")
    assert all(torch.equal(e0[k], m0[k]) for k in e0)  # the EMA starts as the weights
    e2, m2 = _read(c2 / "ema"), _read(c2 / "model")
    assert any(not torch.equal(e2[k], m2[k]) for k in e2)

    # --init-from-weights ema: a new run starts from the EMA (lr 0: the weights stay as loaded)
    args = _data_args(
        manifest, "--run.name=from-ema", "--run.max_steps=1", "--optim.lr=0.0", "--checkpoint.at_start=false"
    )
    out = train(tmp_path, args + ["--init-from", str(c2), "--init-from-weights", "ema"], config=ORIGINAL_STAGE1)
    assert "reelcache checkpoint, ema/" in out
    c1 = tmp_path / "runs/from-ema/ckpt-00000001"
    assert json.loads((c1 / "state.json").read_text())["init_weights"] == "ema"
    m1 = _read(c1 / "model")
    assert all(torch.equal(m1[k], e2[k]) for k in e2)

    # the model it was trained as is checked: a silent difference is an error naming the field
    from reelcache.train.weights import load_weights

    plain = STDiT3(_cfg("debug/stage1", "model.overrides={caption_channels=8, model_max_length=300}").model.stdit3())
    with pytest.raises(ValueError, match=r"pos_embed_bf16_freqs = True \(this model: False\)"):
        load_weights(plain, c2, which="ema")


@pytest.mark.slow
def test_an_original_run_steps_on_a_nan_like_upstream_and_stops_naming_the_checkpoint_before_it(tmp_path):
    from latent_data import write_latents

    manifest = write_latents(tmp_path, 12, name="t")
    bad, clip = poisoned_manifest(tmp_path, manifest)
    args = _data_args(
        bad, "--run.name=poisoned", "--checkpoint.every=1", "--checkpoint.keep_last=0", "--guard.max_bad_steps=2"
    )
    out = train(tmp_path, args, ok=False, config=ORIGINAL_STAGE1)
    run = tmp_path / "runs/poisoned"
    recs = [json.loads(ln) for ln in (run / "bad_steps.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and clip in recs[0]["clip_ids"] and not any(r["skipped"] for r in recs)
    k = recs[0]["step"]
    assert recs[1]["step"] == k + 1 and "NOT skipped" in out and "consecutive bad steps" in out
    assert f"--load {run / f'ckpt-{k:08d}'}" in out  # the checkpoint before the NaN step, not after it
    assert all(v.isfinite().all() for v in _read(run / f"ckpt-{k:08d}/model").values())
    after = _read(run / f"ckpt-{k + 1:08d}/model")  # the optimizer stepped on the NaN gradient, as upstream's does
    assert any(not v.isfinite().all() for v in after.values())
