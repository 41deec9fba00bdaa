"""`reelcache eval once` of one checkpoint of a real run (conftest.py): the validation loss and the
sampled videos against references computed from their definitions (not from eval/'s helpers), and
one-line refusals of broken checkpoints. The model is built from the checkpoint's config.json and
weights; the clip's latent is read straight from its shard with tarfile + safetensors. (The VAE
decoder is tested beside the encoders, in test_encoders.py.)"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from support import REPO

from reelcache.cli import main

# Every test here evaluates the checkpoints of the session's real 2-process run (conftest.py): slow.
pytestmark = pytest.mark.slow

PROMPTS = REPO / "configs/eval/debug-prompts.txt"
RUN = "evalrun"  # the run conftest.py's `trained` writes


def test_validation_loss_does_not_depend_on_batching(trained):
    import torch

    from reelcache.catalog.manifest import resolve_manifest
    from reelcache.eval.evaluate import Evaluator
    from reelcache.eval.valloss import validation_loss

    ev = Evaluator(root=trained, run_dir=f"runs/{RUN}", val_manifest="lat")
    model, _ = ev._model(trained / "runs" / RUN / "ckpt-00000004")
    m = resolve_manifest(trained, "lat")
    a = validation_loss(model, m, trained, device=torch.device("cpu"), batch_size=1, timesteps=2, max_clips=6)
    b = validation_loss(model, m, trained, device=torch.device("cpu"), batch_size=4, timesteps=2, max_clips=6)
    assert a["timestep_values"] == [250.0, 750.0] and a["clips"] == 6
    assert max(v["clips"] for v in a["buckets"].values()) > 1  # some batch holds several clips
    assert a["overall"] == pytest.approx(b["overall"], rel=1e-5)
    assert all(a["buckets"][k]["loss"] == pytest.approx(b["buckets"][k]["loss"], rel=1e-5) for k in a["buckets"])


def test_once_with_the_training_weights(trained, run_copy):
    """`eval once --weights model`: its own tag and files; the non-EMA weights give another loss than
    the EMA ones (after 4 steps at decay 0.99 the EMA is still near the initial weights). On a copy of
    the run: the server's test (test_serve.py) expects the run's own eval/ untouched."""
    run = run_copy("once", steps=(4,))
    out = trained / run / "eval" / "ckpt-00000004"
    args = [
        "eval",
        "once",
        "--root",
        str(trained),
        "--run",
        run,
        "--checkpoint",
        "ckpt-00000004",
        "--preset",
        "debug",
        "--val-manifest",
        "lat",
        "--val-max-clips",
        "2",
        "--device",
        "cpu",
        "--wandb-mode",
        "disabled",
    ]
    assert main(args + ["--weights", "model"]) == 0
    assert main(args) == 0
    model = json.loads((out / "debug-model/done.json").read_text())
    ema = json.loads((out / "debug/done.json").read_text())
    assert model["weights"] == "model" and ema["weights"] == "ema" and "videos" not in model
    assert model["val_loss"]["clips"] == 2 and model["val_loss"]["overall"] != ema["val_loss"]["overall"]
    assert json.loads((out / "val_loss-model.json").read_text())["overall"] == model["val_loss"]["overall"]


@pytest.mark.parametrize("weights", ["model", "ema"])
def test_once_of_a_checkpoint_missing_a_shard_is_one_line_and_writes_nothing(trained, capsys, weights):
    """A checkpoint copied without one of its shards (the index still names it): one line naming the
    file, exit 2, no eval/ folder; before, a FileNotFoundError traceback from inside safetensors."""
    run = trained / "runs" / f"noshard-{weights}"
    shutil.copytree(trained / "runs" / RUN, run, ignore=shutil.ignore_patterns("eval", "wandb"))
    ckpt = run / "ckpt-00000004"
    shard = sorted((ckpt / weights).glob("*.safetensors"))[0]
    assert shard.name in (ckpt / weights / "model.safetensors.index.json").read_text()
    shard.unlink()
    args = ["eval", "once", "--root", str(trained), "--run", str(run), "--checkpoint", ckpt.name,
            "--preset", "debug", "--val-manifest", "lat", "--val-max-clips", "1", "--device", "cpu",
            "--wandb-mode", "disabled", "--weights", weights]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 2
    err = [e for e in capsys.readouterr().err.splitlines() if "error" in e]
    assert len(err) == 1 and f"{weights}/{shard.name} is missing" in err[0], err
    assert not (run / "eval").exists()
    shutil.rmtree(run)


def test_once_of_a_checkpoint_whose_index_is_cut_short_is_one_line(trained, capsys):
    """A shard index cut short by a copy: one line naming it, exit 2, no eval/ folder (was a
    JSONDecodeError traceback)."""
    run = trained / "runs" / "cutindex"
    shutil.copytree(trained / "runs" / RUN, run, ignore=shutil.ignore_patterns("eval", "wandb"))
    index = run / "ckpt-00000004" / "ema" / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    args = ["eval", "once", "--root", str(trained), "--run", str(run), "--checkpoint", "ckpt-00000004",
            "--preset", "debug", "--val-manifest", "lat", "--val-max-clips", "1", "--device", "cpu",
            "--wandb-mode", "disabled"]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 2
    err = [e for e in capsys.readouterr().err.splitlines() if "error" in e]
    assert len(err) == 1 and "ema/model.safetensors.index.json is not a shard index" in err[0], err
    assert not (run / "eval").exists()
    shutil.rmtree(run)


def _stdit(ckpt: Path, which: str = "model"):
    from reelcache.train.config import from_dict
    from reelcache.train.model import STDiT3
    from reelcache.train.weights import load_weights

    cfg = from_dict(json.loads((ckpt / "config.json").read_text()))
    model = STDiT3(cfg.model.stdit3())
    load_weights(model, ckpt, which=which)
    return model.float().eval(), cfg


def _shift(t: float, height: int, width: int, frames: int) -> float:
    """Open-Sora 1.2's timestep_transform (OPENSORA12.md §2), one sample."""
    ratio = math.sqrt(height * width / 512**2) * math.sqrt(1 if frames == 1 else frames // 17 * 5)
    tn = t / 1000
    return 1000 * ratio * tn / (1 + (ratio - 1) * tn)


def _luma_psnr(a, b) -> float:
    """PSNR of BT.601 luma: yuv420p halves chroma in both directions, and the tiny random VAE's
    frames are noise-like, so an RGB PSNR is ~17 dB even for the very same frames (luma: ~35 dB)."""
    import numpy as np

    w = np.array([0.299, 0.587, 0.114])
    mse = np.mean((np.asarray(a, np.float64) @ w - np.asarray(b, np.float64) @ w) ** 2)
    return 10 * math.log10(255**2 / mse)


@pytest.fixture(scope="module")
def once_ref(trained, run_copy) -> tuple[Path, str]:
    """`eval once` of ckpt-00000002's training weights on a run copy: the first clip's validation
    loss and the debug preset's two sample videos. Returns (root, run)."""
    run = run_copy("evalref", steps=(2,))
    assert (
        main(
            [
                "eval",
                "once",
                "--root",
                str(trained),
                "--run",
                run,
                "--checkpoint",
                "ckpt-00000002",
                "--preset",
                "debug",
                "--weights",
                "model",
                "--prompts",
                str(PROMPTS),
                "--val-manifest",
                "lat",
                "--val-max-clips",
                "1",
                "--val-batch",
                "1",
                "--device",
                "cpu",
                "--wandb-mode",
                "disabled",
            ]
        )
        == 0
    )
    return trained, run


def test_validation_loss_of_one_clip_from_its_definition(once_ref):
    """docs/EVAL.md / eval/valloss.py: the first clip in clip-id order, t = 50, 150, ..., 950 WITHOUT the
    resolution shift, the posterior MEAN, noise from blake2b("val-noise|<clip id>|<k>"), loss =
    mean over C, T, H, W of (v - (x0 - eps))^2 with x_t = (1 - t/1000) x0 + t/1000 eps."""
    import hashlib
    import tarfile
    import tomllib

    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load as load_safetensors

    from reelcache.base.buckets import bucket_hw
    from reelcache.catalog.manifest import resolve_manifest

    root, run = once_ref
    ckpt = root / run / "ckpt-00000002"
    reported = json.loads((root / run / "eval/ckpt-00000002/val_loss-model.json").read_text())
    model, cfg = _stdit(ckpt)
    clip = min(pq.read_table(resolve_manifest(root, "lat")).to_pylist(), key=lambda r: r["clip_id"])
    with tarfile.open(root / clip["shard"]) as tar:
        member = next(m for m in tar.getmembers() if m.offset_data == clip["shard_offset"])
        latent = load_safetensors(tar.extractfile(member).read())
    with tarfile.open(root / clip["text_shard"]) as tar:  # the caption embedding: stored once, in its own shard
        member = next(m for m in tar.getmembers() if m.offset_data == clip["text_offset"])
        latent["text"] = load_safetensors(tar.extractfile(member).read())["text"]
    x0 = latent["mean"].float()[None]
    assert latent["logvar"].float().exp().mean() > 0.1  # a posterior draw would move the loss a lot
    res, frames, ar = clip["bucket"].split("/")
    height, width = bucket_hw(res, ar)
    interval = tomllib.loads((REPO / cfg.data.buckets).read_text()).get("frame_interval", 1)
    fps = cfg.conditioning.default_fps if math.isnan(clip["fps"]) else clip["fps"]
    y = latent["text"].float()[None]
    kwargs = {
        "y": y,
        "mask": torch.ones(1, y.shape[1], dtype=torch.bool),
        "fps": torch.tensor([float(fps // interval)]),  # the trainer's floor(fps / frame_interval)
        "height": torch.tensor([float(height)]),
        "width": torch.tensor([float(width)]),
    }
    mine = {}
    with torch.no_grad():
        for k in range(10):
            t = (k + 0.5) * 100
            h = hashlib.blake2b(f"val-noise|{clip['clip_id']}|{k}".encode(), digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(h, "big") & (2**63 - 1))
            eps = torch.randn(x0.shape[1:], generator=gen)[None]
            x_t = (1 - t / 1000) * x0 + t / 1000 * eps
            v = model(x_t, torch.tensor([t]), **kwargs)[:, : x0.shape[1]]
            mine[f"{t:g}"] = float((v - (x0 - eps)).pow(2).mean())
    assert reported["clips"] == 1 and reported["buckets"] == {clip["bucket"]: {"loss": reported["overall"], "clips": 1}}
    assert reported["timesteps"] == pytest.approx(mine, rel=1e-5)
    assert reported["overall"] == pytest.approx(sum(mine.values()) / 10, rel=1e-5)
    # the shift would move t noticeably in this bucket: t = 500 -> about 456
    assert abs(_shift(500, height, width, int(frames)) - 500) > 20


def test_sample_video_is_the_guided_euler_sampler_decoded(once_ref):
    """The debug preset's sample_1.mp4 (prompt 1: seed 42 + 1) against the definition: z ~ N(0, 1)
    from a CPU generator seeded 43; t_i = (1 - i/4) * 1000 shifted for 17 x 72 x 128; Euler
    z += dt v with dt = (t_i - t_{i+1}) / 1000, the last dt = t_3 / 1000; v = v_u + 7 (v_c - v_u),
    where v_u takes the model's null caption y_embedding[:L] under the prompt's own mask; fps 24;
    then the cache's VAE decodes it (VideoEncoder.decode, tested in test_encoders.py)."""
    import av
    import numpy as np
    import torch

    from reelcache.cache.encoders import TextEncoder, VideoEncoder
    from reelcache.cache.plan import load_cache

    root, run = once_ref
    model, _ = _stdit(root / run / "ckpt-00000002")
    cache_cfg, _, _ = load_cache(root, "t")
    vae, t5 = VideoEncoder(cache_cfg.video_encoder, "cpu"), TextEncoder(cache_cfg.text_encoder, "cpu")
    prompts = [ln for ln in PROMPTS.read_text().splitlines() if ln and not ln.startswith("#")]
    i, frames, height, width, steps, guidance = 1, 17, 72, 128, 4, 7.0
    y = t5.encode(prompts)[i].float()[None]
    null = model.y_embedder.y_embedding[: y.shape[1]][None]
    shape = vae.encode(np.zeros((1, frames, height, width, 3), np.uint8))["mean"].shape[1:]
    kwargs = {
        "mask": torch.ones(1, y.shape[1], dtype=torch.bool),
        "fps": torch.tensor([24.0]),
        "height": torch.tensor([float(height)]),
        "width": torch.tensor([float(width)]),
    }
    ts = [_shift((1 - n / steps) * 1000, height, width, frames) for n in range(steps)]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(42 + i))[None]
    with torch.no_grad():
        for n, t in enumerate(ts):
            v_c = model(z, torch.tensor([t]), y=y, **kwargs)[:, :4]
            v_u = model(z, torch.tensor([t]), y=null, **kwargs)[:, :4]
            z = z + (t - ts[n + 1] if n < steps - 1 else t) / 1000 * (v_u + guidance * (v_c - v_u))
    ref = vae.decode(z, frames)[0].numpy()
    with av.open(str(root / run / f"eval/ckpt-00000002/debug-model/sample_{i}.mp4")) as c:
        video = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    assert video.shape == ref.shape == (frames, height, width, 3)
    # crf 18 keeps ~35 dB of luma here; guidance off gives ~21 dB, the unshifted schedule ~29 dB,
    # another seed ~22 dB
    psnr = _luma_psnr(video, ref)
    assert psnr > 32, f"sample_{i}.mp4 vs the reference: luma PSNR {psnr:.1f} dB"


PRESET_TABLE = {
    "low4s": (102, 360, 640, 8, 30),
    "high4s": (102, 720, 1280, 2, 30),
    "low16s": (408, 360, 640, 2, 30),
    "debug": (17, 72, 128, 2, 4),
}


def test_each_preset_reaches_the_sampler_and_the_videos(trained, monkeypatch, tmp_path, run_copy):
    """`eval once --preset P` for every preset, with the sampler, the VAE decoder and the mp4 writer
    replaced by recorders (720p x 102 frames does not sample on a CPU): each sampler batch gets the
    preset's batch size, steps, guidance, pixel size, frame count (rounded to 1 + k x the VAE's
    temporal ratio) and fps, and starts from the seed 42 + i noise; the videos are written at 24 fps."""
    import pyarrow.parquet as pq
    import torch

    import reelcache.eval.evaluate
    import reelcache.eval.samples
    from reelcache.cache.encoders import VideoEncoder
    from reelcache.catalog.manifest import resolve_manifest

    run = run_copy("presets", steps=(2,))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS.read_text() + "a dog and a cyclist on the beach\n")  # 3 prompts
    # the tiny VAE's ratios, from the cache: a 33-frame 192 x 192 clip has 17 x 24 x 24 latents
    clip = min(pq.read_table(resolve_manifest(trained, "lat")).to_pylist(), key=lambda r: r["clip_id"])
    assert clip["bucket"] == "144p/33/1.00" and clip["shape"][1:] == [17, 24, 24]
    r, f = 2, 8

    sampled, decoded, written = [], [], []

    def euler_sample(model, z, y, mask, **kw):
        sampled.append((z.clone(), kw))
        return z

    def decode(self, z, num_frames):
        decoded.append(num_frames)
        return torch.zeros((z.shape[0], num_frames, 2, 2, 3), dtype=torch.uint8)

    def write_mp4(frames, path, fps=24.0, crf=18):
        written.append((Path(path).name, fps))
        return Path(path)

    # where the evaluator looks them up (its modules import them by name)
    monkeypatch.setattr(reelcache.eval.samples, "euler_sample", euler_sample)
    monkeypatch.setattr(VideoEncoder, "decode", decode)
    monkeypatch.setattr(reelcache.eval.evaluate, "write_mp4", write_mp4)
    for name, (frames, height, width, batch, steps) in PRESET_TABLE.items():
        for record in (sampled, decoded, written):
            record.clear()
        assert (
            main(
                [
                    "eval",
                    "once",
                    "--root",
                    str(trained),
                    "--run",
                    run,
                    "--checkpoint",
                    "ckpt-00000002",
                    "--preset",
                    name,
                    "--prompts",
                    str(prompts),
                    "--cache",
                    "t",
                    "--device",
                    "cpu",
                    "--wandb-mode",
                    "disabled",
                ]
            )
            == 0
        )
        n = 1 + (frames - 1) // r * r  # every preset size is a multiple of the tiny VAE's 8
        assert [len(z) for z, _ in sampled] == [min(batch, 3 - i) for i in range(0, 3, batch)], name
        i = 0
        for z, kw in sampled:
            b = len(z)
            assert (kw["steps"], kw["cfg_scale"]) == (steps, 7.0), name
            got = {k: torch.as_tensor(kw[k]).tolist() for k in ("height", "width", "num_frames", "fps")}
            assert got == {"height": [height] * b, "width": [width] * b, "num_frames": [n] * b, "fps": [24.0] * b}, name
            for zj in z:
                noise = torch.randn(
                    (4, 1 + (n - 1) // r, height // f, width // f), generator=torch.Generator().manual_seed(42 + i)
                )
                assert torch.equal(zj, noise), (name, i)
                i += 1
        assert decoded == [n] * 3 and written == [(f"sample_{j}.mp4", 24.0) for j in range(3)], name
        done = json.loads((trained / run / f"eval/ckpt-00000002/{name}/done.json").read_text())
        assert (done["preset"], done["frames"], len(done["videos"])) == (name, n, 3)


def test_once_over_a_val_manifest_whose_store_shard_is_gone_is_one_line(trained, capsys):
    """Issue 30.5: a store shard the validation manifest names, deleted after caching: one line naming the
    shard, its cache unit and how to write it again, exit 2, no eval/ folder (was a traceback)."""
    import pyarrow.parquet as pq

    from reelcache.catalog.manifest import resolve_manifest

    manifest = resolve_manifest(trained, "lat")
    rows = sorted(pq.read_table(manifest).to_pylist(), key=lambda r: (r["clip_id"], r.get("view") or 0))
    shard = rows[0]["shard"]  # the first clip's video latent: in every --val-max-clips
    unit = shard.split("/")[3][:6]
    assert shard.startswith("store/video/t/")
    run = trained / "runs" / "lostshard"
    shutil.copytree(trained / "runs" / RUN / "ckpt-00000004", run / "ckpt-00000004")
    saved = (trained / shard).read_bytes()
    (trained / shard).unlink()
    try:
        args = ["eval", "once", "--root", str(trained), "--run", str(run), "--checkpoint", "latest",
                "--preset", "debug", "--val-manifest", "lat", "--val-max-clips", "1", "--device", "cpu",
                "--wandb-mode", "disabled"]  # fmt: skip
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
    finally:
        (trained / shard).write_bytes(saved)
    r = trained
    assert err == [
        f"reelcache: error: latent shard {shard} is missing: it was written by unit t/{unit} of cache 't'; write it "
        f"again: delete latents/t/{unit}.parquet (the unit's sidecar), run `reelcache cache run --root {r} "
        f"t/{unit}` and `reelcache catalog merge --root {r}`, then make the manifest again (or re-plan the cache: "
        f"`reelcache cache plan`) (named by 1 of {manifest.name}'s rows)"  # --val-max-clips 1: one row checked
    ], err
    assert not (run / "eval").exists()
    shutil.rmtree(run)
