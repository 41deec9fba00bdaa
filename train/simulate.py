"""``reelcache loader simulate``: the real loader planning and state, every rank, no GPU, no reads.

Answers before a cluster is booked: how many steps per epoch, which buckets, what a world-size
change does. It runs one LatentLoader per rank (read=False: the plan, the schedule and the
state machinery are the real ones; only tensor reads are skipped), in lockstep, and writes
(epoch, step, rank, worker, clip_id, bucket, pad) to parquet for auditing with SQL; ``worker``
is the DataLoader worker that would make the batch (after a resume: counted from the resumed step). With
``--save-at STEP`` it saves a real state at that global step, builds loaders for
``--resume-world-size`` ranks, loads the state and goes on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.progress import bar, say
from reelcache.train.loader import LatentLoader


def simulate(
    manifests,
    buckets,
    *,
    root=None,
    world_size: int,
    workers: int = 1,
    seed: int = 0,
    epochs: int = 1,
    out=None,
    save_at: int | None = None,
    resume_world_size: int | None = None,
    block: int = 64,
):
    def make(world):
        return [
            LatentLoader(manifests, buckets, root=root, rank=r, world_size=world, seed=seed, read=False, block=block)
            for r in range(world)
        ]

    loaders = make(world_size)
    rows = {k: [] for k in ("epoch", "step", "rank", "worker", "clip_id", "bucket", "pad", "world_size")}
    summary = []
    gstep = 0
    saved = None
    while loaders[0].epoch < epochs:
        epoch = loaders[0].epoch
        steps = loaders[0].steps_remaining()
        plan = loaders[0].plan()
        summary.append(
            {
                "epoch": epoch,
                "world_size": len(loaders),
                "steps": steps,
                "micro_batches": plan.num_batches,
                "samples": int(len(plan.order)),
            }
        )
        with bar(steps, f"epoch {epoch}", "step") as pbar:
            iters = [iter(ld) for ld in loaders]
            for k, batches in enumerate(zip(*iters)):
                for r, b in enumerate(batches):
                    n = len(b["clip_id"])
                    rows["epoch"] += [epoch] * n
                    # Each pass over a loader starts a new DataLoader whose worker w makes the w-th,
                    # (w+W)-th, ... of the steps REMAINING in the epoch, not of all its steps.
                    rows["worker"] += [k % max(1, workers)] * n
                    rows["step"] += [b["step"]] * n
                    rows["rank"] += [r] * n
                    rows["clip_id"] += b["clip_id"]
                    rows["bucket"] += [b["bucket"]] * n
                    rows["pad"] += [b["weight"] == 0] * n
                    rows["world_size"] += [len(loaders)] * n
                gstep += 1
                pbar.update(1)
                if save_at is not None and saved is None and gstep == save_at:
                    saved = loaders[0].state_dict()
                    loaders = make(resume_world_size or world_size)
                    for ld in loaders:
                        ld.load_state_dict(saved)
                    say(f"saved at step {gstep}: {json.dumps(saved)}; resumed on {len(loaders)} ranks")
                    break
            else:
                for it in iters:  # let every loader close its epoch
                    for _ in it:
                        pass
    table = pa.table(rows)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out)
    for s in summary:
        say(
            f"epoch {s['epoch']}: {s['samples']} samples in {s['micro_batches']} micro-batches, "
            f"{s['steps']} steps on {s['world_size']} ranks"
        )
    return table, summary, saved
