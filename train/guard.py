"""The divergence guard: skip a step whose loss or gradient is not finite or spikes, together.

A step is bad when the global loss or the global gradient norm is not finite, or when the loss
lies more than ``spike_z`` standard deviations above the mean of the last ``window`` good steps
(checked once the window is full). Every rank decides from the same all-reduced numbers and the
flags are max-reduced once more, so all ranks skip the optimizer step together: no collective
ever falls out of step. Bad steps do not enter the window. After ``max_bad`` consecutive bad
steps the run stops, naming the last good checkpoint and the command that resumes from it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from reelcache.settings import setting


@dataclass
class GuardConfig:
    """[guard]: which steps are skipped as divergent, and how many in a row stop the run."""

    spike_z: float = setting(6.0, "a loss this many std above the running window is a spike (0 = off)", ge=0)
    window: int = setting(100, "steps in the running loss window (spike detection starts when full)", ge=2)
    max_bad_steps: int = setting(5, "consecutive skipped steps before the run stops with a message", ge=1)

    def build(self) -> Guard:
        return Guard(self.spike_z, self.window, self.max_bad_steps)


class DivergedError(RuntimeError):
    pass


class Guard:
    def __init__(self, spike_z: float = 6.0, window: int = 100, max_bad: int = 5):
        self.spike_z, self.max_bad = spike_z, max_bad
        self.window: deque[float] = deque(maxlen=max(2, window))
        self.bad = 0

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """None for a good step, else the reason it is bad (the window is not updated here)."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if self.spike_z > 0 and len(self.window) == self.window.maxlen:
            mean = sum(self.window) / len(self.window)
            std = math.sqrt(sum((v - mean) ** 2 for v in self.window) / (len(self.window) - 1))
            z = (loss - mean) / max(std, 1e-12)
            if z > self.spike_z:
                return (
                    f"loss {loss:.4g} is a spike: z = {z:.1f} over the last {len(self.window)} steps "
                    f"(mean {mean:.4g}, std {std:.3g})"
                )
        return None

    def record(self, loss: float, bad: bool) -> None:
        if bad:
            self.bad += 1
        else:
            self.bad = 0
            self.window.append(loss)

    @property
    def exhausted(self) -> bool:
        return self.bad >= self.max_bad

    def state_dict(self) -> dict:
        return {"window": list(self.window), "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        self.window.clear()
        self.window.extend(state.get("window", []))
        self.bad = int(state.get("bad", 0))
