"""Training across the namespace nodes (tests/cluster_local.py): gloo over the bridge, each node
started over real ssh from the head, by ``torchrun --nnodes`` and by ``colossalai run --hostfile``.

Reference: the same debug stage on one node with the same world size (torchrun --nproc_per_node 3,
tests/test_train.py's launcher). The ranks see the same data and gloo reduces in the same order
whatever host a rank sits on, so losses and final weights are compared exactly.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from latent_data import write_latents
from test_train import CONFIG, PLUGINS, REPO, data_args, metrics, train, weights

pytestmark = pytest.mark.multinode

ENV = {"REELCACHE_PROGRESS": "0", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("multinode-train")
    return r, write_latents(r, 24, name="train")


def torchrun_on_nodes(cluster, root: Path, args: list[str], nodes: list[str], port: int, env: dict | None = None):
    """`torchrun --nnodes N --node_rank K --master_addr <first node>` on each node, over ssh from the
    head node (node1), one process per node; returns the ssh processes (each one's output: that node's)."""
    procs = []
    for k, node in enumerate(nodes):
        cmd = shlex.join(
            ["env", *(f"{a}={b}" for a, b in {**ENV, **(env or {})}.items()), sys.executable,
             "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--nproc_per_node", "1",
             "--node_rank", str(k), "--master_addr", nodes[0],
             "--master_port", str(port), "-m", "reelcache.train", str(CONFIG), "--root", str(root), *args]
        )  # fmt: skip
        procs.append(
            cluster.popen(
                1, "ssh", node, f"cd {REPO} && {cmd}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def finish(procs, ok: bool = True, timeout: float = 300) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out)
        if ok:
            assert p.returncode == 0, out[-4000:]
    return outs


def same_run(a: Path, b: Path, last: int) -> None:
    ma, mb = metrics(a), metrics(b)
    assert sorted(ma) == sorted(mb) == list(range(last))
    assert [ma[s]["loss"] for s in sorted(ma)] == [mb[s]["loss"] for s in sorted(mb)]
    wa, wb = weights(a / f"ckpt-{last:08d}"), weights(b / f"ckpt-{last:08d}")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_torchrun_on_three_nodes_equals_one_node_ddp(cluster, root):
    """DDP, 3 nodes x 1 rank (`torchrun --nnodes 3` over ssh) = 3 ranks on one node: losses, weights."""
    r, manifest = root
    args = data_args(manifest, "--run.epochs=1", *PLUGINS["ddp"])
    train(r, args + ["--run.name=one-node-ddp"], nproc=3)
    finish(torchrun_on_nodes(cluster, r, args + ["--run.name=three-nodes-ddp"], cluster.names, 29501))
    ranks = [json.loads(p.read_text())["host"] for p in sorted((r / "runs/three-nodes-ddp/ranks").glob("rank*.json"))]
    assert ranks == cluster.names  # rank k ran on node k+1
    same_run(r / "runs/one-node-ddp", r / "runs/three-nodes-ddp", 4)


def test_colossalai_run_hostfile_on_three_nodes_equals_one_node_zero2(cluster, root, tmp_path):
    """ZeRO-2 (CPU mode), `colossalai run --nproc_per_node 1 --hostfile nodes.txt` from the head node
    (paramiko over ssh to each node) = 3 ranks on one node."""
    r, manifest = root
    args = data_args(manifest, "--run.epochs=1", *PLUGINS["zero2-fp32"])
    train(r, args + ["--run.name=one-node-zero2"], nproc=3)
    cfg = tmp_path / "stage.toml"  # colossalai run re-joins arguments unquoted: the settings go in a file
    cfg.write_text(
        CONFIG.read_text()
        .replace('name = "demo-stage1-tiny"', f'name = "{manifest}"')
        .replace("configs/buckets/demo.toml", "configs/buckets/tiny.toml")
        .replace("caption_channels = 32", "caption_channels = 8")
    )
    bindir = Path(sys.executable).parent
    env = cluster.env(**ENV)
    env["PATH"] = f"{bindir}:{env['PATH']}"
    hostfile = cluster.hostfile(tmp_path / "nodes.txt")
    p = cluster.run(
        1, bindir / "colossalai", "run", "--nproc_per_node", "1", "--hostfile", hostfile,
        "--master_port", "29502", "-m", "reelcache.train", cfg, "--root", r, "--run.name=three-nodes-zero2",
        "--run.plugin=zero2", "--model.dtype=fp32", "--run.epochs=1", "--data.workers=1", "--log.wandb_mode=disabled",
        env=env, cwd=REPO, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0 and "failure" not in p.stdout, (p.stdout + p.stderr)[-4000:]
    ranks = [json.loads(f.read_text())["host"] for f in sorted((r / "runs/three-nodes-zero2/ranks").glob("rank*.json"))]
    assert ranks == cluster.names
    same_run(r / "runs/one-node-zero2", r / "runs/three-nodes-zero2", 4)
