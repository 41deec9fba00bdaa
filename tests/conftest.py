"""Shared fixtures: a small generated OpenVid-format dataset, and that dataset ingested.

Everything is real: clips encoded with PyAV, probed by the real probe, sharded into real tars,
merged into a real DuckDB catalog. Session-scoped so the suite encodes the videos once.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    from reelcache.ingest.demo import generate

    out = tmp_path_factory.mktemp("demo")
    generate(out, n=18, seed=1, workers=2)
    return out


def ingest(root: Path, data: Path, *extra: str, name: str = "openvid") -> list[str]:
    """plan + run every unit (in-process, like one parallel slot) + merge; returns the units."""
    import contextlib
    import io

    from reelcache.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            main(
                [
                    "ingest",
                    "plan",
                    "--root",
                    str(root),
                    "--source",
                    "openvid",
                    "--name",
                    name,
                    "--meta",
                    str(data / "OpenVid-demo.csv"),
                    "--videos",
                    str(data / "videos"),
                    "--rows-per-unit",
                    "8",
                    "--max-file-mb",
                    "8",
                    *extra,
                ]
            )
            == 0
        )
    units = buf.getvalue().split()
    assert main(["ingest", "run", "--root", str(root), *units]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    return units


@pytest.fixture(scope="session")
def ingested(demo_dataset, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("root")
    ingest(root, demo_dataset)
    return root


@pytest.fixture()
def fresh_root(ingested, tmp_path) -> Path:
    """A private copy of the ingested root that a test may change."""
    dst = tmp_path / "root"
    shutil.copytree(ingested, dst)
    return dst


def tiny_cache_config(path: Path, manifest: str, name: str = "t") -> Path:
    """configs/cache/tiny.toml (the demo's cache: tiny LTX and T5, its views) over ``manifest``, named
    ``name``, with its buckets file by absolute path and one decode worker, written to ``path``."""
    repo = Path(__file__).resolve().parents[1]
    path.write_text(
        (repo / "configs/cache/tiny.toml")
        .read_text()
        .replace('manifest = "demo-stage1"', f'manifest = "{manifest}"')
        .replace('name = "tiny"', f'name = "{name}"')
        .replace("configs/buckets/demo.toml", str(repo / "configs/buckets/demo.toml"))
        .replace("workers = 2", "workers = 1")
    )
    return path


def sql(root: Path, query: str):
    from reelcache.catalog.db import open_catalog

    con = open_catalog(root)
    try:
        return con.execute(query).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Three nodes, each a network + UTS + mount namespace with real sshd (tests/cluster_local.py),
    started once for the session; skipped with one line where it cannot start (not root, no sshd)."""
    from cluster_local import local_cluster_or_skip

    with local_cluster_or_skip(tmp_path_factory.mktemp("cluster"), nodes=3) as c:
        yield c
