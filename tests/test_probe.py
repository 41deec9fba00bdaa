"""The probe on real files: exact metadata without decoding, and each reason from a real bad file."""

from __future__ import annotations

from fractions import Fraction

import pytest

from reelcache.ingest.demo import ClipSpec, write_clip
from reelcache.ingest.filters import Reason, Rejected
from reelcache.ingest.probe import probe


@pytest.mark.parametrize("ext,frames_from", [(".mp4", "header"), (".mov", "header"), (".mkv", "demux"),
                                             (".avi", "demux")])
def test_frame_count_and_rate_without_decoding(tmp_path, ext, frames_from):
    path = tmp_path / f"c{ext}"
    n = write_clip(path, ClipSpec(path.name, 96, 64, Fraction(30000, 1001), 2.0))
    p = probe(str(path))
    assert p["num_frames"] == n == 60 and p["frames_from"] == frames_from
    if ext != ".avi":      # AVI stores a time base, not the NTSC fraction
        assert (p["fps_num"], p["fps_den"]) == (30000, 1001)
    assert (p["width"], p["height"]) == (96, 64) and p["aspect_ratio"] == pytest.approx(64 / 96)
    assert p["duration"] == pytest.approx(n * 1001 / 30000, abs=0.05)
    assert p["file_size"] == path.stat().st_size and p["bit_depth"] == 8 and p["pix_fmt"] == "yuv420p"


def test_rotation_swaps_displayed_size_and_audio_is_seen(tmp_path):
    path = tmp_path / "portrait.mp4"
    write_clip(path, ClipSpec(path.name, 128, 72, Fraction(25), 1.0, rotation=90, audio=True))
    p = probe(str(path))
    assert p["rotation"] in (90, 270) and (p["coded_width"], p["coded_height"]) == (128, 72)
    assert (p["width"], p["height"]) == (72, 128) and p["has_audio"] is True


def test_full_decode_verification_counts_frames(tmp_path):
    path = tmp_path / "c.mkv"
    write_clip(path, ClipSpec(path.name, 64, 64, Fraction(24), 1.5))
    p = probe(str(path), verify="decode")
    assert p["frames_from"] == "decode" and p["num_frames"] == 36


def _reason(path, **kw):
    with pytest.raises(Rejected) as e:
        probe(str(path), **kw)
    return e.value.reason


def test_bad_files_are_rejected_with_their_reason(tmp_path):
    assert _reason(tmp_path / "missing.mp4") == Reason.missing_file
    (tmp_path / "empty.mp4").write_bytes(b"")
    assert _reason(tmp_path / "empty.mp4") == Reason.empty_file
    (tmp_path / "noise.mp4").write_bytes(bytes(range(256)) * 64)
    assert _reason(tmp_path / "noise.mp4") == Reason.undecodable
    good = tmp_path / "good.mp4"
    write_clip(good, ClipSpec(good.name, 64, 64, Fraction(30), 2.0))
    assert _reason(good, max_file_mb=good.stat().st_size / 2e6) == Reason.too_large
    (tmp_path / "dir.mp4").mkdir()
    assert _reason(tmp_path / "dir.mp4") == Reason.missing_file
    for name, faststart in (("a.mp4", True), ("b.mp4", False), ("c.mkv", False)):
        full = tmp_path / name
        write_clip(full, ClipSpec(name, 160, 120, Fraction(30), 6.0, crf=10, faststart=faststart))
        data = full.read_bytes()
        full.write_bytes(data[: len(data) // 2])
        assert _reason(full) == Reason.truncated, name
