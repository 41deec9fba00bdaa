"""A run whose root is in S3 (train/runfiles.py, docs/STORAGE.md), on a real SeaweedFS (tests/s3_local.py): the run
lease as an object, a checkpoint visible only once whole (its state.json last) and never after a cut-off upload.
The references are a plain boto3 client of the test's listing the objects, and the objects' own bytes."""

from __future__ import annotations

import json
import os
import socket
import time

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
    monkeypatch.setenv("REELCACHE_LAUNCH", "1")  # refusals raised as one UserError (what a launch's rank says)
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
