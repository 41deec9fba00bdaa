"""The training loop: STDiT3 + rectified flow on the latent cache, one stage per run.

    reelcache train configs/train/opensora12/stage1.toml --root /data/rc --init-from PixArt-Sigma-XL-2-2K-MS.pth
    reelcache train configs/train/opensora12/stage1.toml --root /data/rc --resume

The loop is short on purpose: each concern is a component built from its config section (one
``build(**runtime)`` each, train/sections.py; ``_build`` is the list of them) and
called once per step. ``Step`` (train/step.py) is the step itself; the ``Checkpointer``
(train/checkpoint.py) decides when to save (its cadence, the last step, a stop request) and saves
what ``snapshot`` gathers; ``TrainState`` (train/state.py) is all of a checkpoint's state.json;
the ``Watchdog`` times each step, the ``Guard`` judges it, ``metrics_row`` (train/metrics.py)
measures it on logged steps and the ``RunLog`` writes it. Rank records (cluster/ranks.py) say
which process runs each rank, for ``reelcache cluster dump|stop``.

A start first takes the run directory's lease (train/runlease.py: one writer per run), then makes
every check that can refuse it (the checkpoint to resume, the config's changes, the manifests, the
data position, the weights) before it writes anything there: a refused start leaves the run
directory as it found it.

A run whose ``--root`` is ``s3://bucket/prefix`` (train/runfiles.py, docs/STORAGE.md) reads its manifests from
the root's ``manifests/`` (mirrored down), its shards from S3 (``data.shard_root`` defaults to the root), keeps
its folder in the root's local mirror and publishes each finished file, and its checkpoints, to
``s3://bucket/prefix/runs/<run>/``; its lease is an object there; a checkpoint it resumes is downloaded first.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch

from reelcache import UserError
from reelcache.base import s3
from reelcache.cluster import ranks
from reelcache.log import log_to_file, say
from reelcache.train import checkpoint as ck
from reelcache.train.config import TrainConfig, from_dict, resume_changes
from reelcache.train.guard import DivergedError
from reelcache.train.loader import ConsumedLog
from reelcache.train.metrics import metrics_row, peak_flops
from reelcache.train.runfiles import RunFiles, fetch, mirrored_inputs, run_place
from reelcache.train.runlease import take
from reelcache.train.state import TrainState
from reelcache.train.step import StepResult
from reelcache.train.watchdog import install_stack_signal
from reelcache.train.weights import load_weights, read_sharded


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        root,
        *,
        load=None,
        resume: bool = False,
        init_from=None,
        init_weights: str = "model",
        reset_data: bool = False,
        wait: bool = False,
    ):
        """``load``: a checkpoint (or "latest") to continue; ``resume``: continue from the run's newest
        checkpoint if it has one, else start (what a requeued job runs); ``init_from``: weights to
        start a new run from, ``init_weights`` which of a checkpoint folder's ("model" or "ema");
        ``wait``: wait for a live run of the same run directory to end instead of refusing."""
        self.cfg, self.init_weights = cfg, init_weights
        self.root_url = s3.parse(root) if s3.is_url(root) else None  # a root in S3; self.root is then its mirror
        self.root, self.run_dir, self.remote = run_place(root, cfg.run.name)
        self.par = cfg.parallel.build()
        self.rank0 = self.par.rank == 0
        self.files = RunFiles(self.run_dir, self.remote, self.par.rank)
        self.lease = None
        try:
            self._on_node(lambda: mirrored_inputs(root))  # the manifests and takedowns of a root in S3
            self.lease = take(self.run_dir, self.par, wait=wait, remote=self.remote)
            self.files.lease = self.lease.lease
            self._build(load, resume, init_from, reset_data)
        except BaseException:
            self.par.close()
            if self.lease is not None:
                self.lease.release()
            raise

    # -- setup: every component from its section ------------------------------------------
    def _build(self, load, resume, init_from, reset_data):
        cfg, par = self.cfg, self.par
        self.ckpt_path = self._checkpoint_to_load(load, resume)
        self.loader = cfg.data.build(root=self.root, par=par, seed=cfg.run.seed, shard_root=self.root_url)
        self.state = TrainState(self.loader, cfg.guard.build(), cfg.run.name, par.world, cfg.model.preset)
        if self.ckpt_path is not None:
            try:
                self.state.load_state_dict(ck.read_state(self.ckpt_path), reset_data=reset_data)
            except ValueError as e:
                raise UserError(f"--load {self.ckpt_path}: {e}") from e
        model = cfg.model.build(seed=cfg.run.seed)
        if self.ckpt_path is not None:
            self._load_weights(model, self.ckpt_path, strict=True)
        elif init_from is not None:
            self._load_weights(model, init_from, strict=None, which=self.init_weights)
        self._open_run_dir()  # every check passed: from here on this start writes in the run directory
        self.model, self.optimizer = self._boost(model)
        if self.ckpt_path is not None:
            self._resume(self.ckpt_path, reset_data)
        self.ema = cfg.ema.build(chunks=self._ema_chunks)
        if self.remote is not None and self.ckpt_path is not None and self.ckpt_path.is_relative_to(self.root):
            par.barrier()  # every rank of the node has read the copy downloaded from S3: it is not kept
            if par.local_rank == 0:
                shutil.rmtree(self.ckpt_path, ignore_errors=True)
        cond = cfg.conditioning.build(frame_interval=self.loader.buckets.frame_interval)
        self.step = cfg.step.build(
            par=par,
            model=self.model,
            optimizer=self.optimizer,
            guard=self.state.guard,
            ema=self.ema,
            cond=cond,
            flow=cfg.flow,
            optim=cfg.optim,
            seed=cfg.run.seed,
        )
        saved = self.state.global_step if self.ckpt_path is not None else None
        self.ckpt = cfg.checkpoint.build(
            run_dir=self.run_dir,
            par=par,
            snapshot=self.snapshot,
            saved_step=saved,
            lease=self.lease.lease,
            remote=self.remote,
        )
        self.total_steps = self._total_steps()
        self.log = cfg.log.build(
            run_dir=self.run_dir,
            enabled=self.rank0,
            name=cfg.run.name,
            config=self._write_config(),
            generation=self.loader.generation,
            total_steps=self.total_steps,
        )
        self.peak = peak_flops(par.device)
        self.files.publish()  # a run in S3: the rank records and config.json go up now
        self._announce()

    def _checkpoint_to_load(self, load, resume) -> Path | None:
        """The checkpoint this start continues (``--load``, or the newest with ``--resume``), its config's
        changes said; a UserError for a run directory with checkpoints that neither flag continues."""
        existing = ck.list_checkpoints(self.remote or self.run_dir)
        if resume and load is None and existing:
            load = existing[-1]
        if load is None:
            if existing:
                raise UserError(
                    f"{self.remote or self.run_dir} already has checkpoints up to {existing[-1].name}: continue it "
                    f"with --resume (= --load latest; or --load {existing[-1]}), or train under another run.name"
                )
            return None
        if self.remote is not None and not Path(str(load)).exists():
            path = self._fetch_checkpoint(load, existing)
        else:
            try:
                path = ck.resolve(load, self.root, self.run_dir)
            except FileNotFoundError as e:
                raise UserError(str(e)) from None
        if (path / "config.json").exists():
            saved = from_dict(json.loads((path / "config.json").read_text()))
            changes = resume_changes(saved, self.cfg)  # a UserError if the model differs
            if changes and self.rank0:
                say(f"config changes since {path.name}:\n  " + "\n  ".join(changes))
        return path

    def _on_node(self, fn):
        """``fn()`` on each node's local rank 0 (into the node's mirror), the others waiting for it."""
        if self.par.local_rank == 0:
            fn()
        self.par.barrier()

    def _fetch_checkpoint(self, load, existing: list) -> Path:
        """A run in S3: ``--load latest`` (the newest complete checkpoint in the run's prefix), ``runs/<run>/ckpt-N``
        (under the root) or an ``s3://`` URL, downloaded into the mirror; its local folder."""
        if str(load) == "latest":
            if not existing:
                raise UserError(f"--load latest: no complete checkpoint in {self.remote}")
            url = s3.parse(existing[-1])
        else:
            url = s3.parse(load) if s3.is_url(load) else self.root_url / str(load)
        if s3.head(url / "state.json") is None:
            raise UserError(f"no checkpoint at {url} (no state.json object: none there, or its upload never finished)")
        self._on_node(lambda: fetch(url))
        return s3.mirror_dir(url)

    def _boost(self, model):
        """The model on its device, its optimizer, both boosted by the plugin; ZeRO's fp32 masters set
        from the fp32 values as initialised or loaded (its boost casts the module to bf16 and would
        build them from the rounded values); frozen entries kept for the checkpoints."""
        self.shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
        fp32 = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.frozen = {k: v for k, v in fp32.items() if k not in self.shapes}
        params = [p for p in model.to(self.par.device).parameters() if p.requires_grad]
        model, optimizer = self.par.boost(model, self.cfg.optim.build(par=self.par, params=params))
        if self.par.zero:
            for n, m in self.par.master_chunks(model, optimizer).items():
                m.copy_(self.par.chunk(fp32[n].float().reshape(-1)))
        if self.cfg.model.compile:
            for blk in list(model.unwrap().spatial_blocks) + list(model.unwrap().temporal_blocks):
                blk.compile()
        return model, optimizer

    def _write_config(self) -> dict:
        resolved = self.cfg.to_dict()
        if self.rank0:
            (self.run_dir / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
        return resolved

    def _announce(self) -> None:
        if self.rank0:
            cfg, par = self.cfg, self.par
            n = sum(p.numel() for p in self.module.parameters())
            t = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
            say(
                f"train {cfg.run.name}: {cfg.model.preset} ({n / 1e6:.1f}M parameters, {t / 1e6:.1f}M trainable) on "
                f"{par.world} x {par.device.type} with {par.plugin_name}; {self.loader.plan().num_batches} "
                f"micro-batches per epoch, {self.total_steps} steps; run dir {self.run_dir}"
            )

    def _open_run_dir(self) -> None:
        par = self.par
        log_to_file(self.run_dir / "log" / f"rank{par.rank:05d}.log")  # every line this rank says, timed
        self._stacks = install_stack_signal(self.run_dir, par.rank)  # SIGUSR1 dumps this rank's stacks
        ranks.write(self.run_dir, par.rank, par.world, par.local_rank, Path(self._stacks.name).resolve())
        self.loader.log = ConsumedLog(self.run_dir / "consumed", par.rank, max(1, self.cfg.checkpoint.every or 100))
        self.loader.log.generation = self.loader.generation
        if self.remote is not None and self.rank0:  # the run's wandb id, if an earlier start made one
            s3.mirror_object(self.remote / "wandb_id", self.run_dir / "wandb_id")

    @property
    def module(self):
        return self.model.unwrap()

    def _load_weights(self, model, path, strict, which: str = "model"):
        local = path
        if s3.is_url(path):  # --init-from s3://...: downloaded into the mirror, loaded from there, then removed
            url = s3.parse(path)
            self._on_node(lambda: fetch(url))
            local = s3.mirror_dir(url)
        try:
            report = load_weights(model, local, strict=strict, which=which, chosen=set(self.cfg.model.overrides))
        except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
            raise UserError(f"cannot load weights from {path}: {e}") from e
        finally:
            if local is not path:
                self.par.barrier()  # every rank of the node has read it
                if self.par.local_rank == 0 and Path(local).is_dir():
                    shutil.rmtree(local, ignore_errors=True)
                elif self.par.local_rank == 0:
                    Path(local).unlink(missing_ok=True)
        self.state.init_from, self.state.init_weights = str(path), which
        if self.rank0:
            say(f"weights from {path}:\n{report.summary()}")

    def _resume(self, ckpt: Path, reset_data: bool):
        if (ckpt / "optimizer").exists():  # absent when saved before the first optimizer step
            self.par.load_optimizer(self.optimizer, self.model, str(ckpt / "optimizer"))
            for group in self.optimizer.param_groups:  # the config's hyper-parameters, not the saved ones
                group.update(**self.cfg.optim.hyper())
        if self.rank0:
            say(
                f"resumed from {ckpt}: step {self.state.global_step}, epoch {self.loader.epoch}, position "
                f"{self.loader.consumed}" + (" (data position reset)" if reset_data else "")
            )

    def _ema_chunks(self) -> dict:
        """Where the EMA starts: the checkpoint's, or (fresh, or --init-from) the weights themselves."""
        par = self.par
        if self.ckpt_path is not None and (self.ckpt_path / "ema").exists():
            full = read_sharded(self.ckpt_path / "ema")
            return {n: par.chunk(full[n].float().reshape(-1)).clone().to(par.device) for n in self.shapes}
        return {n: c.detach().clone() for n, c in par.master_chunks(self.model, self.optimizer).items()}

    def _total_steps(self) -> int:
        """Optimizer steps of the whole stage: the rest of this epoch plus the remaining epochs.

        One plan per distinct set of mixing weights, not per epoch (a plan costs about a second at
        1.3M clips, and upstream configs say epochs = 1000): for the ETA, epochs with the same
        weights are taken to have the same number of micro-batches."""
        total = self.state.global_step + self.loader.steps_remaining()
        per_weights: dict[tuple, int] = {}
        for e in range(self.loader.epoch + 1, self.cfg.run.epochs):
            key = tuple(s.weight for s in self.loader.epoch_sources(e))
            if key not in per_weights:
                per_weights[key] = math.ceil(self.loader.plan(e).num_batches / self.par.world)
            total += per_weights[key]
        if self.cfg.run.max_steps:
            total = min(total, self.cfg.run.max_steps)
        return total

    # -- checkpoints -----------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """A collective: (model, EMA, optimizer state on rank 0; the TrainState's dict: state.json, the config)."""
        par = self.par
        masters = par.gather_full(par.master_chunks(self.model, self.optimizer), self.shapes)
        ema = par.gather_full(self.ema.chunks, self.shapes) if self.ema is not None else None
        model_state = {**self.frozen, **masters} if self.rank0 else None
        if ema is not None and self.rank0:
            # a complete state dict, as Open-Sora's ema.pt is: the frozen entries and buffers beside the
            # EMA tensors, so ema/ alone loads strictly anywhere (an upstream loader, inference tools)
            ema = {**self.frozen, **ema}
        if self.rank0:
            self.log.flush()  # metrics up to this step exist before the checkpoint does
        if self.loader.log:
            self.loader.log.flush()
        self.files.publish()  # a run in S3: this rank's metrics, consumed log and log up to here, before the checkpoint
        optim = par.optimizer_state(self.optimizer, self.model) if self.state.opt_steps else None
        return model_state, ema, optim, self.state.state_dict(), self.cfg.to_dict()

    def _save(self, last: bool = False) -> None:
        path = self.ckpt.save(self.state.global_step, last=last)
        if path is not None and self.rank0:
            say(f"checkpoint {path.name} (writing in the background)")

    # -- the loop --------------------------------------------------------------------------
    def train(self) -> None:
        cfg, par, st = self.cfg, self.par, self.state
        self.model.train()
        self._since_log: list[float] = []  # losses of the good steps since the last metrics row
        dog = cfg.watchdog.build(
            run_dir=self.run_dir, rank=par.rank, alert=lambda m: say(f"WATCHDOG rank {par.rank}: {m}")
        )
        try:
            path = self.ckpt.start(st.global_step)
            if path is not None and self.rank0:
                say(f"checkpoint {path.name} before the first step (checkpoint.at_start; writing in the background)")
            while self.loader.epoch < cfg.run.epochs and not self._done():
                sched, k = self.loader.schedule(), 0
                dog.begin(st.global_step, **self._upcoming(sched, k))
                t_data = time.monotonic()
                for batch in self.loader:
                    dog.working_on(waiting_for_data=False, bucket=batch["bucket"], clip_ids=list(batch["clip_id"]))
                    t_step = time.monotonic()
                    out = self.step(batch, st)
                    if par.device.type == "cuda":
                        torch.cuda.synchronize()
                    t_end = time.monotonic()
                    st.global_step += 1
                    dog.end()
                    dog.begin(st.global_step, after_step=True)  # the collectives below are watched too
                    if not out.skipped:
                        self._since_log.append(out.loss)
                    if out.bad:
                        self._record_bad(batch, out)
                        if st.guard.exhausted:  # the same verdict on every rank (the guard's is max-reduced)
                            self.ckpt.wait()  # a collective: the checkpoint in flight is on disk and can be named
                            raise DivergedError(self._diverged_message())
                    if st.global_step % cfg.log.every == 0 or out.bad:
                        self._log(batch, out, t_end - t_data, t_step - t_data)
                    self._save(last=self._done())
                    dog.end(record=False)
                    if self._done() or self.ckpt.stopping:
                        break
                    k += 1
                    dog.begin(st.global_step, **self._upcoming(sched, k))
                    t_data = time.monotonic()
                dog.end()
                if self.ckpt.stopping:
                    break
            self._save(last=True)
            self.ckpt.wait()
            if self.ckpt.stopping and self.rank0:
                say(
                    f"stopped on request at step {st.global_step} (SIGUSR2 or {self.ckpt.stop.file}); "
                    f"continue with --resume"
                )
        finally:
            dog.close()
            self.log.finish()
            if self.loader.log:
                self.loader.log.flush()
            try:
                self.files.publish()  # a run in S3: the last metrics, consumed-log parts and logs
            finally:
                self.par.close()
                self.lease.release()

    def _upcoming(self, sched, k: int) -> dict:
        """What step k of this epoch's schedule will train on (for the watchdog's report)."""
        info = {"epoch": self.loader.epoch, "waiting_for_data": True}
        if k < len(sched):
            _, index, pad = sched[k]
            plan = self.loader.plan()
            info.update(
                bucket=plan.buckets[plan.bucket[index]],
                padding=pad,
                clip_ids=[str(c) for c in self.loader.clip_id[plan.batch(index)]],
            )
        return info

    def _done(self) -> bool:
        return bool(self.cfg.run.max_steps) and self.state.global_step >= self.cfg.run.max_steps

    def _log(self, batch, out: StepResult, step_s: float, wait_s: float) -> None:
        row = metrics_row(self.par, self.module, self.module.config, out, step_s=step_s, wait_s=wait_s, peak=self.peak)
        head = {"step": self.state.global_step - 1, "epoch": self.loader.epoch, "epoch_step": int(batch["step"])}
        mean = sum(self._since_log) / len(self._since_log) if self._since_log else float("nan")
        self._since_log.clear()
        self.log.log({**head, **row, "loss_mean": mean})

    def _record_bad(self, batch, out: StepResult) -> None:
        clips = self.par.gather_objects(list(batch["clip_id"]) if batch["weight"] else [])
        if self.rank0:
            rec = {
                "step": self.state.global_step - 1,
                "epoch": self.loader.epoch,
                "loss": out.loss,
                "grad_norm": out.grad_norm,
                "reason": out.bad,
                "skipped": bool(out.skipped),
                "clip_ids": [c for r in clips for c in r],
            }
            with open(self.run_dir / "bad_steps.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            what = "skipped" if out.skipped else "NOT skipped (guard.skip_nonfinite = false), the optimizer stepped"
            say(
                f"step {rec['step']}: {what} ({out.bad}); clips: {', '.join(rec['clip_ids'][:8])}"
                + (" ..." if len(rec["clip_ids"]) > 8 else "")
            )

    def _diverged_message(self) -> str:
        found = ck.list_checkpoints(self.ckpt.home)
        stepped = self.state.guard.stepped_from  # bad steps that changed the weights: a checkpoint before them
        if stepped is not None:
            found = [c for c in found if ck.ckpt_step(c) <= stepped]
        last = found[-1] if found else None
        cmd = (
            f"reelcache train <config> --root {self.root_url or self.root} --load {last}"
            if last
            else "no checkpoint yet: start again with another seed or a lower lr"
        )
        return (
            f"stopping: {self.state.guard.bad} consecutive bad steps (non-finite or spiking loss/gradient) up to "
            f"step {self.state.global_step}; see {self.run_dir / 'bad_steps.jsonl'} for the clips. Last good "
            f"checkpoint: {last or 'none'}. Resume with: {cmd} (consider a lower optim.lr, or --reset-data)"
        )
