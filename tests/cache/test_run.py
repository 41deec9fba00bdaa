"""The latent cache: bucket assignment, windowed decode, tiny encoders end to end, identity,
SIGKILL, corrupt clips, GNU parallel."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from support import REPO, cache_config, cache_plan, sql

from reelcache.catalog.buckets import BucketConfig, bucket_hw
from reelcache.cli import main

# -- buckets -------------------------------------------------------------------------------
CFG = BucketConfig.from_dict({"720p": {51: [1.0, 2]}, "240p": {51: [1.0, 8], 102: [1.0, 4]}, "144p": {1: [1.0, 64]}})


@pytest.mark.parametrize(
    "h,w,frames,bucket,hw",
    [
        (720, 1280, 120, "720p/51/0.56", (720, 1280)),  # eligible at 720p, 120 > 51
        (360, 640, 110, "240p/102/0.56", (240, 426)),  # 230,400 < 0.8 x 921,600: falls to 240p; 110 > 102
        (1280, 720, 60, "720p/51/1.78", (1280, 720)),  # portrait: H/W = 1.78
        (286, 286, 52, "240p/51/1.00", (320, 320)),  # 81,796 >= 0.8 x 102,240 = 81,792: eligible
        (285, 286, 52, None, None),  # 81,510 < 81,792: too small for 240p; 144p is images only
        (144, 256, 1, "144p/1/0.56", (144, 256)),  # a single frame goes to the image bucket
    ],
)
def test_bucket_assignment_hand_computed(h, w, frames, bucket, hw):
    a = CFG.assign("clip", h, w, frames)
    assert a.bucket == bucket and (hw is None or (a.height, a.width) == hw)
    if bucket is None:
        assert a.reason == "too_short"  # eligible at 144p by size, but only single frames go there


def test_bucket_reasons_interval_and_tables():
    assert CFG.assign("c", 100, 100, 500).reason == "too_small"
    slow = BucketConfig.from_dict({"240p": {51: [1.0, 8]}}, frame_interval=2)
    assert slow.assign("c", 240, 426, 102).reason == "too_short" and slow.assign("c", 240, 426, 103).bucket
    assert bucket_hw("240p", "0.56") == (240, 426) and bucket_hw("720p", "0.56") == (720, 1280)
    assert CFG.batch_size("240p/102/0.56") == 4


def test_keep_probability_is_deterministic_and_demotes():
    cfg = BucketConfig.from_dict({"720p": {51: [0.3, 2]}, "240p": {51: [1.0, 8]}})
    ids = [f"clip{i}" for i in range(4000)]
    a = [cfg.assign(c, 720, 1280, 60, seed=1).bucket for c in ids]
    assert a == [cfg.assign(c, 720, 1280, 60, seed=1).bucket for c in ids]  # pure function
    top = sum(b.startswith("720p") for b in a) / len(a)
    assert 0.27 < top < 0.33 and all(b.startswith(("720p", "240p")) for b in a)  # the rest demoted
    assert a != [cfg.assign(c, 720, 1280, 60, seed=2).bucket for c in ids]


def test_length_keep_probability_and_never_entries_demote_as_open_sora():
    """Open-Sora's bucket.py: a (p_res, p_t) length is tried only when a draw passes p_t, else the
    next shorter length; a (0.0, None) length that a clip reaches demotes it to the next resolution."""
    cfg = BucketConfig.from_dict({"240p": {51: [1.0, 20], 102: [[1.0, 0.33], 10]}})
    got = [cfg.assign(f"c{i}", 240, 426, 150).bucket for i in range(4000)]
    share = sum(b == "240p/102/0.56" for b in got) / len(got)
    assert 0.30 < share < 0.36 and set(got) == {"240p/51/0.56", "240p/102/0.56"}
    assert cfg.assign("c", 240, 426, 60).bucket == "240p/51/0.56"  # 102 does not fit: no draw needed
    never = BucketConfig.from_dict({"480p": {51: [1.0, 5], 102: [0.0, 0]}, "240p": {102: [1.0, 10]}})
    assert never.assign("c", 480, 854, 150).bucket == "240p/102/0.56"  # reaches 480p x 102: demoted
    assert never.assign("c", 480, 854, 60).bucket == "480p/51/0.56"  # stops at 480p x 51: kept
    with pytest.raises(ValueError, match="no batch size"):
        never.batch_size("480p/102/0.56")


# -- decode --------------------------------------------------------------------------------
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


def test_closing_the_decode_stream_early_frees_every_block(tmp_path):
    """A unit that stops early (an encoder error, a kill) closes the stream: the window handed out is
    the consumer's to release; every other block (queued, finished out of order, or being written
    by a worker when it was stopped) is gone from /dev/shm."""
    from reelcache.cache.run import decode_clip, decoded
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
    time.sleep(1.0)  # the workers run ahead: queued, in the pipe, in flight
    stream.close()
    assert [p.name for p in Path("/dev/shm").glob(f"rc{os.getpid()}-*")] == [frames.shm.name.lstrip("/")]
    frames.release()
    assert not [p for p in Path("/dev/shm").glob(f"rc{os.getpid()}-*")]


@pytest.fixture()
def cache_root(fresh_root):
    from reelcache.catalog.manifest import make_manifest

    make_manifest(fresh_root, "m", "true")
    return fresh_root


def test_cache_end_to_end_bit_exact_and_merged(cache_root, tmp_path):
    import torch

    from reelcache.cache.decode import FileSlice, decode_window
    from reelcache.cache.encoders import EncoderSpec, TextEncoder, VideoEncoder
    from reelcache.catalog.latents import read_latent

    cfg = cache_config(tmp_path, "m")
    units = cache_plan(cache_root, cfg)
    assert len(units) >= 2
    assert main(["cache", "run", "--root", str(cache_root), *units]) == 0
    assert main(["catalog", "merge", "--root", str(cache_root)]) == 0
    ((n_ok,),) = sql(cache_root, "SELECT count(*) FROM clips WHERE status = 'ok'")
    rows = sql(
        cache_root,
        "SELECT l.clip_id, l.status, l.bucket, l.shape, l.shard, l.shard_offset, l.num_frames, "
        "l.height, l.width, l.window_start, c.shard, c.shard_offset, c.file_size, c.text, l.text_shard, l.text_offset "
        "FROM latents l JOIN clips c USING (clip_id) ORDER BY 1",
    )
    assert len(rows) == n_ok and all(r[1] == "ok" for r in rows)
    video = VideoEncoder(EncoderSpec("ltx", tiny=True, dtype="float32"))
    text = TextEncoder(EncoderSpec("t5", tiny=True, dtype="float32"))
    clip, _, bucket, shape, shard, off, t, h, w, start, raw, raw_off, size, caption, text_shard, text_off = rows[0]
    frames = decode_window(
        FileSlice(str(cache_root / raw), raw_off, size), frames=t, interval=1, height=h, width=w, start=start
    )
    want = video.encode(frames[None])
    got = read_latent(
        cache_root, {"shard": shard, "shard_offset": off, "text_shard": text_shard, "text_offset": text_off}
    )
    assert torch.equal(got["mean"], want["mean"][0]) and torch.equal(got["logvar"], want["logvar"][0])
    assert torch.equal(got["text"], text.encode([caption])[0]) and list(got["mean"].shape) == shape
    assert got["mean"].dtype == torch.bfloat16 and bucket.startswith("144p/")
    # the loader reads the cache through a --cache manifest
    assert main(["catalog", "manifest", "--root", str(cache_root), "--name", "lat", "--cache", "t"]) == 0
    from reelcache.catalog.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    batches = list(LatentLoader(["lat"], BucketConfig.from_toml(REPO / "configs/buckets/demo.toml"), root=cache_root))
    assert sorted(c for b in batches for c in b["clip_id"]) == [r[0] for r in rows]


def test_identical_captions_are_encoded_once(fresh_root, tmp_path, monkeypatch):
    """Clips share two captions: the text encoder sees each caption once in the unit (across its VAE
    batches too), and every clip stores its caption's embedding."""
    import torch

    from reelcache.cache.encoders import TextEncoder
    from reelcache.catalog.db import open_catalog
    from reelcache.catalog.latents import read_latent
    from reelcache.catalog.manifest import make_manifest

    con = open_catalog(fresh_root, write=True)
    try:
        con.execute(
            "UPDATE clips SET text = CASE WHEN hash(clip_id) % 2 = 0 THEN 'a dog runs' "
            "ELSE 'a red car drives through the city at night' END"
        )
    finally:
        con.close()
    make_manifest(fresh_root, "m", "true")
    (tmp_path / "b.toml").write_text("[buckets.144p]\n9 = [1.0, 2]\n")  # short windows: a quick unit
    unit = cache_plan(fresh_root, cache_config(tmp_path, "m", clips_per_unit=4, buckets=tmp_path / "b.toml"))[0]
    seen = []
    encode = TextEncoder.encode
    monkeypatch.setattr(TextEncoder, "encode", lambda self, texts: seen.extend(texts) or encode(self, texts))
    assert main(["cache", "run", "--root", str(fresh_root), unit]) == 0
    ok = [r for r in _sidecar_rows(fresh_root / "latents/t") if r["status"] == "ok"]
    captions = dict(sql(fresh_root, "SELECT clip_id, text FROM clips"))
    assert len(ok) > 2  # more clips than captions, over several batches of 2
    assert sorted(seen) == sorted({captions[r["clip_id"]] for r in ok}), seen
    by_caption = {}
    for r in ok:
        text = read_latent(fresh_root, r)["text"]
        assert torch.equal(by_caption.setdefault(captions[r["clip_id"]], text), text)


