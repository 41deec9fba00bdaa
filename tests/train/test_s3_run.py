"""A run whose root is in S3 (train/runfiles.py, docs/STORAGE.md), on a real SeaweedFS (tests/s3_local.py): the run
lease as an object, a checkpoint visible only once whole (its state.json last) and never after a cut-off upload.
The references are a plain boto3 client of the test's listing the objects, and the objects' own bytes."""

from __future__ import annotations

import json
import os
import socket
import time
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
from support import FakePar

from reelcache import UserError
from reelcache.base import lease as leases
from reelcache.base import s3


class OnePar(FakePar):
    """One rank: what runlease.take gathers is its own outcome."""

    local_rank = 0

    def gather_objects(self, obj):
        return [obj]


def keys(s3_server, url: str) -> list[str]:
    """The object keys under `url` by a plain boto3 client (not reelcache's), relative to it."""
    bucket, _, prefix = url[5:].partition("/")
    out = []
    for page in s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        out += [o["Key"][len(prefix) + 1 :] for o in page.get("Contents", [])]
    return sorted(out)


def test_s3_run_lease_is_an_object_and_a_second_start_is_refused_in_one_line(s3_server, s3_root, tmp_path, monkeypatch):
    from reelcache.train.runlease import take

    remote = s3.parse(s3_root) / "runs" / "r"
    run = tmp_path / "mirror" / "runs" / "r"
    held = take(run, OnePar(), remote=remote)
    assert keys(s3_server, str(remote)) == ["run.lease"]
    body = json.loads(s3_server.client().get_object(Bucket=remote.bucket, Key=f"{remote.key}/run.lease")["Body"].read())
    assert body["pid"] == os.getpid() and body["host"] == socket.gethostname()
    held.release()
    assert keys(s3_server, str(remote)) == []

    # a live holder on another node (its heartbeat fresh by the store's clock), then one on this machine
    # refusals raised as one UserError (what a rank of `reelcache train --nproc` says; the variable: its launcher)
    monkeypatch.setenv("REELCACHE_LAUNCH", str(os.getpid()))
    c = s3_server.client()
    other = {"host": "node7", "boot_id": "x", "pid": 4242, "pid_start": 1, "started_at": "t", "token": "first"}
    c.put_object(Bucket=remote.bucket, Key=f"{remote.key}/run.lease", Body=json.dumps(other).encode())
    with pytest.raises(UserError) as e:
        take(run, OnePar(), remote=remote)
    msg = str(e.value)
    assert "\n" not in msg and "running on another node" in msg and "node7 pid 4242" in msg
    assert f"{remote}/run.lease" in msg and f"aws s3 cp /dev/null {remote}/stop" in msg and "touch" not in msg
    here = {**other, "host": socket.gethostname(), "boot_id": leases.boot_id(), "pid": os.getpid()}
    here["pid_start"] = leases.pid_start(os.getpid())
    c.put_object(Bucket=remote.bucket, Key=f"{remote.key}/run.lease", Body=json.dumps(here).encode())
    with pytest.raises(UserError, match=r"run r is running: .* stop it first \(put the object s3://.*/runs/r/stop"):
        take(run, OnePar(), remote=remote)
    assert not run.exists()  # a refused start leaves no folder behind
    assert json.loads(c.get_object(Bucket=remote.bucket, Key=f"{remote.key}/run.lease")["Body"].read())["pid"] == (
        os.getpid()
    )


def _checkpointer(run, remote, lease):
    from reelcache.train.checkpoint import CheckpointConfig

    def snapshot():
        w = {"w": torch.arange(6.0)}
        return w, {"w": torch.ones(6)}, None, {"global_step": 1}, {"version": 2}

    return CheckpointConfig(every=1, keep_last=0).build(
        run_dir=run, par=OnePar(), snapshot=snapshot, lease=lease, remote=remote
    )


