"""The divergence guard: skip a step whose loss or gradient is not finite or spikes, together.

A step is bad when the global loss or the global gradient norm is not finite, or when the loss
lies more than ``spike_z`` standard deviations above the mean of the last ``window`` good steps
(checked once the window is full). Every rank decides from the same all-reduced numbers and the
flags are max-reduced once more, so all ranks skip the optimizer step together: no collective
ever falls out of step. Bad steps do not enter the window. After ``max_bad_steps`` consecutive bad
steps the run stops, naming the last good checkpoint and the command that resumes from it.

Open-Sora never skips a step. ``spike_z = 0`` and ``skip_nonfinite = false`` (the
``opensora12-original`` configs) give its behaviour: a non-finite step then updates the weights
as upstream's would (they usually become NaN, and so does every later loss). Such a step is still
bad: it is recorded and logged, and ``max_bad_steps`` of them in a row stop the run where upstream would
train on NaN weights to the end; the checkpoint the message names is then the newest one saved
before the first of them (``stepped_from``), not one holding the NaN weights.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from reelcache.settings import setting


@dataclass
class GuardConfig:
    """[guard]: which steps are skipped as divergent, and how many in a row stop the run."""

    spike_z: float = setting(
        6.0,
        "a loss this many std above the running window is a spike (0 = off); at least 3: below, ordinary steps of "
        "a noisy diffusion loss would be skipped (2 std: ~2% of a Gaussian's)",
        ge=3,
        off=0,
    )
    window: int = setting(100, "steps in the running loss window (spike detection starts when full)", ge=2)
    max_bad_steps: int = setting(5, "consecutive bad steps (skipped or not) before the run stops with a message", ge=1)
    skip_nonfinite: bool = setting(
        True, "skip a step whose loss or gradient norm is not finite; false: step anyway, as Open-Sora does"
    )

    def build(self) -> Guard:
        return Guard(self)


class DivergedError(RuntimeError):
    pass


class Guard:
    """The guard of one run (``GuardConfig.build``): its [guard] section, and the window and streak it keeps."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.window: deque[float] = deque(maxlen=max(2, cfg.window))
        self.bad = 0
        self.stepped_from: int | None = None  # the first bad step of this streak that updated the weights

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """None for a good step, else the reason it is bad (the window is not updated here)."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if self.cfg.spike_z > 0 and len(self.window) == self.window.maxlen:
            mean = sum(self.window) / len(self.window)
            std = math.sqrt(sum((v - mean) ** 2 for v in self.window) / (len(self.window) - 1))
            z = (loss - mean) / max(std, 1e-12)
            if z > self.cfg.spike_z:
                return (
                    f"loss {loss:.4g} is a spike: z = {z:.1f} over the last {len(self.window)} steps "
                    f"(mean {mean:.4g}, std {std:.3g})"
                )
        return None

    def skips(self, loss: float, grad_norm: float) -> bool:
        """Whether a bad step is skipped: always for a spike; a non-finite one unless skip_nonfinite is off."""
        return self.cfg.skip_nonfinite or (math.isfinite(loss) and math.isfinite(grad_norm))

    def record(self, loss: float, bad: bool, stepped_at: int | None = None) -> None:
        """``stepped_at``: the global step of a bad step the optimizer took anyway."""
        if bad:
            self.bad += 1
            if stepped_at is not None and self.stepped_from is None:
                self.stepped_from = stepped_at
        else:
            self.bad = 0
            self.stepped_from = None
            self.window.append(loss)

    @property
    def exhausted(self) -> bool:
        return self.bad >= self.cfg.max_bad_steps

    def state_dict(self) -> dict:
        return {"window": list(self.window), "bad": self.bad, "stepped_from": self.stepped_from}

    def load_state_dict(self, state: dict) -> None:
        self.window.clear()
        self.window.extend(state.get("window", []))
        self.bad = int(state.get("bad", 0))
        self.stepped_from = state.get("stepped_from")
