"""``reelcache eval serve|once``: the evaluation stage's arguments (reelcache/cli.py only registers them).

Nothing heavy is imported here: the parser must build without torch (tests/core/test_package.py).
"""

from __future__ import annotations

import argparse
import sys

from reelcache import UserError
from reelcache.args import arg, existing_file
from reelcache.base.s3 import root_arg
from reelcache.cluster.slurm import options as slurm_options

# The evaluator, its samples and the checkpoint listing (torch, and cache/ and train/ modules) are imported
# by the command that runs them: `reelcache --help` builds every stage's parser.

EXAMPLES = """\
examples:
  # beside training, on a GPU of its own (a box that mounts the data root and the run directory)
  reelcache eval serve --root /data/rc --run runs/stage1 --prompts configs/eval/prompts.txt \\
      --val-manifest val-240p --preset low4s --every 1
  # on Slurm, following the training job 4242: ends once it has ended and every checkpoint is evaluated
  reelcache eval serve --root /data/rc --run runs/stage1 --val-manifest val-240p --slurm --partition h100 --after 4242
  reelcache eval once --root /data/rc --run runs/stage1 --checkpoint ckpt-00002210 --preset high4s --weights model
  # the demo's run, on CPU
  reelcache eval once --root demo-root --run runs/debug-stage1 --checkpoint latest --preset debug \\
      --prompts configs/eval/debug-prompts.txt --val-manifest demo-stage1-tiny --device cpu

Results: ROOT/runs/<run>/eval/ckpt-<step>/ (val_loss.json, <preset>/sample_<i>.mp4, <preset>/done.json),
ROOT/runs/<run>/eval/val_loss.parquet, and the run's own wandb run (eval/* against eval/global_step).
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        required=True,
        type=root_arg,
        help="data root (manifests, latents, runs): a folder, or s3://bucket/prefix (docs/STORAGE.md)",
    )
    p.add_argument("--run", required=True, help="the run directory: runs/<name> (relative to ROOT) or a path")
    p.add_argument(
        "--preset",
        default="low4s",
        choices=["low4s", "high4s", "low16s", "debug"],
        help="sampling preset (Open-Sora 1.2's inference server; debug: tiny, CPU)",
    )
    p.add_argument("--prompts", type=existing_file, help="text file, one prompt per line (no samples without it)")
    p.add_argument("--val-manifest", help="loader manifest (catalog manifest --cache) for the validation loss")
    p.add_argument("--val-batch", type=arg(int, ge=1), default=4, help="clips per validation forward pass")
    p.add_argument(
        "--val-max-clips", type=arg(int, ge=1), help="only the first N clips (clip-id order) of the manifest"
    )
    p.add_argument("--weights", default="ema", choices=["ema", "model"], help="EMA (default) or the training weights")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="model dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--cache", help="latent cache whose encoders decode and encode (default: the val manifest's)")
    p.add_argument(
        "--wandb-mode", choices=["offline", "online", "disabled"], help="default: the run's own log.wandb_mode"
    )


def add_commands(top) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    ev = top.add_parser(
        "eval",
        help="evaluate a run's checkpoints: validation loss, sample videos, wandb",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    iev = ev.add_subparsers(dest="cmd", required=True)
    s = iev.add_parser(
        "serve",
        help="watch a run and evaluate each new checkpoint, in step order",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    _common(s)
    which = s.add_mutually_exclusive_group()
    which.add_argument(
        "--every", type=arg(int, ge=1), default=1, help="every N-th save of the run (steps on N x ckpt_every)"
    )
    which.add_argument("--latest-only", action="store_true", help="only the newest pending checkpoint per poll")
    s.add_argument("--poll", type=arg(float, gt=0), default=60.0, help="seconds between looks at the run directory")
    s.add_argument(
        "--exit-idle",
        type=arg(float, ge=0),
        default=0.0,
        help="stop after this many seconds with nothing new (0: never)",
    )
    s.add_argument(
        "--follow",
        metavar="JOBID",
        help="end once this Slurm job (the training; requeues included) has ended and every checkpoint "
        "is evaluated (what --slurm --after JOBID runs)",
    )
    s.add_argument(
        "--max-attempts", type=arg(int, ge=1), default=3, help="tries per checkpoint before it is left alone"
    )
    slurm_options.add_arguments(s, "eval")
    s.set_defaults(fn=_serve)
    o = iev.add_parser("once", help="evaluate one checkpoint", epilog=EXAMPLES, formatter_class=fmt)
    _common(o)
    o.add_argument("--checkpoint", required=True, help="ckpt-<step> of the run, a path, or 'latest'")
    o.set_defaults(fn=_once)


def _evaluator(a, max_attempts: int = 3):
    from reelcache.base import s3
    from reelcache.cache.encoders import default_device

    if s3.is_url(a.root):
        s3.check_root(a.root)  # the bucket, the credentials, conditional writes: one line before any work
    from reelcache.eval.evaluate import Evaluator
    from reelcache.eval.samples import read_prompts

    try:
        prompts = read_prompts(a.prompts) if a.prompts else []
    except (OSError, ValueError) as e:
        raise UserError(f"--prompts: {e}") from None
    device = a.device or default_device()
    dtype = a.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    return Evaluator(
        root=a.root,
        run_dir=a.run,
        preset=a.preset,
        prompts=prompts,
        val_manifest=a.val_manifest,
        weights=a.weights,
        device=device,
        dtype=dtype,
        cache=a.cache,
        val_batch=a.val_batch,
        val_max_clips=a.val_max_clips,
        wandb_mode=a.wandb_mode,
        max_attempts=max_attempts,
    )


def _serve(a) -> None:
    if a.slurm:
        return _submit(a)
    ev = _evaluator(a, a.max_attempts)
    ended = None
    if a.follow:
        from reelcache.cluster.slurm.client import job_ended

        def ended() -> bool:
            return bool(job_ended(a.follow))  # None: the controller did not answer; ask again next poll

    ev.serve(poll=a.poll, every=a.every, latest_only=a.latest_only, exit_idle=a.exit_idle, until=ended)


def _submit(a) -> None:
    """``eval serve --slurm``: the same command as a job on one GPU (cluster/slurm/jobs.py), after --after starts.
    A run in S3: the run exists there (its config.json, or the training job's script from the moment ``train
    --slurm`` submitted it: ``run_in_s3``), and the job keeps a mirror of its own (jobs.py)."""
    from reelcache.base import s3
    from reelcache.cluster.slurm import jobs

    rel = a.run
    if s3.is_url(a.root):
        s3.check_root(a.root)  # the bucket, the credentials, conditional writes: one line before any work
        from reelcache.eval.evaluate import run_in_s3

        rel, _ = run_in_s3(s3.parse(a.root), a.run)  # as the evaluator finds it
    _check_inputs(a)
    argv = sys.argv[sys.argv.index("serve") + 1 :]
    res = slurm_options.resources(a)
    args = slurm_options.without_slurm_options(argv, "eval") + (
        ["--follow", a.after] if a.after and not a.follow else []
    )
    job = jobs.eval_script(a.root, rel, res, after=a.after, args=args)
    job_id = jobs.launch(job, res, dry_run=a.dry_run)
    if job_id:
        where = " on the job's node" if job.remote else ""
        print(f"submitted job {job_id}: eval serve of {job.script.parent.parent.name}; log {job.log(job_id)}{where}")


def _check_inputs(a) -> None:
    """Before submitting: something to evaluate, and the validation manifest exists (as the evaluator checks)."""
    if not a.prompts and not a.val_manifest:
        raise UserError("nothing to evaluate: give --prompts and/or --val-manifest")
    if a.val_manifest:
        from reelcache.catalog.manifest import resolve_manifest
        from reelcache.train.runfiles import mirrored_inputs

        try:
            resolve_manifest(mirrored_inputs(a.root), a.val_manifest)
        except ValueError as e:
            raise UserError(f"--val-manifest: {e}") from None


def _once(a) -> None:
    from reelcache.train.checkpoint import list_checkpoints

    ev = _evaluator(a)
    ev.check()
    ckpt = a.checkpoint  # a path, or ckpt-<step> of the run (evaluate finds it)
    if ckpt == "latest":
        found = list_checkpoints(ev.home)
        if not found:
            raise UserError(f"no complete checkpoint in {ev.home}")
        ckpt = found[-1]
    ev.evaluate(ckpt)
