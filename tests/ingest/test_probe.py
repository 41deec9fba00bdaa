"""The probe on real files: exact metadata without decoding, and each reason from a real bad file."""

from __future__ import annotations

from fractions import Fraction

import pytest

from reelcache.ingest.demo import ClipSpec, write_clip
from reelcache.ingest.filters import Rejected
from reelcache.ingest.probe import probe
from reelcache.rejects import Reason


@pytest.mark.parametrize(
    "ext,frames_from", [(".mp4", "header"), (".mov", "header"), (".mkv", "demux"), (".avi", "demux")]
)
def test_frame_count_and_rate_without_decoding(tmp_path, ext, frames_from):
    path = tmp_path / f"c{ext}"
    n = write_clip(path, ClipSpec(path.name, 96, 64, Fraction(30000, 1001), 2.0))
    p = probe(str(path))
    assert p["num_frames"] == n == 60 and p["frames_from"] == frames_from
    if ext != ".avi":  # AVI stores a time base, not the NTSC fraction
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


# --- the encodings a crawl mixes in, each checked against ffprobe (an independent reading) ---------


def _ffprobe(path) -> dict:
    import json
    import shutil
    import subprocess

    if not shutil.which("ffprobe"):
        pytest.skip("ffprobe is not installed (apt-get install ffmpeg): it is this test's reference")
    out = subprocess.run(
        [
            "ffprobe",
            "-v",
            "error",
            "-select_streams",
            "V:0",
            "-count_frames",
            "-show_entries",
            "stream=codec_name,pix_fmt,width,height,sample_aspect_ratio,display_aspect_ratio,"
            "avg_frame_rate,nb_read_frames,bits_per_raw_sample",
            "-of",
            "json",
            str(path),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)["streams"][0]


def _ratio(text) -> Fraction | None:
    """ffprobe's 'a:b' (None for N/A or 0:1)."""
    if not text or ":" not in text or text.startswith("0:"):
        return None
    a, b = text.split(":")
    return Fraction(int(a), int(b))


def _special(tmp_path, key):
    import av

    from reelcache.ingest.demo import CODEC_SPECIALS, codec_specials

    kw, encoder = CODEC_SPECIALS[key]
    if encoder not in av.codecs_available:
        pytest.skip(f"this PyAV/FFmpeg build has no {encoder} encoder")
    spec = codec_specials()[key]
    path = tmp_path / spec.name
    n = write_clip(path, spec)
    return path, n


@pytest.mark.parametrize("key", ["hevc", "vp9", "av1", "ten_bit", "open_gop", "vfr", "fragmented", "anamorphic"])
def test_probe_agrees_with_ffprobe(tmp_path, key):
    path, n = _special(tmp_path, key)
    ref = _ffprobe(path)
    p = probe(str(path))
    assert p["num_frames"] == int(ref["nb_read_frames"]) == n
    assert Fraction(p["fps_num"], p["fps_den"]) == Fraction(ref["avg_frame_rate"])
    assert p["codec"] == ref["codec_name"] and p["pix_fmt"] == ref["pix_fmt"]
    assert (p["coded_width"], p["coded_height"]) == (ref["width"], ref["height"])
    sar = _ratio(ref.get("sample_aspect_ratio")) or Fraction(1)  # N/A: square pixels
    assert Fraction(p["sar_num"], p["sar_den"]) == sar
    # the displayed size: ffprobe's display aspect ratio, at the stored height
    assert p["height"] == ref["height"] and p["width"] == round(ref["width"] * sar)
    if dar := _ratio(ref.get("display_aspect_ratio")):
        assert p["width"] / p["height"] == pytest.approx(float(dar), rel=0.005)
    if key == "ten_bit":
        assert p["bit_depth"] == 10
    if key == "anamorphic":
        assert (p["width"], p["height"]) == (427, 240) and p["aspect_ratio"] == pytest.approx(240 / 427)
    decoded = probe(str(path), verify="decode")
    assert decoded["num_frames"] == n and decoded["frames_from"] == "decode"


def test_cover_art_is_not_a_video_stream(tmp_path):
    from reelcache.ingest.demo import write_audio_only

    path = tmp_path / "song.m4a"
    write_audio_only(path, cover=True)
    with pytest.raises(Rejected) as e:
        probe(str(path))
    assert e.value.reason == Reason.no_video_stream and "attached picture" in e.value.detail


def test_a_cut_webm_fails_even_full_decode_verification(tmp_path):
    import av

    from reelcache.ingest.demo import CODEC_SPECIALS, ClipSpec

    if "libvpx-vp9" not in av.codecs_available:
        pytest.skip("this PyAV/FFmpeg build has no libvpx-vp9 encoder")
    full = tmp_path / "long.webm"
    kw = {k: v for k, v in CODEC_SPECIALS["vp9"][0].items() if k != "name"}
    write_clip(full, ClipSpec(full.name, 160, 96, Fraction(25), 6.0, **kw))
    data = full.read_bytes()
    full.write_bytes(data[: len(data) // 2])
    assert float(_ffprobe_format_duration(full)) == pytest.approx(6.0, abs=0.1)  # the header still says 6 s
    for verify in ("header", "decode"):
        assert _reason(full, verify=verify) == Reason.truncated, verify


def _ffprobe_format_duration(path) -> str:
    import subprocess

    _ffprobe(path)
    return subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_sar_set_by_ffmpeg_in_matroska_and_with_rotation(tmp_path):
    """SAR stored by the container (ffmpeg's setsar into MKV), and SAR then a 90-degree display matrix."""
    import shutil
    import subprocess

    if not shutil.which("ffmpeg"):
        pytest.skip("ffmpeg is not installed (apt-get install ffmpeg)")
    mkv = tmp_path / "setsar.mkv"
    subprocess.run(
        [
            "ffmpeg",
            "-v",
            "error",
            "-f",
            "lavfi",
            "-i",
            "testsrc=size=352x240:rate=25",
            "-t",
            "1",
            "-vf",
            "setsar=40/33",
            "-c:v",
            "libx264",
            "-preset",
            "ultrafast",
            str(mkv),
        ],
        check=True,
    )
    ref = _ffprobe(mkv)
    p = probe(str(mkv))
    sar = _ratio(ref["sample_aspect_ratio"])
    assert sar == Fraction(40, 33) and Fraction(p["sar_num"], p["sar_den"]) == sar
    assert (p["width"], p["height"]) == (round(352 * sar), 240) == (427, 240)
    assert p["width"] / p["height"] == pytest.approx(float(_ratio(ref["display_aspect_ratio"])), rel=0.005)
    rotated = tmp_path / "rotated.mp4"
    write_clip(rotated, ClipSpec(rotated.name, 320, 240, Fraction(25), 1.0, sar=Fraction(4, 3), rotation=90))
    p = probe(str(rotated))
    assert p["rotation"] in (90, 270) and (p["coded_width"], p["coded_height"]) == (320, 240)
    assert (p["width"], p["height"]) == (240, 427) and p["aspect_ratio"] == pytest.approx(427 / 240)
