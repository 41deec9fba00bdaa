"""Run under torchrun (2 ranks): the trainer's gradients and clipped steps vs plain autograd on one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/grad_check.py CONFIG --root ROOT MANIFEST \
        PLUGIN DTYPE... [PLUGIN DTYPE...]

For each plugin and each of its working dtypes (one trainer each, the plugin's real boosted model and optimizer,
one after another in this one launch: a launch of 2 ranks costs ~16 CPU-s before its first step):

- gradients: rank 0 trains on batch A; rank 1 on batch B (another bucket and batch size), or on a
  padding batch (weight 0). The reference, computed on every rank without DDP or ColossalAI: the
  gradient of sum(loss_i over the real samples) / N ("sample") or of the mean of the real ranks'
  means ("rank"), with the same per-sample draws, on a copy of the module in fp32 (for a bf16 run,
  the bf16 weights exactly, computed in fp32). Under ZeRO the gradient is all-gathered from the
  shards ZeRO's grad store holds after its reduce-scatter.
- clipping: two optimizer steps whose gradient norm is ~100x parallel.grad_clip, against
  torch.optim.AdamW with clip_grad_norm_ on the same reference (and without it, which must be far
  off): the trainer's fp32 master weights afterwards.

Prints one JSON line per case from rank 0.
"""

import copy
import json
import sys

import torch

from reelcache.base.buckets import bucket_geometry
from reelcache.train.config import load_config
from reelcache.train.flow import timestep_transform, training_losses
from reelcache.train.loader import LatentLoader
from reelcache.train.schedule import lr_at
from reelcache.train.trainer import Trainer

CLIP = 0.05


def debug_stage_config(config, manifest, plugin: str, dtype: str, *extra: str):
    """The debug stage pointed at a test root's manifest (8-wide captions, tiny buckets, no data
    workers, no wandb) on the given plugin and working dtype, plus overrides."""
    return load_config(
        config,
        [
            f'data.manifests=[{{name="{manifest}"}}]',
            'data.buckets="configs/buckets/tiny.toml"',
            "model.overrides={caption_channels=8, model_max_length=300}",
            "data.workers=0",
            'log.wandb_mode="disabled"',
            f'parallel.plugin="{plugin}"',
            f'parallel.dtype="{dtype}"',
            *extra,
        ],
    )


def reference_losses(trainer, module, batch):
    d = trainer.step.draws(batch, trainer.state.global_step)
    frames, h, w = bucket_geometry(batch["bucket"])
    b = batch["x"].shape[0]
    full = lambda v: torch.full((b,), float(v))  # noqa: E731
    t = timestep_transform(d["t"], full(h), full(w), full(frames))
    kw = {
        "y": batch["text"].float(),
        "mask": batch["text_mask"],
        "fps": torch.full((b,), 24.0),
        "height": full(h),
        "width": full(w),
        "caption_drop": d["caption_drop"],
    }
    return training_losses(module, batch["x"].float(), kw, d["noise"], t, x_mask=d["x_mask"])


def reference_loss(trainer, module, batches, reduction):
    losses = [reference_losses(trainer, module, b) for b in batches]
    if reduction == "sample":
        return torch.cat(losses).sum() / sum(len(x) for x in losses)
    return torch.stack([x.mean() for x in losses]).mean()


def trainer_grads(tr) -> dict:
    """name -> the full gradient of every trainable parameter (a collective under ZeRO)."""
    out = {}
    for n, p in tr.module.named_parameters():
        if not p.requires_grad:
            continue
        g = tr.optimizer.get_param_grad(p) if tr.par.zero else p.grad
        if g is not None:
            out[n] = g.detach().float().clone()
    return out


def rel_err(got: dict, want: dict) -> float:
    """Max over parameters of max|got - want| / max|want|, the denominator floored at 1e-3 of the
    largest parameter's (a key bias has a gradient of exactly zero in exact arithmetic: float noise)."""
    assert want.keys() == got.keys(), sorted(set(want) ^ set(got))[:5]
    scale = {n: float(want[n].abs().max()) for n in want}
    floor = 1e-3 * max(scale.values())
    return max(float((got[n] - want[n]).abs().max()) / max(scale[n], floor) for n in want)


