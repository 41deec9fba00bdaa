"""A realistic small OpenVid-format dataset, generated with PyAV: the demo's and tests' input.

Clips span 240p-720p, landscape, portrait and square, 23.976-60 fps, 1-10 s, in MP4, MOV,
Matroska and AVI, some with audio, some rotated through the display matrix, with captions of
varied length. Then the bad inputs every real crawl has, one or more of each reject reason:
a missing file, a zero-byte file, random bytes named .mp4, an MP4 cut in half, an audio-only
file, a clip too short, one too large (for the demo's --max-file-mb), an empty caption, a
duplicate row, a malformed CSV row, and rows whose stated frame count disagrees with the file.

Frames are cheap procedural motion (a scrolling gradient with a moving block), encoded with
libx264 ``ultrafast``: a few hundred clips take about a minute on two cores.
"""

from __future__ import annotations

import csv
import random
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from reelcache.ingest.sources import OPENVID_COLUMNS
from reelcache.words import ADJ, CAMERA, PLACES, SUBJECTS, THINGS, VERBS

SIZES = [((426, 240), 30), ((640, 360), 25), ((854, 480), 15), ((1280, 720), 8),
         ((240, 426), 8), ((360, 640), 8), ((480, 480), 6)]
RATES = [Fraction(24000, 1001), Fraction(24), Fraction(25), Fraction(30000, 1001), Fraction(30),
         Fraction(50), Fraction(60)]
CONTAINERS = [(".mp4", 70), (".mkv", 12), (".mov", 10), (".avi", 8)]


def caption(rng: random.Random) -> str:
    s = f"A {rng.choice(ADJ)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} a {rng.choice(PLACES)}"
    extra = rng.choice([0, 0, 1, 1, 2, 3, 5, 8])
    for _ in range(extra):
        s += rng.choice([f", next to a {rng.choice(THINGS)}", f" while a {rng.choice(SUBJECTS)} watches",
                         f", with a {rng.choice(THINGS)} and a {rng.choice(THINGS)} in the background",
                         f". The camera shows the {rng.choice(THINGS)}"])
    return s + "."


@dataclass
class ClipSpec:
    name: str
    width: int
    height: int
    rate: Fraction
    seconds: float
    rotation: int = 0
    audio: bool = False
    noise: bool = False     # incompressible frames: a big file
    crf: int = 30
    faststart: bool = False  # MP4 index (moov) before the data


