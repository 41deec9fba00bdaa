"""train/step.py alone, on a one-process fake ``Parallel`` (support.FakePar): the guard's verdict
taken or not by the optimizer step, and the conditioning the model is given. The step in real
multi-rank runs: test_train.py::test_step_gradient_and_clipped_step_match_plain_torch (slow)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from support import REPO, FakePar
from torch import nn

from reelcache.train.config import load_config
from reelcache.train.model import STDiT3


def _cfg(name: str = "debug/original-stage1", *overrides: str):
    return load_config(REPO / "configs/train" / f"{name}.toml", list(overrides))


def _build_step(cfg, model, optimizer, ema=None):
    """The step as the trainer builds it (StepConfig.build), on the fake one-process Parallel."""
    return cfg.step.build(
        par=FakePar(cfg.parallel),
        model=model,
        optimizer=optimizer,
        guard=cfg.guard.build(),
        ema=ema,
        cond=cfg.conditioning.build(frame_interval=1),
        flow=cfg.flow,
        optim=cfg.optim,
        seed=cfg.run.seed,
    )


def _step(skip_nonfinite: bool):
    cfg = _cfg("debug/original-stage1", f"guard.skip_nonfinite={str(skip_nonfinite).lower()}", "optim.lr=0.1")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cfg.ema.decay = 0.9
    ema = cfg.ema.build(chunks=lambda: {n: c.clone() for n, c in FakePar().master_chunks(model, opt).items()})
    return _build_step(cfg, model, opt, ema), model, ema


def _nan_grads(model):
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))


@pytest.mark.parametrize("skip", [True, False])
def test_a_non_finite_step_is_skipped_or_stepped_as_configured(skip):
    from reelcache.train.step import StepResult

    step, model, ema = _step(skip)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = SimpleNamespace(global_step=7, opt_steps=3)
    out = StepResult(
        loss=float("nan"), samples=4, local_samples=4, bucket="b", latent_shape=(1, 1, 1), text_len=1, losses=None
    )
    _nan_grads(model)
    out = step.update(out, state)
    assert out.bad == "loss is nan" and step.guard.bad == 1
    after = dict(model.named_parameters())
    if skip:
        assert out.skipped == out.bad and out.lr is None and state.opt_steps == 3
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert step.guard.stepped_from is None
    else:  # Open-Sora's step: AdamW on NaN gradients, the EMA following the NaN masters
        assert out.skipped is None and out.lr is not None and state.opt_steps == 4
        assert all(after[n].isnan().all() for n in before)
        assert all(c.isnan().all() for c in ema.chunks.values())
        assert step.guard.stepped_from == 7
    assert all(p.grad is None or not p.grad.isnan().any() for p in model.parameters())  # cleared either way


@pytest.mark.parametrize("image_fps,want", [(0.0, [24.0, 25.0]), (120.0, [120.0, 120.0])])
def test_the_step_gives_the_model_the_image_fps(image_fps, want):
    overrides = ("model.overrides={caption_channels=8, model_max_length=300}", f"conditioning.image_fps={image_fps}")
    cfg = _cfg("debug/stage1", *overrides)
    model = STDiT3(cfg.model.stdit3())
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["fps"].tolist()), with_kwargs=True)
    step = _build_step(cfg, model, torch.optim.AdamW(model.parameters()))
    batch = {
        "x": torch.randn(2, 4, 1, 4, 6),
        "weight": 1.0,
        "clip_id": ["a", "b"],
        "bucket": "144p/1/0.56",
        "fps": torch.tensor([float("nan"), 25.0]),
        "text": torch.randn(2, 3, 8),
        "text_mask": torch.ones(2, 3, dtype=torch.bool),
    }
    out = step.forward_backward(batch, 0)
    assert seen == [want] and math.isfinite(out.loss)