def test_s3_checkpoint_is_listed_only_once_whole_and_never_after_a_cut_off_upload(
    s3_server, s3_proxy, tmp_path, monkeypatch
):
    from reelcache.train.checkpoint import list_checkpoints

    remote = s3.parse(s3_proxy.root) / "runs" / "r"
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    lease = leases.acquire(remote / "run.lease")
    ck = _checkpointer(run, remote, lease)

    # the marker held at the proxy: every other object of the checkpoint is in, and no reader takes it
    marker = s3_proxy.add("hold", lambda m, p: m == "PUT" and "ckpt-00000001/state.json" in p)
    ck.save(1)
    deadline = time.monotonic() + 30
    while marker.hits == 0:
        assert time.monotonic() < deadline, "the writer never sent state.json"
        time.sleep(0.02)
    there = keys(s3_server, str(remote))
    written = sorted(p.relative_to(run).as_posix() for p in (run / ".tmp-ckpt-00000001").rglob("*") if p.is_file())
    assert "ema/model.safetensors" in " ".join(written) and "model/" in " ".join(written)
    assert [k for k in there if k.startswith("ckpt-")] == [  # every file but the marker is in
        w.replace(".tmp-", "") for w in written if not w.endswith("/state.json")
    ]
    assert list_checkpoints(remote) == []
    marker.release.set()
    ck.wait()
    assert [u.name for u in list_checkpoints(remote)] == ["ckpt-00000001"]
    assert "ckpt-00000001/state.json" in keys(s3_server, str(remote))

    # an upload that fails for good (the store answering 500, one attempt): the run fails at the next wait,
    # and ckpt-2 is never listed; a new start clears its objects
    monkeypatch.setattr(s3, "ATTEMPTS", 1)
    s3.forget_clients()
    s3_proxy.add("error500", lambda m, p: m == "PUT" and "ckpt-00000002/ema" in p, times=1000)
    ck.save(2)
    with pytest.raises(RuntimeError, match="ckpt-00000002/ema"):
        ck.wait()
    there = keys(s3_server, str(remote))
    assert "ckpt-00000002/config.json" in there  # sent before the failure
    assert "ckpt-00000002/state.json" not in there
    assert [u.name for u in list_checkpoints(remote)] == ["ckpt-00000001"]
    s3_proxy.clear()
    _checkpointer(tmp_path / "again", remote, lease)  # a new start of the run
    assert not [k for k in keys(s3_server, str(remote)) if k.startswith("ckpt-00000002")]
    assert [u.name for u in list_checkpoints(remote)] == ["ckpt-00000001"]
    lease.release()


def download(s3_server, url: str, to) -> list[str]:
    """Every object under `url` into the folder `to`, with a plain boto3 client; their relative keys."""
    bucket, _, prefix = url[5:].partition("/")
    got = keys(s3_server, url)
    for k in got:
        (to / k).parent.mkdir(parents=True, exist_ok=True)
        s3_server.client().download_file(bucket, f"{prefix}/{k}", str(to / k))
    return got


