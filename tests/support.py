"""What the tests share: one home for launching a trainer (`torchrun`, `train`), ingesting a test
dataset (`ingest`), the debug stage's test-root overrides (`data_args`), a free port, and the
readers of what a run, a cache or a catalog wrote. Test files import from here, never from each
other; fixtures stay in conftest.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

# --- paths and constants ----------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]

CONFIG = REPO / "configs/train/debug/stage1.toml"

RC = str(Path(sys.executable).parent / "reelcache")  # the shared install every node runs

# The two paths a run takes: ZeRO-2 (what GPU nodes run; here its CPU mode over gloo, bf16 working
# weights and fp32 masters) and DDP (the CPU default).
PLUGINS = {
    "ddp": ["--parallel.plugin=ddp"],
    "zero2-bf16": ["--parallel.plugin=zero2", "--parallel.dtype=bf16"],
    "zero2-fp32": ["--parallel.plugin=zero2", "--parallel.dtype=fp32"],
}

TOL = 0.5 + 1e-3

# nvidia-smi --format=csv,noheader,nounits: ", "-separated values in the order queried, and
# "[N/A]" / "[Not Supported]" where a value is unavailable (nvidia-smi --help-query-gpu).
# Values as an 8 x H100 node shows them, one GPU without a power reading.
GPU_CSV = """\
0, GPU-6d1b3a1e-0c42-11ee-be56-0242ac120002, NVIDIA H100 80GB HBM3, 71234, 81559, 512.37, 97
1, GPU-6d1b3d2a-0c42-11ee-be56-0242ac120002, NVIDIA H100 80GB HBM3, 3, 81559, [N/A], 0
"""

APPS_CSV = """\
GPU-6d1b3a1e-0c42-11ee-be56-0242ac120002, 40213, /opt/conda/bin/python3.10, 71220
GPU-6d1b3a1e-0c42-11ee-be56-0242ac120002, 40299, python -c import a,b, [N/A]
"""

# nvidia-smi as the agent calls it (the two queries, csv,noheader,nounits), answering with the
# documented samples above; the compute-apps query lists what the file apps.csv beside it holds.
FAKE_NVIDIA_SMI = f"""#!/bin/bash
case "$*" in
  *--query-gpu=*) printf '%s' '{GPU_CSV}';;
  *--query-compute-apps=*) cat "$(dirname "$0")/apps.csv" 2>/dev/null;;
  *) exit 2;;
