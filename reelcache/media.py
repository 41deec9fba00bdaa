"""What every stage does with a video container the same way.

Reading: which stream is the video, and its sample aspect ratio. Ingest probes with these and the
cache decodes with them, so the catalog's metadata always describes the stream whose frames are encoded.

Writing (``write_mp4``: eval's sample videos, the viewer's previews): H.264 (libx264), yuv420p, constant
frame rate, through PyAV. yuv420p is what browsers and wandb's player decode everywhere, and it subsamples
chroma 2x2, so both sides must be even: an odd row or column is dropped (never padded with made-up
pixels). The file is written under a temporary name and renamed, so a reader (wandb, a person, a rerun
after a kill) never sees half an mp4.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from reelcache.files import atomic_path


def video_stream(container):
    """The first video stream that is not an attached picture (cover art), or None."""
    return next((s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic), None)


def sample_aspect_ratio(stream) -> Fraction:
    """As ffprobe guesses it: the container's, else the bitstream's, else 1."""
    for sar in (stream.sample_aspect_ratio, stream.codec_context.sample_aspect_ratio):
        if sar and sar > 0:
            return Fraction(sar)
    return Fraction(1)


def write_mp4(frames, path, fps: float = 24.0, crf: int = 18) -> Path:
    """uint8 [T, H, W, 3] (numpy or torch) -> ``path`` (atomic). Returns the path."""
    frames = np.asarray(frames.numpy() if hasattr(frames, "numpy") else frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"need uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
    t, h, w, _ = frames.shape
    h2, w2 = h - h % 2, w - w % 2
    if t == 0 or h2 == 0 or w2 == 0:
        raise ValueError(f"cannot write an mp4 of shape {frames.shape}")
    frames = frames[:, :h2, :w2]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = Fraction(fps).limit_denominator(1001)
    with atomic_path(path) as tmp, av.open(str(tmp), mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w2, h2, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "medium"}
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")))
        out.mux(stream.encode(None))
    return path
