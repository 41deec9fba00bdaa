"""The evaluation server on CPU with the debug configs, against a real run.

The run is real end to end: the ingested demo root, a tiny-encoder latent cache made by the real
`cache plan/run` (tiny LTX VAE, tiny T5), a `--cache` loader manifest, and 2-process torchrun
training of the debug stage writing checkpoints. The server runs as a real subprocess and is
killed with SIGKILL. References are independent of the code under test: PyAV reads the mp4s,
wandb's own offline file format holds the logged rows. (The VAE decoder is tested beside the
encoders, in test_encoders.py.)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reelcache.cli import main
from wandb_files import history, run_files

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "configs/eval/debug-prompts.txt"
RUN = "evalrun"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "REELCACHE_PROGRESS": "0", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
            "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def trained(ingested, tmp_path_factory) -> Path:
    """A data root with a tiny cache over 10 clips, its loader manifest `lat`, and runs/evalrun with
    checkpoints at steps 2 and 4 from a 2-process run (wandb offline)."""
    from reelcache.catalog.manifest import make_manifest

    root = tmp_path_factory.mktemp("eval") / "root"
    shutil.copytree(ingested, root)
    make_manifest(root, "m", "clip_id IN (SELECT clip_id FROM clips WHERE status = 'ok' ORDER BY clip_id LIMIT 10)")
    cfg = root / "cache.toml"
    cfg.write_text((REPO / "configs/cache/tiny.toml").read_text().replace('manifest = "demo-stage1"', 'manifest = "m"')
                   .replace('name = "tiny"', 'name = "t"')
                   .replace("configs/buckets/demo.toml", str(REPO / "configs/buckets/demo.toml"))
                   .replace("workers = 2", "workers = 1"))
    out = subprocess.run([sys.executable, "-m", "reelcache", "cache", "plan", "--root", str(root), "--config",
                          str(cfg)], check=True, capture_output=True, text=True, env=_env())
    assert main(["cache", "run", "--root", str(root), "--device", "cpu", *out.stdout.split()]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    assert main(["catalog", "manifest", "--root", str(root), "--name", "lat", "--cache", "t"]) == 0
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(_port()), "-m", "reelcache.train", "configs/train/debug/stage1.toml", "--root", str(root),
                        f"--run.name={RUN}", '--data.manifests=[{name="lat"}]', "--run.max_steps=4",
                        "--run.ckpt_every=2", "--run.keep_last=10", "--run.epochs=20"],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert sorted(c.name for c in (root / "runs" / RUN).glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000004"]
    return root


def _serve(root: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "reelcache", "eval", "serve", "--root", str(root), "--run",
                             f"runs/{RUN}", "--prompts", str(PROMPTS), "--val-manifest", "lat", "--preset", "debug",
                             "--device", "cpu", "--poll", "0.2", "--val-max-clips", "5", *extra],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wandb_files_rows(run_dir: Path) -> list[dict]:
    """History rows of every offline run file under the run's wandb/ folder (training's and eval's)."""
    return [row for f in run_files(run_dir) for row in history(f)]


def _corrupt_copy(run_dir: Path, src: str, step: int) -> Path:
    """A complete-looking checkpoint (state.json present) whose model shard is garbage."""
    dst = run_dir / f"ckpt-{step:08d}"
    shutil.copytree(run_dir / src, dst)
    for f in (dst / "model").glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return dst


