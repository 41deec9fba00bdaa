"""A cache unit's windows (cache/decode.py, cache/run.py: decoded): a window equals those frames of a
full decode, also read in place from a tar; rotated clips come out upright as ffmpeg shows them; seeds
use the whole clip id; and a decode stream closed early frees every shared-memory block."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest


def test_decoded_window_equals_frames_of_a_full_decode(tmp_path):
    import av

    from reelcache.cache.decode import FileSlice, decode_window
    from reelcache.ingest.demo import ClipSpec, write_clip

    path = tmp_path / "c.mp4"
    write_clip(path, ClipSpec("c.mp4", 640, 360, Fraction(30), 4.0))
    got = decode_window(str(path), frames=9, interval=3, height=144, width=240, start=70)
    with av.open(str(path)) as c:
        full = [f for f in c.decode(video=0)]
    ref = []
    for f in full[70 : 70 + 27 : 3]:
        rgb = f.reformat(width=256, height=144, format="rgb24", interpolation="AREA").to_ndarray()
        ref.append(rgb[:, 8:248])
    assert got.dtype == np.uint8 and np.array_equal(got, np.stack(ref))
    # the same bytes read in place from inside a tar give the same frames
    tar = tmp_path / "s.tar"
    with tarfile.open(tar, "w") as t:
        t.add(path, "k.mp4")
    with tarfile.open(tar) as t:
        m = t.getmember("k.mp4")
    inside = decode_window(
        FileSlice(str(tar), m.offset_data, m.size), frames=9, interval=3, height=144, width=240, start=70
    )
    assert np.array_equal(inside, got)
    with pytest.raises(ValueError, match="clip ended"):
        decode_window(str(path), frames=9, interval=3, height=144, width=240, start=110)


@pytest.mark.slow  # decode worker processes
def test_closing_the_decode_stream_early_frees_every_block(tmp_path):
    """A unit that stops early (an encoder error, a kill) closes the stream: the window handed out is
    the consumer's to release; every other block (queued, finished out of order, or being written
    by a worker when it was stopped) is gone from /dev/shm."""
    from reelcache.cache.decode import decode_clip
    from reelcache.cache.run import decoded
    from reelcache.ingest.demo import ClipSpec, write_clip

    jobs = []
    for i in range(10):
        write_clip(tmp_path / f"c{i}.mp4", ClipSpec(f"c{i}.mp4", 320, 180, Fraction(30), 2.0))
        jobs.append(
            dict(
                clip_id=f"c{i}",
                raw_shard=f"c{i}.mp4",
                raw_offset=0,
                file_size=(tmp_path / f"c{i}.mp4").stat().st_size,
                num_frames=17,
                interval=1,
                height=144,
                width=256,
                window_start=0,
                fps=30.0,
            )
        )
    stream = decoded(jobs, str(tmp_path), workers=2, timeout=60, memory_mb=None, prefetch=2)
    job, frames = next(stream)
    assert np.array_equal(frames.array, decode_clip(job, str(tmp_path)))
    # the workers run ahead (queued, in the pipe, in flight): wait until they hold blocks beside the one handed out
    deadline = time.monotonic() + 60
    while len(list(Path("/dev/shm").glob(f"rc{os.getpid()}-*"))) < 3:
        assert time.monotonic() < deadline, "the workers made no window past the first two"
        time.sleep(0.01)
    stream.close()
    assert [p.name for p in Path("/dev/shm").glob(f"rc{os.getpid()}-*")] == [frames.shm.name.lstrip("/")]
    frames.release()
    assert not [p for p in Path("/dev/shm").glob(f"rc{os.getpid()}-*")]


def test_a_block_left_empty_by_a_killed_worker_is_removed(tmp_path):
    """A decode worker killed (its timeout) between creating its block and sizing it leaves an empty
    /dev/shm file, which SharedMemory() refuses to map: the unit's cleanup still removes it (CI saw the
    `cannot mmap an empty file` fail a unit and leave its blocks behind)."""
    from reelcache.cache.run import unlink_shared

    name = f"rc{os.getpid()}-empty-{tmp_path.name}"
    os.close(os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # as shm_open left it
    assert os.stat(f"/dev/shm/{name}").st_size == 0
    unlink_shared(name)
    assert not Path(f"/dev/shm/{name}").exists()
    unlink_shared(name)  # gone already (or never made): nothing to do


def test_rotated_clips_decode_upright_like_ffmpeg_autorotate(tmp_path):
    from reelcache.cache.decode import decode_window
    from reelcache.ingest.demo import ClipSpec, write_clip

    if not shutil.which("ffmpeg"):
        pytest.skip("ffmpeg is not installed")
    p = tmp_path / "rot.mp4"
    write_clip(p, ClipSpec("rot.mp4", 128, 64, Fraction(25), 1.0, rotation=90, crf=0))
    ours = decode_window(str(p), frames=1, interval=1, height=128, width=64)[0]
    raw = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", str(p), "-frames:v", "1", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
        check=True,
        capture_output=True,
    ).stdout
    assert np.array_equal(ours, np.frombuffer(raw, np.uint8).reshape(128, 64, 3))


def test_seeds_use_the_whole_clip_id():
    from reelcache.cache.decode import clip_seed, window_start

    prefix = "openvid/videos/part-000123/" + "x" * 40
    a, b = prefix + "_clip_00001.mp4", prefix + "_clip_00002.mp4"
    assert clip_seed("sample", 0, a) != clip_seed("sample", 0, b)
    assert clip_seed("sample", 0, a) != clip_seed("sample", 1, a) != clip_seed("window", 1, a)
    starts = [window_start(f"{prefix}_clip_{i:05d}.mp4", 0, 100_000, 33) for i in range(200)]
    assert len(set(starts)) > 190  # a prefix-only hash gives one start for all 200
    assert 0 <= clip_seed("sample", 0, a) < 2**64 and window_start(a, 0, 40, 33) <= 7
