"""Ingest's filters: which rows and probed files are rejects, each with a reason of the one reject
vocabulary (reelcache/rejects.py: ``Reason``).

A filter is a plain function ``(row or probe, thresholds) -> None | (Reason, detail)``: with its
thresholds bound, a step of the unit runner (base/units.py). A unit applies ``ROW_FILTERS``
before touching the file and ``PROBE_FILTERS`` after probing it, in order, and records the first
reason that fires. The probe itself raises ``Rejected`` for what it finds in the file (missing,
empty, too large, undecodable, truncated, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from reelcache.rejects import Reason
from reelcache.settings import check, setting


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
