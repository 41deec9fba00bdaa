"""Progress bars for long work, on stderr so that stdout stays machine-readable.

Bars show count, rate and ETA when stderr is a terminal; under GNU parallel or CI (no tty)
they stay silent and the caller prints one summary line instead, so logs are not flooded.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def bar(total_or_iterable=None, desc: str = "", unit: str = "it", **kw) -> tqdm:
    """A tqdm bar over a count (``bar(n)``) or an iterable (``bar(rows)``)."""
    force = os.environ.get("REELCACHE_PROGRESS")
    disable = {"1": False, "0": True}.get(force, not sys.stderr.isatty())
    if isinstance(total_or_iterable, int) or total_or_iterable is None:
        kw["total"] = total_or_iterable
    else:
        kw["iterable"] = total_or_iterable
    return tqdm(desc=desc, unit=unit, disable=disable, dynamic_ncols=True, smoothing=0.1, file=sys.stderr, **kw)


def say(msg: str) -> None:
    """One line of human-facing status on stderr."""
    print(msg, file=sys.stderr, flush=True)


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


# Libraries whose import-time and internal chatter is not about the run: bitsandbytes (imported by
# peft, which diffusers imports when installed) warns that an optional CPU kernel cannot be fetched
# from a hub; ColossalAI logs each plugin's set-up; ZeRO 0.5.0 calls torch names torch 2.x deprecates.
QUIET_LOGGERS = ("bitsandbytes", "colossalai")
QUIET_WARNINGS = (
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    r"TypedStorage is deprecated",
)


def quiet_libraries() -> None:
    """Keep libraries' noise off the console: errors still show. Call before they are imported."""
    import logging
    import warnings

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
