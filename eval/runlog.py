"""Evaluation results into the training run's own wandb run, from a second process.

The run is the trainer's: its id is ``runs/<run>/wandb_id`` (or, in a run directory of the old
layout, a checkpoint's state.json), its project and mode the run's config.json
(``log.wandb_project``, ``log.wandb_mode``). Keys:

    eval/global_step                   the checkpoint's global step: the x axis of everything below
    eval/<tag>/val_loss                overall validation loss
    eval/<tag>/val_loss/<bucket>       per bucket (bucket names keep their slashes: 144p/17/0.56)
    eval/<tag>/val_loss_t/<t>          per fixed timestep
    eval/<tag>/video_<i>               wandb.Video, the prompt as caption

Every key is bound to ``eval/global_step`` with ``define_metric("eval/*", step_metric=...)`` and
rows are logged WITHOUT ``step=``: wandb drops a row whose step is below the run's current step,
and the trainer is always ahead of its evaluator (the bug of Open-Sora's inference server, which
logged ``step=global_step``). Plotted against eval/global_step, checkpoints may be logged in
any order and late.

Two processes, one run, as wandb 0.31 offers it:
  online   ``mode="shared"`` (wandb's multi-writer mode: the server merges the writers' rows;
           ``step=`` is ignored there anyway), ``x_label="eval"`` to tell its console/system
           data apart, ``x_primary=False`` (it does not upload the run's metadata/files, which
           belong to the trainer) and ``x_update_finish_state=False`` (an evaluator finishing
           must not mark the training run finished).
  offline  shared mode needs the server, so the evaluator writes its own offline run with the
           same id into the run's ``wandb/`` folder (``offline-run-<time>-<id>``, beside the
           trainer's). ``wandb sync --id <id> runs/<run>/wandb/offline-run-*`` uploads them all into
           the one run, in start-time order. One wandb.init per checkpoint, finished before the
           checkpoint's done.json, so a killed evaluator never leaves a checkpoint logged halfway
           without redoing it; inits are at least one second apart so their folders never collide.
  disabled nothing is logged (the files under runs/<run>/eval/ still are).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from reelcache.log import say
from reelcache.train.checkpoint import list_checkpoints, read_state
from reelcache.train.config import from_dict
from reelcache.train.runlog import read_run_id, wandb_settings

__all__ = ["log_eval", "run_wandb"]

# wandb (optional: the [train] extra; 0.3 s to import) is imported when a run logs to it, not in disabled mode.

_last_init = 0.0


def run_wandb(run_dir: Path) -> dict:
    """{id, project, mode} of the training run (id None when it never started wandb)."""
    run_dir = Path(run_dir)
    run_id = read_run_id(run_dir)
    if run_id is None:  # a run directory of the old layout: its checkpoints' state.json held the id
        for c in reversed(list_checkpoints(run_dir)):
            if run_id := read_state(c).get("wandb_id"):
                break
    cfg = {}
    if (run_dir / "config.json").exists():
        cfg = dataclasses.asdict(from_dict(json.loads((run_dir / "config.json").read_text())).log)
    return {"id": run_id, "project": cfg.get("wandb_project", "reelcache"), "mode": cfg.get("wandb_mode", "offline")}


def log_eval(run_dir, tag: str, result: dict, prompts: list[str], mode: str | None = None) -> bool:
    """One checkpoint's results as one wandb row; False (and a message) when there is no run to log to."""
    global _last_init
    run_dir = Path(run_dir)
    info = run_wandb(run_dir)
    mode = mode or info["mode"]
    if mode == "disabled":
        return False
    if info["id"] is None:
        say(
            f"  wandb: {run_dir} has no wandb run id (trained with wandb disabled?): results stay in {run_dir / 'eval'}"
        )
        return False
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    data = {"eval/global_step": result["global_step"]}
    if "val_loss" in result:
        v = result["val_loss"]
        data[f"eval/{tag}/val_loss"] = v["overall"]
        data.update({f"eval/{tag}/val_loss/{b}": x["loss"] for b, x in v["buckets"].items()})
        data.update({f"eval/{tag}/val_loss_t/{t}": x for t, x in v["timesteps"].items()})
    for i, path in enumerate(result.get("videos", [])):
        data[f"eval/{tag}/video_{i}"] = wandb.Video(path, caption=prompts[i], format="mp4")

    offline = mode != "online"
    if offline:
        wait = _last_init + 1.0 - time.time()  # offline-run-<second>-<id>: one folder per init
        if wait > 0:
            time.sleep(wait)
    _last_init = time.time()
    run = wandb.init(
        project=info["project"],
        id=info["id"],
        dir=str(run_dir),
        resume="allow" if offline else None,
        settings=wandb_settings(mode, label="eval", primary=False),
    )
    try:
        run.define_metric("eval/global_step")
        run.define_metric("eval/*", step_metric="eval/global_step")
        run.log(data)
    finally:
        run.finish()
    return True