def test_identity_mismatch_is_refused_with_the_difference(cache_root, tmp_path, capsys):
    cache_plan(cache_root, cache_config(tmp_path, "m"))
    assert main(["cache", "plan", "--root", str(cache_root), "--config", str(cache_config(tmp_path, "m", seed=1))]) == 2
    err = capsys.readouterr().err
    assert "another identity" in err and "video_encoder.weights_sha256" in err
    assert (
        main(
            ["cache", "plan", "--root", str(cache_root), "--config", str(cache_config(tmp_path, "m", kind="cogvideox"))]
        )
        == 2
    )


def test_clips_without_bucket_and_corrupt_clips_are_recorded(cache_root, tmp_path):
    ((clip, shard, off, size),) = sql(
        cache_root,
        "SELECT clip_id, shard, shard_offset, file_size FROM clips WHERE status = 'ok' ORDER BY clip_id LIMIT 1",
    )
    with open(cache_root / shard, "r+b") as f:  # scribble over the clip's bytes inside the raw shard
        f.seek(off)
        f.write(os.urandom(size))
    cfg = cache_config(tmp_path, "m", clips_per_unit=100)
    subprocess.run(
        [sys.executable, "-m", "reelcache", "cache", "plan", "--root", str(cache_root), "--config", str(cfg)],
        check=True,
        capture_output=True,
    )
    assert main(["cache", "run", "--root", str(cache_root), "t/000000"]) == 0
    assert main(["catalog", "merge", "--root", str(cache_root)]) == 0
    got = dict(sql(cache_root, "SELECT clip_id, reject_reason FROM latents WHERE status = 'rejected'"))
    assert got[clip] == "undecodable"
    ((n,),) = sql(cache_root, "SELECT count(*) FROM latents")
    ((m,),) = sql(cache_root, "SELECT count(*) FROM clips WHERE status = 'ok'")
    assert n == m  # every planned clip has a row


