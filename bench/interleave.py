"""Side-by-side measurements for the benches: contenders interleaved, ratios with their spread.

A ratio of two timings taken one after the other measures the machine as much as the code: a
compile, a backup or a test run that starts during the first contender slows only that one, and
the same bench gave 0.9x and 2.3x minutes apart. So every ratio `make bench` prints comes from
rounds: each round runs every contender once, back to back, and the order rotates from round to
round (AB, BA, AB, ... for two), so that load from elsewhere and a slow drift hit all contenders
alike and none is always first. Warm-up calls run before the first round and are not recorded.

A ratio is the median of the per-round ratios (contender over baseline in the same round), with
the spread of those ratios and their count: the min-max range, and from IQR_FROM rounds on the
interquartile range too, which one burst of load cannot stretch. A wide spread says the machine
was busy; the median is what a reader should quote. Interleaving costs a few more repetitions
than one timed run per contender; the benches keep their runtime by making a repetition smaller
(a slice of the clips, one training step) where the measurement allows it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# A spread wider than this (its top over its bottom) is flagged: the median is then a rough
# guess, and the bench is worth rerunning on a quieter machine.
NOISY = 1.3
# From this many rounds on, the spread is the interquartile range (one burst of load from
# elsewhere no longer sets it); with fewer, the min-max range.
IQR_FROM = 6


def rounds(contenders: dict[str, Callable[[int], object]], reps: int, warmup: int = 1) -> dict[str, list]:
    """Run the contenders in `reps` interleaved rounds after `warmup` unrecorded ones.

    Each contender is called with the round's index (warm-up rounds get -1, -2, ...), so that a
    round can work on its own slice of the inputs. The result per contender and round is what
    the callable returns, or its wall seconds when it returns None.
    """
    names = list(contenders)
    out: dict[str, list] = {n: [] for n in names}
    for r in range(-warmup, reps):
        k = r % len(names)  # rotate: every contender leads as often as the others
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            res = contenders[name](r)
            dt = time.perf_counter() - t0
            if r >= 0:
                out[name].append(dt if res is None else res)
    return out


@dataclass
class Ratio:
    """Per-round ratios of a contender over its baseline."""

    values: list[float]

    @classmethod
    def of(cls, num: list[float], den: list[float]) -> Ratio:
        """num[i] / den[i] for each round i (both lists from the same `rounds` call)."""
        assert len(num) == len(den) and num, (len(num), len(den))
        return cls([a / b for a, b in zip(num, den)])

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> tuple[float, float]:
        """The interquartile range from IQR_FROM rounds on, else the min-max range."""
        if len(self.values) >= IQR_FROM:
            q1, _, q3 = statistics.quantiles(self.values, n=4, method="inclusive")
            return q1, q3
        return self.lo, self.hi

    @property
    def noisy(self) -> bool:
        lo, hi = self.spread
        return hi > NOISY * lo

    def short(self) -> str:
        """'1.23x [1.10-1.31]': for tables whose header says what the brackets are (table_note)."""
        lo, hi = self.spread
        return f"{num(self.median)}x [{num(lo)}-{num(hi)}]{' noisy' if self.noisy else ''}"

    def __str__(self) -> str:
        return self.describe()

    def describe(self, what: str = "interleaved pairs") -> str:
        """'1.90x (median of 7 interleaved pairs, range 1.70-2.10x)', with the IQR from IQR_FROM pairs."""
        iqr = f"IQR {num(self.spread[0])}-{num(self.spread[1])}x, " if len(self.values) >= IQR_FROM else ""
        flag = f"; spread over {NOISY}x wide: {busy()}" if self.noisy else ""
        return (
            f"{num(self.median)}x (median of {len(self.values)} {what}, {iqr}"
            f"range {num(self.lo)}-{num(self.hi)}x{flag})"
        )

    def as_dict(self) -> dict:
        return {
            "median": self.median,
            "min": self.lo,
            "max": self.hi,
            "spread": list(self.spread),
            "rounds": len(self.values),
            "per_round": self.values,
        }


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def num(x: float) -> str:
    """A ratio with two decimals, or two significant digits below 0.1 (0.0075, not 0.01)."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def busy() -> str:
    """Why a spread may be wide, with the load average as evidence."""
    return f"a busy machine? (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs), worth a rerun"


def table_note(reps: int) -> str:
    """The line a table of short ratios prints under its header."""
    what = "interquartile range" if reps >= IQR_FROM else "min-max"
    return (
        f"  (ratios: median of the per-round ratios over {reps} interleaved rounds, contenders in rotating "
        f"order; [{what}] of those ratios)"
    )
