"""The cache's windowed decode against ffmpeg's own displayed frames.

Reference: the ffmpeg CLI decodes every frame (``-fps_mode passthrough``: none dropped or
repeated, so frame k is the k-th displayed frame), autorotates, applies the sample aspect ratio
(``scale=iw*sar:ih,setsar=1``), then resizes (area) to cover the bucket and centre-crops.

Threshold: PSNR >= 32 dB per frame. On these moving circular gradients our one-step swscale
resize and ffmpeg's filter chain agree to 36-41 dB, while the neighbouring frame scores ~21 dB
and a picture squeezed by ignoring the SAR ~19 dB (both asserted below), so the threshold accepts
only the right frame with the right geometry. At native size
(no resize) the two decodes are bit-identical and compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from videos import cover_crop, ffmpeg_frames, lavfi_clip, needs_ffmpeg, psnr

pytestmark = needs_ffmpeg
H, W = 48, 64
THRESHOLD = 32.0


def check_window(path, start, *, frames=8, interval=2, sar="1", height=H, width=W):
    from reelcache.cache.decode import decode_window

    ref = ffmpeg_frames(path, height, width, cover_crop(height, width, sar))
    got = decode_window(str(path), frames=frames, interval=interval, height=height, width=width, start=start)
    scores = [psnr(got[k], ref[start + k * interval]) for k in range(frames)]
    assert min(scores) >= THRESHOLD, [round(s, 1) for s in scores]
    # the threshold separates: the neighbouring frames score below it
    assert max(psnr(got[k], ref[start + k * interval + 1]) for k in range(frames)) < THRESHOLD
    return ref


@pytest.mark.parametrize(
    "name,opts",
    [
        ("cfr", dict(size="160x96")),
        ("yuv420p10", dict(size="160x96", pix_fmt="yuv420p10le")),
        (
            "hevc-10bit",
            dict(size="160x96", codec=("-c:v", "libx265", "-x265-params", "log-level=error"), pix_fmt="yuv420p10le"),
        ),
    ],
)
def test_window_matches_ffmpeg(tmp_path, name, opts):
    p = lavfi_clip(tmp_path / f"{name}.mp4", **opts)
    check_window(p, 0)
    check_window(p, 40)  # beyond the first second: a seek


def test_rotated_clip_is_displayed_upright(tmp_path):
    import subprocess

    plain = lavfi_clip(tmp_path / "plain.mp4", size="160x96")
    p = tmp_path / "rot.mp4"
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-i", str(plain), "-c", "copy", "-metadata:s:v", "rotate=90", str(p)],
        check=True,
        capture_output=True,
    )
    from reelcache.cache.decode import decode_window

    ref = ffmpeg_frames(p, 160, 96)  # displayed portrait, native size: exactly ffmpeg's
    got = decode_window(str(p), frames=8, interval=2, height=160, width=96, start=40)
    assert np.array_equal(got, ref[40:56:2])


def test_anamorphic_clip_is_stretched_to_its_displayed_width(tmp_path):
    p = lavfi_clip(tmp_path / "sar.mp4", size="96x64", vf="setsar=2/1")  # displayed 192 x 64
    ref = check_window(p, 40, sar="sar")
    squeezed = ffmpeg_frames(p, H, W, "setsar=1," + cover_crop(H, W))
    assert psnr(squeezed[40], ref[40]) < THRESHOLD  # ignoring the SAR is caught


def test_variable_frame_rate_clip_is_cut_by_frames(tmp_path):
    from reelcache.cache.decode import decode_window

    # every third frame lasts twice as long: pts x average rate is not the frame index
    p = lavfi_clip(
        tmp_path / "vfr.mp4", size="160x96", vf="setpts='(N+floor(N/3))/(25*TB)'", extra=("-fps_mode", "vfr")
    )
    ref = check_window(p, 40)
    check_window(p, 3, interval=3)
    with pytest.raises(ValueError, match="clip ended"):
        decode_window(str(p), frames=8, interval=2, height=H, width=W, start=len(ref) - 10)


@pytest.mark.parametrize("ext", ["mp4", "ts"])
def test_seek_that_lands_past_the_window_never_repeats_frames(tmp_path, ext):
    """Open GOPs with B-frames: a seek to the keyframe before a window that starts on a leading
    B-frame lands on the keyframe after it (MP4: index by decode time; MPEG-TS: coarse seeking).
    Every window start is checked against ffmpeg's full decode, at native size: exactly."""
    from reelcache.cache.decode import decode_window

    p = lavfi_clip(
        tmp_path / f"og.{ext}",
        size="64x48",
        codec=(
            "-c:v",
            "libx264",
            "-preset",
            "ultrafast",
            "-bf",
            "3",
            "-x264-params",
            "keyint=10:min-keyint=10:open-gop=1:scenecut=0",
        ),
    )
    ref = ffmpeg_frames(p, 48, 64)
    for start in range(26, len(ref) - 3):
        got = decode_window(str(p), frames=3, interval=1, height=48, width=64, start=start)
        assert np.array_equal(got, ref[start : start + 3]), f"window at frame {start}"