def test_no_bucket_is_a_recorded_reason(cache_root, tmp_path):
    cfg = cache_config(tmp_path, "m", clips_per_unit=100)
    cfg.write_text(cfg.read_text().replace(str(REPO / "configs/buckets/demo.toml"), str(tmp_path / "b.toml")))
    (tmp_path / "b.toml").write_text("[buckets.720p]\n17 = [1.0, 2]\n")
    cache_plan(cache_root, cfg)
    assert main(["cache", "run", "--root", str(cache_root), "t/000000"]) == 0
    assert main(["catalog", "merge", "--root", str(cache_root)]) == 0
    reasons = dict(sql(cache_root, "SELECT reject_reason, count(*) FROM latents GROUP BY 1"))
    assert set(reasons) <= {"no_bucket:too_small", None} and reasons["no_bucket:too_small"] > 0


def test_sigkill_mid_unit_then_rerun_gives_the_same_latents(cache_root, tmp_path):
    cfg = cache_config(tmp_path, "m", clips_per_unit=100)
    (unit,) = cache_plan(cache_root, cfg)
    cdir, vdir = cache_root / "latents" / "t", cache_root / "store" / "video" / "t"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reelcache", "cache", "run", "--root", str(cache_root), unit],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not any(vdir.glob(".000000-*-00.tar.tmp*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # some samples are in the temporary shard
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cdir / "000000.parquet").exists()
    assert main(["cache", "run", "--root", str(cache_root), unit]) == 0
    store = cache_root / "store"
    killed = {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*.tar")}
    import pyarrow.parquet as pq

    side = pq.read_table(cdir / "000000.parquet").to_pylist()
    shutil.rmtree(cdir)
    shutil.rmtree(store)  # a fresh encode, not a reuse of the store
    cache_plan(cache_root, cfg)
    assert main(["cache", "run", "--root", str(cache_root), unit]) == 0
    assert {str(p.relative_to(store)) for p in store.rglob("*.tar")} == killed.keys()

    def members(data: bytes) -> list[tuple]:
        """Each member's name, safetensors header and tensor bytes. Not compared: the tar headers' mtime
        (the run's) and the order of the safetensors header's keys (serialized from a hash map, it
        changes from process to process), so the header is compared as JSON."""
        out = []
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            for m in t:
                blob = t.extractfile(m).read()
                n = int.from_bytes(blob[:8], "little")
                out.append((m.name, json.loads(blob[8 : 8 + n]), blob[8 + n :]))
        return out

    for name, data in killed.items():
        assert members((store / name).read_bytes()) == members(data), name
    assert pq.read_table(cdir / "000000.parquet").to_pylist() == side
    assert not list(cdir.glob(".*tmp*"))


def test_gnu_parallel_two_slots(cache_root, tmp_path):
    if not shutil.which("parallel"):
        pytest.skip("GNU parallel is not installed")
    units = cache_plan(cache_root, cache_config(tmp_path, "m"))
    (tmp_path / "u.txt").write_text("\n".join(units) + "\n")
    subprocess.run(
        [
            "parallel",
            "--will-cite",
            "-j",
            "2",
            sys.executable,
            "-m",
            "reelcache",
            "cache",
            "run",
            "--root",
            str(cache_root),
            "{}",
            "::::",
            str(tmp_path / "u.txt"),
        ],
        check=True,
        capture_output=True,
    )
    assert main(["catalog", "merge", "--root", str(cache_root)]) == 0
    ((n,),) = sql(cache_root, "SELECT count(*) FROM latents WHERE status = 'ok'")
    ((m,),) = sql(cache_root, "SELECT count(*) FROM clips WHERE status = 'ok'")
    assert n == m


def test_opensora_vae_loads_the_public_key_layout_and_chunks_17_frames(tmp_path):
    import torch
    from safetensors.torch import save_file

    from reelcache.cache.encoders import EncoderSpec, VideoEncoder
    from reelcache.cache.opensora_vae import OpenSoraVAE, latent_frames

    assert [latent_frames(t) for t in (17, 51, 102, 204)] == [5, 15, 30, 60]  # DATASETS.md
    torch.manual_seed(3)
    model = OpenSoraVAE(tiny=True).eval()
    # the file under the published prefixes; that the names under them are the published ones is
    # test_opensora_vae_names_its_tensors_as_the_published_checkpoint's (against the written-out layout)
    state = {f"spatial_vae.module.{k}": v for k, v in model.spatial.state_dict().items()}
    state |= {f"temporal_vae.{k}": v for k, v in model.temporal.state_dict().items()}
    state |= {"scale": model.scale.clone(), "shift": model.shift.clone()}  # the published buffers
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    from reelcache.cache import opensora_vae

    loaded = OpenSoraVAE.from_checkpoint(
        tmp_path, spatial=opensora_vae.TINY_SPATIAL, temporal=opensora_vae.TINY_TEMPORAL
    ).eval()
    x = torch.rand(1, 3, 51, 32, 48) * 2 - 1
    a, b = model.encode(x), loaded.encode(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].shape == (1, 4, 15, 16, 24)
    enc = VideoEncoder(EncoderSpec("opensora-v1.2", tiny=True, dtype="float32"))
    out = enc.encode(np.random.default_rng(0).integers(0, 255, (2, 17, 32, 48, 3), dtype=np.uint8))
    assert out["mean"].shape == (2, 4, 5, 16, 24) and out["mean"].dtype == torch.bfloat16


def test_opensora_vae_names_its_tensors_as_the_published_checkpoint():
    """At the published sizes (built on the meta device: no memory, no init), every tensor the public
    dump lists has that name and shape here, and the per-prefix counts are the published file's, so
    its model.safetensors loads strictly. The reference is the published layout written out
    (tests/opensora_vae12_keys.txt, OPENSORA12.md section 10), not our module's own keys."""
    import ast
    from collections import Counter

    import torch

    from reelcache.cache.opensora_vae import OpenSoraVAE

    with torch.device("meta"):
        model = OpenSoraVAE()
    ours = {f"spatial_vae.module.{k}": tuple(v.shape) for k, v in model.spatial.state_dict().items()}
    ours |= {f"temporal_vae.{k}": tuple(v.shape) for k, v in model.temporal.state_dict().items()}
    ours |= {"scale": tuple(model.scale.shape), "shift": tuple(model.shift.shape)}
    published = dict(
        line.split("#")
        for line in (REPO / "tests/opensora_vae12_keys.txt").read_text().splitlines()
        if not line.startswith("#")
    )
    published = {k: ast.literal_eval(v) for k, v in published.items()}
    assert len(published) == 117 and {k: ours.get(k) for k in published} == published
    attention = "spatial_vae.module.encoder.mid_block.attentions.0"
    for name in ("group_norm", "to_q", "to_k", "to_v", "to_out.0"):
        assert f"{attention}.{name}.weight" in ours and f"{attention}.{name}.bias" in ours
    assert "spatial_vae.module.encoder.conv_norm_out.weight" in ours
    assert any(k.startswith("spatial_vae.module.decoder.up_blocks.") for k in ours)

    def part(k):
        for prefix, what in (
            ("spatial_vae.module.", "spatial"),
            ("temporal_vae.encoder.", "encode"),
            ("temporal_vae.quant_conv.", "encode"),
            ("temporal_vae.decoder.", "decode"),
            ("temporal_vae.post_quant_conv.", "decode"),
        ):
            if k.startswith(prefix):
                return what
        return k

    assert Counter(map(part, ours)) == {"scale": 1, "shift": 1, "spatial": 248, "encode": 133, "decode": 134}


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


# -- issue 9: seeds, write failures, two runs of one unit -----------------------------------
def test_seeds_use_the_whole_clip_id():
    from reelcache.cache.decode import clip_seed, window_start

    prefix = "openvid/videos/part-000123/" + "x" * 40
    a, b = prefix + "_clip_00001.mp4", prefix + "_clip_00002.mp4"
    assert clip_seed("sample", 0, a) != clip_seed("sample", 0, b)
    assert clip_seed("sample", 0, a) != clip_seed("sample", 1, a) != clip_seed("window", 1, a)
    starts = [window_start(f"{prefix}_clip_{i:05d}.mp4", 0, 100_000, 33) for i in range(200)]
    assert len(set(starts)) > 190  # a prefix-only hash gives one start for all 200
    assert 0 <= clip_seed("sample", 0, a) < 2**64 and window_start(a, 0, 40, 33) <= 7


def _sidecar_rows(cdir):
    import pyarrow.parquet as pq

    return pq.read_table(cdir / "000000.parquet").to_pylist()


def run_until_writing(root, unit: str, cdir):
    """`cache run UNIT` in a subprocess, returned once it is writing its first latent shard."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reelcache", "cache", "run", "--root", str(root), unit],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    vdir = Path(root) / "store" / "video" / Path(cdir).name  # the unit's latent shards (cache/store.py)
    while not any(vdir.glob(".000000-*-00.tar.tmp*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return proc


def test_write_failure_fails_the_unit_loudly_and_its_rerun_is_clean(cache_root, tmp_path):
    """A real file-size limit (RLIMIT_FSIZE, as a quota or a full disk would) on the running unit.

    It is set with prlimit once the unit writes its first latent shard, so it hits our own output
    (the shard) in the process that writes it; the decode workers already run without it."""
    import resource

    from reelcache.train.loader import read_sample

    cfg = cache_config(tmp_path, "m", clips_per_unit=100)
    (unit,) = cache_plan(cache_root, cfg)
    cdir = cache_root / "latents" / "t"
    proc = run_until_writing(cache_root, unit, cdir)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "cannot write" in err and "File too large" in err, err[-2000:]
    assert "Traceback" not in err
    assert not (cdir / "000000.parquet").exists()  # not finished, nothing recorded
    store = cache_root / "store"
    assert not list(store.rglob("*.tar")) and not list(store.rglob(".*tmp*")) and not list(store.rglob("*.parquet"))
    assert main(["cache", "run", "--root", str(cache_root), unit]) == 0  # space freed: the clean result
    rows = _sidecar_rows(cdir)
    assert {r["reject_reason"] for r in rows} <= {None, "no_bucket:too_small", "no_bucket:too_short"}
    ok = [r for r in rows if r["status"] == "ok"]
    assert sum(r["shape"][1] * r["shape"][2] * r["shape"][3] * 16 for r in ok) > 64 * 1024  # the limit bit
    for r in ok:
        assert read_sample(str(cache_root / r["shard"]), r["shard_offset"])["mean"].shape == tuple(r["shape"])


def test_two_runs_of_one_unit_never_touch_each_others_files(cache_root, tmp_path):
    from reelcache import UserError
    from reelcache.cache.run import run_unit

    cfg = cache_config(tmp_path, "m", clips_per_unit=100)
    (unit,) = cache_plan(cache_root, cfg)
    cdir = cache_root / "latents" / "t"
    first = run_until_writing(cache_root, unit, cdir)  # it holds the lease and is writing
    assert first.poll() is None, first.communicate()
    second = subprocess.run(
        [sys.executable, "-m", "reelcache", "cache", "run", "--root", str(cache_root), unit],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2 and "is being run by" in second.stderr and f"pid {first.pid}" in second.stderr, (
        second.stderr
    )
    vdir = cache_root / "store" / "video" / "t"
    assert any(vdir.glob(".000000-*-00.tar.tmp*")) or (cdir / "000000.parquet").exists()  # left alone
    with pytest.raises(UserError, match="is being run by"):
        run_unit(str(cache_root), unit)
    assert run_unit(str(cache_root), unit, wait=True) == {"unit": unit, "skipped": True}  # waits, then done
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    rows = _sidecar_rows(cdir)
    from reelcache.train.loader import read_sample

    for r in rows:  # every sample the first run recorded is intact
        if r["status"] == "ok":
            assert read_sample(str(cache_root / r["shard"]), r["shard_offset"])["mean"].shape == tuple(r["shape"])
    assert not (cdir / "000000.lease").exists()


def test_decode_timeouts_are_rejects_the_unit_goes_on_and_no_frames_leak(cache_root, tmp_path):
    """The isolation survives the shared-memory path: killed workers are `timeout` rejects and
    leave no /dev/shm block behind (nor do the clips that made it)."""
    cfg = cache_config(tmp_path, "m", clips_per_unit=100, decode_timeout=0.005)
    (unit,) = cache_plan(cache_root, cfg)
    assert main(["cache", "run", "--root", str(cache_root), unit]) == 0
    rows = _sidecar_rows(cache_root / "latents" / "t")
    reasons = {r["reject_reason"] for r in rows}
    assert "timeout" in reasons and reasons <= {"timeout", None, "no_bucket:too_small", "no_bucket:too_short"}
    assert not [p for p in Path("/dev/shm").glob(f"rc{os.getpid()}-*")]
