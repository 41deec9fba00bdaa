"""reelcache/media.py's write_mp4 (eval's samples, the viewer's previews), read back by ffprobe."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from reelcache.media import write_mp4


def test_write_mp4_writes_h264_yuv420p_of_even_sides_and_leaves_no_temporary(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (5, 33, 47, 3), dtype=np.uint8)
    path = write_mp4(frames, tmp_path / "out" / "s.mp4", fps=12.0)
    probe = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-show_streams", "-of", "json", str(path)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (stream,) = json.loads(probe.stdout)["streams"]
    assert (stream["codec_name"], stream["pix_fmt"]) == ("h264", "yuv420p")
    assert (stream["width"], stream["height"], int(stream["nb_read_frames"])) == (46, 32, 5)  # odd sides dropped
    assert stream["r_frame_rate"] == "12/1"
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.mp4"]
