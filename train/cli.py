"""``reelcache train``, ``reelcache loader simulate`` and ``reelcache demo train``:
the train stage's command-line arguments (reelcache/cli.py only assembles). Nothing heavy is imported
here: the parser builds without torch. Each command imports its stage modules when it runs (the
imports inside the functions below), so ``reelcache --help`` and ``reelcache catalog ...`` start fast.

The same arguments work under a launcher: ``torchrun --nproc_per_node 8 -m reelcache.train ...``
or ``colossalai run --nproc_per_node 8 --hostfile nodes.txt -m reelcache.train ...``.
"""

from __future__ import annotations

import argparse

from reelcache import UserError
from reelcache.args import arg, existing_dir, existing_file, option
from reelcache.base.s3 import root_arg
from reelcache.cluster.slurm import options as slurm_options

EXAMPLES = """\
examples:
  # stage 1 of the replication, 24 nodes x 8 GPUs
  colossalai run --nproc_per_node 8 --hostfile nodes.txt -m reelcache.train \\
      configs/train/opensora12/stage1.toml --root /data/rc --init-from PixArt-Sigma-XL-2-2K-MS.pth
  reelcache train configs/train/opensora12/stage1.toml --root /data/rc --load latest       # after a crash
  reelcache train configs/train/opensora12/stage2.toml --root /data/rc \\
      --init-from /data/rc/runs/stage1/ckpt-00002210                                      # next stage: weights only
  reelcache train configs/train/opensora12/stage3.toml --root /data/rc --load runs/stage3/ckpt-00007099 --reset-data
  reelcache train configs/train/opensora12-original/stage3.toml --root /data/rc \\
      --init-from outputs/010-STDiT3-XL-2/epoch4-global_step14778 --init-from-weights ema    # an Open-Sora run's EMA
  reelcache train configs/train/debug/stage1.toml --root demo-root --nproc 2     # CPU, 2 ranks here
  torchrun --nproc_per_node 2 -m reelcache.train configs/train/debug/stage1.toml --root demo-root   # the same

Any config field can be overridden after the file: --optim.lr=2e-4 --run.name=stage1-try2 --run.epochs=3
"""

SIMULATE_EXAMPLES = """\
examples:
  reelcache loader simulate --root /data/rc --manifest stage3-openvid --manifest stage3-mira --weight 0.3 \\
      --buckets configs/buckets/opensora12-stage1.toml --world-size 16 --workers 8 --seed 42 --epochs 2 \\
      --out consumed.parquet --save-at 1000 --resume-world-size 24
  reelcache catalog sql --root /data/rc "SELECT epoch, count(DISTINCT clip_id), count(*) FROM 'consumed.parquet'
      WHERE NOT pad GROUP BY 1"
"""


