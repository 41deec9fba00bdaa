"""What every stage reads from a video container the same way: which stream is the video, and
its sample aspect ratio. Ingest probes with these and the cache decodes with them, so the
catalog's metadata always describes the stream whose frames are encoded."""

from __future__ import annotations

from fractions import Fraction

import av


def video_stream(container):
    """The first video stream that is not an attached picture (cover art), or None."""
    return next((s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic), None)


def sample_aspect_ratio(stream) -> Fraction:
    """As ffprobe guesses it: the container's, else the bitstream's, else 1."""
    for sar in (stream.sample_aspect_ratio, stream.codec_context.sample_aspect_ratio):
        if sar and sar > 0:
            return Fraction(sar)
    return Fraction(1)
