"""Training across the namespace nodes (tests/cluster_local.py): gloo over the bridge, each node
started over real ssh from the head, by ``torchrun --nnodes`` and by ``colossalai run --hostfile``.

Reference: the same debug stage on one node with the same world size (torchrun --nproc_per_node 3,
tests/support.py's torchrun). The ranks see the same data and gloo reduces in the same order
whatever host a rank sits on, so losses and final weights are compared exactly. (The same with the root
in S3 on node1, trained on the cache the nodes made there: tests/cluster/test_multinode.py's chain.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from latent_data import write_latents
from support import (
    APPS_CSV,
    CONFIG,
    FAKE_NVIDIA_SMI,
    NODE_ENV,
    PLUGINS,
    REPO,
    assert_same_ingest,
    complete,
    data_args,
    finish,
    ingest_plan,
    manifest_clips,
    node_s3_env,
    proc_alive,
    proc_stat,
    same_run,
    stage_file,
    torchrun_on_nodes,
    train,
)

pytestmark = pytest.mark.multinode


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("multinode-train")
    return r, write_latents(r, 24, name="train")


DDP_ARGS = ["--run.epochs=1", *PLUGINS["ddp"]]  # the DDP runs' settings, beside data_args


@pytest.fixture(scope="module")
def one_node_ddp(root) -> Path:
    """The reference of the DDP runs over the nodes: 3 ranks on one node (torchrun --nproc_per_node 3) on the
    shared file system, trained once for the module: runs/one-node-ddp, 4 steps, ckpt-4."""
    r, manifest = root
    train(r, data_args(manifest, *DDP_ARGS, "--run.name=one-node-ddp"), nproc=3)
    return r / "runs/one-node-ddp"


def test_torchrun_on_three_nodes_equals_one_node_ddp(cluster, root, one_node_ddp):
    """DDP, 3 nodes x 1 rank (`torchrun --nnodes 3` over ssh) = 3 ranks on one node: losses, weights."""
    r, manifest = root
    args = data_args(manifest, *DDP_ARGS)
    finish(torchrun_on_nodes(cluster, r, args + ["--run.name=three-nodes-ddp"], cluster.names, 29501))
    ranks = [json.loads(p.read_text())["host"] for p in sorted((r / "runs/three-nodes-ddp/ranks").glob("rank*.json"))]
    assert ranks == cluster.names  # rank k ran on node k+1
    same_run(one_node_ddp, r / "runs/three-nodes-ddp", 4)


# --- the root in S3 on node1 (issue 32) ------------------------------------------------------------

MANIFEST_KEY = "manifests/train-0123456789abcdef.parquet"  # a manifest as `catalog manifest` names it, found by name


@pytest.fixture(scope="module")
def s3_root_on_node1(cluster, node1_s3, root) -> str:
    """`root`'s training data (its shards and manifest) in S3 on node1, uploaded from node1 by a plain boto3
    client (tests/s3_local.py upload): a root 's3://<bucket>/<random>/root' of the module's own."""
    import secrets

    r, manifest = root
    url = f"s3://{node1_s3.shared_bucket}/{secrets.token_hex(4)}/root"
    pairs = [r / "latents/train", f"{url}/latents/train", manifest, f"{url}/{MANIFEST_KEY}"]
    up = cluster.run(
        1, sys.executable, REPO / "tests/s3_local.py", "upload", *pairs, env=cluster.env(**node_s3_env(node1_s3))
    )
    assert len(up.stdout.split()) == len(list((r / "latents/train").glob("*.tar"))) + 1, up.stdout
    return url


HOLD = """
import json, os, sys
import boto3
from reelcache.base import lease, s3
url = s3.parse(sys.argv[1])
held = lease.acquire(url)
print(os.getpid(), flush=True)
sys.stdin.read()
def keys():  # a plain boto3 client's listing of the run's prefix
    got = boto3.client("s3").list_objects_v2(Bucket=url.bucket, Prefix=url.key.rsplit("/", 1)[0] + "/")
    return [o["Key"].rsplit("/", 1)[1] for o in got.get("Contents", [])]
before = keys()
held.release()
print(json.dumps([before, keys()]))
"""


