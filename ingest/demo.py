"""A realistic small OpenVid-format dataset, generated with PyAV: the demo's and tests' input.

Clips span 240p-720p, landscape, portrait and square, 23.976-60 fps, 1-10 s, in MP4, MOV,
Matroska and AVI, some with audio, some rotated through the display matrix, with captions of
varied length. Then the encodings a real crawl mixes in (each only where this PyAV can encode
it, see ``CODEC_SPECIALS``): HEVC, VP9 in WebM, AV1, 10-bit H.264, B-frames with open GOPs,
variable frame rate, fragmented MP4, and an anamorphic clip (non-square pixels). Then the bad
inputs every real crawl has, one or more of each reject reason: a missing file, a zero-byte
file, random bytes named .mp4, an MP4, an MKV and a WebM cut in half, an audio-only file and
one with cover art (an attached picture is not video), a clip too short, one too large (for the
demo's --max-file-mb), an empty caption, a duplicate row, a malformed CSV row, and rows whose
stated frame count disagrees with the file.

Frames are cheap procedural motion (a scrolling gradient with a moving block), encoded with
libx264 ``ultrafast``: a few hundred clips take about a minute on two cores.
"""

from __future__ import annotations

import csv
import os
import random
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from reelcache.ingest.sources import OPENVID_COLUMNS
from reelcache.progress import bar
from reelcache.words import ADJ, CAMERA, PLACES, SUBJECTS, THINGS, VERBS

SIZES = [
    ((426, 240), 30),
    ((640, 360), 25),
    ((854, 480), 15),
    ((1280, 720), 8),
    ((240, 426), 8),
    ((360, 640), 8),
    ((480, 480), 6),
]
RATES = [
    Fraction(24000, 1001),
    Fraction(24),
    Fraction(25),
    Fraction(30000, 1001),
    Fraction(30),
    Fraction(50),
    Fraction(60),
]
CONTAINERS = [(".mp4", 70), (".mkv", 12), (".mov", 10), (".avi", 8)]


def caption(rng: random.Random) -> str:
    s = f"A {rng.choice(ADJ)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} a {rng.choice(PLACES)}"
    extra = rng.choice([0, 0, 1, 1, 2, 3, 5, 8])
    for _ in range(extra):
        s += rng.choice(
            [
                f", next to a {rng.choice(THINGS)}",
                f" while a {rng.choice(SUBJECTS)} watches",
                f", with a {rng.choice(THINGS)} and a {rng.choice(THINGS)} in the background",
                f". The camera shows the {rng.choice(THINGS)}",
            ]
        )
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
    noise: bool = False  # incompressible frames: a big file
    crf: int = 30
    faststart: bool = False  # MP4 index (moov) before the data
    codec: str | None = None  # default: libx264, mpeg4 in AVI
    pix_fmt: str = "yuv420p"
    options: dict | None = None  # encoder options, e.g. x264-params
    sar: Fraction | None = None  # sample aspect ratio (anamorphic when not 1)
    vfr: bool = False  # frame durations alternate between 1x and 2x the nominal one
    fragmented: bool = False  # fragmented MP4 (moof boxes, no sample table in moov)


# name -> (spec, encoder it needs). Small and short: the demo stays about as quick.
CODEC_SPECIALS = {
    "hevc": (
        dict(name="hevc_clip.mp4", codec="libx265", options={"preset": "ultrafast", "x265-params": "log-level=error"}),
        "libx265",
    ),
    "vp9": (
        dict(name="vp9_clip.webm", codec="libvpx-vp9", options={"deadline": "realtime", "cpu-used": "8"}),
        "libvpx-vp9",
    ),
    "av1": (dict(name="av1_clip.mkv", codec="libsvtav1", options={"preset": "12"}), "libsvtav1"),
    "ten_bit": (dict(name="ten_bit_clip.mp4", pix_fmt="yuv420p10le"), "libx264"),
    "open_gop": (
        dict(
            name="open_gop_clip.mp4",
            options={
                "preset": "veryfast",
                "x264-params": "open-gop=1:bframes=3:b-pyramid=normal:keyint=24:min-keyint=24:scenecut=0",
            },
        ),
        "libx264",
    ),
    "vfr": (dict(name="vfr_clip.mp4", vfr=True), "libx264"),
    "fragmented": (dict(name="fragmented_clip.mp4", fragmented=True), "libx264"),
    "anamorphic": (dict(name="anamorphic_clip.mp4", width=320, height=240, sar=Fraction(4, 3)), "libx264"),
}


def codec_specials() -> dict[str, ClipSpec]:
    """The CODEC_SPECIALS this PyAV/FFmpeg build can encode (426x240, 25 fps, 2.4 s each)."""
    out = {}
    for key, (kw, encoder) in CODEC_SPECIALS.items():
        if encoder in av.codecs_available:
            out[key] = ClipSpec(**{"width": 426, "height": 240, "rate": Fraction(25), "seconds": 2.4, **kw})
    return out