def add_commands(top) -> None:
    """``train`` and ``loader simulate`` under the top-level ``reelcache`` parser."""
    fmt = argparse.RawDescriptionHelpFormatter
    tr = top.add_parser(
        "train",
        help="train a stage (STDiT3 + rectified flow) on the latent cache",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    add_arguments(tr)
    tr.set_defaults(fn=run, takes_overrides=True)

    ld = top.add_parser("loader", help="the streaming loader: simulate a stage's data order without GPUs")
    sub = ld.add_subparsers(dest="cmd", required=True)
    sim = sub.add_parser(
        "simulate",
        help="plan every rank's batches (no model, no reads), optionally resume",
        formatter_class=fmt,
        epilog=SIMULATE_EXAMPLES,
    )
    sim.add_argument(
        "--root",
        type=root_arg,
        help="data root, a folder or s3://bucket/prefix (manifest names resolve to ROOT/manifests/NAME-*.parquet)",
    )
    sim.add_argument(
        "--manifest",
        dest="manifests",
        action=_ManifestArg,
        required=True,
        help="loader manifest name or path; repeat to mix",
    )
    sim.add_argument(
        "--weight", action=_ManifestArg, type=arg(float, ge=0, le=1), help="share of the preceding --manifest (0..1)"
    )
    sim.add_argument(
        "--buckets", required=True, type=existing_file, help="bucket config TOML (batch size per resolution/frames)"
    )
    sim.add_argument("--world-size", type=arg(int, ge=1), required=True)
    sim.add_argument(
        "--workers", type=arg(int, ge=0), default=1, help="data workers per rank (recorded; order is independent)"
    )
    sim.add_argument("--seed", type=arg(int, ge=0), default=0)
    sim.add_argument("--epochs", type=arg(int, ge=1), default=1)
    sim.add_argument("--out", help="write (epoch, step, rank, worker, clip_id, bucket, pad) parquet")
    sim.add_argument("--save-at", type=arg(int, ge=0), help="save the data state at this global step, then resume")
    sim.add_argument("--resume-world-size", type=arg(int, ge=1), help="world size to resume on (default: the same)")
    sim.set_defaults(fn=_simulate)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="stage config TOML, e.g. configs/train/opensora12/stage1.toml")
    p.add_argument(
        "--root",
        required=True,
        type=root_arg,
        help="data root, a folder or s3://bucket/prefix (docs/STORAGE.md): manifests, latents; runs go to "
        "ROOT/runs/<run.name>",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--load",
        metavar="CKPT",
        help="resume everything from a checkpoint of ours: a ckpt-<step> "
        "folder (path, or relative to ROOT) or 'latest' of this run",
    )
    src.add_argument(
        "--init-from",
        metavar="WEIGHTS",
        help="weights only (a new stage): our ckpt folder, an Open-Sora checkpoint folder, a "
        "published STDiT3 folder / .safetensors, or a PixArt-Sigma .pth",
    )
    p.add_argument(
        "--init-from-weights",
        choices=["model", "ema"],
        help="with --init-from a checkpoint folder: its training weights (model/, the default, as "
        "Open-Sora's own loader takes) or its EMA (our ema/, Open-Sora's ema.pt)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="resume from this run's newest checkpoint if it has one, else start (from --init-from "
        "when given): the flag for a job that is requeued after a crash",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="if another start of this run still runs (it holds runs/<run>/run.lease), wait for it to end "
        "instead of refusing (what a requeued Slurm job runs: its predecessor may still be exiting)",
    )
    p.add_argument(
        "--reset-data",
        action="store_true",
        help="with --load: keep model, EMA, optimizer and schedule, restart the data position",
    )
    p.add_argument(
        "--run",
        type=option("reelcache.train.config:RunConfig.name"),
        help="run name (= run.name; default: the config file's stem)",
    )
    p.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], help="= log.wandb_mode")
    p.add_argument(
        "--nproc",
        type=arg(int, ge=1),
        metavar="N",
        help="start N ranks on this machine (torch's elastic launch, as torchrun), a failed start said in one "
        "line (train/launch.py); without it: one rank of a launcher's, or a run of its own",
    )
    slurm_options.add_arguments(p, "train")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="reelcache train",
        description="train a stage on the latent cache",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def run(a, overrides: list[str]) -> None:
    from reelcache.train.config import load_config

    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        raise UserError(f"unrecognized arguments {bad}: config overrides look like --optim.lr=2e-4")
    if a.reset_data and not a.load:
        raise UserError("--reset-data goes with --load (it keeps the optimizer and restarts the data)")
    if a.init_from_weights and not a.init_from:
        raise UserError("--init-from-weights goes with --init-from (which weights of that checkpoint to start from)")
    raw_overrides = list(overrides)
    overrides = [o[2:] for o in overrides]
    if a.run:
        overrides.append(f'run.name="{a.run}"')
    if a.wandb_mode:
        overrides.append(f'log.wandb_mode="{a.wandb_mode}"')
    cfg = load_config(a.config, overrides)
    if str(a.root).startswith("s3://"):
        from reelcache.base import s3

        s3.check_root(a.root)  # the bucket, the credentials, conditional writes: one line before any work
    if a.slurm:
        if a.nproc:
            raise UserError("--nproc starts ranks here; a Slurm job takes --nproc-per-node (ranks per node)")
        return _submit(a, cfg, overrides)
    if a.nproc:
        from reelcache.train.launch import launch

        return launch(_rank_args(a, raw_overrides), a.nproc)

    from reelcache.train.guard import DivergedError
    from reelcache.train.trainer import Trainer

    try:
        Trainer(
            cfg,
            a.root,
            load=a.load,
            resume=a.resume,
            init_from=a.init_from,
            init_weights=a.init_from_weights or "model",
            reset_data=a.reset_data,
            wait=a.wait,
        ).train()
    except DivergedError as e:
        raise UserError(str(e)) from None


def _rank_args(a, overrides: list[str]) -> list[str]:
    """This command's arguments for each rank of ``--nproc`` (``python -m reelcache.train ...``), without it."""
    args = [a.config, "--root", str(a.root)]
    for flag, value in (("--load", a.load), ("--init-from", a.init_from), ("--init-from-weights", a.init_from_weights)):
        if value:
            args += [flag, str(value)]
    for flag, on in (("--resume", a.resume), ("--wait", a.wait), ("--reset-data", a.reset_data)):
        if on:
            args.append(flag)
    if a.run:
        args += ["--run", a.run]
    if a.wandb_mode:
        args += ["--wandb-mode", a.wandb_mode]
    return args + overrides


