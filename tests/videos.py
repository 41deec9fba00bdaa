"""Test videos made by the ffmpeg CLI, and ffmpeg's own decode of them as the reference picture."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

needs_ffmpeg = pytest.mark.skipif(not shutil.which("ffmpeg"), reason="ffmpeg is not installed")


def lavfi_clip(
    path: Path,
    *,
    size="96x64",
    rate=25,
    seconds=4.0,
    vf: str | None = None,
    codec=("-c:v", "libx264"),
    pix_fmt="yuv420p",
    extra=(),
) -> Path:
    """Moving colour gradients encoded by ffmpeg (high quality).

    Smooth but structured content on purpose: two correct resizes of it (ours in one swscale
    call, ffmpeg's in its filter chain) agree to 36-41 dB, while neighbouring frames score ~21 dB
    and a wrongly stretched picture ~19 dB, so a PSNR threshold between them tells the right
    frame and geometry from a wrong one. (A sharp pattern such as testsrc2 puts right and wrong
    both at 20-30 dB; plain gradients barely change when stretched.)"""
    cmd = [
        "ffmpeg",
        "-v",
        "error",
        "-y",
        "-f",
        "lavfi",
        "-i",
        f"gradients=size={size}:rate={rate}:speed=0.3:seed=1:nb_colors=8:type=circular",
        "-t",
        str(seconds),
    ]
    if vf:
        cmd += ["-vf", vf]
    cmd += [*codec, "-pix_fmt", pix_fmt, *(("-crf", "10") if "libx264" in codec else ()), *extra, str(path)]
    subprocess.run(cmd, check=True, capture_output=True)
    return path


def ffmpeg_frames(path: Path, height: int, width: int, vf: str = "") -> np.ndarray:
    """Every frame ffmpeg decodes (no frame dropped or duplicated: passthrough), autorotated, through
    the filter chain `vf`, as rgb24 [N, height, width, 3]."""
    cmd = ["ffmpeg", "-v", "error", "-i", str(path), "-fps_mode", "passthrough"]
    if vf:
        cmd += ["-vf", vf]
    raw = subprocess.run(cmd + ["-f", "rawvideo", "-pix_fmt", "rgb24", "-"], check=True, capture_output=True).stdout
    return np.frombuffer(raw, np.uint8).reshape(-1, height, width, 3)


def cover_crop(height: int, width: int, sar: str = "1") -> str:
    """ffmpeg's filter chain for the displayed picture (SAR applied), cover-resized (area) and centre-cropped."""
    return (
        f"scale=trunc(iw*{sar}/2)*2:ih:flags=bicubic,setsar=1,"
        f"scale=w='max({width},ceil(iw*max({height}/ih,{width}/iw)-0.000001))'"
        f":h='max({height},ceil(ih*max({height}/ih,{width}/iw)-0.000001))':flags=area,format=rgb24,crop={width}:{height}"
    )


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
