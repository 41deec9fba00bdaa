"""The wheel installs only `reelcache.*`: bare train/cache/catalog/ingest are not ours to take."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_contains_only_the_reelcache_namespace(tmp_path):
    # Build from a copy of the tracked files: setuptools never prunes a stale build/ folder.
    files = subprocess.run(["git", "ls-files"], cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("reelcache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"reelcache", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for stage in ("ingest", "catalog", "cache", "train", "eval"):
        assert f"reelcache/{stage}/__init__.py" in names
    assert "reelcache/catalog/schema.sql" in names


def test_bare_stage_names_are_not_importable(tmp_path):
    code = (
        "import importlib.util as u, reelcache.catalog, reelcache.ingest, reelcache.cache, reelcache.train,"
        " reelcache.eval; print([n for n in ('train','cache','catalog','ingest','eval') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_cli_starts_without_heavy_imports(tmp_path):
    code = (
        "import sys; from reelcache.cli import build_parser; build_parser();"
        "print([m for m in ('torch','duckdb','av','pyarrow','matplotlib') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_stages_import_only_catalog_and_the_root():
    """DESIGN.md: ingest, cache and train depend on catalog and reelcache/, never on each other;
    eval, the stage after train, composes cache's encoders with train's model and sampler."""
    import re

    allowed = {
        "ingest": {"catalog"},
        "cache": {"catalog"},
        "train": {"catalog"},
        "catalog": set(),
        "eval": {"catalog", "cache", "train"},
    }
    for stage, ok in allowed.items():
        for path in (REPO / stage).glob("*.py"):
            for other in re.findall(r"reelcache\.(\w+)", path.read_text()):
                if other in allowed and other != stage:
                    assert other in ok, f"{path.relative_to(REPO)} imports reelcache.{other}"


def test_root_cli_only_assembles_the_stages():
    """A stage owns its commands (<stage>/cli.py: add_commands, add_demo); reelcache/cli.py registers
    them in pipeline order and runs them, naming no stage module and declaring no stage argument."""
    import re

    from reelcache.cli import STAGES, build_parser

    src = (REPO / "reelcache/cli.py").read_text()
    assert not re.findall(r"reelcache\.(?:ingest|catalog|cache|train|eval)\b", src)
    assert src.count("add_argument(") == 1  # --version
    assert set(STAGES) == {p.name for p in REPO.iterdir() if (p / "cli.py").exists()} - {"reelcache"}
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"ingest", "catalog", "cache", "train", "loader", "cluster", "eval", "demo"} <= set(top.choices)
