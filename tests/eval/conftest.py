"""The eval tests' shared run, made once per session: the ingested demo root, a tiny-encoder latent
cache made by the real `cache plan/run` (tiny LTX VAE, tiny T5), a `--cache` loader manifest, and
2-process torchrun training of the debug stage writing checkpoints at steps 2 and 4 (slow: every
test that takes it is marked so)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import built_once, private_copy, quiet_env, tiny_cache_config, train

from reelcache.cli import main

RUN = "evalrun"


@pytest.fixture(scope="session")
def trained(ingested, tmp_path_factory) -> Path:
    """A data root with a tiny cache over 10 clips, its loader manifest `lat`, and runs/evalrun with
    checkpoints at steps 2 and 4 from a 2-process run (wandb offline): built once for the session (a cache
    run and a 2-rank training, ~30 CPU-s), this worker's copy."""
    return private_copy(tmp_path_factory, built_once(tmp_path_factory, "eval", lambda r: build(r, ingested)), "eval")


def build(root: Path, ingested: Path) -> None:
    from reelcache.catalog.manifest import make_manifest

    shutil.copytree(ingested, root, dirs_exist_ok=True)
    make_manifest(root, "m", "clip_id IN (SELECT clip_id FROM clips WHERE status = 'ok' ORDER BY clip_id LIMIT 10)")
    cfg = tiny_cache_config(root / "cache.toml", "m")
    out = subprocess.run(
        [sys.executable, "-m", "reelcache", "cache", "plan", "--root", str(root), "--config", str(cfg)],
        check=True,
        capture_output=True,
        text=True,
        env=quiet_env(),
    )
    assert main(["cache", "run", "--root", str(root), "--device", "cpu", *out.stdout.split()]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    assert main(["catalog", "manifest", "--root", str(root), "--name", "lat", "--cache", "t"]) == 0
    args = [f"--run.name={RUN}", '--data.manifests=[{name="lat"}]', "--run.max_steps=4", "--checkpoint.every=2"]
    train(root, [*args, "--checkpoint.keep_last=10", "--run.epochs=20"], nproc=2, timeout=300, env=quiet_env())
    assert sorted(c.name for c in (root / "runs" / RUN).glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000004"]


@pytest.fixture(scope="session")
def run_copy(trained):
    """``run_copy(name, steps)``: a copy of the run's checkpoints as runs/<name>, so a test's eval/ files
    never meet another's; returns "runs/<name>"."""

    def copy(name: str, steps=(2, 4)) -> str:
        dst = trained / "runs" / name
        shutil.rmtree(dst, ignore_errors=True)
        for s in steps:
            shutil.copytree(trained / "runs" / RUN / f"ckpt-{s:08d}", dst / f"ckpt-{s:08d}")
        return f"runs/{name}"

    return copy
