"""The evaluation server: watch a run's checkpoints, evaluate each one, log into the run's wandb run.

    reelcache eval serve --root R --run runs/stage1 --prompts configs/eval/prompts.txt \\
        --val-manifest val-240p --preset low4s            # beside training, on its own GPU
    reelcache eval once  --root R --run runs/stage1 --checkpoint ckpt-00002210 --preset low4s

What counts as a checkpoint: ``train.checkpoint.list_checkpoints`` (``ckpt-<8 digits>`` folders with
a state.json: the trainer renames a finished ``.tmp-ckpt-*`` into place, so a half-written one is
never seen). Each poll processes the pending ones in ascending step order, re-listing after each,
so a checkpoint written meanwhile joins the queue in order and none is skipped (Open-Sora's
server globbed unsorted and remembered only the last step it did, so it skipped checkpoints).
``--every N`` keeps the steps on every N-th save of the run (multiples of N x checkpoint.every,
a grid that pruning does not shift) plus a run's final off-grid checkpoint; ``--latest-only``
takes only the newest pending one per poll.

Per checkpoint, into ``runs/<run>/eval/ckpt-<step>/``:
  val_loss.json        deterministic validation loss (eval/valloss.py), per bucket and overall;
                       computed once per (weights, manifest) and reused by every preset
  <tag>/sample_<i>.mp4 one video per prompt (eval/samples.py), decoded by the cache's VAE
  <tag>/done.json      written last, atomically: the checkpoint is finished for this tag
where <tag> is the preset name, with "-model" appended for non-EMA weights. A server killed at
any point redoes only the checkpoint it was on. ``runs/<run>/eval/val_loss.parquet`` gathers
every val_loss*.json as rows (step, weights, bucket, t, loss, clips) and is rewritten each time.

Failures: an exception on one checkpoint (a corrupt file, say) is written to
``<tag>/error-<n>.txt`` and the server goes on with the next; the checkpoint is retried on later
polls until it has failed ``max_attempts`` times (the error files count, across restarts), then
left alone with a message. A checkpoint that the trainer pruned before its turn is skipped and
said so: give the trainer ``checkpoint.keep_every`` (or keep_last) wide enough for the evaluator's lag.

wandb (eval/runlog.py): the numbers and videos go into the SAME run as training, under
``eval/<tag>/...`` with their own x axis ``eval/global_step`` (define_metric), never ``step=``.

Beside this module: eval/checkpoints.py (which checkpoints ``--every`` takes, and whether one is whole),
eval/encoders.py (the cache's encoders, found and checked), eval/records.py (the JSON records and
val_loss.parquet).

A run in S3 (``--root s3://bucket/prefix``, train/runfiles.py), followed from a machine that shares nothing
else: its complete checkpoints are listed in S3 (a ``ckpt-<step>/state.json`` object each), the one to evaluate
is downloaded into the root's local mirror and read there as a folder; the records are written in the mirror's
``runs/<run>/eval/`` and each uploaded whole to ``s3://.../runs/<run>/eval/`` (done.json last), and what was
done before is read from there at the start; the validation shards are read from S3 by ranged reads.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from reelcache import UserError
from reelcache.base import s3
from reelcache.cache.plan import load_cache
from reelcache.catalog.manifest import read_manifest, resolve_manifest
from reelcache.eval.checkpoints import check_weights, select
from reelcache.eval.encoders import cache_encoders, made_from
from reelcache.eval.records import write_json, write_val_loss_parquet
from reelcache.eval.runlog import log_eval
from reelcache.eval.samples import PRESETS, sample
from reelcache.eval.valloss import validation_loss
from reelcache.log import say
from reelcache.media import write_mp4
from reelcache.progress import fmt_eta
from reelcache.train.checkpoint import list_checkpoints, read_state
from reelcache.train.config import from_dict
from reelcache.train.model import STDiT3
from reelcache.train.runfiles import TEMPORARY, RunFiles, fetch, mirrored_inputs
from reelcache.train.source import check_shards, load_source
from reelcache.train.weights import load_weights

__all__ = ["Evaluator", "run_in_s3", "select"]

RUN_FILES = ("config.json", "wandb_id")  # of a run in S3, mirrored for the wandb run to log into
SUBMITTED = "slurm/train.sbatch"  # a training submitted by `train --slurm` (cluster/slurm/jobs.py), before it starts


def run_in_s3(root: s3.Url, run) -> tuple[str, s3.Url]:
    """``--run`` under a root in S3: (its path under the root, its prefix), or one line saying what is wrong. It
    exists when its config.json or the script of a training submitted there does: two HEADs at most, never a
    listing of its prefix (the consumed log: tens of thousands of parts on a long run)."""
    rel = Path(run).as_posix().strip("/")
    if Path(run).is_absolute() or ".." in Path(rel).parts:
        raise UserError(f"--run {run}: with an s3:// --root, the run under it: runs/<name>")
    remote = root / rel
    if s3.head(remote / "config.json") is None and s3.head(remote / SUBMITTED) is None:
        raise UserError(f"no run at {remote} (no config.json under it, no training submitted there)")
    return rel, remote


class _Progress:
    """One line per ~10 s (and at the end) with count and ETA: readable under nohup and in CI logs."""

    def __init__(self, what: str, every_s: float = 10.0):
        self.what, self.every, self.t0, self.last = what, every_s, time.monotonic(), 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < self.every:
            return
        self.last = now
        eta = (now - self.t0) / max(done, 1) * (total - done)
        say(f"  {self.what}: {done}/{total}, {now - self.t0:.0f}s, ETA {fmt_eta(eta)}")


@dataclass
class Evaluator:
    root: Path
    run_dir: Path
    preset: str = "debug"
    prompts: list[str] = field(default_factory=list)
    val_manifest: str | None = None
    weights: str = "ema"
    device: str = "cpu"
    dtype: str = "fp32"
    cache: str | None = None
    val_batch: int = 4
    val_max_clips: int | None = None
    wandb_mode: str | None = None  # None: the run's own log.wandb_mode
    max_attempts: int = 3

    def __post_init__(self):
        self.root_url = self.remote = None
        if s3.is_url(self.root):  # a run in S3: its folder mirrored locally (module docstring)
            self.root_url = s3.parse(self.root)
            self.root = s3.mirror_dir(self.root_url)
            rel, self.remote = run_in_s3(self.root_url, self.run_dir)
            mirrored_inputs(self.root_url)
            (self.root / rel).mkdir(parents=True, exist_ok=True)
            self._mirror_run_files(self.root / rel)
            s3.sync_down(self.remote / "eval", self.root / rel / "eval", lambda r: not r.endswith(".mp4"))
        self.root, self.run_dir = Path(self.root), Path(self.run_dir)
        if not self.run_dir.is_absolute() and not self.run_dir.exists():
            self.run_dir = self.root / self.run_dir
        if not self.run_dir.is_dir():
            raise UserError(f"no run directory {self.run_dir}")
        self.shard_root = str(self.root_url) if self.root_url is not None else self.root
        if self.preset not in PRESETS:
            raise UserError(f"--preset {self.preset!r}: one of {', '.join(PRESETS)}")
        if self.weights not in ("ema", "model"):
            raise UserError(f"--weights {self.weights!r}: ema or model")
        self.tag = self.preset if self.weights == "ema" else f"{self.preset}-model"
        self.out = self.run_dir / "eval"
        self.records = RunFiles(self.out, self.remote / "eval" if self.remote is not None else None, 0, TEMPORARY)
        self._encoders = None
        self._prompt_text = None
        self._manifest = self._manifest_fp = self._cache_doc = None
        self._given_up: set[str] = set()

    # -- what to do ------------------------------------------------------------------------
    def done(self, ckpt: Path) -> bool:
        return (self.out / ckpt.name / self.tag / "done.json").exists()

    def attempts(self, ckpt: Path) -> int:
        return len(list((self.out / ckpt.name / self.tag).glob("error-*.txt")))

    @property
    def home(self):
        """Where the run's checkpoints are listed: its folder, or its prefix in S3."""
        return self.remote if self.remote is not None else self.run_dir

    def pending(self, every: int = 1, latest_only: bool = False) -> list:
        found = list_checkpoints(self.home)
        if not found:
            return []
        ckpt_every = int(self._config(found[-1]).checkpoint.every) if every > 1 else 0
        todo = [c for c in select(found, every, ckpt_every) if not self.done(c) and c.name not in self._given_up]
        for c in list(todo):
            if self.attempts(c) >= self.max_attempts:
                say(
                    f"eval: {c.name} failed {self.attempts(c)} times, left alone (see {self.out / c.name / self.tag}/"
                    f"error-*.txt; delete them to retry)"
                )
                self._given_up.add(c.name)
                todo.remove(c)
        return todo[-1:] if latest_only else todo

    def check(self) -> None:
        """Settings errors stop the command before any checkpoint (they would fail every one of them)."""
        if not self.prompts and not self.val_manifest:
            raise UserError("nothing to evaluate: give --prompts and/or --val-manifest")
        if self.val_manifest:
            try:
                src = load_source(self.manifest(), view=0)  # what valloss reads: view 0, the first max_clips
            except ValueError as e:
                raise UserError(f"--val-manifest {self.val_manifest}: {e}") from e
            rows = range(min(len(src.clip_id), self.val_max_clips or len(src.clip_id)))
            check_shards(
                self.shard_root, src, self.manifest(), rows
            )  # a missing shard: one line, before any checkpoint
        if self.prompts:
            self._cache()

    def serve(
        self, poll: float = 60.0, every: int = 1, latest_only: bool = False, exit_idle: float = 0.0, until=None
    ) -> None:
        """Evaluate checkpoints as they appear, forever, or until idle for ``exit_idle`` seconds, or (``until``:
        the followed training job has ended) until ``until()`` is true and nothing is left to evaluate."""
        self.check()
        say(
            f"eval serve: watching {self.run_dir} for checkpoints (preset {self.preset}, {self.weights} weights, "
            f"poll {poll:g}s"
            + (f", every {every}th" if every > 1 else "")
            + (", latest only" if latest_only else "")
            + f"); results in {self.out}"
        )
        idle_since = time.monotonic()
        while True:
            todo = self.pending(every, latest_only)
            if todo:
                ckpt = todo[0]
                say(f"eval: {ckpt.name} ({len(todo)} pending)")
                self.try_one(ckpt)
                idle_since = time.monotonic()
                continue  # re-list: new checkpoints join in step order
            if exit_idle and time.monotonic() - idle_since >= exit_idle:
                say(f"eval serve: nothing new for {exit_idle:g}s, stopping")
                return
            if until is not None and until():
                if self.pending(every, latest_only):  # written just before the training ended
                    continue
                say("eval serve: the training job has ended and every checkpoint is evaluated, stopping")
                return
            time.sleep(poll)

    def try_one(self, ckpt) -> bool:
        """evaluate() with the failure policy: an error is recorded and the caller goes on."""
        try:
            self.evaluate(ckpt)
            return True
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - the policy: record, go on, retry later
            gone = s3.head(s3.parse(ckpt) / "state.json") is None if s3.is_url(ckpt) else not Path(ckpt).exists()
            if gone:
                say(f"eval: {ckpt.name} was removed (pruned by the trainer?) before it was evaluated; skipped")
                self._given_up.add(ckpt.name)
                return False
            d = self.out / ckpt.name / self.tag
            d.mkdir(parents=True, exist_ok=True)
            n = self.attempts(ckpt) + 1
            (d / f"error-{n}.txt").write_text(traceback.format_exc())
            self.records.publish()
            say(
                f"eval: {ckpt.name} FAILED (attempt {n} of {self.max_attempts}): {type(e).__name__}: {e}; "
                f"traceback in {d / f'error-{n}.txt'}"
            )
            return False

    # -- one checkpoint --------------------------------------------------------------------
    def local(self, ckpt) -> Path:
        """A checkpoint as a local folder: a path, ckpt-<step> of the run, or (a run in S3) one in S3, downloaded
        into the mirror."""
        if self.remote is not None and (s3.is_url(ckpt) or not Path(str(ckpt)).exists()):
            url = s3.parse(ckpt) if s3.is_url(ckpt) else self.remote / Path(str(ckpt)).name
            if s3.head(url / "state.json") is None:
                raise UserError(f"{url} is not a complete checkpoint (no state.json object)")
            return fetch(url)
        ckpt = Path(ckpt)
        if not ckpt.is_absolute() and not ckpt.exists():
            ckpt = self.run_dir / ckpt
        return ckpt

    def evaluate(self, ckpt) -> dict:
        ckpt = self.local(ckpt)
        try:
            return self._evaluate(ckpt)
        finally:
            if self.remote is not None and ckpt.parent == self.run_dir:  # a copy downloaded from S3: not kept
                shutil.rmtree(ckpt, ignore_errors=True)

    def _evaluate(self, ckpt: Path) -> dict:
        if not (ckpt / "state.json").exists():
            raise UserError(f"{ckpt} is not a complete checkpoint (no state.json)")
        t0 = time.monotonic()
        state = read_state(ckpt)
        step = int(state["global_step"])
        model, used = self._model(ckpt)
        dev, dtype = torch.device(self.device), self._torch_dtype()
        result = {"checkpoint": ckpt.name, "global_step": step, "preset": self.preset, "weights": used}
        d = self.out / ckpt.name / self.tag

        if self.val_manifest:
            result["val_loss"] = self._val_loss(ckpt, model, step, used)
            say(f"  val loss {result['val_loss']['overall']:.5f} over {result['val_loss']['clips']} clips")
        if self.prompts:
            video_enc, text = self.encoders()[0], self.prompt_text()
            p = PRESETS[self.preset]
            videos, frames = sample(
                model,
                text,
                video_enc,
                p,
                device=dev,
                dtype=dtype,
                progress=_Progress(
                    f"{ckpt.name} sampling {len(self.prompts)} prompts, {p.steps} steps, batches of {p.batch}"
                ),
            )
            result["videos"] = [str(write_mp4(v, d / f"sample_{i}.mp4", fps=p.fps)) for i, v in enumerate(videos)]
            result["frames"] = frames
            result["size"] = list(videos[0].shape[1:3])
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the next checkpoint's model goes where this one was
        self._log_wandb(result)
        result["seconds"] = time.monotonic() - t0
        write_json(d / "done.json", result)  # last: the checkpoint is finished for this tag
        self.records.publish()  # a run in S3: the records up to it (done.json last)
        say(f"eval: {ckpt.name} done in {result['seconds']:.0f}s -> {d}")
        return result

    def _torch_dtype(self):
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]

    def _config(self, ckpt):
        if s3.is_url(ckpt):
            return from_dict(json.loads(s3.get(s3.parse(ckpt) / "config.json")))
        return from_dict(json.loads((ckpt / "config.json").read_text()))

    def _model(self, ckpt: Path):
        """STDiT3 as configured in the checkpoint's config.json, with its EMA (or model) weights."""
        model = STDiT3(self._config(ckpt).model.stdit3())
        used = self.weights
        if used == "ema" and not (ckpt / "ema").is_dir():
            say(f"  {ckpt.name} has no ema/ (ema.decay = 0): using model/")
            used = "model"
        check_weights(ckpt, used)
        try:
            load_weights(model, ckpt, which=used)
        except (OSError, SafetensorError) as e:  # a shard present but unreadable (cut short, overwritten)
            raise UserError(f"{ckpt.name}: its {used}/ weights cannot be read ({type(e).__name__}: {e})") from e
        return model.to(torch.device(self.device), self._torch_dtype()).eval(), used

    # -- validation loss -------------------------------------------------------------------
    def manifest(self) -> Path:
        if self._manifest is None:
            try:
                self._manifest = resolve_manifest(self.root, self.val_manifest)
            except ValueError as e:
                raise UserError(f"--val-manifest: {e}") from e
        return self._manifest

    def manifest_fingerprint(self) -> str:
        """The val manifest's fingerprint, read once (its file name carries it: it cannot change)."""
        if self._manifest_fp is None:
            self._manifest_fp = read_manifest(self.manifest())[1]
        return self._manifest_fp

    def _val_loss(self, ckpt: Path, model, step: int, used: str) -> dict:
        path = self.out / ckpt.name / ("val_loss.json" if used == "ema" else f"val_loss-{used}.json")
        fp = self.manifest_fingerprint()
        if path.exists():
            doc = json.loads(path.read_text())
            if doc.get("manifest_fingerprint") == fp and doc.get("max_clips") == self.val_max_clips:
                return doc
        cfg = self._config(ckpt)
        res = validation_loss(
            model,
            self.manifest(),
            self.shard_root,
            device=torch.device(self.device),
            dtype=self._torch_dtype(),
            cond=cfg.conditioning.build(frame_interval=self._frame_interval(cfg)),
            batch_size=self.val_batch,
            max_clips=self.val_max_clips,
            progress=_Progress(f"{ckpt.name} val loss batches"),
        )
        doc = {
            "checkpoint": ckpt.name,
            "global_step": step,
            "weights": used,
            "manifest": str(self.manifest()),
            "manifest_fingerprint": fp,
            "max_clips": self.val_max_clips,
            "dtype": self.dtype,
            **res,
        }
        write_json(path, doc)
        write_val_loss_parquet(self.out)
        return doc

    def _frame_interval(self, cfg) -> int:
        """What the trainer divided fps by: its own bucket config's frame interval; when that file is
        not on this machine, the cache's (its identity records it); else 1, said aloud."""
        try:
            return cfg.frame_interval()
        except OSError:
            pass
        try:
            return int(self._cache()[2]["buckets"]["frame_interval"])
        except (UserError, KeyError):
            say(
                f"  no bucket config ({cfg.data.buckets}) nor cache identity here: fps conditioning "
                "assumes frame_interval = 1"
            )
            return 1

    # -- encoders from the cache -----------------------------------------------------------
    def _cache_name(self) -> str:
        """--cache, else the cache the val manifest was made from, else the one the run trained on."""
        if self.cache:
            return self.cache
        candidates = []
        if self.val_manifest:
            candidates.append(self.manifest())
        ckpts = list_checkpoints(self.home)
        if ckpts:
            for m in self._config(ckpts[-1]).data.manifests:
                try:
                    candidates.append(resolve_manifest(self.root, m.name))
                except ValueError:
                    pass
        return made_from(candidates)

    def _cache(self):
        """(CacheConfig, plan, identity) of the cache whose encoders this evaluator uses, read once."""
        if self._cache_doc is None:
            self._cache_doc = load_cache(self.root, self._cache_name())
        return self._cache_doc

    def encoders(self):
        """(VideoEncoder, TextEncoder) rebuilt from the cache's plan, checked against its cache.json."""
        if self._encoders is None:
            cfg, _plan, ident = self._cache()
            self._encoders = cache_encoders(cfg, ident, self.device)
        return self._encoders

    def prompt_text(self) -> list:
        """The prompts through the cache's text encoder, once for every checkpoint this evaluator sees."""
        if self._prompt_text is None:
            self._prompt_text = self.encoders()[1].encode(self.prompts)
        return self._prompt_text

    # -- wandb -----------------------------------------------------------------------------
    def _mirror_run_files(self, run_dir: Path) -> None:
        """A run in S3: its config.json and wandb_id mirrored, each until it is here (a server started by
        ``eval serve --slurm --after`` may come before the training has written them)."""
        for name in RUN_FILES:
            if not (run_dir / name).exists():
                s3.mirror_object(self.remote / name, run_dir / name)

    def _log_wandb(self, result: dict) -> None:
        if self.remote is not None:
            self._mirror_run_files(self.run_dir)
        log_eval(self.run_dir, self.tag, result, self.prompts, mode=self.wandb_mode)
