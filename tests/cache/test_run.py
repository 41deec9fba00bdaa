"""`cache run UNIT` (cache/run.py): the cache's steps of the unit runner on real tiny inputs (fast; its
outcome rows and reject vocabulary: test_outputs.py), and their slow twins end to end with tiny
encoders: bit-exact latents, identity, corrupt clips and clips without a bucket recorded, SIGKILL, a
failed write, two runs of one unit, GNU parallel."""

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
from pathlib import Path

import pytest
from support import REPO, cache_config, cache_plan, sql

from reelcache.base.buckets import BucketConfig
from reelcache.cli import main
from reelcache.rejects import Reason


def test_the_finite_step_keeps_a_latent_and_rejects_nan_or_inf():
    """A step of the unit runner: None keeps the row, (reason, detail) rejects it."""
    import torch

    from reelcache.cache.run import finite

    mean = torch.randn(4, 5, 18, 32).bfloat16()
    assert finite({"latents": {"mean": mean, "logvar": torch.zeros_like(mean)}}) is None
    for bad in (float("nan"), float("inf")):
        broken = mean.clone()
        broken[1, 2, 3, 4] = bad
        got = finite({"latents": {"mean": mean, "logvar": broken}})
        assert got == (Reason.invalid_latent, "non-finite values in the encoder output") and got[0] == "invalid_latent"


@pytest.fixture()
def cache_root(fresh_root):
    from reelcache.catalog.manifest import make_manifest

    make_manifest(fresh_root, "m", "true")
    return fresh_root


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
def test_cache_end_to_end_bit_exact_and_merged(cache_root, tmp_path):
    import torch

    from reelcache.base.latents import read_latent
    from reelcache.cache.decode import FileSlice, decode_window
    from reelcache.cache.encoders import TextEncoder, VideoEncoder
    from reelcache.cache.spec import EncoderSpec

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
    from reelcache.train.loader import LatentLoader

    batches = list(LatentLoader(["lat"], BucketConfig.from_toml(REPO / "configs/buckets/demo.toml"), root=cache_root))
    assert sorted(c for b in batches for c in b["clip_id"]) == [r[0] for r in rows]


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
def test_identical_captions_are_encoded_once(fresh_root, tmp_path, monkeypatch):
    """Clips share two captions: the text encoder sees each caption once in the unit (across its VAE
    batches too), and every clip stores its caption's embedding."""
    import torch

    from reelcache.base.latents import read_latent
    from reelcache.cache.encoders import TextEncoder
    from reelcache.catalog.db import open_catalog
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


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
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


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
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


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
def test_no_bucket_is_a_recorded_reason(cache_root, tmp_path):
    cfg = cache_config(tmp_path, "m", clips_per_unit=100)
    cfg.write_text(cfg.read_text().replace(str(REPO / "configs/buckets/demo.toml"), str(tmp_path / "b.toml")))
    (tmp_path / "b.toml").write_text("[buckets.720p]\n17 = [1.0, 2]\n")
    cache_plan(cache_root, cfg)
    assert main(["cache", "run", "--root", str(cache_root), "t/000000"]) == 0
    assert main(["catalog", "merge", "--root", str(cache_root)]) == 0
    reasons = dict(sql(cache_root, "SELECT reject_reason, count(*) FROM latents GROUP BY 1"))
    assert set(reasons) <= {"no_bucket:too_small", None} and reasons["no_bucket:too_small"] > 0


def _grown(paths, past: int = 64 * 1024) -> bool:
    """Whether one of the temporary shards holds more than its first samples' worth of bytes."""
    for p in paths:
        try:
            if p.stat().st_size > past:
                return True
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return False


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
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
    while not _grown(vdir.glob(".000000-*-00.tar.tmp*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # until some samples are in the temporary shard
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


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
def test_gnu_parallel_two_slots(cache_root, tmp_path):
    """`parallel -j 2 reelcache cache run ... :::: units`: the two units run side by side (parallel's job log:
    each started before the other ended) and the merged catalog has an ok latent for each clip of the manifest.
    Two clips, one a unit: each `cache run` costs ~5 CPU-s to start (diffusers, transformers), and what
    parallel does with a unit does not depend on how many clips it holds."""
    from reelcache.catalog.manifest import make_manifest

    if not shutil.which("parallel"):
        pytest.skip("GNU parallel is not installed")
    where = "clip_id IN (SELECT clip_id FROM clips WHERE status = 'ok' ORDER BY clip_id LIMIT 2)"
    make_manifest(cache_root, "two", where)
    units = cache_plan(cache_root, cache_config(tmp_path, "two", clips_per_unit=1))  # a unit per slot
    assert len(units) == 2
    (tmp_path / "u.txt").write_text("\n".join(units) + "\n")
    joblog = tmp_path / "jobs.tsv"
    subprocess.run(
        ["parallel", "--will-cite", "-j", "2", "--joblog", str(joblog), sys.executable, "-m", "reelcache", "cache",
         "run", "--root", str(cache_root), "{}", "::::", str(tmp_path / "u.txt")],
        check=True,
        capture_output=True,
    )  # fmt: skip
    jobs = [line.split("\t") for line in joblog.read_text().splitlines()[1:]]  # Seq Host Starttime JobRuntime ...
    spans = [(float(j[2]), float(j[2]) + float(j[3])) for j in jobs]
    assert len(spans) == 2 and all(start < min(end for _, end in spans) for start, _ in spans), jobs
    assert main(["catalog", "merge", "--root", str(cache_root)]) == 0
    want = sql(cache_root, f"SELECT clip_id FROM clips WHERE {where} ORDER BY 1")
    assert len(want) == 2 and sql(cache_root, "SELECT clip_id FROM latents WHERE status = 'ok' ORDER BY 1") == want


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


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
def test_write_failure_fails_the_unit_loudly_and_its_rerun_is_clean(cache_root, tmp_path):
    """A real file-size limit (RLIMIT_FSIZE, as a quota or a full disk would) on the running unit.

    It is set with prlimit once the unit writes its first latent shard, so it hits our own output
    (the shard) in the process that writes it; the decode workers already run without it."""
    import resource

    from reelcache.train.source import read_sample

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


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
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
    from reelcache.train.source import read_sample

    for r in rows:  # every sample the first run recorded is intact
        if r["status"] == "ok":
            assert read_sample(str(cache_root / r["shard"]), r["shard_offset"])["mean"].shape == tuple(r["shape"])
    assert not (cdir / "000000.lease").exists()


@pytest.mark.slow  # end to end: cache plan and run over the ingested demo
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