@pytest.mark.slow
def test_s3_root_run_resumes_from_s3_as_the_local_run_and_eval_once_gives_the_same_records(
    s3_server, s3_root, tmp_path, monkeypatch
):
    """Two training launches. The reference: a 6-step run on a local root (checkpoints at 3 and 6). Its data, its
    manifest and its ckpt-3 are uploaded with a plain boto3 client as a run in S3 that stopped at step 3; the same
    run on `--root s3://` with `--load latest` takes the manifest by name from the root's manifests/, reads the
    shards from S3, resumes from ckpt-3 downloaded from S3 and writes ckpt-6 there: its losses, consumed clips and
    final weights equal the local run's (the local resume is exact: test_train.py), every file of the local ckpt-6
    is an object, and `eval once` over the run in S3 gives the local run's validation loss, its records in S3."""
    from latent_data import write_latents
    from support import consumed, metrics, train, weights

    from reelcache.cli import main

    r = tmp_path / "local"
    manifest = write_latents(r, 24, name="train")
    named = manifest.with_name("train-0123456789abcdef.parquet")  # a manifest as `catalog manifest` names it
    manifest.rename(named)
    args = [
        '--data.manifests=[{name="train"}]',
        '--data.buckets="configs/buckets/tiny.toml"',
        "--model.overrides={caption_channels=8, model_max_length=300}",
        "--data.workers=0",
        "--log.wandb_mode=disabled",
        "--log.every=1",
        "--run.max_steps=6",
        "--checkpoint.every=3",
        "--checkpoint.keep_last=0",
        "--run.name=r",
    ]
    env = {"REELCACHE_S3_MIRROR": str(tmp_path / "mirror")}
    train(r, args, env=env)
    local = r / "runs" / "r"
    assert sorted(p.name for p in local.glob("ckpt-*")) == ["ckpt-00000003", "ckpt-00000006"]

    bucket, _, prefix = s3_root[5:].partition("/")
    c = s3_server.client()
    for p in sorted([*(r / "latents").rglob("*.tar"), named, *(local / "ckpt-00000003").rglob("*")]):
        if p.is_file():
            c.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(r).as_posix()}")
    out = train(s3_root, [*args, "--load", "latest"], env=env)
    assert "resumed from" in out and "ckpt-00000003" in out
    mirrored = tmp_path / "mirror" / bucket / prefix
    assert (mirrored / "runs/r/config.json").exists() and not list((mirrored / "runs/r").glob("*ckpt-*"))

    run_url = f"{s3_root}/runs/r"
    got = tmp_path / "got"
    objects = download(s3_server, run_url, got)
    files = sorted(p.relative_to(local).as_posix() for p in (local / "ckpt-00000006").rglob("*") if p.is_file())
    assert [k for k in objects if k.startswith("ckpt-00000006/")] == files  # every file of it, as an object
    assert "run.lease" not in objects  # released at the end
    assert {"config.json", "log/rank00000.log", "ranks/rank00000.json"} <= set(objects)
    assert json.loads((got / "ckpt-00000006/state.json").read_text())["global_step"] == 6
    ref, s3run = metrics(local), metrics(got)
    assert sorted(s3run) == [3, 4, 5]
    for s in (3, 4, 5):
        assert s3run[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-6, abs=1e-7), s
    assert consumed(got) == [row for row in consumed(local) if row[1] >= 3]
    for which in ("model", "ema"):
        a, b = weights(local / "ckpt-00000006", which), weights(got / "ckpt-00000006", which)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a), which

    # eval once over the run in S3 and over the local run: the same validation loss; the S3 run's records in S3
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "eval-mirror"))  # a machine sharing nothing else
    common = ["--preset", "debug", "--val-manifest", "train", "--val-max-clips", "2", "--device", "cpu"]
    common += ["--wandb-mode", "disabled"]
    assert main(["eval", "once", "--root", s3_root, "--run", "runs/r", *common, "--checkpoint", "latest"]) == 0
    assert main(["eval", "once", "--root", str(r), "--run", "runs/r", *common, "--checkpoint", "latest"]) == 0
    assert not list((tmp_path / "eval-mirror").rglob("ckpt-*/state.json"))  # the downloaded copy is not kept
    records = [k for k in keys(s3_server, run_url) if k.startswith("eval/")]
    assert {"eval/ckpt-00000006/val_loss.json", "eval/ckpt-00000006/debug/done.json"} <= set(records)
    doc = json.loads(
        c.get_object(Bucket=bucket, Key=f"{prefix}/runs/r/eval/ckpt-00000006/val_loss.json")["Body"].read()
    )
    want = json.loads((local / "eval/ckpt-00000006/val_loss.json").read_text())
    for k in ("global_step", "clips", "manifest_fingerprint", "weights"):
        assert doc[k] == want[k], k
    assert doc["overall"] == pytest.approx(want["overall"], rel=1e-6)
    assert doc["buckets"].keys() == want["buckets"].keys()
    assert all(doc["buckets"][b]["loss"] == pytest.approx(want["buckets"][b]["loss"], rel=1e-6) for b in doc["buckets"])

    # eval serve on yet another machine: ckpt-6's records are read back from S3, so only ckpt-3 is evaluated
    done6 = c.head_object(Bucket=bucket, Key=f"{prefix}/runs/r/eval/ckpt-00000006/debug/done.json")["ETag"]
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "serve-mirror"))
    serve = ["eval", "serve", "--root", s3_root, "--run", "runs/r", *common, "--poll", "0.1", "--exit-idle", "0.3"]
    assert main(serve) == 0
    assert c.head_object(Bucket=bucket, Key=f"{prefix}/runs/r/eval/ckpt-00000006/debug/done.json")["ETag"] == done6
    three = json.loads(
        c.get_object(Bucket=bucket, Key=f"{prefix}/runs/r/eval/ckpt-00000003/debug/done.json")["Body"].read()
    )
    assert three["global_step"] == 3 and three["val_loss"]["clips"] == 2


