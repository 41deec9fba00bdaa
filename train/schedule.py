"""Learning-rate schedules as pure functions of the optimizer step.

The schedule's whole state is the step counter, which the checkpoint stores as an integer:
nothing is pickled (Open-Sora's OneCycleScheduler pickles the optimizer with it), and a
``--load`` resumes the schedule exactly. The lr of optimizer step k (k = 0 for the first step):

- constant: lr.
- warmup (Open-Sora's LinearWarmupLR): (k+1)/(W+1) * lr for k < W, then lr; no decay.
- 1cycle (the replication's "bump"): cosine from min_lr up to max_lr over W steps, cosine from
  max_lr down to lr over the next C steps, then lr. f(k, a->b, n) = b + (a-b)/2 (cos(pi k/n) + 1).
"""

from __future__ import annotations

import math


def _cos(k: int, a: float, b: float, n: int) -> float:
    return b + (a - b) / 2 * (math.cos(math.pi * k / n) + 1)


def lr_at(step: int, optim) -> float:
    """The lr for optimizer step `step` under an OptimConfig."""
    if optim.schedule == "warmup" and step < optim.warmup_steps:
        return (step + 1) / (optim.warmup_steps + 1) * optim.lr
    if optim.schedule == "1cycle":
        if step < optim.warmup_steps:
            return _cos(step, optim.min_lr, optim.max_lr, optim.warmup_steps)
        if step < optim.warmup_steps + optim.cooldown_steps:
            return _cos(step - optim.warmup_steps, optim.max_lr, optim.lr, optim.cooldown_steps)
    return optim.lr