def write_clip(path: Path, spec: ClipSpec) -> int:
    """Encode one clip; returns its frame count."""
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1: errors only, not its banner on every clip
    n = max(1, round(spec.seconds * spec.rate))
    ext = path.suffix
    codec = spec.codec or ("mpeg4" if ext == ".avi" else "libx264")
    movflags = "+".join(
        f for f, on in (("faststart", spec.faststart), ("frag_keyframe+empty_moov", spec.fragmented)) if on
    )
    sched = os.sched_getscheduler(0), os.sched_getparam(0)
    out = av.open(str(path), "w", options={"movflags": movflags} if movflags else None)
    try:
        vs = out.add_stream(codec, rate=spec.rate)
        vs.width, vs.height, vs.pix_fmt = spec.width, spec.height, spec.pix_fmt
        if codec == "libx264":
            vs.options = {"preset": "ultrafast", "crf": str(0 if spec.noise else spec.crf), **(spec.options or {})}
        elif spec.options:
            vs.options = dict(spec.options)
        if spec.sar:
            vs.codec_context.sample_aspect_ratio = spec.sar
        tick, pts = None, 0
        if spec.vfr:  # millisecond timestamps, frame durations 1x, 1x, 2x, ...
            tick = Fraction(1, 1000)
            vs.codec_context.time_base = vs.time_base = tick
            step = round(1000 / spec.rate)
        if spec.rotation:
            vs.set_display_rotation(spec.rotation)
        aus = out.add_stream("aac", rate=16000) if spec.audio else None
        h, w = spec.height, spec.width
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack(
            [(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)), ((xx + yy) * 127 // max(1, w + h))], axis=-1
        ).astype(np.uint8)
        rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
        bs = max(8, min(h, w) // 6)
        for i in range(n):
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8) if spec.noise else np.roll(base, 3 * i, axis=1)
            y0 = (i * 5) % max(1, h - bs)
            x0 = (i * 7) % max(1, w - bs)
            img[y0 : y0 + bs, x0 : x0 + bs] = (255, 255 - (i * 4) % 256, 0)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if tick is not None:
                frame.pts, frame.time_base = pts, tick
                pts += step * (2 if i % 3 == 2 else 1)
            for p in vs.encode(frame):
                out.mux(p)
        for p in vs.encode():
            out.mux(p)
        if aus is not None:
            _mux_tone(out, aus, spec.seconds)
    finally:
        out.close()
        # SVT-AV1 (libsvtav1), run as root, puts the thread that opens it under SCHED_FIFO 99 and leaves it there:
        # everything this process did and started afterwards (ffprobe, workers, a test session's) ran real-time.
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != sched:
            os.sched_setscheduler(0, *sched)
    return n


def _write_one(args):
    path, spec = args
    return write_clip(Path(path), spec)


def generate(out_dir: str | Path, n: int = 240, seed: int = 0, workers: int = 2) -> Path:
    """Write ``out_dir/videos/*`` and ``out_dir/OpenVid-demo.csv``; returns the CSV path."""
    rng = random.Random(seed)
    out = Path(out_dir)
    vdir = out / "videos"
    vdir.mkdir(parents=True, exist_ok=True)
    specs = _random_specs(rng, n)
    specials = _special_specs()
    jobs = [(str(vdir / s.name), s) for s in specs + list(specials.values())]
    frames = {}
    with ProcessPoolExecutor(workers) as ex, bar(len(jobs), "generating demo clips", "clip") as pbar:
        for (_path, spec), nf in zip(jobs, ex.map(_write_one, jobs, chunksize=4)):
            frames[spec.name] = nf
            pbar.update(1)
    _write_bad_files(vdir, seed)
    csv_path = out / "OpenVid-demo.csv"
    _write_csv(csv_path, _rows(rng, specs, list(specials.values()), frames))
    return csv_path


def _random_specs(rng: random.Random, n: int) -> list[ClipSpec]:
    """The `n` ordinary clips: sizes, containers and rates drawn from the weighted tables above."""
    specs = []
    for i in range(n):
        ((w, h),) = rng.choices([s for s, _ in SIZES], weights=[wt for _, wt in SIZES])
        (ext,) = rng.choices([c for c, _ in CONTAINERS], weights=[wt for _, wt in CONTAINERS])
        seconds = round(min(10.0, 1.0 + rng.expovariate(1 / 2.5)), 2)
        rotation = 90 if ext in (".mp4", ".mov") and rng.random() < 0.05 else 0
        specs.append(
            ClipSpec(
                f"clip_{i:05d}{ext}",
                w,
                h,
                rng.choice(RATES),
                seconds,
                rotation=rotation,
                audio=ext != ".avi" and rng.random() < 0.2,
            )
        )
    return specs


def _special_specs() -> dict[str, ClipSpec]:
    """The clips each made for one reject reason or one encoding a crawl mixes in (the cut ones are
    written whole, then cut by _write_bad_files)."""
    specials = {
        "too_short": ClipSpec("short_clip.mp4", 426, 240, Fraction(30), 0.3),
        "too_large": ClipSpec("huge_noise.mp4", 1280, 720, Fraction(30), 0.3, noise=True),
        "cut_index": ClipSpec("cut_in_half.mp4", 640, 360, Fraction(30), 4.0, crf=18, faststart=True),
        "cut_moov": ClipSpec("cut_no_moov.mp4", 640, 360, Fraction(30), 4.0, crf=18),
        "cut_mkv": ClipSpec("cut_in_half.mkv", 640, 360, Fraction(30), 6.0, crf=18),
        "long": ClipSpec("long_take.mp4", 854, 480, Fraction(25), 10.0),
        **codec_specials(),
    }
    if "vp9" in specials:
        specials["cut_webm"] = ClipSpec(
            "cut_in_half.webm",
            426,
            240,
            Fraction(25),
            6.0,
            **{k: v for k, v in CODEC_SPECIALS["vp9"][0].items() if k != "name"},
        )
    return specials


def _write_bad_files(vdir: Path, seed: int) -> None:
    """Corrupt what should be corrupt: cut four clips in half, and write the files that are not video."""
    for name in ("cut_in_half.mp4", "cut_no_moov.mp4", "cut_in_half.mkv", "cut_in_half.webm"):
        cut = vdir / name
        if not cut.exists():
            continue
        data = cut.read_bytes()
        cut.write_bytes(data[: len(data) // 2])
    (vdir / "zero_bytes.mp4").write_bytes(b"")
    (vdir / "random_bytes.mp4").write_bytes(random.Random(seed).randbytes(20000))
    write_audio_only(vdir / "audio_only.mp4")
    write_audio_only(vdir / "cover_art.m4a", cover=True)


def _row(rng: random.Random, name, text, nf, fps, secs) -> list:
    """One OpenVid CSV row (OPENVID_COLUMNS order), with random scores and camera motion."""
    return [
        name,
        text,
        f"{rng.uniform(4, 6.5):.4f}",
        f"{rng.uniform(0, 30):.4f}",
        f"{rng.uniform(0.9, 1.0):.4f}",
        rng.choice(CAMERA),
        nf,
        fps,
        secs,
    ]


def _rows(rng: random.Random, specs: list[ClipSpec], specials: list[ClipSpec], frames: dict) -> list[list]:
    """The CSV's rows: one per written clip, then the table's own faults (a wrong frame count and fps,
    rows for files that are missing or not video, an empty caption, a duplicate row)."""
    rows = []
    for s in specs + specials:
        nf = frames[s.name]
        rows.append(_row(rng, s.name, caption(rng), nf, f"{float(s.rate):.3f}", f"{float(nf / s.rate):.3f}"))
    rows[3][6] = frames[specs[3].name] + 12  # the table's frame count is wrong
    rows[5][7] = "24.0" if rows[5][7] != "24.000" else "30.0"  # and this one's fps
    rows.append(_row(rng, "not_there.mp4", caption(rng), 90, "30.000", "3.000"))
    rows.append(_row(rng, "zero_bytes.mp4", caption(rng), 90, "30.000", "3.000"))
    rows.append(_row(rng, "random_bytes.mp4", caption(rng), 90, "30.000", "3.000"))
    rows.append(_row(rng, "audio_only.mp4", caption(rng), 0, "0", "2.000"))
    rows.append(_row(rng, "cover_art.m4a", caption(rng), 0, "0", "2.000"))
    rows[7][1] = ""  # an empty caption
    rows.append(_row(rng, specs[1].name, caption(rng), 0, "", ""))  # a duplicate row
    return rows


def _write_csv(csv_path: Path, rows: list[list]) -> None:
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(OPENVID_COLUMNS)
        w.writerows(rows)
        f.write('broken_row.mp4,"a caption, with the rest of the row missing"\n')  # malformed


def _mux_tone(out, stream, seconds: float, rate: int = 16000) -> None:
    """A 440 Hz tone into an AAC stream of `out`."""
    t = np.arange(int(rate * seconds)) / rate
    frame = av.AudioFrame.from_ndarray(
        (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None, :], format="fltp", layout="mono"
    )
    frame.sample_rate = rate
    for p in stream.encode(frame):
        out.mux(p)
    for p in stream.encode():
        out.mux(p)


def write_audio_only(path: Path, cover: bool = False) -> None:
    """An AAC tone; with `cover`, plus cover art: a JPEG in a video stream marked as an attached picture."""
    out = av.open(str(path), "w", format="mp4")
    try:
        audio = out.add_stream("aac", rate=16000)
        if cover:
            pic = out.add_stream("mjpeg", rate=1)
            pic.width, pic.height, pic.pix_fmt = 64, 64, "yuvj420p"
            pic.disposition = av.stream.Disposition.attached_pic
            art = av.VideoFrame.from_ndarray(np.full((64, 64, 3), (200, 80, 40), np.uint8), format="rgb24")
            for p in [*pic.encode(art), *pic.encode()]:
                out.mux(p)
        _mux_tone(out, audio, 2.0)
    finally:
        out.close()
