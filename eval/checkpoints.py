"""Which checkpoints of a run the evaluator takes, and whether one is whole before any work on it."""

from __future__ import annotations

import json
from pathlib import Path

from reelcache import UserError
from reelcache.train.checkpoint import ckpt_step
from reelcache.train.weights import INDEX


def select(ckpts: list[Path], every: int = 1, ckpt_every: int = 0) -> list[Path]:
    """The checkpoints ``--every N`` evaluates: steps on every N-th save (multiples of
    N x ckpt_every), plus checkpoints off the save grid (a run's final one); all when N <= 1."""
    if every <= 1 or ckpt_every <= 0:
        return list(ckpts)
    return [c for c in ckpts if ckpt_step(c) % ckpt_every or (ckpt_step(c) // ckpt_every) % every == 0]


def check_weights(ckpt: Path, used: str) -> None:
    """Refuse, in one line and before any work, a checkpoint whose weight shards are not all there
    (a copy cut short, a shard deleted by hand): the index names every shard the folder must hold.
    An EMA load also reads model/ (the frozen tensors and buffers come from there)."""
    for folder in dict.fromkeys([ckpt / used, ckpt / "model"]):
        index = folder / INDEX
        if not folder.is_dir():
            raise UserError(f"{ckpt.name} is incomplete: no {folder.name}/ folder; evaluate another checkpoint")
        if not index.exists():
            continue  # a single-file layout: load_weights says what is missing
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # cut short, or not an index
            raise UserError(f"{ckpt.name} is incomplete: {folder.name}/{INDEX} is not a shard index ({e!r})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise UserError(
                f"{ckpt.name} is incomplete: {folder.name}/{missing[0]} is missing "
                f"({len(missing)} of the {len(names)} shards its index names); evaluate another checkpoint, "
                "or copy the checkpoint again whole"
            )
