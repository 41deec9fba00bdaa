"""``TrainState``: all of a checkpoint's state.json, and the one object a resume restores from it.

    {"global_step": 2210, "opt_steps": 2210, "loader": {...}, "guard": {...}, "run": "os12-stage1",
     "world_size": 192, "model_preset": "STDiT3-XL/2", "init_from": ..., "init_weights": "model",
     "saved_at": "2026-...Z", "versions": {"torch": ..., "colossalai": ..., "reelcache": ...}}

The loop's counters and its stateful parts (the loader's position, the guard's window) are
restored on resume; the rest says what wrote the checkpoint (world size, preset, where its first
weights came from, when, with which libraries). The epoch and the data fingerprint are the
loader's; the learning rate follows from ``opt_steps`` and the config's [optim]. The checkpoint
writer adds ``write_seconds``, what its write took.

The wandb run id is the run's, not a checkpoint's: it lives in ``runs/<run>/wandb_id`` (train/runlog.py).
Checkpoints written before that (config.json version 2) carry it here as ``wandb_id``, which is not read:
a run directory of that layout gets its id file by hand (docs/CHANGELOG.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from reelcache.train.checkpoint import library_versions

RESTORED = ("global_step", "opt_steps", "loader", "guard")


@dataclass
class TrainState:
    loader: object  # train/loader.py LatentLoader
    guard: object  # train/guard.py Guard
    run: str = ""
    world_size: int = 1
    model_preset: str = ""
    global_step: int = 0
    opt_steps: int = 0
    init_from: str | None = None  # the weights this run's model was first loaded from (a checkpoint, --init-from)
    init_weights: str | None = None  # model or ema: which of init_from's weights

    def state_dict(self) -> dict:
        return {
            "global_step": self.global_step,
            "opt_steps": self.opt_steps,
            "loader": self.loader.state_dict(),
            "guard": self.guard.state_dict(),
            "run": self.run,
            "world_size": self.world_size,
            "model_preset": self.model_preset,
            "init_from": self.init_from,
            "init_weights": self.init_weights,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": library_versions(),
        }

    def load_state_dict(self, state: dict, reset_data: bool = False) -> None:
        """The counters, the loader's position (``reset_data``: restart it) and the guard's window; what
        describes the checkpoint's writer is not restored (this start's is written next time)."""
        self.loader.load_state_dict(state["loader"], reset_data=reset_data)
        self.global_step, self.opt_steps = int(state["global_step"]), int(state["opt_steps"])
        self.guard.load_state_dict(state.get("guard", {}))
