"""``reelcache loader simulate``: the real loader planning and state, every rank, no GPU, no reads.

Answers before a cluster is booked: how many steps per epoch, which buckets, what a world-size
change does. It runs one LatentLoader per rank (read=False: the plan, the schedule and the
state machinery are the real ones; only tensor reads are skipped), in lockstep, and writes
(epoch, step, rank, worker, clip_id, view, bucket, pad) to parquet for auditing with SQL; ``worker``
is the DataLoader worker that would make the batch (after a resume: counted from the resumed step). With
``--save-at STEP`` it saves a real state at that global step, builds loaders for
``--resume-world-size`` ranks, loads the state and goes on; a step past the last one is refused
(nothing written), never a run that silently saved nothing. For manifests of a cache of several
views it says which views each epoch showed, and over the epochs how many clips were shown how
many different latents.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.log import say
from reelcache.progress import bar
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
    if save_at is not None and save_at < 1:
        raise UserError(f"--save-at {save_at}: the state is saved after a step; give a step from 1")

    def make(world):
        return [
            LatentLoader(manifests, buckets, root=root, rank=r, world_size=world, seed=seed, read=False, block=block)
            for r in range(world)
        ]

    loaders = make(world_size)
    if save_at is not None:  # refused before any simulating: every epoch's plan says its steps
        total = sum(len(loaders[0].plan(e).rank_batches(0, 0, world_size)) for e in range(epochs))
        if save_at > total:
            raise UserError(
                f"--save-at {save_at} is past the end: {epochs} epoch(s) on {world_size} ranks are {total} steps; "
                f"give a step from 1 to {total} (or more --epochs)"
            )
    rows = {k: [] for k in COLUMNS}
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
                # Each pass over a loader starts a new DataLoader whose worker w makes the w-th,
                # (w+W)-th, ... of the steps REMAINING in the epoch, not of all its steps.
                _record(rows, epoch, k % max(1, workers), batches)
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
    _report(summary, table, loaders[0])
    return table, summary, saved


COLUMNS = ("epoch", "step", "rank", "worker", "clip_id", "view", "bucket", "pad", "world_size")


def _record(rows: dict, epoch: int, worker: int, batches) -> None:
    """One step of every rank (batches[r] is rank r's) as rows of COLUMNS, one per sample."""
    for r, b in enumerate(batches):
        n = len(b["clip_id"])
        for key, value in (("epoch", epoch), ("worker", worker), ("step", b["step"]), ("rank", r)):
            rows[key] += [value] * n
        rows["clip_id"] += b["clip_id"]
        rows["view"] += b["view"]
        rows["bucket"] += [b["bucket"]] * n
        rows["pad"] += [b["weight"] == 0] * n
        rows["world_size"] += [len(batches)] * n


def _report(summary: list[dict], table: pa.Table, loader: LatentLoader) -> None:
    for s in summary:
        say(
            f"epoch {s['epoch']}: {s['samples']} samples in {s['micro_batches']} micro-batches, "
            f"{s['steps']} steps on {s['world_size']} ranks"
        )
    if loader.views > 1:
        for line in view_summary(table, loader):
            say(line)


def view_summary(table: pa.Table, loader: LatentLoader) -> list[str]:
    """Per epoch, how many clips showed each view; over all epochs, how many different latents (shard,
    offset) each clip was shown: two views with the same draw share one latent."""
    real = [i for i, pad in enumerate(table["pad"].to_pylist()) if not pad]
    epoch, clip, view = (table[c].to_pylist() for c in ("epoch", "clip_id", "view"))
    place = {(c, v): (s, o) for c, v, s, o in zip(loader.clip_id, loader.view, loader.shard, loader.offset)}
    per_epoch: dict[int, Counter] = {}
    seen: dict[str, set] = {}
    shown: dict[str, set] = {}
    for i in real:
        per_epoch.setdefault(epoch[i], Counter())[view[i]] += 1
        shown.setdefault(clip[i], set()).add(view[i])
        seen.setdefault(clip[i], set()).add(place[(clip[i], view[i])])
    lines = [f"views: {loader.views} per clip; the loader shows each clip view pi[epoch mod {loader.views}]"]
    if not per_epoch:
        return lines
    for e, c in sorted(per_epoch.items()):
        lines.append(f"  epoch {e}: " + ", ".join(f"view {v} {n} clips" for v, n in sorted(c.items())))
    ways = Counter(len(s) for s in seen.values())
    same = sum(len(v) > len(seen[c]) for c, v in shown.items())
    lines.append(
        f"  over epochs {min(per_epoch)}-{max(per_epoch)}: "
        + ", ".join(f"{n} clips were shown {k} different latent{'s' if k > 1 else ''}" for k, n in sorted(ways.items()))
        + (f" ({same} clips in views that drew the same bucket and window: one latent)" if same else "")
    )
    return lines