esac
"""


# A stand-in for ssh to another node that is this machine. It does what sshd does with a command:
# SHELL set to the user's login shell (GNU parallel's remote worker execs $SHELL; CI runs with no
# SHELL in its environment, sshd always sets it) and the words after the host joined by spaces, run
# by that shell with -c. So the path a remote node takes (GNU parallel's ssh wrapper, our own held
# session, the quoting of the agent through both) is exercised without an ssh server. A file
# <host>.env beside it, if present, is that node's environment (e.g. a clock of its own).
FAKE_SSH = """#!/bin/bash
echo "$*" >> "$(dirname "$0")/ssh.log"
while [ $# -gt 0 ]; do case "$1" in -l|-p|-o) shift 2;; -*) shift;; *) break;; esac; done
host="${1##*@}"
shift
[ "$1" = "--" ] && shift
if [ -f "$(dirname "$0")/$host.env" ]; then set -a; . "$(dirname "$0")/$host.env"; set +a; fi
SHELL="$(getent passwd "$(id -u)" | cut -d: -f7)"
export SHELL="${SHELL:-/bin/sh}"
exec "$SHELL" -c "$*"
"""


# --- processes and ports ----------------------------------------------------------------------


def quiet_env(**extra: str) -> dict:
    """This process's environment for a reelcache subprocess: no progress bars, one thread a rank, a
    silent wandb, no hub lookups; ``extra`` on top."""
    quiet = {"REELCACHE_PROGRESS": "0", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}
    return {**os.environ, **quiet, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid: int):
    try:
        after = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return after[0], int(after[19])


def proc_alive(pid: int, start: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[1] == start and st[0] != "Z"


# --- the cluster commands ---------------------------------------------------------------------


def cluster_cli(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    """``reelcache cluster ARGS`` in a process of its own, from the repository."""
    return subprocess.run(
        [sys.executable, "-m", "reelcache.cli", "cluster", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def record(run: Path, rank: int, pid: int, host: str, stacks: Path | None = None):
    """The record of another process (a stand-in rank), as the trainer would have written it."""
    from reelcache.cluster.ranks import RankRecord

    rec = RankRecord(
        rank=rank,
        world_size=2,
        local_rank=rank,
        host=host,
        pid=pid,
        proc_start=proc_stat(pid)[1],
        boot_id=boot_id(),
        started=time.time(),
        launcher_pid=os.getpid(),
        launcher_proc_start=proc_stat(os.getpid())[1],
        stacks=None if stacks is None else str(stacks),
    )
    rec.save(run)
    return rec


# --- what the session builds once -----------------------------------------------------------


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(folder)` run once for the whole session, by whichever xdist worker asks first (the others wait for
    it on a lock), in a folder of the session's temporary directory that every worker sees; that folder. The
    suite's session fixtures (a generated dataset, its ingest, the eval tests' trained run) cost each worker
    that builds them 10-40 CPU-s, and the suite is CPU-bound. Callers that may write give each test file's
    worker a copy (`private_copy`), so what a worker changes stays its own, as when each built its own."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: <session>/popen-gw<N>
    out = shared / f"built-{name}"
    with open(shared / f"built-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not (shared / f"built-{name}.done").exists():
            shutil.rmtree(out, ignore_errors=True)  # a builder that failed half-way
            out.mkdir()
            build(out)
            (shared / f"built-{name}.done").touch()
    return out


def private_copy(tmp_path_factory, built: Path, name: str) -> Path:
    """A copy of what `built_once` built, in a new folder of this worker's temporary directory."""
    import shutil

    dst = tmp_path_factory.mktemp(name) / built.name.removeprefix("built-")
    shutil.copytree(built, dst, symlinks=True)
    return dst


# --- ingest and the catalog -------------------------------------------------------------------


def plan_ingest(root: Path, meta: Path, videos: Path, *extra: str) -> list[str]:
    """`ingest plan` of an OpenVid-format table in this process; returns the units it printed."""
    import contextlib
    import io

    from reelcache.cli import main

    args = ["ingest", "plan", "--root", str(root), "--source", "openvid", "--meta", str(meta), "--videos", str(videos)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*args, *extra]) == 0
    return buf.getvalue().split()


