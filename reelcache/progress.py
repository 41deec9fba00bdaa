"""Progress bars for long work, on stderr so that stdout stays machine-readable.

Bars show count, rate and ETA when stderr is a terminal; under GNU parallel or CI (no tty)
they stay silent and the caller prints one summary line instead, so logs are not flooded.
Status lines are ``say`` (reelcache/log.py).
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

__all__ = ["bar", "fmt_eta"]


def bar(total_or_iterable=None, desc: str = "", unit: str = "it", **kw) -> tqdm:
    """A tqdm bar over a count (``bar(n)``) or an iterable (``bar(rows)``)."""
    force = os.environ.get("REELCACHE_PROGRESS")
    disable = {"1": False, "0": True}.get(force, not sys.stderr.isatty())
    if isinstance(total_or_iterable, int) or total_or_iterable is None:
        kw["total"] = total_or_iterable
    else:
        kw["iterable"] = total_or_iterable
    return tqdm(desc=desc, unit=unit, disable=disable, dynamic_ncols=True, smoothing=0.1, file=sys.stderr, **kw)


def fmt_eta(seconds: float) -> str:
    """A duration for humans: 42s, 7m05s, 3h02m, 2d04h (a stage's ETA runs to days)."""
    s = max(0, int(round(seconds)))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s" if m else f"{s}s"