def _submit(a, cfg, overrides: list[str]) -> None:
    """``train --slurm``: the same command as a requeueable batch job (cluster/slurm/jobs.py; a root in S3: its
    module docstring)."""
    from pathlib import Path

    from reelcache.base import s3
    from reelcache.cluster.slurm import checks, jobs

    if a.load or a.reset_data:
        raise UserError(
            "--slurm runs with --resume (the run's newest checkpoint, else a start): drop --load/--reset-data"
        )
    res = slurm_options.resources(a)
    nproc = a.nproc_per_node or a.gpus_per_node
    if not nproc:
        raise UserError("--gpus-per-node 0 (CPU nodes): give --nproc-per-node, the ranks per node")
    checks.check_time(a.time, a.signal_s)
    _check_manifests(cfg, a.root)  # here, not only inside the job
    train_args = [f"--{o}" for o in overrides if not o.startswith("run.name=")]
    if a.init_from:
        train_args += ["--init-from", a.init_from if s3.is_url(a.init_from) else str(Path(a.init_from).resolve())]
    if a.init_from_weights:
        train_args += ["--init-from-weights", a.init_from_weights]
    root = a.root if s3.is_url(a.root) else Path(a.root).resolve()
    job = jobs.train_script(a.config, root, cfg.run.name, res, nproc=nproc, signal_s=a.signal_s, train_args=train_args)
    job_id = jobs.launch(job, res, dry_run=a.dry_run, signal_s=a.signal_s)
    if job_id:
        run = f"{root}/runs/{cfg.run.name}"
        where, stop = ("", f"touch {run}/stop")
        if job.remote:  # the log on the node that runs the batch shell, the stop request an object
            where, stop = " on the job's first node", f"aws s3 cp /dev/null {run}/stop"
        print(
            f"submitted job {job_id}: {cfg.run.name} on {res.node_range} node(s) x {nproc} rank(s); log "
            f"{job.log(job_id)}{where}; checkpoint and stop: {stop}; checkpoint, stop and requeue: "
            f"scancel --batch --signal=USR2 {job_id}"
        )


def _check_manifests(cfg, root) -> None:
    """Each of data.manifests exists, found as the loader finds it (catalog/manifest.py: a file, or a name
    under ROOT; a root in S3: under its mirror, the manifests mirrored first as the trainer does)."""
    from reelcache.catalog.manifest import resolve_manifest
    from reelcache.train.runfiles import mirrored_inputs

    local = mirrored_inputs(root)
    for m in cfg.data.manifests:
        try:
            resolve_manifest(local, m.name)
        except ValueError as e:
            raise UserError(f"data.manifests: {e}") from None


class _ManifestArg(argparse.Action):
    """--manifest NAME [--weight W] pairs, in the order given."""

    def __call__(self, parser, ns, value, option=None):
        pairs = getattr(ns, "manifests", None) or []
        if option == "--manifest":
            pairs.append((value, None))
        elif not pairs or pairs[-1][1] is not None:
            parser.error("--weight must follow the --manifest it applies to")
        else:
            pairs[-1] = (pairs[-1][0], value)
        ns.manifests = pairs


def _simulate(a) -> None:
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.simulate import simulate

    given = [w for _, w in a.manifests if w is not None]
    if sum(given) > 1 or (len(given) == len(a.manifests) > 1 and abs(sum(given) - 1) > 1e-6):
        raise UserError(f"--weight values {given} must add up to 1 (unweighted manifests share the rest)")
    rest = (1 - sum(given)) / max(1, sum(1 for _, w in a.manifests if w is None))
    manifests = [(m, w if w is not None else rest) for m, w in a.manifests]
    root = a.root
    if root is not None and root.startswith("s3://"):  # manifests and takedowns mirrored (no shard is read)
        from reelcache.base import s3
        from reelcache.train.runfiles import mirrored_inputs

        s3.check_root(root, write=False)
        root = mirrored_inputs(root)
    try:
        simulate(
            manifests,
            BucketConfig.from_toml(a.buckets),
            root=root,
            world_size=a.world_size,
            workers=a.workers,
            seed=a.seed,
            epochs=a.epochs,
            out=a.out,
            save_at=a.save_at,
            resume_world_size=a.resume_world_size,
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    if a.out:
        print(a.out)


def add_demo(sub) -> None:
    """``reelcache demo train``: two tiny stages on CPU, one run killed and resumed."""
    d = sub.add_parser(
        "train",
        help="train two tiny stages on the demo cache with 2 CPU processes, killing and "
        "resuming the first (after `make demo`'s data steps)",
    )
    d.add_argument("--root", required=True, type=existing_dir)
    d.add_argument("--nproc", type=arg(int, ge=1), default=2)
    d.set_defaults(fn=_demo_train)


def _demo_train(a) -> None:
    from reelcache.train.demo import run as demo

    demo(a.root, a.nproc)


def main(argv=None) -> int:
    """``python -m reelcache.train`` (what torchrun and colossalai run start on every rank)."""
    from reelcache.cli import run_command

    a, rest = parser().parse_known_args(argv)
    return run_command(lambda: run(a, rest))