def write_clip(path: Path, spec: ClipSpec) -> int:
    """Encode one clip; returns its frame count."""
    import av
    import numpy as np

    n = max(1, round(spec.seconds * spec.rate))
    ext = path.suffix
    codec = "mpeg4" if ext == ".avi" else "libx264"
    out = av.open(str(path), "w", options={"movflags": "faststart"} if spec.faststart else None)
    try:
        vs = out.add_stream(codec, rate=spec.rate)
        vs.width, vs.height, vs.pix_fmt = spec.width, spec.height, "yuv420p"
        if codec == "libx264":
            vs.options = {"preset": "ultrafast", "crf": str(0 if spec.noise else spec.crf)}
        if spec.rotation:
            vs.set_display_rotation(spec.rotation)
        aus = out.add_stream("aac", rate=16000) if spec.audio else None
        h, w = spec.height, spec.width
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)),
                         ((xx + yy) * 127 // max(1, w + h))], axis=-1).astype(np.uint8)
        rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
        bs = max(8, min(h, w) // 6)
        for i in range(n):
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8) if spec.noise else np.roll(base, 3 * i, axis=1)
            y0 = (i * 5) % max(1, h - bs)
            x0 = (i * 7) % max(1, w - bs)
            img[y0:y0 + bs, x0:x0 + bs] = (255, 255 - (i * 4) % 256, 0)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            for p in vs.encode(frame):
                out.mux(p)
        for p in vs.encode():
            out.mux(p)
        if aus is not None:
            _mux_tone(out, aus, spec.seconds)
    finally:
        out.close()
    return n


def _write_one(args):
    path, spec = args
    return write_clip(Path(path), spec)


def generate(out_dir: str | Path, n: int = 240, seed: int = 0, workers: int = 2) -> Path:
    """Write ``out_dir/videos/*`` and ``out_dir/OpenVid-demo.csv``; returns the CSV path."""
    from concurrent.futures import ProcessPoolExecutor

    from reelcache.progress import bar

    rng = random.Random(seed)
    out = Path(out_dir)
    vdir = out / "videos"
    vdir.mkdir(parents=True, exist_ok=True)
    specs = []
    for i in range(n):
        (w, h), = rng.choices([s for s, _ in SIZES], weights=[wt for _, wt in SIZES])
        ext, = rng.choices([c for c, _ in CONTAINERS], weights=[wt for _, wt in CONTAINERS])
        seconds = round(min(10.0, 1.0 + rng.expovariate(1 / 2.5)), 2)
        rotation = 90 if ext in (".mp4", ".mov") and rng.random() < 0.05 else 0
        specs.append(ClipSpec(f"clip_{i:05d}{ext}", w, h, rng.choice(RATES), seconds,
                              rotation=rotation, audio=ext != ".avi" and rng.random() < 0.2))
    specials = {"too_short": ClipSpec("short_clip.mp4", 426, 240, Fraction(30), 0.3),
                "too_large": ClipSpec("huge_noise.mp4", 1280, 720, Fraction(30), 0.3, noise=True),
                "cut_index": ClipSpec("cut_in_half.mp4", 640, 360, Fraction(30), 4.0, crf=18, faststart=True),
                "cut_moov": ClipSpec("cut_no_moov.mp4", 640, 360, Fraction(30), 4.0, crf=18),
                "cut_mkv": ClipSpec("cut_in_half.mkv", 640, 360, Fraction(30), 6.0, crf=18),
                "long": ClipSpec("long_take.mp4", 854, 480, Fraction(25), 10.0)}
    jobs = [(str(vdir / s.name), s) for s in specs + list(specials.values())]
    frames = {}
    with ProcessPoolExecutor(workers) as ex, bar(len(jobs), "generating demo clips", "clip") as pbar:
        for (path, spec), nf in zip(jobs, ex.map(_write_one, jobs, chunksize=4)):
            frames[spec.name] = nf
            pbar.update(1)

    # Corrupt what should be corrupt.
    for name in ("cut_in_half.mp4", "cut_no_moov.mp4", "cut_in_half.mkv"):
        cut = vdir / name
        data = cut.read_bytes()
        cut.write_bytes(data[: len(data) // 2])
    (vdir / "zero_bytes.mp4").write_bytes(b"")
    (vdir / "random_bytes.mp4").write_bytes(random.Random(seed).randbytes(20000))
    _write_audio_only(vdir / "audio_only.mp4")

    rows = []

    def row(name, text, nf, fps, secs, rng=rng):
        return [name, text, f"{rng.uniform(4, 6.5):.4f}", f"{rng.uniform(0, 30):.4f}",
                f"{rng.uniform(0.9, 1.0):.4f}", rng.choice(CAMERA), nf, fps, secs]

    for s in specs + list(specials.values()):
        nf = frames[s.name]
        rows.append(row(s.name, caption(rng), nf, f"{float(s.rate):.3f}", f"{float(nf / s.rate):.3f}"))
    rows[3][6] = frames[specs[3].name] + 12          # the table's frame count is wrong
    rows[5][7] = "24.0" if rows[5][7] != "24.000" else "30.0"  # and this one's fps
    rows.append(row("not_there.mp4", caption(rng), 90, "30.000", "3.000"))
    rows.append(row("zero_bytes.mp4", caption(rng), 90, "30.000", "3.000"))
    rows.append(row("random_bytes.mp4", caption(rng), 90, "30.000", "3.000"))
    rows.append(row("audio_only.mp4", caption(rng), 0, "0", "2.000"))
    rows[7][1] = ""                                                      # an empty caption
    rows.append(row(specs[1].name, caption(rng), 0, "", ""))             # a duplicate row
    csv_path = out / "OpenVid-demo.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(OPENVID_COLUMNS)
        w.writerows(rows)
        f.write("broken_row.mp4,\"a caption, with the rest of the row missing\"\n")   # malformed
    return csv_path


def _mux_tone(out, stream, seconds: float, rate: int = 16000) -> None:
    """A 440 Hz tone into an AAC stream of `out`."""
    import av
    import numpy as np

    t = np.arange(int(rate * seconds)) / rate
    frame = av.AudioFrame.from_ndarray((0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None, :],
                                       format="fltp", layout="mono")
    frame.sample_rate = rate
    for p in stream.encode(frame):
        out.mux(p)
    for p in stream.encode():
        out.mux(p)


def _write_audio_only(path: Path) -> None:
    import av

    out = av.open(str(path), "w")
    try:
        _mux_tone(out, out.add_stream("aac", rate=16000), 2.0)
    finally:
        out.close()
