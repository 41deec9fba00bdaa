"""Run under torchrun (2 ranks): the trainer's gradient for one step vs plain autograd on one process.

rank 0 trains on batch A; rank 1 on batch B (another bucket and batch size), or on a padding
batch (weight 0). The reference, computed on every rank without DDP or ColossalAI: the gradient
of sum(loss_i over the real samples) / N ("sample") or of the mean of the real ranks' means
("rank"), with the same per-sample draws. Prints one JSON line per case from rank 0.
"""

import copy
import json
import sys

import torch

from reelcache.train.config import load_config
from reelcache.train.flow import timestep_transform, training_losses
from reelcache.train.loader import LatentLoader
from reelcache.train.trainer import Trainer, bucket_geometry


def reference_losses(trainer, module, batch):
    d = trainer.draws(batch)
    frames, h, w = bucket_geometry(batch["bucket"])
    b = batch["x"].shape[0]
    full = lambda v: torch.full((b,), float(v))   # noqa: E731
    t = timestep_transform(d["t"], full(h), full(w), full(frames))
    kw = {"y": batch["text"].float(), "mask": batch["text_mask"], "fps": torch.full((b,), 24.0),
          "height": full(h), "width": full(w), "caption_drop": d["caption_drop"]}
    return training_losses(module, batch["x"].float(), kw, d["noise"], t, x_mask=d["x_mask"])


def main(config, root, manifest, reduction):
    cfg = load_config(config, [f'data.manifests=[{{name="{manifest}"}}]', 'data.buckets="configs/buckets/tiny.toml"',
                               "model.overrides={caption_channels=8, model_max_length=300}", "data.workers=0",
                               "run.wandb_mode=\"disabled\"", f'run.loss_reduction="{reduction}"',
                               f'run.name="grad-{reduction}"', "model.grad_checkpoint=false"])
    tr = Trainer(cfg, root)
    rank, world = tr.par.rank, tr.par.world
    # Two batches of different buckets, read by a one-rank loader over the same manifest.
    single = LatentLoader([manifest], tr.buckets, root=root, seed=cfg.run.seed)
    batches = []
    for b in single:
        if not batches or b["bucket"] != batches[0]["bucket"]:
            batches.append(b)
        if len(batches) == 2:
            break
    for case in ("two buckets", "padding rank"):
        mine = dict(batches[rank])
        if case == "padding rank" and rank == 1:
            mine = dict(batches[0], weight=0.0)
        ref_module = copy.deepcopy(tr.module)
        tr.optimizer.zero_grad()
        out = tr.forward_backward(mine)
        got = {n: p.grad.clone() for n, p in tr.module.named_parameters() if p.grad is not None}
        # Reference: plain autograd on one process over the real samples of both ranks.
        real = [batches[0]] if case == "padding rank" else batches[:2]
        losses = [reference_losses(tr, ref_module, b) for b in real]
        if reduction == "sample":
            total = torch.cat(losses).sum() / sum(len(x) for x in losses)
        else:
            total = torch.stack([x.mean() for x in losses]).mean()
        total.backward()
        want = {n: p.grad for n, p in ref_module.named_parameters() if p.grad is not None}
        assert want.keys() == got.keys(), (sorted(want)[:3], sorted(got)[:3])
        err = max(float((got[n] - want[n]).abs().max() / (want[n].abs().max() + 1e-12)) for n in want)
        if rank == 0:
            print(json.dumps({"case": case, "reduction": reduction, "max_rel_err": err,
                              "loss": out["loss"], "samples": out["samples"]}), flush=True)
    tr.optimizer.zero_grad()
    tr.par.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
