"""``reelcache train``: the train stage's command-line arguments (reelcache/cli.py only assembles).

The same arguments work under a launcher: ``torchrun --nproc_per_node 8 -m reelcache.train ...``
or ``colossalai run --nproc_per_node 8 --hostfile nodes.txt -m reelcache.train ...``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

EXAMPLES = """\
examples:
  # stage 1 of the replication, 24 nodes x 8 GPUs
  colossalai run --nproc_per_node 8 --hostfile nodes.txt -m reelcache.train \\
      configs/train/opensora12/stage1.toml --root /data/rc --init-from PixArt-Sigma-XL-2-2K-MS.pth
  reelcache train configs/train/opensora12/stage1.toml --root /data/rc --load latest       # after a crash
  reelcache train configs/train/opensora12/stage2.toml --root /data/rc \\
      --init-from /data/rc/runs/stage1/ckpt-00002210                                      # next stage: weights only
  reelcache train configs/train/opensora12/stage3.toml --root /data/rc --load runs/stage3/ckpt-00007099 --reset-data
  torchrun --nproc_per_node 2 -m reelcache.train configs/train/debug/stage1.toml --root demo-root   # CPU

Any config field can be overridden after the file: --optim.lr=2e-4 --run.name=stage1-try2 --run.epochs=3
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="stage config TOML, e.g. configs/train/opensora12/stage1.toml")
    p.add_argument("--root", required=True, help="data root: manifests, latents; runs go to ROOT/runs/<run.name>")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--load", metavar="CKPT", help="resume everything from a checkpoint of ours: a ckpt-<step> "
                                                   "folder (path, or relative to ROOT) or 'latest' of this run")
    src.add_argument("--init-from", metavar="WEIGHTS",
                     help="weights only (a new stage): our ckpt folder, an Open-Sora checkpoint folder, a "
                          "published STDiT3 folder / .safetensors, or a PixArt-Sigma .pth")
    p.add_argument("--resume", action="store_true",
                   help="resume from this run's newest checkpoint if it has one, else start (from --init-from "
                        "when given): the flag for a job that is requeued after a crash")
    p.add_argument("--reset-data", action="store_true",
                   help="with --load: keep model, EMA, optimizer and schedule, restart the data position")
    p.add_argument("--run", help="run name (= run.name; default: the config file's stem)")
    p.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], help="= run.wandb_mode")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reelcache train", description="train a stage on the latent cache",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def run(a, overrides: list[str]) -> None:
    from reelcache import UserError
    from reelcache.train.config import load_config

    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        raise UserError(f"unrecognized arguments {bad}: config overrides look like --optim.lr=2e-4")
    if a.reset_data and not a.load:
        raise UserError("--reset-data goes with --load (it keeps the optimizer and restarts the data)")
    overrides = [o[2:] for o in overrides]
    if a.run:
        overrides.append(f'run.name="{a.run}"')
    if a.wandb_mode:
        overrides.append(f'run.wandb_mode="{a.wandb_mode}"')
    cfg = load_config(a.config, overrides)

    from reelcache.train.trainer import Trainer

    load, init_from = a.load, a.init_from
    if a.resume:
        from reelcache.train.checkpoint import list_checkpoints

        if list_checkpoints(Path(a.root) / "runs" / cfg.run.name):
            load, init_from = "latest", None
    from reelcache.train.guard import DivergedError

    try:
        Trainer(cfg, a.root, load=load, init_from=init_from, reset_data=a.reset_data).train()
    except DivergedError as e:
        raise UserError(str(e)) from None


def add_demo(sub) -> None:
    """``reelcache demo train``: two tiny stages on CPU, one run killed and resumed."""
    d = sub.add_parser("train", help="train two tiny stages on the demo cache with 2 CPU processes, killing and "
                                     "resuming the first (after `make demo`'s data steps)")
    d.add_argument("--root", required=True)
    d.add_argument("--nproc", type=int, default=2)
    d.set_defaults(fn=_demo_train)


def _demo_train(a) -> None:
    from reelcache.train.demo import run as demo

    demo(a.root, a.nproc)


def main(argv=None) -> int:
    """``python -m reelcache.train`` (what torchrun and colossalai run start on every rank)."""
    from reelcache.cli import run_command

    a, rest = parser().parse_known_args(argv)
    return run_command(lambda: run(a, rest))
