"""Why a row is rejected: a fixed vocabulary, and the filters that apply it.

A filter is a plain function ``(row or probe, thresholds) -> None | (Reason, detail)``: with its
thresholds bound, a step of the unit runner (base/units.py). A unit applies ``ROW_FILTERS``
before touching the file and ``PROBE_FILTERS`` after probing it, in order, and records the first
reason that fires. The probe itself raises ``Rejected`` for what it finds in the file (missing,
empty, too large, undecodable, truncated, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from reelcache.settings import check, setting


class Reason(str, Enum):
    bad_row = "bad_row"  # the table row itself is malformed (no path, wrong field count)
    duplicate_row = "duplicate_row"  # same path listed again in the same source
    empty_caption = "empty_caption"  # no caption text
    missing_file = "missing_file"  # path does not exist (or is not a regular file)
    empty_file = "empty_file"  # zero bytes
    too_large = "too_large"  # file over --max-file-mb
    no_video_stream = "no_video_stream"  # container has no video stream (audio only, image sequence...)
    undecodable = "undecodable"  # container or bitstream FFmpeg cannot read, or no decoder
    truncated = "truncated"  # index points past the end of file / fewer frames than stated
    too_short = "too_short"  # fewer than --min-frames frames or --min-seconds
    timeout = "timeout"  # probe or decode did not finish within its time limit
    crashed = "crashed"  # the probe process died on this file (e.g. a decoder segfault)
    withdrawn = "withdrawn"  # the same video (content hash) was withdrawn by a takedown (catalog/withdrawn.py)


class Rejected(Exception):
    """Raised by a probe: this file cannot be used, for this reason."""

    def __init__(self, reason: Reason, detail: str = ""):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self):  # crosses the process boundary from probe workers
        return Rejected, (self.reason, self.detail)


@dataclass(frozen=True)
class Thresholds:
    max_file_mb: float | None = setting(
        None, "reject larger files; the Open-Sora 1.2 recipe caps at 50 MB; None = no cap", gt=0
    )
    min_frames: int = setting(17, "reject shorter clips; one temporal-VAE chunk (17 frames -> 5 latent frames)", ge=0)
    min_seconds: float = setting(0.0, "reject clips shorter than this many seconds", ge=0)

    def __post_init__(self):
        check(self)


def bad_row(row, t):
    if row.get("row_error"):
        return Reason.bad_row, row["row_error"]
    if not row.get("relpath"):
        return Reason.bad_row, "no video path in this row"


def duplicate_row(row, t):
    if row.get("duplicate_of") is not None:
        return Reason.duplicate_row, f"same path as row {row['duplicate_of']}"


def empty_caption(row, t):
    if not (row.get("text") or "").strip():
        return Reason.empty_caption, "caption is empty"


def too_short(p, t):
    if p["num_frames"] < t.min_frames:
        return Reason.too_short, f"{p['num_frames']} frames < --min-frames {t.min_frames}"
    if p["duration"] is not None and p["duration"] < t.min_seconds:
        return Reason.too_short, f"{p['duration']:.2f} s < --min-seconds {t.min_seconds}"


ROW_FILTERS = [bad_row, duplicate_row, empty_caption]
PROBE_FILTERS = [too_short]