@pytest.mark.parametrize("what", ["bucket", "credentials", "endpoint"])
def test_s3_root_train_and_eval_refuse_a_bad_store_in_one_line_before_any_work(
    s3_root, what, tmp_path, monkeypatch, capsys
):
    """A missing bucket, wrong credentials, an endpoint refusing connections: `train` and `eval once` on
    `--root s3://` say it in one line and exit 2; nothing is written in the mirror."""
    from s3_local import BAD_ROOTS, bad_root
    from support import CONFIG

    from reelcache.cli import main

    mirror = tmp_path / "mirror"
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(mirror))
    root, expect = bad_root(what, s3_root, monkeypatch), BAD_ROOTS[what]
    capsys.readouterr()
    for argv in (
        ["train", str(CONFIG), "--root", root, "--log.wandb_mode=disabled"],
        ["eval", "once", "--root", root, "--run", "runs/r", "--checkpoint", "latest", "--val-manifest", "v"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], (argv, err)
    assert not mirror.exists()


def test_s3_stop_object_checkpoints_and_stops_and_is_consumed(s3_server, s3_root, tmp_path):
    """The stop request of a run in S3 is the object runs/<run>/stop (no file to touch on an object store): rank 0
    sees it, the checkpointer saves and stops, and the object is deleted once the checkpoint is written."""
    remote = s3.parse(s3_root) / "runs" / "r"
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    ck = _checkpointer(run, remote, None)
    ck.cfg.every = 100
    assert not ck.due(1)
    s3_server.client().put_object(Bucket=remote.bucket, Key=f"{remote.key}/stop", Body=b"")
    ck.stop._looked = 0.0  # the next look is now, not REMOTE_POLL_S later
    assert ck.save(2) is not None and ck.stopping
    ck.wait()
    there = keys(s3_server, str(remote))
    assert "ckpt-00000002/state.json" in there and "stop" not in there


def test_s3_fetch_downloads_a_checkpoint_prefix_or_one_object_into_the_mirror(
    s3_server, s3_root, tmp_path, monkeypatch
):
    """What --load / --init-from s3://... and eval download (train/runfiles.py: fetch): a prefix's objects, or one
    weights object, into the root's mirror at the same path, byte for byte (uploaded by a plain boto3 client);
    nothing there is one line naming the URL."""
    from reelcache.train.runfiles import fetch

    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    bucket, _, prefix = s3_root[5:].partition("/")
    c = s3_server.client()
    files = {"runs/a/ckpt-00000004/state.json": b"{}", "runs/a/ckpt-00000004/model/w.safetensors": os.urandom(3000)}
    files["weights/pixart.pth"] = os.urandom(5000)
    for k, v in files.items():
        c.put_object(Bucket=bucket, Key=f"{prefix}/{k}", Body=v)
    got = fetch(f"{s3_root}/runs/a/ckpt-00000004")
    assert got == tmp_path / "mirror" / bucket / prefix / "runs/a/ckpt-00000004"
    assert sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()) == [
        "model/w.safetensors",
        "state.json",
    ]
    assert (got / "model/w.safetensors").read_bytes() == files["runs/a/ckpt-00000004/model/w.safetensors"]
    one = fetch(f"{s3_root}/weights/pixart.pth")
    assert one.is_file() and one.read_bytes() == files["weights/pixart.pth"]
    with pytest.raises(UserError, match=r"nothing at s3://.*/runs/a/ckpt-00000009"):
        fetch(f"{s3_root}/runs/a/ckpt-00000009")


def test_s3_eval_finds_a_run_by_its_config_without_listing_it(s3_server, s3_proxy, tmp_path, monkeypatch, capsys):
    """`eval` over a run in S3 checks that the run exists by a HEAD of its config.json (the first object a start
    publishes) or of a submitted training's script, never by listing the run's prefix (its consumed log: tens of
    thousands of parts on a long run): neither is one line naming the run, whatever else lies under it."""
    from reelcache.cli import main

    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    root = s3_proxy.root
    remote = s3.parse(root) / "runs" / "r"
    c = s3_server.client()
    c.put_object(Bucket=remote.bucket, Key=f"{remote.key}/consumed/rank00000-000000.parquet", Body=b"part")
    argv = ["eval", "once", "--root", root, "--run", "runs/r", "--checkpoint", "latest", "--val-manifest", "v"]
    capsys.readouterr()
    s3_proxy.clear()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: no run at {remote} (no config.json under it, no training submitted there)"] or (
        len(err) == 1 and err[0].endswith(f"no run at {remote} (no config.json under it, no training submitted there)")
    ), err
    c.put_object(Bucket=remote.bucket, Key=f"{remote.key}/config.json", Body=b"{}")
    s3_proxy.clear()
    main(argv)  # it goes on past the check (and stops later: no checkpoint, no manifest)
    assert "no run at" not in capsys.readouterr().err
    assert ("HEAD", f"/{remote.bucket}/{remote.key}/config.json") in s3_proxy.requests
    listed = [parse_qs(urlsplit(p).query).get("prefix", [""])[0] for m, p in s3_proxy.requests if "list-type=2" in p]
    part = f"{remote.key}/consumed/rank00000-000000.parquet"
    assert listed and not [q for q in listed if part.startswith(q)], listed  # no listing holds the consumed log
    # a training submitted by `train --slurm` (its script's object) and not started yet is a run too
    c.put_object(Bucket=remote.bucket, Key=f"{remote.key}-submitted/slurm/train.sbatch", Body=b"#!/bin/bash\n")
    capsys.readouterr()
    main([*argv[:5], "runs/r-submitted", *argv[6:]])
    assert "no run at" not in capsys.readouterr().err
