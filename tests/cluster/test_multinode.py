"""Many nodes on one machine (tests/cluster_local.py): the cluster itself, then ingest and the latent
cache over real ssh with GNU parallel, with a node killed and a node cut off mid-unit; then the whole chain
(ingest, merge, cache, train, eval) over the nodes with every data path in S3 on node1.

References: the one-machine ingest (conftest's ``ingested``: every unit in one process) for the
catalog rows and the shard bytes; the cache units run in one process for the latents; the plan's
units for "every unit done once"; for the chain's training and eval, the same chain on the shared file
system (those ingest and cache, then 3 ranks on one node), compared exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import (
    NODE_ENV,
    PLUGINS,
    RC,
    REPO,
    assert_same_ingest,
    cache_config,
    catalog_rows,
    finish,
    ingest_plan,
    node_s3_env,
    outputs,
    quiet_env,
    same_run,
    tar_members,
    torchrun_on_nodes,
    train,
)

pytestmark = pytest.mark.multinode


def test_nodes_have_their_names_and_reach_each_other_over_ssh_only_inside(cluster):
    """Each node answers over ssh from the head with its own hostname and address; the machine's own
    network namespace gained nothing; a node has no route out."""
    for i, name in enumerate(cluster.names, 1):
        out = cluster.run(1, "ssh", name, "hostname; hostname -I; getent hosts node1").stdout.split()
        assert out[:2] == [name, cluster.addr(i)] and out[2:4] == [cluster.addr(1), "node1"], out
    host_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert cluster.net + "." not in host_addrs
    assert "default" not in cluster.run(2, "ip", "route").stdout
    assert cluster.run(1, "cat", "/etc/hostname").stdout.strip() == "node1"
    assert subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip() != "node1"


# --- ingest and the latent cache over ssh ---------------------------------------------------------

TTL = "4"  # REELCACHE_LEASE_TTL_S: a dead node's lease goes stale in 4 s, not 300


def parallel(cluster, nodes: Path, joblog: Path, command: list[str], units: Path, *extra: str, env=None):
    """The README's `parallel --sshloginfile nodes.txt --joblog J CMD {} :::: units.txt`, started on the head node;
    `env`'s variables (with the lease TTL) are set there and passed on to every unit (`--env`)."""
    env = {"REELCACHE_LEASE_TTL_S": TTL, **(env or {})}
    cmd = ["parallel", "--will-cite", "--sshloginfile", nodes, "--joblog", joblog, *_passed_on(env)]
    return cluster.popen(
        1,
        *cmd,
        *extra,
        *command,
        "{}",
        "::::",
        units,
        env=cluster.env(**env, REELCACHE_PROGRESS="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _passed_on(env: dict) -> list[str]:
    return [a for name in env for a in ("--env", name)]


def retry_failed(cluster, nodes: Path, joblog: Path, env=None) -> None:
    """docs/INGEST.md's retry: `parallel --retry-failed --joblog J` (the commands come from the joblog)."""
    env = {"REELCACHE_LEASE_TTL_S": TTL, **(env or {})}
    cluster.run(
        1,
        "parallel",
        "--will-cite",
        "--retry-failed",
        "--sshloginfile",
        nodes,
        "--joblog",
        joblog,
        *_passed_on(env),
        env=cluster.env(**env, REELCACHE_PROGRESS="0"),
        timeout=180,
    )
    rows = [line.split("\t") for line in joblog.read_text().splitlines()[1:]]
    last = {r[-1]: r[6] for r in rows}  # command -> the exit value of its newest try
    assert set(last.values()) == {"0"}, joblog.read_text()


def lease_of(d: Path, host: str) -> Path | None:
    for p in d.glob("*.lease"):
        try:
            if json.loads(p.read_text()).get("host") == host:
                return p
        except (OSError, ValueError):
            continue
    return None


def wait_for(cond, what: str, proc: subprocess.Popen, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (found := cond()):
        assert proc.poll() is None, f"finished before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.02)
    return found


def ingest_over_nodes(cluster, root: Path, data: Path, fault=None) -> None:
    """plan, run the units over the 3 nodes (fault(proc) breaks something mid-run), retry, merge."""
    units = ingest_plan(cluster, root, data)
    nodes, joblog = cluster.hostfile(root / "nodes.txt"), root / "ingest.log"
    p = parallel(cluster, nodes, joblog, [RC, "ingest", "run", "--root", root, "--wait"], units)
    survivors = fault(p) if fault else None
    out, err = p.communicate(timeout=180)
    assert (p.returncode != 0) == bool(fault), err[-3000:]
    if fault:
        retry_failed(cluster, cluster.hostfile(root / "alive.txt", names=survivors), joblog)
    cluster.run(1, RC, "catalog", "merge", "--root", root)


def kill_node_mid_unit(cluster, d: Path, node: int):
    """SIGKILL every process of node `node` (sshd included) once it holds a unit's lease."""

    def fault(p):
        wait_for(lambda: lease_of(d, f"node{node}"), f"lease of node{node}", p)
        assert cluster.kill_node(node)
        return [n for n in cluster.names if n != f"node{node}"]

    return fault


def test_ingest_over_three_nodes_equals_one_machine(cluster, demo_dataset, ingested, tmp_path):
    """README: `parallel --sshloginfile nodes.txt --joblog ingest.log reelcache ingest run ...` then merge."""
    ingest_over_nodes(cluster, tmp_path / "r", demo_dataset)
    hosts = {line.split("\t")[1] for line in (tmp_path / "r/ingest.log").read_text().splitlines()[1:]}
    assert hosts == set(cluster.names)  # every node ran units
    assert_same_ingest(tmp_path / "r", ingested)


def freeze_and_cut_node_mid_unit(cluster, d: Path, node: int, frozen: list):
    """Cut node `node`'s link once it holds a unit's lease and freeze its processes (SIGSTOP; as its
    processes would hang on storage mounted over that link): no reset, no close, no heartbeat."""

    def fault(p):
        wait_for(lambda: lease_of(d, f"node{node}"), f"lease of node{node}", p)
        cluster.cut(node)
        frozen.extend(cluster.freeze_node(node))
        return [n for n in cluster.names if n != f"node{node}"]

    return fault


def thaw(cluster, node: int, frozen: list[int]) -> None:
    """Bring the node back: its frozen run finds its lease taken over and must publish nothing."""
    cluster.join(node)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while any(p != cluster.pids[node] for p in cluster.node_pids(node)) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("fault", ["killed", "cut"])
def test_ingest_retry_after_a_node_dies_or_is_cut_off_mid_unit(cluster, demo_dataset, ingested, tmp_path, fault):
    """A node's every process SIGKILLed mid-unit (its lease left behind), or its link cut with its runs
    frozen: `parallel --retry-failed` on the others finishes; no row lost or doubled, no lease left."""
    root, frozen = tmp_path / "r", []
    if fault == "killed":
        broken = kill_node_mid_unit(cluster, root / "raw/openvid", 2)
    else:
        broken = freeze_and_cut_node_mid_unit(cluster, root / "raw/openvid", 3, frozen)
    try:
        ingest_over_nodes(cluster, root, demo_dataset, broken)
    finally:
        thaw(cluster, 3, frozen) if frozen else None
    if fault == "killed":
        cluster.restart(2)
    assert_same_ingest(root, ingested)


def test_a_bad_lease_ttl_is_one_line_before_any_work(ingested, tmp_path):
    """REELCACHE_LEASE_TTL_S must be seconds in [1, 86400]: else one line naming it, and no unit touched."""
    env = {**os.environ, "REELCACHE_LEASE_TTL_S": "soon"}
    before = sorted(p.name for p in (ingested / "raw/openvid").iterdir())
    (ingested / "raw/openvid/000001.parquet").rename(tmp_path / "side.parquet")  # the unit would run
    try:
        p = subprocess.run(
            [RC, "ingest", "run", "--root", ingested, "openvid/000001"], capture_output=True, text=True, env=env
        )
    finally:
        (tmp_path / "side.parquet").rename(ingested / "raw/openvid/000001.parquet")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "reelcache: error: REELCACHE_LEASE_TTL_S='soon': must be seconds in [1, 86400] (default 300)"
    ]
    assert sorted(p.name for p in (ingested / "raw/openvid").iterdir()) == before


def latent_members(path: Path) -> list[tuple]:
    """A latent shard's members: name, safetensors header as JSON (its key order is a hash map's,
    process to process) and tensor bytes."""
    out = []
    for name, blob in tar_members(path):
        n = int.from_bytes(blob[:8], "little")
        out.append((name, json.loads(blob[8 : 8 + n]), blob[8 + n :]))
    return out


def assert_same_store_shard(got: Path, want: Path) -> None:
    """Two store shards hold the same members (names, safetensors metadata, tensor names, dtypes and shapes) and
    tensors equal bit for bit, read by safetensors itself (a header's key order, and so its tensors' offsets, is
    a hash map's, process to process). Bit for bit holds where both caches ran on as many threads (ONE_THREAD)."""
    import torch
    from safetensors.torch import load

    a, b = tar_members(got), tar_members(want)
    assert [n for n, _ in a] == [n for n, _ in b], got
    for (name, x), (_, y) in zip(a, b):
        hx, hy = (json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")]) for blob in (x, y))
        assert hx.pop("__metadata__", None) == hy.pop("__metadata__", None), name
        assert {k: (v["dtype"], v["shape"]) for k, v in hx.items()} == {
            k: (v["dtype"], v["shape"]) for k, v in hy.items()
        }
        tx, ty = load(x), load(y)
        for k in tx:
            assert torch.equal(tx[k], ty[k]), f"{got}: {name} {k}"


CACHE_WHERE = "level <= 2"  # 11 clips in 3 units: one a node
# The encoders' float results depend on how many threads split their reductions (the tiny LTX VAE's latents
# differ in bf16's last bits between 1 and 2 threads): the reference's cache and the S3 chain's units on the
# nodes (which get no variable of this process but those parallel passes on) run on one thread each, so the
# chain's training reads the reference's latents bit for bit.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cache_reference(ingested, tmp_path_factory):
    """The tiny cache's units run in one process over a copy of the ingested root, on one thread (ONE_THREAD)."""

    from reelcache.catalog.manifest import make_manifest
    from reelcache.cli import main

    d = tmp_path_factory.mktemp("cache-ref")
    shutil.copytree(ingested, d / "root")
    make_manifest(d / "root", "m", CACHE_WHERE)
    cfg = cache_config(d, "m", clips_per_unit=4)
    units = subprocess.run([RC, "cache", "plan", "--root", d / "root", "--config", cfg], capture_output=True, text=True)
    p = subprocess.run(
        [RC, "cache", "run", "--root", d / "root", *units.stdout.split()],
        capture_output=True, text=True, env=quiet_env(**ONE_THREAD), timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert main(["catalog", "merge", "--root", str(d / "root")]) == 0
    return d / "root", cfg


def cache_outputs(root: Path) -> dict:
    out = outputs(root, "latents/t")
    return {k: latent_members(root / "latents/t" / k) if k.endswith(".tar") else v for k, v in out.items()}


def test_cache_units_over_three_nodes_with_one_killed_equal_one_process(cluster, ingested, cache_reference, tmp_path):
    """README: `parallel --sshloginfile gpu-nodes.txt --joblog cache.log reelcache cache run ...` (tiny
    encoders) with every process of one node SIGKILLed mid-unit, then `--retry-failed` on the others,
    gives the latents of one process. (A link cut is the ingest test's: the unit protocol is the same.)"""
    from reelcache.catalog.manifest import make_manifest

    ref, cfg = cache_reference
    root = tmp_path / "r"
    shutil.copytree(ingested, root)
    make_manifest(root, "m", CACHE_WHERE)
    units = root / "units.txt"
    units.write_text(cluster.run(1, RC, "cache", "plan", "--root", root, "--config", cfg).stdout)
    assert len(units.read_text().split()) == 3
    nodes, joblog = cluster.hostfile(root / "nodes.txt"), root / "cache.log"
    p = parallel(cluster, nodes, joblog, [RC, "cache", "run", "--root", root, "--wait"], units)
    try:
        kill_node_mid_unit(cluster, root / "latents/t", 2)(p)
        out, err = p.communicate(timeout=180)
        assert p.returncode != 0, err[-3000:]
        retry_failed(cluster, cluster.hostfile(root / "alive.txt", names=["node1", "node3"]), joblog)
    finally:
        cluster.restart(2)
    cluster.run(1, RC, "catalog", "merge", "--root", root)
    assert cache_outputs(root) == cache_outputs(ref)
    assert catalog_rows(root, "latents", "ALL") == catalog_rows(ref, "latents", "ALL")


# --- every data path in S3, served by node1 (issue 32) ---------------------------------------------


def staged_on(mirrors: Path, node: str, sub: str) -> list[Path]:
    """Files a node's unit has staged in its own mirror under `sub` (its shards before their upload)."""
    return [p for p in (mirrors / node).glob(f"*/*/root/{sub}/**/*") if p.is_file()]


@pytest.fixture(scope="module")
def s3_chain(cluster, node1_s3, demo_dataset, cache_reference, tmp_path_factory):
    """docs/STORAGE.md's worked example over the three nodes with the root in S3 on node1 (each node stages in a
    mirror of its own: nothing but the videos is shared): ingest units over the nodes, merge on the head, a
    manifest made there; the cache's units over the nodes with every process of node2 SIGKILLed once its unit
    has staged a store shard, then `--retry-failed` on the others (the dead run's lease goes stale by the
    store's clock and its uploads are cleared); merge. Made once for the module: the tests below check it and
    train on it. Returns the root's URL, the nodes' mirrors, the head's `reelcache` (with its mirror) and
    environment, the cache's joblog."""
    import secrets

    _, cfg = cache_reference
    tmp = tmp_path_factory.mktemp("s3-chain")
    root = f"s3://{node1_s3.shared_bucket}/{secrets.token_hex(4)}/root"
    mirrors, work = tmp / "mirrors", tmp / "work"
    work.mkdir()
    rc = tmp / "rc-node"  # reelcache with this node's own mirror
    rc.write_text(f'#!/bin/sh\nexport REELCACHE_S3_MIRROR="{mirrors}/$(hostname)"\nexec {RC} "$@"\n')
    rc.chmod(0o755)
    env = {**node1_s3.env(), **ONE_THREAD}
    on_head = cluster.env(**env, REELCACHE_LEASE_TTL_S=TTL, REELCACHE_PROGRESS="0")
    nodes = cluster.hostfile(work / "nodes.txt")

    units = work / "ingest-units.txt"
    units.write_text(
        cluster.run(
            1,
            rc,
            "ingest",
            "plan",
            "--root",
            root,
            "--source",
            "openvid",
            "--name",
            "openvid",
            "--meta",
            demo_dataset / "OpenVid-demo.csv",
            "--videos",
            demo_dataset / "videos",
            "--rows-per-unit",
            "8",
            "--max-file-mb",
            "8",
            env=on_head,
        ).stdout  # fmt: skip
    )
    p = parallel(cluster, nodes, work / "ingest.log", [rc, "ingest", "run", "--root", root, "--wait"], units, env=env)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    cluster.run(1, rc, "catalog", "merge", "--root", root, env=on_head)
    cluster.run(1, rc, "catalog", "manifest", "--root", root, "--name", "m", "--where", CACHE_WHERE, env=on_head)

    units = work / "cache-units.txt"
    units.write_text(cluster.run(1, rc, "cache", "plan", "--root", root, "--config", cfg, env=on_head).stdout)
    assert len(units.read_text().split()) == 3
    joblog = work / "cache.log"
    p = parallel(cluster, nodes, joblog, [rc, "cache", "run", "--root", root, "--wait"], units, env=env)
    try:
        wait_for(lambda: staged_on(mirrors, "node2", "store"), "store shard staged on node2", p)
        assert cluster.kill_node(2)
        out, err = p.communicate(timeout=180)
        assert p.returncode != 0, err[-3000:]
        retry_failed(cluster, cluster.hostfile(work / "alive.txt", names=["node1", "node3"]), joblog, env=env)
    finally:
        cluster.restart(2)
    cluster.run(1, rc, "catalog", "merge", "--root", root, env=on_head)
    return SimpleNamespace(root=root, mirrors=mirrors, rc=rc, on_head=on_head, joblog=joblog)


def test_ingest_and_cache_over_three_nodes_into_s3_on_node1_equal_one_machine(
    cluster, node1_s3, s3_chain, ingested, cache_reference, tmp_path
):
    """The chain's ingest and cache in S3 (s3_chain): node2 took a cache unit before it died; the objects, read
    back by a plain boto3 client, and the head's catalog equal the one-machine ingest and cache on a file
    system."""
    ref, _ = cache_reference
    root, on_head = s3_chain.root, s3_chain.on_head
    hosts = {line.split("\t")[1] for line in s3_chain.joblog.read_text().splitlines()[1:]}
    assert hosts == set(cluster.names)  # node2 took a unit before it died

    keys = cluster.run(
        1, sys.executable, REPO / "tests/s3_local.py", "download", root, tmp_path / "dl", env=on_head
    ).stdout.split()
    assert not [k for k in keys if k.endswith(".lease") or "tmp" in k], keys  # no lease, no partial object left
    dl = tmp_path / "dl"
    assert outputs(dl, "raw/openvid") == outputs(ingested, "raw/openvid")  # the raw shards' members, sidecar rows
    assert cache_outputs(dl) == cache_outputs(ref)  # the cache's sidecars
    store = sorted(p.relative_to(ref).as_posix() for p in (ref / "store").rglob("*.tar"))
    assert store and sorted(k for k in keys if k.startswith("store/") and k.endswith(".tar")) == store
    for rel in store:  # every latent and caption embedding: the same members, metadata and tensors
        assert_same_store_shard(dl / rel, ref / rel)
    head = s3_chain.mirrors / "node1" / node1_s3.shared_bucket / root.split("/", 3)[3]  # node1's catalog
    assert catalog_rows(head, "clips", "clip_id") == catalog_rows(ingested, "clips", "clip_id")
    assert catalog_rows(head, "latents", "ALL") == catalog_rows(ref, "latents", "ALL")


# The chain's training: the debug stage (tiny STDiT3, the demo buckets, 32-wide captions: the tiny cache's) on the
# cache's loader manifest. Its 11 latents fall in 144p/33 (2 a rank): on 3 ranks, 2 steps an epoch, 4 in all.
CHAIN_TRAIN = [
    '--data.manifests=[{name="train"}]',
    "--data.workers=1",
    "--log.wandb_mode=disabled",
    "--run.epochs=2",
    "--checkpoint.every=2",
    *PLUGINS["ddp"],
]
CHAIN_STEPS = 4
EVAL = ["--preset", "debug", "--val-manifest", "train", "--val-max-clips", "2", "--device", "cpu"]
EVAL += ["--wandb-mode", "disabled", "--checkpoint", "latest"]


@pytest.fixture(scope="module")
def chain_reference(cache_reference) -> Path:
    """The chain on the shared file system: cache_reference's root (the one-machine ingest and cache), its
    loader manifest `train` (`catalog manifest --cache t`), 3 ranks on one node (torchrun --nproc_per_node 3)
    trained on it, and `eval once` over that run: runs/one-node-ddp."""
    from reelcache.catalog.manifest import make_manifest

    ref, _ = cache_reference
    make_manifest(ref, "train", CACHE_WHERE, cache="t")
    train(ref, [*CHAIN_TRAIN, "--run.name=one-node-ddp"], nproc=3)
    run = ref / "runs/one-node-ddp"
    assert sorted(c.name for c in run.glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000004"]
    p = subprocess.run(
        [RC, "eval", "once", "--root", ref, "--run", "runs/one-node-ddp", *EVAL],
        capture_output=True, text=True, env=quiet_env(), cwd=REPO, timeout=180,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return run


def test_torchrun_on_three_nodes_trains_that_cache_in_s3_and_equals_one_node_ddp(
    cluster, node1_s3, s3_chain, chain_reference, tmp_path
):
    """The chain's end, docs/STORAGE.md "A run in S3": on the head, the loader manifest of the nodes' cache in S3
    (`catalog manifest --cache t`: the reference's, named by the same rows); `torchrun --nnodes 3` (one rank a
    node, over ssh) trains `--root s3://` on node1's server, each node with a mirror of its own: the manifest
    found by name, the latents read from the store's objects. Its run folder, read back from node1 by a plain
    boto3 client: the losses and final weights of the one-node run on the shared file system, every checkpoint
    file of that run an object, the ranks on node1..3, the run lease released. Then `eval once` on node3 (another
    mirror) over the run in S3 gives the validation loss of `eval once` over the one-node run."""
    url, env = s3_chain.root, node_s3_env(node1_s3)
    made = cluster.run(
        1, s3_chain.rc, "catalog", "manifest", "--root", url, "--name", "train", "--cache", "t", "--where",
        CACHE_WHERE, env=s3_chain.on_head,
    )  # fmt: skip
    (want,) = (chain_reference.parents[1] / "manifests").glob("train-*.parquet")
    assert made.stdout.split() == [f"{url}/manifests/{want.name}"], made.stdout  # named by the same rows

    mirrors, name = tmp_path / "mirrors", "s3-three-nodes-ddp"
    procs = torchrun_on_nodes(
        cluster, url, [*CHAIN_TRAIN, f"--run.name={name}"], cluster.names, 29508, env=env,
        node_env=lambda n: {"REELCACHE_S3_MIRROR": mirrors / n},
    )  # fmt: skip
    finish(procs)
    bucket, prefix = url[5:].split("/", 1)
    for n in cluster.names:  # each node mirrored the manifest into its own mirror
        assert (mirrors / n / bucket / prefix / "manifests" / want.name).is_file(), n

    mirror3 = {"REELCACHE_S3_MIRROR": str(tmp_path / "eval-mirror")}  # eval once on node3, a mirror of its own
    cluster.run(
        3, RC, "eval", "once", "--root", url, "--run", f"runs/{name}", *EVAL,
        env=cluster.env(**env, **NODE_ENV, **mirror3), cwd=REPO, timeout=180,
    )  # fmt: skip
    got = tmp_path / "got"
    on_node = cluster.env(**env)
    dl = cluster.run(1, sys.executable, REPO / "tests/s3_local.py", "download", f"{url}/runs/{name}", got, env=on_node)
    keys = [k for k in dl.stdout.split() if not k.startswith("eval/")]
    assert "run.lease" not in keys and {"config.json", "ranks/rank00000.json"} <= set(keys), keys
    ref = chain_reference
    want = sorted(p.relative_to(ref).as_posix() for p in ref.glob("ckpt-*/**/*") if p.is_file())
    assert want and [k for k in keys if k.startswith("ckpt-")] == want
    assert [json.loads(p.read_text())["host"] for p in sorted((got / "ranks").glob("rank*.json"))] == cluster.names
    same_run(ref, got, CHAIN_STEPS)

    rel = f"eval/ckpt-{CHAIN_STEPS:08d}/val_loss.json"
    doc, want = json.loads((got / rel).read_text()), json.loads((ref / rel).read_text())
    for k in ("global_step", "clips", "manifest_fingerprint", "weights", "overall", "buckets"):
        assert doc[k] == want[k], k
