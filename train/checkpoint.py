"""Checkpoints: ``ROOT/runs/<run>/ckpt-<global step, 8 digits>/``, never visible half-written.

    ckpt-00002210/
      model/       fp32 master weights (trainable) + frozen ones and buffers, safetensors shards + index
      ema/         fp32 EMA of the trainable tensors beside model/'s frozen ones and buffers: a complete
                   state dict, same layout (absent when ema.decay = 0)
      optimizer/   full Adam moments by parameter name (safetensors) + step counts (JSON), the
                   same for ZeRO and DDP at any world size (absent before the first optimizer step)
      state.json   train/state.py's TrainState: global and optimizer steps, the loader's state (epoch,
                   position, data fingerprint), guard window, world size, library versions
      config.json  the resolved config that trained it

Every rank takes part in gathering the state into host memory on rank 0 (weights, EMA and
optimizer moments are collectives under ZeRO); rank 0 then writes it into ``.tmp-ckpt-<step>`` from
a background thread while training goes on, fsyncs, and renames it to ``ckpt-<step>``. A reader
that lists ``ckpt-*`` only ever sees complete checkpoints, and a run killed at any moment leaves at
most a ``.tmp-*`` folder, which the next run deletes. The next checkpoint (or the end of the run)
waits for the writer; if it failed, every rank raises there. After each rename, rank 0 prunes: the
newest ``keep_last`` plus every step that is a multiple of ``keep_every`` survive.

A run whose root is in S3 (train/runfiles.py) writes ``.tmp-ckpt-<step>`` in the root's local mirror the
same way, then uploads each file whole to ``s3://.../runs/<run>/ckpt-<step>/``, the lease verified before
each, and ``state.json`` last: the object ``ckpt-<step>/state.json`` marks a complete checkpoint (a reader
listing the run takes no prefix without it). Pruning deletes a checkpoint's state.json first, then the rest;
a start deletes the objects of a ``ckpt-*`` prefix without its state.json (a killed upload's) and aborts the
run's incomplete multipart uploads.

Randomness needs no saved generator state: every draw of a step (timesteps, noise, frame
masks, caption dropout) is seeded by (run seed, global step, clip id), and the loader's order
and posterior noise by (seed, epoch, position). So a resume repeats the same draws exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from reelcache.base import s3
from reelcache.files import fsync_path
from reelcache.settings import setting

# what other stages may use (train/__init__.py: PUBLIC)
__all__ = ["CheckpointConfig", "Checkpointer", "ckpt_step", "list_checkpoints", "read_state"]

# train.parallel and train.weights (torch, safetensors) are imported by the writer thread that uses them:
# train/config.py imports this module (CheckpointConfig), and importing a config module loads no torch.

CKPT_RE = re.compile(r"^ckpt-(\d{8})$")


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:08d}"


def ckpt_step(path) -> int:
    """The global step of a checkpoint folder ``ckpt-<8 digits>`` (a path, or its prefix in S3)."""
    m = CKPT_RE.match(str(path).rstrip("/").rsplit("/", 1)[-1])
    if not m:
        raise ValueError(f"{path} is not a checkpoint folder (ckpt-<8 digits>)")
    return int(m.group(1))


def list_checkpoints(run_dir) -> list:
    """Complete checkpoints of a run, oldest first: folders, or for a run in S3 (an ``s3://`` run prefix) the
    ``ckpt-<step>`` prefixes whose ``state.json``, uploaded last, exists (their Urls)."""
    if s3.is_url(run_dir):
        url = s3.parse(run_dir)
        base = url.key.rstrip("/") + "/"
        done = {
            o["Key"][len(base) :].split("/", 1)[0]
            for o in s3.list_objects(s3.Url(url.bucket, base + "ckpt-"))
            if o["Key"][len(base) :].endswith("/state.json") and o["Key"][len(base) :].count("/") == 1
        }
        return sorted((url / n for n in done if CKPT_RE.match(n)), key=ckpt_step)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if CKPT_RE.match(p.name) and (p / "state.json").exists()]
    return sorted(found, key=ckpt_step)


def resolve(path, root=None, run_dir=None) -> Path:
    """A checkpoint argument: a path, a path under ROOT, or ``latest`` (the run's newest)."""
    if str(path) == "latest":
        found = list_checkpoints(run_dir) if run_dir else []
        if not found:
            raise FileNotFoundError(f"--load latest: no complete checkpoint in {run_dir}")
        return found[-1]
    p = Path(path)
    if not p.exists() and root is not None and (Path(root) / p).exists():
        p = Path(root) / p
    if not p.exists():
        raise FileNotFoundError(f"no checkpoint at {path}" + (f" (nor under {root})" if root else ""))
    return p


@dataclass
class CheckpointConfig:
    """[checkpoint]: when a run saves and which checkpoints it keeps."""

    every: int = setting(100, "steps between checkpoints (0 = only at the end and on a stop request)", ge=0)
    keep_last: int = setting(3, "newest checkpoints kept (0 = all) ...", ge=0)
    keep_every: int = setting(0, "... plus every checkpoint whose step is a multiple of this (0 = none)", ge=0)
    at_start: bool = setting(
        False,
        "save ckpt-00000000 before the first step of a run that resumes nothing (Open-Sora's epoch0-global_step0)",
    )

    def build(self, *, run_dir, par, snapshot, saved_step: int | None = None, lease=None, remote=None) -> Checkpointer:
        return Checkpointer(
            self, run_dir=run_dir, par=par, snapshot=snapshot, saved_step=saved_step, lease=lease, remote=remote
        )


def library_versions() -> dict:
    """The versions that wrote a checkpoint (its state.json says them)."""
    out = {}
    for m in ("torch", "colossalai", "reelcache"):
        try:
            out[m] = version(m)
        except PackageNotFoundError:
            pass
    return out


def read_state(ckpt) -> dict:
    return json.loads((Path(ckpt) / "state.json").read_text())


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, files in os.walk(folder):
        for f in files:
            fsync_path(os.path.join(dirpath, f))


class StopRequest:
    """A request to checkpoint and stop: SIGUSR2 to any rank (Slurm's ``--signal=USR2@<s>`` before a
    time limit), or the file ``runs/<run>/stop`` (``touch`` it from anywhere that sees the run
    directory), or for a run in S3 the object ``s3://.../runs/<run>/stop`` (``remote``: rank 0 looks for it
    every ``REMOTE_POLL_S``). SIGUSR1 stays the stack dump (train/watchdog.py)."""

    REMOTE_POLL_S = 10.0

    def __init__(self, run_dir: Path, remote=None):
        self.file = run_dir / "stop"
        self.object = remote / "stop" if remote is not None else None
        self.signalled = False
        self._looked = 0.0
        self._found = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def local(self) -> bool:
        if self.object is not None and not self._found and time.monotonic() - self._looked >= self.REMOTE_POLL_S:
            self._looked = time.monotonic()
            try:
                self._found = s3.head(self.object) is not None
            except s3.S3Error:
                pass  # the store not answering now: looked for again at the next poll
        return self.signalled or self._found or self.file.exists()

    def consume(self) -> None:
        self.file.unlink(missing_ok=True)
        if self.object is not None and self._found:
            s3.delete(self.object)
            self._found = False


class Checkpointer:
    """Decides when a run saves, writes and prunes its checkpoints; one per run and process.

    ``snapshot()`` is the trainer's: a collective returning what one checkpoint holds (host copies
    of the weights, EMA and optimizer moments on rank 0, the trainer's state and config). The loop
    calls ``start(step)`` before its first step, ``save(step)`` after every step and ``save(step,
    last=True)`` at its end; the checkpointer saves at the start if asked (``at_start``), on its
    cadence, at the last step, or when a stop was requested on any rank, and then sets ``stopping``."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        run_dir,
        par,
        snapshot=None,
        saved_step: int | None = None,
        lease=None,
        remote=None,
    ):
        self.cfg, self.run_dir, self.par, self.snapshot = cfg, Path(run_dir), par, snapshot
        self.lease = lease  # rank 0's run lease (train/runlease.py): verified before each checkpoint is published
        self.remote = s3.parse(remote) if remote is not None else None  # the run's prefix in S3 (train/runfiles.py)
        self.saved_step = saved_step  # the step of the newest checkpoint this run wrote or loaded
        self.stopping = False
        self.stop = StopRequest(self.run_dir, self.remote if par.rank == 0 else None)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if par.rank == 0:
            for stale in self.run_dir.glob(".tmp-ckpt-*"):  # left by a run killed while saving
                shutil.rmtree(stale, ignore_errors=True)
            if self.remote is not None:
                self._clear_incomplete()
        par.barrier()

    @property
    def home(self):
        """Where the run's checkpoints are listed: its folder, or its prefix in S3."""
        return self.remote if self.remote is not None else self.run_dir

    def start(self, step: int) -> Path | None:
        """Collective, before the first step: ``ckpt-00000000`` with ``at_start`` when the run starts at
        step 0 from nothing saved (a fresh start or --init-from, as upstream saves epoch0-global_step0;
        a resumed run never). Its weights are the initial ones, its EMA a copy of them, no optimizer/."""
        if not (self.cfg.at_start and step == 0 and self.saved_step is None):
            return None
        return self.save(step, last=True)

    def due(self, step: int, last: bool = False) -> bool:
        """Collective: whether ``step`` saves. A stop request on any rank counts for all of them."""
        if not self.stopping and self.par.max([1.0 if self.stop.local() else 0.0])[0] > 0:
            self.stopping = True
        every = self.cfg.every
        return step != self.saved_step and (last or self.stopping or bool(every and step % every == 0))

    def save(self, step: int, last: bool = False) -> Path | None:
        """Collective, after a step: writes a checkpoint if it is due; returns its path, or None."""
        if not self.due(step, last):
            return None
        path = self.write(step, *self.snapshot())
        self.saved_step = step
        if self.stopping and self.par.rank == 0:
            self.stop.consume()
        return path

    def write(
        self,
        step: int,
        model_state: dict | None,
        ema_state: dict | None,
        optim_state: tuple | None,
        state: dict,
        config: dict,
    ) -> Path:
        """Collective: every rank calls it with the same step, after gathering what rank 0 writes
        (host copies that the next step cannot change: ``Parallel.gather_full``,
        ``Parallel.optimizer_state``). Rank 0 writes in a background thread while training goes on;
        the next save (or ``wait``) joins it, and a failed write makes every rank raise there."""
        self.wait()
        final = self.run_dir / ckpt_name(step)
        if self.par.rank == 0:
            self._thread = threading.Thread(
                target=self._write,
                name=f"save-{step}",
                daemon=False,
                args=(step, final, model_state, ema_state, optim_state, state, config),
            )
            self._thread.start()
        return final

    def _write(self, step, final, model_state, ema_state, optim_state, state, config) -> None:
        """Rank 0's writer thread: everything into ``.tmp-ckpt-<step>``, fsync, rename, prune."""
        from reelcache.train.parallel import write_optimizer
        from reelcache.train.weights import save_sharded

        tmp = self.run_dir / f".tmp-{ckpt_name(step)}"
        try:
            t = time.monotonic()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_sharded(model_state, tmp / "model")
            if ema_state is not None:
                save_sharded(ema_state, tmp / "ema")
            if optim_state is not None:  # None before the first optimizer step
                write_optimizer(tmp / "optimizer", *optim_state)
            (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
            (tmp / "state.json").write_text(
                json.dumps({**state, "write_seconds": time.monotonic() - t}, indent=2, default=str)
            )
            _fsync_tree(tmp)
            if self.lease is not None:  # a run frozen past the lease's TTL, whose run another start took over,
                try:  # must not publish into it (the other writes the same ckpt-* names)
                    self.lease.verify()
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            if self.remote is not None:
                self._publish(tmp, step)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                if final.exists():  # a re-run of the same step (after --reset-data, say)
                    shutil.rmtree(final)
                os.rename(tmp, final)
                fsync_path(self.run_dir)
            self.prune()
        except BaseException as e:  # surfaced by wait(): a failed save must stop the run
            self._error = e

    def wait(self) -> None:
        """Collective: the previous checkpoint is complete on disk, or every rank raises (rank 0's
        writer failing must not leave the other ranks waiting in the next collective)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failed = self.par.max([1.0 if self._error is not None else 0.0])[0] > 0
        if failed:
            self._raise()
            raise RuntimeError(f"rank 0 failed to write a checkpoint in {self.run_dir}; stopping with it")

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint in {self.run_dir} failed: {e}") from e

    def prune(self) -> None:
        found = list_checkpoints(self.home)
        keep_last, keep_every = self.cfg.keep_last, self.cfg.keep_every
        keep = set(found[-keep_last:]) if keep_last > 0 else set(found)
        for p in found:
            step = ckpt_step(p)
            if p not in keep and not (keep_every and step % keep_every == 0):
                if self.remote is not None:
                    self._delete_remote(p)
                else:
                    shutil.rmtree(p, ignore_errors=True)

    # -- a run in S3 (train/runfiles.py) ------------------------------------------------------
    def _publish(self, tmp: Path, step: int) -> None:
        """Rank 0's writer: the checkpoint written in ``tmp`` up to ``<run>/ckpt-<step>/``, each file one whole
        object (base/s3.py: ``upload_file``), the lease verified before each; ``state.json`` last: until it is
        there, no reader takes the prefix for a checkpoint. A checkpoint of the same step already there (a re-run
        after --reset-data) is deleted first, its state.json first."""
        url = self.remote / ckpt_name(step)
        self._delete_remote(url)
        files = sorted(p for p in tmp.rglob("*") if p.is_file() and p != tmp / "state.json")
        for p in [*files, tmp / "state.json"]:
            if self.lease is not None:
                self.lease.verify()
            s3.upload_file(p, url / p.relative_to(tmp).as_posix())

    def _delete_remote(self, url) -> None:
        """A checkpoint's objects deleted, its state.json first (it stops being a checkpoint at once), each
        after the lease is verified (a run that lost it leaves the new holder's files alone)."""
        url = s3.parse(url)
        marker = url / "state.json"
        rest = [s3.Url(url.bucket, o["Key"]) for o in s3.list_objects(f"{url}/") if o["Key"] != marker.key]
        for obj in [marker, *rest]:
            if self.lease is not None:
                self.lease.verify()
            s3.delete(obj)

    def _clear_incomplete(self) -> None:
        """What a run killed while uploading a checkpoint left: objects of a ``ckpt-<step>/`` without its
        state.json, and the incomplete multipart uploads under the run (its checkpoint files over 8 MB)."""
        base = self.remote.key.rstrip("/") + "/"
        complete = {u.name for u in list_checkpoints(self.remote)}
        for o in s3.list_objects(s3.Url(self.remote.bucket, base + "ckpt-")):
            if o["Key"][len(base) :].split("/", 1)[0] not in complete:
                s3.delete(s3.Url(self.remote.bucket, o["Key"]))
        for up in s3.list_uploads(s3.Url(self.remote.bucket, base + "ckpt-")):
            s3.abort_upload(self.remote.bucket, up["Key"], up["UploadId"])