def ingest(root: Path, data: Path, *extra: str, name: str = "openvid") -> list[str]:
    """plan + run every unit (in-process, like one parallel slot) + merge of a generated demo dataset
    (8 rows a unit); returns the units."""
    from reelcache.cli import main

    meta, videos = data / "OpenVid-demo.csv", data / "videos"
    units = plan_ingest(root, meta, videos, "--name", name, "--rows-per-unit", "8", "--max-file-mb", "8", *extra)
    assert main(["ingest", "run", "--root", str(root), *units]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    return units


def sql(root: Path, query: str):
    from reelcache.catalog.db import open_catalog

    con = open_catalog(root)
    try:
        return con.execute(query).fetchall()
    finally:
        con.close()


def catalog_rows(root: Path, table: str, order: str) -> list[tuple]:
    import duckdb

    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        return db.sql(f"SELECT * FROM {table} ORDER BY {order}").fetchall()


def tar_members(path: Path) -> list[tuple[str, bytes]]:
    """A shard's members and their bytes (the tar headers' mtime is the run's, not compared)."""
    with tarfile.open(path) as t:
        return [(m.name, t.extractfile(m).read()) for m in t]


def outputs(root: Path, sub: str) -> dict[str, object]:
    """Every shard's members and every sidecar's rows under root/sub (temporaries must be gone)."""
    import pyarrow.parquet as pq

    d = root / sub
    assert not [p.name for p in d.glob(".*tmp*")] and not list(d.glob("*.lease")), sorted(p.name for p in d.iterdir())
    out: dict[str, object] = {p.name: tar_members(p) for p in d.glob("*.tar")}
    out.update({p.name: pq.read_table(p).to_pylist() for p in d.glob("[0-9]*.parquet")})
    return out


def ingest_plan(cluster, root: Path, data: Path) -> Path:
    """ingest plan as conftest's `ingest` makes it (the reference's units), from the head node."""
    out = cluster.run(
        1, RC, "ingest", "plan", "--root", root, "--source", "openvid", "--name", "openvid",
        "--meta", data / "OpenVid-demo.csv", "--videos", data / "videos", "--rows-per-unit", "8", "--max-file-mb", "8",
    ).stdout  # fmt: skip
    (root / "units.txt").write_text(out)
    return root / "units.txt"


def assert_same_ingest(root: Path, reference: Path) -> None:
    assert outputs(root, "raw/openvid") == outputs(reference, "raw/openvid")
    assert catalog_rows(root, "clips", "clip_id") == catalog_rows(reference, "clips", "clip_id")


# --- the cache --------------------------------------------------------------------------------


# -- the cache end to end ------------------------------------------------------------------
CACHED_WHERE = "shard IN ('raw/openvid/000000-00.tar', 'raw/openvid/000003-00.tar')"  # conftest's cached_demo


def cache_config(tmp_path, manifest, **over) -> Path:
    vals = {"name": "t", "kind": "ltx", "seed": 0, "clips_per_unit": 6, "text_kind": "t5"} | over
    p = tmp_path / f"cache-{vals['name']}-{vals['kind']}-{vals['seed']}.toml"
    p.write_text(f"""
name = "{vals["name"]}"
manifest = "{manifest}"
buckets = "{vals.get("buckets", REPO / "configs/buckets/demo.toml")}"
clips_per_unit = {vals["clips_per_unit"]}
batch_size = 2
workers = 1
decode_timeout = {vals.get("decode_timeout", 60)}
[video_encoder]
kind = "{vals["kind"]}"
tiny = true
dtype = "float32"
seed = {vals["seed"]}
[text_encoder]
kind = "{vals["text_kind"]}"
tiny = true
dtype = "float32"
""")
    return p


def tiny_cache_config(path: Path, manifest: str, name: str = "t") -> Path:
    """configs/cache/tiny.toml (the demo's cache: tiny LTX and T5, its views) over ``manifest``, named
    ``name``, with its buckets file by absolute path and one decode worker, written to ``path``."""
    repo = REPO
    path.write_text(
        (repo / "configs/cache/tiny.toml")
        .read_text()
        .replace('manifest = "demo-stage1"', f'manifest = "{manifest}"')
        .replace('name = "tiny"', f'name = "{name}"')
        .replace("configs/buckets/demo.toml", str(repo / "configs/buckets/demo.toml"))
        .replace("workers = 2", "workers = 1")
    )
    return path


def cache_plan(root, config) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "reelcache", "cache", "plan", "--root", str(root), "--config", str(config)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.split()


def write_clip_file(tmp_path, width, height, rotation=0, noise=True) -> Path:
    from reelcache.ingest.demo import ClipSpec, write_clip

    p = tmp_path / f"c{width}x{height}r{rotation}.mp4"
    write_clip(p, ClipSpec(p.name, width, height, Fraction(25), 1.0, rotation=rotation, noise=noise))
    return p


def decode_job(path: Path, bucket: str, height: int, width: int, **kw) -> dict:
    return dict(
        clip_id=path.name,
        raw_shard=path.name,
        raw_offset=0,
        file_size=path.stat().st_size,
        bucket=bucket,
        num_frames=5,
        interval=3,
        height=height,
        width=width,
        window_start=7,
        fps=25.0,
        **kw,
    )


def resize_crop_to_fill(clip, th: int, tw: int):
    """Open-Sora 1.2's function, on a float (T, C, h, w) clip."""
    import torch.nn.functional as F

    h, w = clip.shape[-2:]
    rh, rw = th / h, tw / w
    if rh > rw:
        sh, sw = th, round(w * rh)
        clip = F.interpolate(clip, size=(sh, sw), mode="bilinear", align_corners=False)
        i, j = 0, int(round(sw - tw) / 2.0)
    else:
        sh, sw = round(h * rw), tw
        clip = F.interpolate(clip, size=(sh, sw), mode="bilinear", align_corners=False)
        i, j = int(round(sh - th) / 2.0), 0
    assert i + th <= clip.shape[-2] and j + tw <= clip.shape[-1]
    return clip[..., i : i + th, j : j + tw]


def reference(path, wanted: list[int], fit: tuple[int, int], height: int, width: int) -> np.ndarray:
    """Open-Sora's frames (0..255 floats) for the window `wanted`, centre-cropped to (height, width)."""
    import av
    import torch

    with av.open(str(path)) as c:
        frames = [(f.to_rgb().to_ndarray(), f.rotation) for k, f in enumerate(c.decode(video=0)) if k in wanted]
    # the displayed picture, as the cache decodes it (test_decode.py pins rot90 against ffmpeg's autorotate)
    rgb = np.stack([np.rot90(a, k=int(rot or 0) % 360 // 90) for a, rot in frames])
    clip = torch.from_numpy(rgb.copy()).permute(0, 3, 1, 2).float() / 255.0
    out = resize_crop_to_fill(clip, *fit).permute(0, 2, 3, 1).numpy() * 255.0
    y, x = (fit[0] - height) // 2, (fit[1] - width) // 2
    return out[:, y : y + height, x : x + width]


# --- training runs ----------------------------------------------------------------------------


def data_args(manifest: Path, *extra: str) -> list[str]:
    """Overrides that point the debug stage at a test root (8-wide captions, tiny buckets)."""
    return [
        f'--data.manifests=[{{name="{manifest}"}}]',
        '--data.buckets="configs/buckets/tiny.toml"',
        "--model.overrides={caption_channels=8, model_max_length=300}",
        "--data.workers=1",
        "--log.wandb_mode=disabled",
        *extra,
    ]


# The uninterrupted run that resumed ones are compared with (tests/train/test_train.py's killed and stopped
# runs, tests/cluster/test_slurm_train.py's requeued job): the debug stage on 2 ranks, DDP, 3 epochs of
# write_latents(root, 24, name="train") (15 steps), a checkpoint every 4. conftest's `ddp_reference` trains it
# once for the session.
WHOLE = ["--run.epochs=3", "--checkpoint.every=4", "--checkpoint.keep_last=10"]


def same_data(a: Path, b: Path) -> None:
    """Two roots hold the same latent samples in the same shards (so one's reference run is the other's):
    every file under latents/, a shard member by member (its tar headers' mtime is when it was written), and
    the loader manifests' rows."""
    import pyarrow.parquet as pq
    from safetensors.torch import load

    def member(name: str, data: bytes) -> object:  # a latent: its metadata and tensors (the header's order varies)
        if not name.endswith(".safetensors"):
            return data
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        return header.get("__metadata__"), load(data)

    def files(root: Path) -> dict[str, object]:
        found = sorted(p for p in (root / "latents").rglob("*") if p.is_file())
        return {
            str(p.relative_to(root)): [(n, member(n, d)) for n, d in tar_members(p)]
            if p.suffix == ".tar"
            else p.read_bytes()
            for p in found
        }

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return x.dtype == y.dtype and x.shape == y.shape and bool((x == y).all())
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(i, j) for i, j in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y

    fa, fb = files(a), files(b)
    assert fa.keys() == fb.keys() and all(same(fa[k], fb[k]) for k in fa), sorted(set(fa) ^ set(fb))
    ma, mb = (sorted(p.relative_to(r) for p in (r / "manifests").glob("*.parquet")) for r in (a, b))
    assert ma == mb and all(pq.read_table(a / m).equals(pq.read_table(b / m)) for m in ma), (ma, mb)


TRAINER = ("-m", "reelcache.train")


def torchrun(
    root: Path,
    args: list[str],
    nproc: int = 1,
    entry: list[str] = TRAINER,
    env: dict | None = None,
    config: Path = CONFIG,
    launcher: str = "reelcache",
    **kw,
) -> subprocess.Popen:
    """The trainer on nproc ranks: ``entry CONFIG --root ROOT args``; entry: the program each rank runs (the
    trainer, or a check script such as tests/grad_check.py). Beyond one rank the trainer starts through its own
    launcher, ``reelcache train --nproc N`` (train/launch.py: on this CPU build of torch its ranks are forked
    from one process that imported what a rank imports, most of a test training's work); a check script, or
    launcher="torchrun", through torchrun."""
    env = quiet_env(**(env or {}))
    if nproc > 1 and tuple(entry) == TRAINER and launcher == "reelcache":
        cmd = [sys.executable, "-m", "reelcache", "train", str(config), "--root", str(root), "--nproc", str(nproc)]
    else:
        cmd = [sys.executable]
        if nproc > 1:
            cmd += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
        cmd += [*entry, str(config), "--root", str(root)]
    return subprocess.Popen(
        cmd + args,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,
    )


def train(root: Path, args: list[str], nproc: int = 1, ok: bool = True, timeout: float = 240, **kw) -> str:
    p = torchrun(root, args, nproc, **kw)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the launcher and every rank go, not just the launcher
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"training did not finish in {timeout:.0f} s:\n{out[-4000:]}")
    if ok:
        assert p.returncode == 0, out[-4000:]
    else:
        assert p.returncode != 0, out[-4000:]
    return out


def json_lines(out: str) -> list[dict]:
    """The JSON objects a check script printed, one a line (its other lines are logs)."""
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def stage_file(path: Path, manifest) -> Path:
    """The debug stage with the test root's settings (manifest, tiny buckets, 8 caption channels) in a
    config file: `colossalai run` re-joins its arguments unquoted, so they cannot be overrides."""
    path.write_text(
        CONFIG.read_text()
        .replace('name = "demo-stage1-tiny"', f'name = "{manifest}"')
        .replace("configs/buckets/demo.toml", "configs/buckets/tiny.toml")
        .replace("caption_channels = 32", "caption_channels = 8")
    )
    return path


def poisoned_manifest(root: Path, manifest: Path) -> tuple[Path, str]:
    """The manifest plus one sample whose latents are NaN (as a broken encoder would have written)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from reelcache.base.latents import LATENT_EXT, encode
    from reelcache.base.shards import ShardWriter

    clip, bucket = "poisoned-clip-0000", "144p/17/0.56"
    (root / "latents/poison").mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(root / "latents/poison", "000000", 10_000_000)
    nan = torch.full((4, 5, 4, 6), float("nan")).bfloat16()
    data = encode(
        {"mean": nan, "logvar": torch.zeros(4, 5, 4, 6).bfloat16(), "text": torch.ones(4, 8).bfloat16()},
        clip_id=clip,
        bucket=bucket,
    )
    shard, offsets = writer.write_sample(clip, [(LATENT_EXT, data, None)])
    writer.close()
    table = pq.read_table(manifest)
    row = pa.table(
        {
            "clip_id": [clip],
            "bucket": [bucket],
            "shard": [f"latents/poison/{shard}"],
            "shard_offset": [offsets[LATENT_EXT]],
        }
    ).cast(table.schema)
    out = root / "manifests/poisoned.parquet"
    pq.write_table(pa.concat_tables([table, row]), out)
    return out, clip


class FakePar:
    """The part of train/parallel.py's ``Parallel`` a step uses, for one process without a group; `cfg`: its
    [parallel] section (grad_clip), the default one unless given."""

    device, world, rank, zero = torch.device("cpu"), 1, 0, False

    def __init__(self, cfg=None):
        from reelcache.train.sections import ParallelConfig

        self.cfg = cfg or ParallelConfig()

    def sum(self, values):
        return torch.as_tensor(values, dtype=torch.float64)

    max = sum

    def backward(self, loss, optimizer):
        loss.backward()

    def grad_norm(self, model, optimizer):
        params, max_norm = [p for p in model.parameters() if p.grad is not None], self.cfg.grad_clip
        return torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm > 0 else torch.tensor(0.0)

    def master_chunks(self, model, optimizer):
        return {n: p.detach().reshape(-1).float() for n, p in model.named_parameters() if p.requires_grad}

    def barrier(self):
        pass


# --- reading a run directory ------------------------------------------------------------------


def metrics(run_dir: Path) -> dict[int, dict]:
    """The newest generation's row of each step (what trained)."""
    import pyarrow.parquet as pq

    rows = {}
    for part in sorted((run_dir / "metrics").glob("*.parquet")):
        for r in pq.read_table(part).to_pylist():
            if r["step"] not in rows or r["generation"] >= rows[r["step"]]["generation"]:
                rows[r["step"]] = r
    return rows


def weights(ckpt: Path, which: str = "model") -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((ckpt / which).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def consumed(run_dir: Path) -> list[tuple]:
    import duckdb

    return duckdb.sql(f"""SELECT epoch, step, rank, clip_id FROM '{run_dir}/consumed/*.parquet'
        QUALIFY generation = max(generation) OVER (PARTITION BY epoch, step)
        ORDER BY ALL""").fetchall()


def complete(ckpt: Path) -> bool:
    """Everything a checkpoint promises is there: state, config, every indexed shard, the optimizer."""
    for part in ("model", "ema"):
        index = ckpt / part / "model.safetensors.index.json"
        if not index.exists():
            return False
        if any(not (ckpt / part / f).exists() for f in set(json.loads(index.read_text())["weight_map"].values())):
            return False
    return all(
        (ckpt / f).exists()
        for f in ("state.json", "config.json", "optimizer/state.safetensors", "optimizer/optimizer.json")
    )


def manifest_clips(manifest: Path) -> Counter:
    import pyarrow.parquet as pq

    return Counter(pq.read_table(manifest, columns=["clip_id"]).column("clip_id").to_pylist())


def ema_rule_error(before: Path, after: Path) -> float:
    """How far the EMA of checkpoint `after` (one optimizer step after `before`) is from
    ema = d * ema_before + (1 - d) * w_after (w: model/, d: ema.decay), relative to the
    update's size: ~1e-4 from float rounding; 0.9 with d = 0.9, 9 with 0.999, 1 with no update."""
    import torch

    from reelcache.train.config import from_dict

    d = from_dict(json.loads((after / "config.json").read_text())).ema.decay
    e0, e1, w1 = weights(before, "ema"), weights(after, "ema"), weights(after, "model")
    assert e0.keys() == e1.keys() and 0 < d < 1
    moved = torch.cat([(e1[k] - e0[k]).flatten() for k in e1])
    rule = torch.cat([((1 - d) * (w1[k] - e0[k])).flatten() for k in e1])
    assert rule.norm() > 1e-3  # lr > 0: the weights moved away from the EMA
    return float((moved - rule).norm() / rule.norm())


def ids(path) -> list[str]:
    """A manifest's clip ids, in its order."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["clip_id"]).column("clip_id").to_pylist()


def run_ranks(loaders, steps=None):
    """Iterate rank loaders in lockstep; returns per-rank lists of batches."""
    out = [[] for _ in loaders]
    iters = [iter(ld) for ld in loaders]
    for k, batches in enumerate(zip(*iters)):
        for r, b in enumerate(batches):
            out[r].append(b)
        if steps is not None and k + 1 == steps:
            break
    else:
        for it in iters:  # finish the epoch bookkeeping of every rank
            for _ in it:
                pass
    return out


# --- training over the namespace cluster's nodes (tests/cluster_local.py) ----------------------

NODE_ENV = {"REELCACHE_PROGRESS": "0", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}  # a rank's, on a node


def torchrun_on_nodes(
    cluster, root, args: list[str], nodes: list[str], port: int, env: dict | None = None, node_env=None
):
    """`torchrun --nnodes N --node_rank K --master_addr <first node>` on each node, over ssh from the
    head node (node1), one process per node; returns the ssh processes (each one's output: that node's).
    root: a folder or an s3:// URL; node_env: node name -> the variables of that node's alone."""
    procs = []
    for k, node in enumerate(nodes):
        own = {**NODE_ENV, **(env or {}), **(node_env(node) if node_env else {})}
        cmd = shlex.join(
            ["env", *(f"{a}={b}" for a, b in own.items()), sys.executable,
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
    """Each process's output, once it ended (with ok: each exited 0)."""
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out)
        if ok:
            assert p.returncode == 0, out[-4000:]
    return outs


def same_run(a: Path, b: Path, last: int, which=("model",)) -> None:
    """Two runs trained steps 0..last-1 with the same losses, and their checkpoints at `last` hold the same
    weights (each of `which`: model, ema), exactly."""
    ma, mb = metrics(a), metrics(b)
    assert sorted(ma) == sorted(mb) == list(range(last))
    assert [ma[s]["loss"] for s in sorted(ma)] == [mb[s]["loss"] for s in sorted(mb)]
    for w in which:
        wa, wb = weights(a / f"ckpt-{last:08d}", w), weights(b / f"ckpt-{last:08d}", w)
        assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa), w


def node_s3_env(server) -> dict:
    """The AWS_* variables of the server on node1 (tests/conftest.py: node1_s3), and no config files."""
    return {**server.env(), "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