def check(config, root, manifest, plugin, dtype):
    cfg = debug_stage_config(
        config,
        manifest,
        plugin,
        dtype,
        f'run.name="grad-{plugin}-{dtype}"',
        f"parallel.grad_clip={CLIP}",
        "model.grad_checkpoint=false",
        'optim.schedule="constant"',
        # eps 1e-15 (Open-Sora's) turns the key biases' float-noise gradients into
        # full-size Adam steps: the clipping check would compare noise.
        "optim.adam_eps=1e-8",
    )
    tr = Trainer(cfg, root)
    rank = tr.par.rank
    # Two batches of different buckets, read by a one-rank loader over the same manifest.
    single = LatentLoader([manifest], tr.loader.buckets, root=root, seed=cfg.run.seed)
    batches = []
    for b in single:
        if not batches or b["bucket"] != batches[0]["bucket"]:
            batches.append(b)
        if len(batches) == 2:
            break
    working = copy.deepcopy(tr.module)  # the working weights (bf16 or fp32), plain torch
    # The fp32 masters as the trainer holds them (for bf16, the values before rounding), on rank 0.
    masters0 = tr.par.gather_full(tr.par.master_chunks(tr.model, tr.optimizer), tr.shapes)
    results = []
    for reduction in ("sample", "rank"):
        tr.cfg.step.loss_reduction = reduction
        for case in ("two buckets", "padding rank"):
            mine = dict(batches[rank])
            if case == "padding rank" and rank == 1:
                mine = dict(batches[0], weight=0.0)
            ref = copy.deepcopy(working)
            tr.optimizer.zero_grad()
            out = tr.step.forward_backward(mine, tr.state.global_step)
            got = trainer_grads(tr)
            reference_loss(tr, Cast(ref), [batches[0]] if case == "padding rank" else batches, reduction).backward()
            want = {n: p.grad.float() for n, p in ref.named_parameters() if p.grad is not None}
            results.append(
                {
                    "plugin": plugin,
                    "dtype": dtype,
                    "case": case,
                    "reduction": reduction,
                    "max_rel_err": rel_err(got, want),
                    "loss": out.loss,
                    "samples": out.samples,
                }
            )
    tr.optimizer.zero_grad()

    # Clipping: two steps of the trainer vs mixed-precision AdamW by hand on rank 0 (working weights
    # in the run's dtype for forward and backward, fp32 masters updated by torch's AdamW after
    # clip_grad_norm_ on the fp32 gradient), with and without the clip.
    tr.cfg.step.loss_reduction = "sample"
    o = cfg.optim
    refs = {}
    if rank == 0:
        for clip in (True, False):
            m = copy.deepcopy(working)
            master = {n: masters0[n].clone().requires_grad_(True) for n in masters0}
            opt = torch.optim.AdamW(
                list(master.values()), lr=o.lr, betas=tuple(o.betas), eps=o.adam_eps, weight_decay=o.weight_decay
            )
            refs[clip] = (m, master, opt)
    norms = []
    for k in range(2):
        out = tr.step(dict(batches[rank]), tr.state)
        norms.append(out.grad_norm)
        for clip, (m, master, opt) in refs.items():
            params = dict(m.named_parameters())
            with torch.no_grad():
                for n, v in master.items():
                    params[n].copy_(v)  # rounded to the working dtype
                    params[n].grad = None
            reference_loss(tr, Cast(m), batches, "sample").backward()
            for n, v in master.items():
                v.grad = params[n].grad.float()
            norm = torch.nn.utils.clip_grad_norm_(list(master.values()), CLIP if clip else float("inf"))
            if clip:
                norms.append(float(norm))
            for g in opt.param_groups:
                g["lr"] = lr_at(k, o)
            opt.step()
        tr.state.global_step += 1
    masters = tr.par.gather_full(tr.par.master_chunks(tr.model, tr.optimizer), tr.shapes)
    if rank == 0:
        moved = {n: masters[n] - masters0[n] for n in masters}
        errs = {
            clip: rel_err(moved, {n: v.detach() - masters0[n] for n, v in master.items()})
            for clip, (_, master, _) in refs.items()
        }
        results.append(
            {
                "plugin": plugin,
                "dtype": dtype,
                "case": "clipping",
                "clip": CLIP,
                "grad_norms": norms,
                "err_vs_clipped": errs[True],
                "err_vs_unclipped": errs[False],
            }
        )
        for r in results:
            print(json.dumps(r), flush=True)
    return tr


class Cast(torch.nn.Module):
    """A plain module in bf16 called as ZeRO's bf16 wrapper calls it: floating inputs cast to its dtype."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.dtype = next(module.parameters()).dtype

    def forward(self, *args, **kwargs):
        cast = lambda v: v.to(self.dtype) if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
        return self.module(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})


PLUGINS = ("ddp", "zero2")


def main(config, root, manifest, *words):
    """words: a plugin, then its dtypes; another plugin, then its dtypes; ..."""
    if not words or words[0] not in PLUGINS:
        sys.exit(f"grad_check.py: after MANIFEST, a plugin ({' or '.join(PLUGINS)}), then its dtypes: {words}")
    tr, plugin = None, None
    for word in words:
        if word in PLUGINS:
            plugin = word
        else:
            tr = check(config, root, manifest, plugin, word)
    tr.par.close()


if __name__ == "__main__":  # as support.torchrun starts it: CONFIG --root ROOT ...
    config, _, root, *rest = sys.argv[1:]
    main(config, root, *rest)