def test_serve_in_order_skips_partial_survives_kill_and_logs_to_the_run(trained):
    import av

    run = trained / "runs" / RUN
    out = run / "eval"
    # a checkpoint being written (never renamed): must be ignored; a corrupt one: logged, the server goes on
    partial = run / ".tmp-ckpt-00000006"
    shutil.copytree(run / "ckpt-00000004", partial)
    (partial / "state.json").unlink()
    bad = _corrupt_copy(run, "ckpt-00000002", 3)

    p = _serve(trained, "--max-attempts", "1")
    try:
        deadline = time.monotonic() + 120
        while not (out / "ckpt-00000002/debug/done.json").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-3000:]
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)              # mid-run: it is on ckpt-00000003 or -4 now
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
    first = (out / "ckpt-00000002/debug/done.json").stat().st_mtime_ns

    p = _serve(trained, "--max-attempts", "1", "--exit-idle", "1")
    log, _ = p.communicate(timeout=180)
    assert p.returncode == 0, log[-4000:]
    assert (out / "ckpt-00000002/debug/done.json").stat().st_mtime_ns == first     # not redone
    assert "eval: ckpt-00000002" not in log
    assert not (out / ".tmp-ckpt-00000006").exists() and not (out / "ckpt-00000006").exists()
    assert (out / "ckpt-00000003/debug/error-1.txt").exists() and not (out / "ckpt-00000003/debug/done.json").exists()
    assert "ckpt-00000003 FAILED" in log or "ckpt-00000003 failed" in log
    done = {s: json.loads((out / f"ckpt-0000000{s}/debug/done.json").read_text()) for s in (2, 4)}
    assert done[2]["seconds"] > 0 and (out / "ckpt-00000002/debug/done.json").stat().st_mtime_ns < \
        (out / "ckpt-00000004/debug/done.json").stat().st_mtime_ns             # step order

    # videos: decodable H.264 with the preset's frame count and (even) size, one per prompt
    for s in (2, 4):
        vids = sorted((out / f"ckpt-0000000{s}/debug").glob("sample_*.mp4"))
        assert [v.name for v in vids] == ["sample_0.mp4", "sample_1.mp4"]
        for v in vids:
            with av.open(str(v)) as c:
                st = c.streams.video[0]
                frames = [f.to_ndarray(format="rgb24") for f in c.decode(st)]
                assert st.codec_context.name == "h264" and st.codec_context.pix_fmt == "yuv420p"
            assert len(frames) == 17 and frames[0].shape == (72, 128, 3)

    # validation loss: finite, per bucket, and the parquet holds both checkpoints
    import duckdb

    vl = {s: json.loads((out / f"ckpt-0000000{s}/val_loss.json").read_text()) for s in (2, 4)}
    for v in vl.values():
        assert v["clips"] == 5 and math.isfinite(v["overall"]) and v["buckets"]
        assert sum(b["clips"] for b in v["buckets"].values()) == v["clips"]
        assert len(v["timesteps"]) == 10
    assert vl[2]["overall"] != vl[4]["overall"]
    rows = duckdb.sql(f"SELECT global_step, loss FROM '{out / 'val_loss.parquet'}' WHERE bucket = 'all' AND t IS NULL "
                      "ORDER BY 1").fetchall()
    assert rows == [(2, vl[2]["overall"]), (4, vl[4]["overall"])]

    # wandb: the training run's offline files (same run id) hold the trainer's rows and the eval rows
    run_id = (run / "wandb_id").read_text()
    assert all(run_id in d.name for d in run.glob("wandb/offline-run-*"))
    hist = wandb_files_rows(run)
    assert [r["global_step"] for r in hist if "train/loss" in r] == [0, 1, 2, 3]
    ev = {}
    for r in hist:
        if "eval/debug/val_loss" in r:
            ev[r["eval/global_step"]] = r
    assert sorted(ev) == [2, 4]
    for s, r in ev.items():
        assert r["eval/debug/val_loss"] == vl[s]["overall"]
        for b, x in vl[s]["buckets"].items():
            assert r[f"eval/debug/val_loss/{b}"] == x["loss"]
        for i, prompt in enumerate(PROMPTS.read_text().splitlines()[1:]):
            key = f"eval/debug/video_{i}/"                 # media items are stored as nested keys
            assert r[key + "_type"] == "video-file" and r[key + "caption"] == prompt
            assert r[key + "path"].endswith(".mp4") and r[key + "size"] > 0
    shutil.rmtree(bad)                          # the other tests use the real checkpoints only


def test_every_selects_a_stable_grid_of_saves():
    from reelcache.eval.evaluate import select

    ckpts = [Path(f"ckpt-{s:08d}") for s in (200, 300, 400, 600, 700, 1000, 1050)]     # 100 and 500 pruned
    assert [int(c.name[5:]) for c in select(ckpts, 2, 100)] == [200, 400, 600, 1000, 1050]
    assert select(ckpts, 1, 100) == ckpts


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
    assert max(v["clips"] for v in a["buckets"].values()) > 1          # some batch holds several clips
    assert a["overall"] == pytest.approx(b["overall"], rel=1e-5)
    assert all(a["buckets"][k]["loss"] == pytest.approx(b["buckets"][k]["loss"], rel=1e-5) for k in a["buckets"])


def test_once_with_the_training_weights(trained):
    """`eval once --weights model`: its own tag and files; the non-EMA weights give another loss than
    the EMA ones (after 4 steps at decay 0.99 the EMA is still near the initial weights)."""
    out = trained / "runs" / RUN / "eval" / "ckpt-00000004"
    args = ["eval", "once", "--root", str(trained), "--run", f"runs/{RUN}", "--checkpoint", "ckpt-00000004",
            "--preset", "debug", "--val-manifest", "lat", "--val-max-clips", "2", "--device", "cpu",
            "--wandb-mode", "disabled"]
    assert main(args + ["--weights", "model"]) == 0
    assert main(args) == 0
    model = json.loads((out / "debug-model/done.json").read_text())
    ema = json.loads((out / "debug/done.json").read_text())
    assert model["weights"] == "model" and ema["weights"] == "ema" and "videos" not in model
    assert model["val_loss"]["clips"] == 2 and model["val_loss"]["overall"] != ema["val_loss"]["overall"]
    assert json.loads((out / "val_loss-model.json").read_text())["overall"] == model["val_loss"]["overall"]