def test_s3_run_lease_held_on_node1_refuses_a_start_on_node2_in_one_line(cluster, node1_s3, s3_root_on_node1, tmp_path):
    """The run lease across two nodes, in S3: while a process on node1 holds `runs/<run>/run.lease` (the object
    lease of base/lease.py, what a run's rank 0 takes), a start of that run on node2 is refused in one line
    naming node1 and the holder's pid (train/runlease.py, before any model or booster), exit 2, and leaves
    nothing in S3 or in node2's mirror; the holder's release deletes the object."""
    url, env = s3_root_on_node1, node_s3_env(node1_s3)
    lease_url = f"{url}/runs/held/run.lease"
    holder = cluster.popen(
        1, sys.executable, "-c", HOLD, lease_url, env=cluster.env(**env), cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pid = holder.stdout.readline().strip()
        assert pid.isdigit(), f"the holder on node1 did not take the lease (exit {holder.poll()})"
        mirror = tmp_path / "node2"
        p = cluster.run(
            2, sys.executable, "-m", "reelcache.train", CONFIG, "--root", url, *data_args("train", "--run.name=held"),
            env=cluster.env(**env, **NODE_ENV, REELCACHE_S3_MIRROR=str(mirror)), cwd=REPO, check=False, timeout=120,
        )  # fmt: skip
    finally:
        out, _ = holder.communicate(timeout=60)  # its stdin closed: it lists the run's objects and releases
    # torch's own C++ warnings aside ("[W<time> socket.cpp:...] [c10d] The hostname of the client socket cannot be
    # retrieved": the gloo group a start makes before its lease, on a node whose address has no name)
    lines = [ln for ln in p.stderr.strip().splitlines() if not ln.startswith("[W")]
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert f"run held is running on another node: {lease_url} is held by host node1 pid {pid} " in lines[0], lines
    assert holder.returncode == 0, out
    assert json.loads(out.splitlines()[-1]) == [["run.lease"], []]  # the refused start wrote nothing; released
    assert not list(mirror.rglob("runs/held"))


def test_colossalai_run_hostfile_on_three_nodes_equals_one_node_zero2(cluster, root, tmp_path):
    """ZeRO-2 (CPU mode), `colossalai run --nproc_per_node 1 --hostfile nodes.txt` from the head node
    (paramiko over ssh to each node) = 3 ranks on one node."""
    r, manifest = root
    args = data_args(manifest, "--run.epochs=1", *PLUGINS["zero2-fp32"])
    train(r, args + ["--run.name=one-node-zero2"], nproc=3)
    cfg = stage_file(tmp_path / "stage.toml", manifest)  # colossalai run: the settings go in a file
    bindir = Path(sys.executable).parent
    env = cluster.env(**NODE_ENV)
    env["PATH"] = f"{bindir}:{env['PATH']}"
    hostfile = cluster.hostfile(tmp_path / "nodes.txt")
    p = cluster.run(
        1, bindir / "colossalai", "run", "--nproc_per_node", "1", "--hostfile", hostfile,
        "--master_port", "29502", "-m", "reelcache.train", cfg, "--root", r, "--run.name=three-nodes-zero2",
        "--parallel.plugin=zero2", "--parallel.dtype=fp32", "--run.epochs=1", "--data.workers=1",
        "--log.wandb_mode=disabled",
        env=env, cwd=REPO, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0 and "failure" not in p.stdout, (p.stdout + p.stderr)[-4000:]
    ranks = [json.loads(f.read_text())["host"] for f in sorted((r / "runs/three-nodes-zero2/ranks").glob("rank*.json"))]
    assert ranks == cluster.names
    same_run(r / "runs/one-node-zero2", r / "runs/three-nodes-zero2", 4)


# --- cluster checks over real ssh -----------------------------------------------------------------


def cluster_cli(cluster, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`reelcache cluster ...` from the head node."""
    return cluster.run(
        1, sys.executable, "-m", "reelcache.cli", "cluster", *args, cwd=REPO, timeout=timeout, check=False
    )


def test_gpus_and_clocks_answer_from_each_node(cluster, tmp_path):
    """`cluster gpus` reads each node's own nvidia-smi (a fake on the nodes' PATH: node2's lists a
    process, so --expect-idle fails naming node2); `cluster clocks` measures each node through its own
    ssh session: the nodes share this machine's clock, so every offset is 0 within its uncertainty."""

    smi = cluster.dir / "bin/nvidia-smi"
    smi.write_text(
        FAKE_NVIDIA_SMI.replace('cat "$(dirname "$0")/apps.csv"', 'cat "$(dirname "$0")/apps-$(hostname).csv"')
    )
    smi.chmod(0o755)
    (cluster.dir / "bin/apps-node2.csv").write_text(APPS_CSV.splitlines()[0] + "\n")
    hostfile = cluster.hostfile(tmp_path / "nodes.txt")
    p = cluster_cli(cluster, "gpus", "--hostfile", hostfile, "--reads", "2")
    assert p.returncode == 0 and p.stdout.count("2 x NVIDIA H100 80GB HBM3") == 3, p.stdout + p.stderr
    p = cluster_cli(cluster, "gpus", "--hostfile", hostfile, "--reads", "2", "--expect-idle")
    blocks = {b.split()[0]: b for b in p.stdout.split("node ")[1:]}  # one block a node, headed by its name
    assert p.returncode == 1 and [n for n, b in blocks.items() if "ERROR" in b] == ["node2"], p.stdout + p.stderr

    p = cluster_cli(cluster, "clocks", "--hostfile", hostfile, "--samples", "4", "--reads", "1000")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {
        line.split()[0]: line.split()
        for line in p.stdout.splitlines()
        if line.startswith("node") and line.split()[0] != "node"
    }
    assert sorted(rows) == cluster.names, p.stdout
    for name, (_, offset, _pm, unc, _ms, back, *_) in rows.items():
        assert abs(float(offset)) <= float(unc) + 1.0 and back == "0", (name, p.stdout)


def wait_ranks(run: Path, n: int, procs, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not all((run / f"ranks/rank{r:05d}.json").exists() for r in range(n)):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [
            p.communicate()[0][-2000:] for p in procs if p.poll() is not None
        ]
        time.sleep(0.2)


def test_dump_and_stop_a_run_on_three_nodes_and_spare_a_decoy_on_another(cluster, root, tmp_path):
    """`cluster dump` and `cluster stop` of a run whose ranks sit on node1..3, over ssh to each rank's
    recorded host; a decoy with rank 2's command line byte for byte, on node2, is not touched."""

    from reelcache.cluster import ranks

    r, manifest = root
    args = data_args(manifest, "--run.epochs=1000", "--checkpoint.every=0", "--run.name=live", *PLUGINS["ddp"])
    procs = torchrun_on_nodes(cluster, r, args, cluster.names, 29503)
    run = r / "runs/live"
    decoy = None
    try:
        wait_ranks(run, 3, procs)
        time.sleep(2)  # into the loop
        recs = ranks.read(run)
        assert [x.host for x in recs] == cluster.names and all(proc_alive(x.pid, x.proc_start) for x in recs)
        argv = Path(f"/proc/{recs[2].pid}/cmdline").read_bytes().split(b"\0")[:-1]
        (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(300)\n")
        decoy = cluster.popen(
            2, *[a.decode() for a in argv], cwd=REPO, env={**cluster.env(), "PYTHONPATH": str(tmp_path)}
        )
        time.sleep(0.5)
        assert Path(f"/proc/{decoy.pid}/cmdline").read_bytes() == Path(f"/proc/{recs[2].pid}/cmdline").read_bytes()
        decoy_start = proc_stat(decoy.pid)[1]

        p = cluster_cli(cluster, "dump", "--run", run)
        assert p.returncode == 0, p.stdout + p.stderr
        (out,) = (run / "dumps").iterdir()
        for x in recs:
            text = (out / f"rank{x.rank:05d}.txt").read_text()
            assert f"Process {x.pid}:" in text and "trainer.py" in text  # py-spy's header: that process
        assert "3 of 3 ranks dumped" in (out / "summary.txt").read_text()

        p = cluster_cli(cluster, "stop", "--run", run, "--grace", "10")
        assert p.returncode == 0, p.stdout + p.stderr
        for x in recs:
            assert f"rank {x.rank:05d} host {x.host} pid {x.pid}: stopped by SIG" in p.stdout
            assert not proc_alive(x.pid, x.proc_start)
        assert proc_alive(decoy.pid, decoy_start), "the decoy with the same command line on node2 was stopped"
        finish(procs, ok=False, timeout=120)  # every node's launcher gives up once its worker is gone
    finally:
        for q in [*procs, *([decoy] if decoy else [])]:
            q.kill()
            q.wait()
        for i in (1, 2, 3):
            cluster.kill_node(i, spare_sshd=True)


# --- a node dies mid-run ---------------------------------------------------------------------------

LIMIT_S = 20  # watchdog.limit_s of the runs below: a silent node ends the run in about this long
BOUND_S = LIMIT_S + 25  # the limit, the launchers stopping their workers, ssh noticing (ServerAlive 3 x 2 s)


def epoch_clips(run: Path) -> dict[int, Counter]:
    import duckdb

    out: dict[int, Counter] = {}
    for e, c in duckdb.sql(f"""SELECT epoch, clip_id FROM '{run}/consumed/*.parquet'
        WHERE NOT pad QUALIFY generation = max(generation) OVER (PARTITION BY epoch, step)""").fetchall():
        out.setdefault(e, Counter())[c] += 1
    return out


@pytest.mark.parametrize("fault", ["killed", "cut"])
def test_a_node_that_dies_mid_run_ends_it_in_bounded_time_and_two_nodes_resume(cluster, root, fault):
    """node3's processes SIGKILLed (its peers see a closed socket), or its link cut with its processes
    frozen (its peers see silence): the survivors end within BOUND_S, naming node3 or its rank; the
    newest checkpoint is complete; `--resume` on node1 and node2 (world 2) finishes every epoch with
    every clip once."""
    r, manifest = root
    name = f"dies-{fault}"
    args = data_args(
        manifest, "--run.epochs=3", "--checkpoint.every=2", "--checkpoint.keep_last=10", f"--run.name={name}",
        "--watchdog.floor_s=2", f"--watchdog.limit_s={LIMIT_S}", *PLUGINS["ddp"],
    )  # fmt: skip
    env = {"REELCACHE_COLLECTIVE_TIMEOUT_S": "120"}  # the backstop behind the watchdog's limit
    run = r / f"runs/{name}"
    procs = torchrun_on_nodes(cluster, r, args, cluster.names, 29504 + (fault == "cut"), env=env)
    frozen: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (run / "ckpt-00000002").exists():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no checkpoint 2"
            time.sleep(0.02)
        t0 = time.monotonic()
        if fault == "killed":
            cluster.kill_node(3, spare_sshd=True)
        else:
            cluster.cut(3)
            frozen = [p for p in cluster.node_pids(3) if p != cluster.pids[3]]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
        outs = [p.communicate(timeout=BOUND_S + 30)[0] for p in procs[:2]]
        took = time.monotonic() - t0
        assert all(p.returncode != 0 for p in procs[:2]), outs
        print(f"{fault}: the survivors ended {took:.1f} s after the fault (bound {BOUND_S} s)")
        assert took < BOUND_S, (took, outs)
        said = "\n".join(outs)
        if fault == "killed":  # gloo names the peer whose socket closed
            assert cluster.addr(3) in said, said[-4000:]
        else:  # the watchdog names the rank that wrote no report
            assert "Stopped answering (no report for this step): rank 2 on node3" in said, said[-4000:]
    finally:
        cluster.join(3)
        cluster.kill_node(3, spare_sshd=True)  # frozen ones too (SIGKILL reaches a stopped process)
        for p in procs:
            p.kill()
            p.wait()
    ckpts = sorted(run.glob("ckpt-*"))
    assert ckpts and all(complete(c) for c in ckpts) and not list(run.glob(".tmp-*"))
    finish(torchrun_on_nodes(cluster, r, args + ["--resume"], ["node1", "node2"], 29506 + (fault == "cut"), env=env))
    clips = epoch_clips(run)
    assert sorted(clips) == [0, 1, 2] and all(c == manifest_clips(manifest) for c in clips.values())
    assert complete(sorted(run.glob("ckpt-*"))[-1])


# --- multi-node Slurm -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node_slurm(cluster, tmp_path_factory):
    """slurmctld and munged on node1, a slurmd on each node (tests/cluster_slurm.py)."""
    from cluster_slurm import NodeSlurm
    from slurm_local import SlurmUnavailable

    slurm = NodeSlurm(cluster, tmp_path_factory.mktemp("node-slurm"))
    try:
        slurm.start()
    except SlurmUnavailable as e:
        slurm.stop()
        pytest.skip(f"no multi-node Slurm: {e}")
    yield slurm
    slurm.stop()


def test_slurm_train_on_three_nodes_equals_one_node(node_slurm, root, one_node_ddp):
    """`reelcache train CONFIG --slurm --nodes 3`: srun starts one torchrun per node (node rank
    SLURM_NODEID, master the first host of the node list): the losses and weights of 3 ranks on one node."""
    r, manifest = root
    args = data_args(manifest, *DDP_ARGS)
    p = node_slurm.run(
        sys.executable, "-m", "reelcache", "train", CONFIG, "--root", r, "--slurm", "--nodes", "3",
        "--gpus-per-node=0", "--nproc-per-node=1", *args, "--run.name=slurm-three-nodes", cwd=REPO, timeout=120,
    )  # fmt: skip
    job = p.stdout.split("submitted job ")[1].split(":")[0]
    (record,) = node_slurm.wait(job)
    run = r / "runs/slurm-three-nodes"
    log = "".join(f.read_text() for f in sorted((run / "slurm").glob("*.out")))
    assert record["JobState"] == "COMPLETED" and record["NodeList"] == "node[1-3]", (record, log[-3000:])
    hosts = [json.loads(f.read_text())["host"] for f in sorted((run / "ranks").glob("rank*.json"))]
    assert hosts == ["node1", "node2", "node3"]
    same_run(one_node_ddp, run, 4)


def test_slurm_ingest_array_spreads_over_the_nodes_and_equals_one_machine(node_slurm, demo_dataset, ingested, tmp_path):
    """docs/CLUSTER.md: `reelcache ingest plan ... | reelcache slurm submit ... -- reelcache ingest run --root R --wait`
    with `--then` merge: the array's tasks run on several nodes; the catalog and shards are the one-machine run's."""

    root = tmp_path / "r"
    units = ingest_plan(node_slurm.cluster, root, demo_dataset)
    merge = f"{sys.executable} -m reelcache catalog merge --root {root}"
    p = node_slurm.run(
        sys.executable, "-m", "reelcache", "slurm", "submit", "--partition", node_slurm.partition, "--dir",
        tmp_path / "job", "--units", units, "--then", merge, "--", sys.executable, "-m", "reelcache", "ingest", "run",
        "--root", root, "--wait", cwd=REPO,
    )  # fmt: skip
    array, then = p.stdout.split()
    records = node_slurm.wait(array)
    assert len(records) == 5 and {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert len({r["BatchHost"] for r in records}) >= 2, [r["BatchHost"] for r in records]
    assert [r["JobState"] for r in node_slurm.wait(then)] == ["COMPLETED"]
    assert_same_ingest(root, ingested)


def test_slurm_requeues_a_job_that_lost_a_node_onto_the_nodes_that_remain(node_slurm, root):
    """docs/CLUSTER.md: `--slurm --nodes 2-3`. node3's slurmd and rank are SIGKILLed after checkpoint 2; Slurm
    cancels the job for the node failure and requeues it (`#SBATCH --requeue`), the next attempt starts
    on node1 and node2 (world 2: SLURM_NNODES), resumes from the newest checkpoint, and every epoch
    trains every clip once. With `--nodes 3` it would stay pending while node3 is down."""
    r, manifest = root
    name = "slurm-loses-a-node"
    args = data_args(manifest, "--run.epochs=3", "--checkpoint.every=2", "--checkpoint.keep_last=10", *PLUGINS["ddp"])
    p = node_slurm.run(
        sys.executable, "-m", "reelcache", "train", CONFIG, "--root", r, "--slurm", "--nodes", "2-3",
        "--gpus-per-node=0", "--nproc-per-node=1", *args, f"--run.name={name}", cwd=REPO, timeout=120,
    )  # fmt: skip
    assert " on 2-3 node(s) " in p.stdout, p.stdout
    job = p.stdout.split("submitted job ")[1].split(":")[0]
    run = r / f"runs/{name}"
    try:
        deadline = time.monotonic() + 240
        while not (run / "ckpt-00000002").exists():
            assert time.monotonic() < deadline, "no checkpoint 2"
            time.sleep(0.1)
        assert {json.loads(f.read_text())["host"] for f in (run / "ranks").glob("rank*.json")} == {
            "node1", "node2", "node3"
        }  # fmt: skip
        node_slurm.cluster.kill_node(3, spare_sshd=True)  # its slurmd and its rank
        (record,) = node_slurm.wait(job, timeout=300)
    finally:
        node_slurm.restart_slurmd(3)
    log = "".join(f.read_text() for f in sorted((run / "slurm").glob("*.out")))
    assert record["JobState"] == "COMPLETED" and int(record["Restarts"]) >= 1, (record, log[-3000:])
    assert record["NodeList"] == "node[1-2]", record
    clips = epoch_clips(run)
    assert sorted(clips) == [0, 1, 2] and all(c == manifest_clips(manifest) for c in clips.values())
    assert complete(sorted(run.glob("ckpt-*"))[-1])
