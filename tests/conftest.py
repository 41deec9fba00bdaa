"""Shared fixtures: a small generated OpenVid-format dataset, and that dataset ingested.

Everything is real: clips encoded with PyAV, probed by the real probe, sharded into real tars,
merged into a real DuckDB catalog. Session-scoped so the suite encodes the videos once.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests live in folders that mirror the packages and are imported by path (--import-mode=importlib),
# so two folders may each have a test_run.py; what they share comes from tests/support.py and the
# other modules here (videos, latent_data, cluster_local, ...), found through this one path entry.
sys.path.insert(0, str(Path(__file__).parent))


SLOW_KINDS = ("multinode", "slurm", "browser", "gpu")


# Tests that share one machine-wide thing run in one xdist worker, one after another: the namespace
# cluster (its namespaces, bridge and addresses) and the one-node Slurm (munge, slurmctld).
SHARED_KINDS = ("multinode", "slurm")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(items):
    """A test on a namespace cluster, a Slurm, a browser or a GPU is a slow one (`make test-fast`
    deselects `slow`): one marker to filter on, whatever made the test slow.

    `make test` runs the suite in xdist workers with --dist loadgroup; every test gets a group: the
    machine-wide kind it needs (SHARED_KINDS), else its file, so a module's fixtures (a training run
    several tests read) are built once, in one worker. Much of the suite waits on timers (lease TTLs,
    watchdog limits, Slurm's node timeouts), so more workers than cores keep the processors busy."""
    for item in items:
        if any(item.get_closest_marker(k) for k in SLOW_KINDS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        if not item.get_closest_marker("xdist_group"):
            kind = next((k for k in SHARED_KINDS if item.get_closest_marker(k)), None)
            item.add_marker(pytest.mark.xdist_group(kind or item.path.parent.name + "/" + item.path.name))


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    from reelcache.ingest.demo import generate

    out = tmp_path_factory.mktemp("demo")
    generate(out, n=18, seed=1, workers=2)
    return out


@pytest.fixture(scope="session")
def ingested(demo_dataset, tmp_path_factory) -> Path:
    from support import ingest

    root = tmp_path_factory.mktemp("root")
    ingest(root, demo_dataset)
    return root


@pytest.fixture()
def fresh_root(ingested, tmp_path) -> Path:
    """A private copy of the ingested root that a test may change."""
    dst = tmp_path / "root"
    shutil.copytree(ingested, dst)
    return dst


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Three nodes, each a network + UTS + mount namespace with real sshd (tests/cluster_local.py),
    started once for the session; skipped with one line where it cannot start (not root, no sshd)."""
    from cluster_local import local_cluster_or_skip

    with local_cluster_or_skip(tmp_path_factory.mktemp("cluster"), nodes=3) as c:
        yield c
