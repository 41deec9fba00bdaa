"""`make gpu-check`'s script at toy sizes on the CPU (`--tiny`), so the check a lent GPU runs cannot rot:
every part runs the same code as on the GPU (the VAE and T5 classes, the zero2 branch of
train/parallel.py in its CPU mode, the loader, the projection's FLOP counts), only smaller.

References: the latent sizes follow from Open-Sora 1.2's VAE rules (8x down in space; 17 frames -> 5
latent frames, each 17-frame chunk padded to a multiple of 4), the caption size from the tiny preset's
fixture config (16 tokens of 32), the loader's count from the manifest it was given; the markdown table
against the JSON beside it. No timing is asserted: speed is what the check measures, not what it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

SCRIPT = REPO / "bench/gpu_check.py"
# Open-Sora 1.2's VAE at 144p 9:16 (144 x 256 pixels): 18 x 32 latents; 9 frames -> 3, 17 -> 5, 1 -> 1.
LATENTS = {"144p/9": "4x3x18x32", "144p/17": "4x5x18x32", "144p/1": "4x1x18x32"}


def run(out: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "REELCACHE_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    p = run(out, "--tiny")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def rows(doc: dict, part: str) -> dict:
    return {r["bucket"]: r for r in doc["rows"] if r["part"] == part}


@pytest.mark.slow
def test_every_part_runs_the_real_code_at_toy_sizes(tiny):
    doc, _ = tiny
    status = {r["part"]: r["status"] for r in doc["rows"]}
    assert status.pop("kernels").startswith("skipped: no CUDA")  # HybridAdam's CUDA kernels: GPU only
    assert set(status.values()) == {"ran"}, (status, doc["errors"])
    assert set(status) == {"versions", "vae", "t5", "train", "online", "loader", "projection"}
    assert {b: r["numbers"]["latent"] for b, r in rows(doc, "vae").items()} == LATENTS
    assert rows(doc, "t5")["16 tokens"]["numbers"]["hidden"] == "16x32"
    train = rows(doc, "train")
    assert set(train) == set(LATENTS)
    for r in train.values():
        assert r["numbers"]["plugin"] == "zero2 on cpu"  # the ZeRO-2 branch, not the DDP fallback
        assert r["numbers"]["samples_per_s"] > 0 and r["numbers"]["skipped_steps"] == 0


@pytest.mark.slow
def test_cached_vs_online_and_loader(tiny):
    doc, _ = tiny
    on = rows(doc, "online")["144p/17"]["numbers"]
    assert on["ratio"]["rounds"] == 2 and on["ratio"]["median"] > 0
    assert 0 < on["online_encode_share"] < 1
    ld = rows(doc, "loader")["144p/17"]["numbers"]
    assert ld["samples_read"] == ld["manifest_rows"] == 3  # every sample written, read back by the loader
    assert 0 <= ld["data_wait_share"] < 1
    proj = rows(doc, "projection")
    assert set(proj) == set(LATENTS)
    assert all(r["numbers"]["projected_at_assumed_mfu"] > 1 for r in proj.values())  # online costs more
    assert "measured_interleaved" in proj["144p/17"]["numbers"]


@pytest.mark.slow
def test_markdown_is_the_json(tiny):
    doc, md = tiny
    lines = [x for x in md.splitlines() if x.startswith("| ") and not x.startswith(("| part", "| ---"))]
    assert len(lines) == len(doc["rows"])
    for line, r in zip(lines, doc["rows"]):
        assert line.startswith(f"| {r['part']} | {r['bucket']} | {r['status']} |")


@pytest.mark.slow
def test_a_spent_budget_skips_parts_and_says_so(tmp_path):
    p = run(tmp_path, "--tiny", "--budget-s", "5", "--parts", "versions,vae,t5")
    assert p.returncode == 0, p.stderr[-3000:]
    status = {r["part"]: r["status"] for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert status["versions"] == "ran"
    assert status["vae"].startswith("skipped:") and "budget" in status["vae"]
    assert status["t5"].startswith("skipped:") and "budget" in status["t5"]


@pytest.mark.parametrize(
    "args, says", [(["--parts", "vae,nope"], "--parts: unknown ['nope']"), (["--budget-s", "0"], "--budget-s 0")]
)
def test_bad_arguments_are_one_line_before_any_work(tmp_path, args, says):
    out = tmp_path / "out"
    p = run(out, *args, timeout=60)
    assert p.returncode == 2 and says in p.stderr
    assert not out.exists()


def test_gpu_wheels_replaces_the_set_across_file_systems(tmp_path):
    """make gpu-wheels downloads into a temporary folder and moves the set into bench/gpu-wheels/: where the
    temporary folder is on another file system (a tmpfs /tmp, here /dev/shm), a rename fails (EXDEV)."""
    import tempfile

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system (/dev/shm) beside the test's folder")
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_wheels import replace_wheels

    folder = tmp_path / "gpu-wheels"
    folder.mkdir()
    (folder / "old-1.0-py3-none-any.whl").write_bytes(b"old")
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        (Path(tmp) / "new-2.0-py3-none-any.whl").write_bytes(b"new")
        replace_wheels(Path(tmp), folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {"new-2.0-py3-none-any.whl": b"new"}
