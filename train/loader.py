"""The streaming loader: bucketed micro-batches from latent shards, with exact and elastic resume.

    loader = LatentLoader([manifest], BucketConfig.from_toml(cfg), root=ROOT,
                          rank=r, world_size=R, seed=42, workers=4)
    while loader.epoch < epochs:
        for batch in loader:            # the rest of the current epoch
            ...
            save(loader.state_dict())   # five integers and a fingerprint

Order comes from train/plan.py, a pure function of (stage fingerprint, seed, epoch), the view each
clip shows at an epoch included (a manifest of a cache with K views: see train/plan.py). The
state is the global position in the epoch's micro-batch list, so it resumes exactly, also on
another world size (rank r continues with global batches consumed + r, consumed + r + R', ...),
and costs one plan build, whatever the position. A state saved against other manifests, weights
or batch sizes is refused unless the caller resets the data position on purpose.

Samples are read with ranged reads from local or shared storage, or from S3 by one exact ranged GET per member
fetched ahead of the step by a thread pool (base/s3fetch.py; docs/STORAGE.md, "The loader"); the manifest
records where each member's data starts (train/source.py): the latent, and its caption embedding where the
manifest names a caption shard (the content-addressed store, cache/store.py: each caption stored once); a row
without one (cache format 1, or samples another tool wrote) holds both in one member, one read. Other URLs and
``pipe:`` commands are streamed through webdataset's ``gopen``. Every read goes through base/latents.py's
``read_latent``, the one place that knows both forms; a ``Source`` carries each row's caption shard or None
(train/plan.py). Posterior latents are sampled here, seeded from (seed, epoch, position), so noise is fresh
each epoch, identical after a resume, and different across ranks and workers.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.base.buckets import BucketConfig
from reelcache.base.latents import read_member, shard_path
from reelcache.base.s3fetch import Fetcher, MemberCache, member_ends
from reelcache.catalog.manifest import resolve_manifest
from reelcache.files import atomic_path
from reelcache.train.plan import PLAN_VERSION, Plan, Source, epoch_plan, stage_fingerprint
from reelcache.train.source import (
    check_shards,
    load_source,
    read_row,
)

# what other stages may use (train/__init__.py: PUBLIC)
__all__ = ["LatentLoader", "pad_text"]

# torch is imported where tensors are made: `reelcache loader simulate` runs the loader with read=False,
# which makes none, on a machine without torch. webdataset (~0.9 s to import) only for shards given as
# URLs or pipe: commands.


def weight_schedule(weight) -> list[float]:
    """A mixing weight as a per-epoch list: a number holds for every epoch; a list gives epoch 0, 1, ...
    and its last value holds after it (a ramp from one difficulty level to the next)."""
    ws = [float(w) for w in weight] if isinstance(weight, (list, tuple)) else [float(weight)]
    if not ws or any(w < 0 for w in ws):
        raise ValueError(f"mixing weight {weight!r}: give a number >= 0 or a non-empty list of them")
    return ws


class LatentLoader:
    def __init__(
        self,
        manifests,
        buckets: BucketConfig,
        *,
        root=None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        workers: int = 0,
        prefetch: int = 2,
        block: int = 64,
        read: bool = True,
        consumed_log=None,
        log_every: int = 100,
        pin_memory: bool | None = None,
        skip=None,
        shard_root=None,
        fetch_ahead: int = 64,
        fetch_threads: int = 8,
        cache_dir=None,
        cache_gb: float = 0.0,
    ):
        """manifests: paths or names (ROOT/manifests/NAME-*.parquet), or (path, weight) pairs. skip: clip ids
        left out of the batches they are planned in (withdrawn clips: catalog/withdrawn.py); the plan, its
        fingerprint and every other sample's position and noise stay as they were, so resume stays exact.
        shard_root: where the manifests' relative shard paths are (default `root`), a folder or ``s3://``.
        fetch_ahead, fetch_threads: for shards in S3, the samples read ahead of the step and the threads that
        read them (per process: each data worker has its own). cache_dir, cache_gb: a local folder keeping the
        members read from S3, up to cache_gb GB, least recently used evicted first (base/s3fetch.py)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        pairs = [m if isinstance(m, tuple) else (m, 1.0) for m in manifests]
        self.root = (root if str(root).startswith("s3://") else Path(root)) if root else None
        shard_root = shard_root or root
        self.shard_root = (
            (str(shard_root) if str(shard_root).startswith("s3://") else Path(shard_root)) if shard_root else None
        )
        self.fetch_ahead, self.fetch_threads = int(fetch_ahead), int(fetch_threads)
        self.cache = MemberCache(cache_dir, int(cache_gb * 1e9)) if cache_dir else None
        if self.cache is not None and read:
            self.cache.evict()  # a smaller limit than the folder holds: honoured from the start
        self.schedules = [weight_schedule(w) for _, w in pairs]
        paths = [resolve_manifest(root, m) for m, _ in pairs]
        self.sources = [load_source(path, ws[0]) for path, ws in zip(paths, self.schedules)]
        self.skip = frozenset(skip or ())
        sizes = {}  # S3 shards' sizes (their HEADs): the bound of each shard's last member's ranged read
        if read:  # a shard deleted or cut short is said now, not by a data worker mid-epoch
            for path, src in zip(paths, self.sources):  # a skipped clip's shard is never read (gc may have freed it)
                rows = np.flatnonzero(~np.isin(src.clip_id, list(self.skip))) if self.skip else None
                sizes.update(check_shards(self.shard_root, src, path, rows, threads=self.fetch_threads))
        self.buckets, self.block = buckets, block
        self.rank, self.world_size, self.seed = rank, world_size, int(seed)
        self.workers, self.prefetch, self.read, self.pin_memory = workers, prefetch, read, pin_memory
        self.fingerprint = stage_fingerprint(self.sources, buckets, block)
        if any(len(ws) > 1 for ws in self.schedules):  # a weight ramp is part of what a position means
            self.fingerprint = hashlib.sha256(f"{self.fingerprint}|weights:{self.schedules!r}".encode()).hexdigest()
        self.epoch = self.consumed = self.step = 0
        self.generation = 0  # resumes so far: the consumed log keeps the newest per step
        self.clip_id = np.concatenate([s.clip_id for s in self.sources])
        self.shard = np.concatenate([s.shard for s in self.sources])
        self.offset = np.concatenate([s.offset for s in self.sources])
        self.text_shard = np.concatenate([s.text_shard for s in self.sources])
        self.text_offset = np.concatenate([s.text_offset for s in self.sources])
        self.end = self.text_end = None  # S3 shards: where each member's one ranged GET ends (base/s3fetch.py)
        self.versions: dict = {}
        if sizes:
            both = np.concatenate([self.shard, self.text_shard])
            urls = np.array([shard_path(self.shard_root, s) if s is not None else None for s in both], dtype=object)
            offsets = np.concatenate([self.offset, self.text_offset])
            ends = member_ends(urls, offsets.astype(np.int64), {u: v[0] for u, v in sizes.items()})
            self.versions = {u: v[1] for u, v in sizes.items()}
            self.end, self.text_end = ends[: len(self.shard)], ends[len(self.shard) :]
        self.view = np.concatenate([s.view if s.view is not None else np.zeros(len(s), np.int32) for s in self.sources])
        self.views = max(s.views for s in self.sources)  # K (per manifest: Source.views)
        self.fps = np.concatenate([s.fps if s.fps is not None else np.full(len(s), np.nan) for s in self.sources])
        self.log = ConsumedLog(consumed_log, rank, log_every) if consumed_log else None
        self._check(self.plan())

    # -- plan and position ------------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> Plan:
        epoch = self.epoch if epoch is None else epoch
        return epoch_plan(self.epoch_sources(epoch), self.buckets, self.seed, epoch, self.block)

    def epoch_sources(self, epoch: int) -> list[Source]:
        """The sources with the mixing weights of `epoch` (the schedule's last value holds after it)."""
        if all(len(ws) == 1 for ws in self.schedules):
            return self.sources
        return [
            dataclasses.replace(s, weight=ws[min(epoch, len(ws) - 1)]) for s, ws in zip(self.sources, self.schedules)
        ]

    def _check(self, plan: Plan) -> None:
        if plan.num_batches < self.world_size:
            warnings.warn(
                f"{plan.num_batches} micro-batches per epoch for {self.world_size} ranks: "
                "some ranks will only see padding batches",
                stacklevel=3,
            )

    def steps_remaining(self) -> int:
        """Steps this rank takes in the rest of the current epoch (the same on every rank)."""
        return len(self.plan().rank_batches(self.consumed, self.rank, self.world_size))

    def state_dict(self) -> dict:
        epoch, consumed, step = self.epoch, self.consumed, self.step
        if consumed >= self.plan().num_batches:  # an epoch just ended: say so
            epoch, consumed, step = epoch + 1, 0, 0
        return {
            "epoch": epoch,
            "consumed": consumed,
            "step": step,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "plan_version": PLAN_VERSION,
            "generation": self.generation,
        }

    def load_state_dict(self, state: dict, reset_data: bool = False) -> None:
        self.generation = int(state.get("generation", 0)) + 1
        if self.log:
            self.log.generation = self.generation
        if reset_data:
            self.epoch = self.consumed = self.step = 0
            return
        if state.get("plan_version") != PLAN_VERSION:
            raise ValueError(
                f"data state has plan version {state.get('plan_version')}, this loader "
                f"{PLAN_VERSION}: the order would differ. Resume with reset_data=True (--reset-data)."
            )
        if state["fingerprint"] != self.fingerprint or state["seed"] != self.seed:
            raise ValueError(
                "refusing to resume the data position: it was saved for stage fingerprint "
                f"{state['fingerprint'][:16]} (seed {state['seed']}), but this loader's manifests, weights and "
                f"batch sizes give {self.fingerprint[:16]} (seed {self.seed}). Resuming would repeat and skip "
                "samples. To keep the model and optimizer and restart the data on purpose, pass "
                "reset_data=True (trainer flag --reset-data)."
            )
        self.epoch, self.consumed, self.step = int(state["epoch"]), int(state["consumed"]), int(state["step"])

    # -- iteration -------------------------------------------------------------------------
    def schedule(self) -> list[tuple[int, int, bool]]:
        """(step, global batch index, is padding) for the rest of this epoch on this rank."""
        return [
            (self.step + k, i, pad)
            for k, (i, pad) in enumerate(self.plan().rank_batches(self.consumed, self.rank, self.world_size))
        ]

    def __iter__(self):
        plan = self.plan()
        if self.consumed >= plan.num_batches:
            self.epoch, self.consumed, self.step = self.epoch + 1, 0, 0
            plan = self.plan()
        sched = self.schedule()
        maker = _BatchMaker(self, plan, sched)
        it = iter(maker) if not self.read else maker.in_process() if self.workers == 0 else iter(maker.dataloader())
        for batch in it:
            self.consumed = min(plan.num_batches, self.consumed + self.world_size)
            self.step += 1
            if self.log:
                self.log.add(
                    self.epoch, batch["step"], batch["clip_id"], batch["bucket"], batch["weight"] == 0, batch["view"]
                )
            yield batch
        if self.log:
            self.log.flush()
        self.epoch, self.consumed, self.step = self.epoch + 1, 0, 0


class _BatchMaker:
    """Turns schedule entries into batches; picklable, so DataLoader workers can run it."""

    def __init__(self, loader: LatentLoader, plan: Plan, sched):
        self.sched, self.plan = sched, plan
        self.epoch, self.seed, self.read, self.root = loader.epoch, loader.seed, loader.read, loader.root
        self.clip_id, self.shard, self.offset, self.fps = loader.clip_id, loader.shard, loader.offset, loader.fps
        self.view, self.text_shard, self.text_offset = loader.view, loader.text_shard, loader.text_offset
        self.workers, self.prefetch, self.pin_memory = loader.workers, loader.prefetch, loader.pin_memory
        self.skip = loader.skip
        self.shard_root, self.end, self.text_end = loader.shard_root, loader.end, loader.text_end
        self.fetch_ahead = loader.fetch_ahead
        self.fetcher = (
            Fetcher(loader.fetch_threads, loader.cache, loader.versions) if self.end is not None and self.read else None
        )

    def __iter__(self, worker: int = 0, nworkers: int = 1):
        yield from self._batches(range(worker, len(self.sched), nworkers))

    def in_process(self):
        """Batches made in the calling process, with torch on one thread while making them: the
        per-sample ops are tiny, and intra-op threads only contend (16x slower on a busy box)."""
        yield from self._batches(range(len(self.sched)), one_thread=True)

    def _batches(self, ks, one_thread: bool = False):
        """The batches of schedule entries `ks`, in order; with shards in S3, the members of the next batches
        (``fetch_ahead`` samples, at least the next batch) are read by the fetcher's threads meanwhile."""
        ks = list(ks)
        pending: collections.deque = collections.deque()  # (k, {(url, offset): Future}, samples)
        ahead = j = 0
        try:
            for k in ks:
                if self.fetcher is not None:
                    while j < len(ks) and (not pending or ahead < self.fetch_ahead):
                        got, n = self._fetch(ks[j])
                        pending.append((ks[j], got, n))
                        ahead, j = ahead + n, j + 1
                    _, got, n = pending.popleft()
                    ahead -= n
                else:
                    got = None
                if one_thread:
                    import torch

                    threads = torch.get_num_threads()
                    torch.set_num_threads(1)
                    try:
                        batch = self.make(*self.sched[k], got=got)
                    finally:
                        torch.set_num_threads(threads)
                else:
                    batch = self.make(*self.sched[k], got=got)
                yield batch
        finally:
            if self.fetcher is not None:
                self.fetcher.close()

    def _fetch(self, k: int) -> tuple[dict, int]:
        """Start reading the S3 members of schedule entry k's batch: {(url, offset): Future}, its sample count."""
        if not self.read:
            return {}, 0
        idx, _, _ = self.kept(*self.sched[k][1:])
        got = {}
        for i in idx:
            for shard, offset, end in (
                (self.shard[i], self.offset[i], self.end[i]),
                (self.text_shard[i], self.text_offset[i], self.text_end[i]),
            ):
                if shard is None:
                    continue
                url = shard_path(self.shard_root, shard)
                if url.startswith("s3://") and (url, int(offset)) not in got:
                    got[url, int(offset)] = self.fetcher.submit(url, int(offset), int(end))
        return got, len(idx)

    def dataloader(self):
        import torch
        from torch.utils.data import DataLoader, IterableDataset, get_worker_info

        maker = self

        class Steps(IterableDataset):
            def __iter__(self):
                info = get_worker_info()
                return maker.__iter__(info.id, info.num_workers) if info else maker.__iter__()

        pin = torch.cuda.is_available() if self.pin_memory is None else self.pin_memory
        return DataLoader(
            Steps(),
            batch_size=None,
            num_workers=self.workers,
            prefetch_factor=self.prefetch,
            pin_memory=pin,
            multiprocessing_context="fork",
            worker_init_fn=_one_thread,
        )

    def kept(self, index: int, pad: bool):
        """(rows, their positions in the epoch, is padding) of batch `index` without the skipped clips. A batch
        all of whose clips are skipped is a padding batch (weight 0) of one row of its bucket that is not."""
        idx = self.plan.batch(index)
        pos = self.plan.starts[index] + np.arange(len(idx))  # positions in the epoch: noise seeds
        if not self.skip:
            return idx, pos, pad
        keep = np.array([self.clip_id[i] not in self.skip for i in idx], dtype=bool)
        if keep.all():
            return idx, pos, pad
        if keep.any():
            return idx[keep], pos[keep], pad
        b = self.plan.bucket[index]
        for j in range(self.plan.num_batches):
            if self.plan.bucket[j] == b:
                live = [k for k, i in enumerate(self.plan.batch(j)) if self.clip_id[i] not in self.skip]
                if live:
                    return self.plan.batch(j)[live[:1]], self.plan.starts[j] + np.array(live[:1]), True
        raise ValueError(f"every clip of bucket {self.plan.buckets[b]} is skipped (withdrawn): nothing to pad with")

    def make(self, step: int, index: int, pad: bool, got=None) -> dict:
        idx, pos, pad = self.kept(index, pad)
        batch = {
            "epoch": self.epoch,
            "step": step,
            "index": index,
            "bucket": self.plan.buckets[self.plan.bucket[index]],
            "clip_id": [self.clip_id[i] for i in idx],
            "view": [int(self.view[i]) for i in idx],  # which of its cache's views each clip shows
            "weight": 0.0 if pad else 1.0,
        }
        if self.read:
            import torch

            batch.update(
                collate(
                    [self.sample(i, got) for i in idx],
                    self.seed,
                    self.epoch,
                    pos,
                )
            )
            batch["fps"] = torch.from_numpy(self.fps[idx])  # NaN where the manifest has no fps
        return batch

    def sample(self, i: int, got=None) -> dict:
        """Row i's latent and caption embedding (base/latents.py's read_latent: one ranged read each, or one
        where the sample holds its caption); `got`: the members fetched ahead, by (url, offset)."""

        def read(path, offset):
            fut = got.get((path, offset)) if got else None
            return fut.result() if fut is not None else read_member(path, offset)

        return read_row(self.shard_root, self.shard[i], self.offset[i], self.text_shard[i], self.text_offset[i], read)


def _one_thread(_worker_id):
    """Workers are the parallelism: torch's intra-op threads in each would oversubscribe the cores."""
    import torch

    torch.set_num_threads(1)


def collate(samples: list[dict], seed: int, epoch: int, positions) -> dict:
    """Stack one bucket's samples; sample posteriors with per-sample seeded noise; pad text."""
    import torch

    xs = []
    for s, p in zip(samples, positions):
        if "mean" in s:
            g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch, int(p)]).generate_state(1)[0]))
            mean = s["mean"].float()
            eps = torch.randn(mean.shape, generator=g)
            xs.append((mean + torch.exp(0.5 * s["logvar"].float()) * eps).to(s["mean"].dtype))
        else:
            xs.append(s["sample"])
    text, mask, lens = pad_text([s["text"] for s in samples])
    return {"x": torch.stack(xs), "text": text, "text_mask": mask, "text_len": torch.tensor(lens)}


def pad_text(texts: list) -> tuple:
    """Per-sample text-encoder outputs [L_i, D] -> (zero-padded [B, max L, D] in their dtype, bool
    key mask [B, max L], the lengths): the caption batch every STDiT3 forward takes."""
    import torch

    lens = [t.shape[0] for t in texts]
    text = torch.zeros((len(texts), max(lens), texts[0].shape[1]), dtype=texts[0].dtype)
    mask = torch.zeros((len(texts), max(lens)), dtype=torch.bool)
    for i, t in enumerate(texts):
        text[i, : lens[i]] = t
        mask[i, : lens[i]] = True
    return text, mask, lens


class ConsumedLog:
    """Per-rank parquet parts of (generation, epoch, step, rank, clip_id, bucket, pad, view).

    Parts are written every ``every`` steps, so a killed run loses at most that many steps of
    log, never its consistency. After a resume (generation g+1 from a state saved at step s),
    steps >= s are logged again: per (epoch, step), the rows of the newest generation are the
    ones that trained, e.g. ``QUALIFY generation = max(generation) OVER (PARTITION BY epoch, step)``.
    """

    def __init__(self, directory, rank: int, every: int = 100):
        self.dir, self.rank, self.every = Path(directory), rank, every
        self.generation = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[tuple] = []
        self.steps = 0

    def add(self, epoch, step, clip_ids, bucket, pad, views=None) -> None:
        views = views if views is not None else [0] * len(clip_ids)
        self.rows += [(epoch, step, self.rank, c, bucket, pad, v) for c, v in zip(clip_ids, views)]
        self.steps += 1
        if self.steps % self.every == 0:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return

        cols = list(zip(*self.rows))
        t = pa.table(
            {
                "generation": pa.array([self.generation] * len(cols[0]), pa.int32()),
                "epoch": pa.array(cols[0], pa.int32()),
                "step": pa.array(cols[1], pa.int64()),
                "rank": pa.array(cols[2], pa.int32()),
                "clip_id": pa.array(cols[3], pa.string()),
                "bucket": pa.array(cols[4], pa.string()),
                "pad": pa.array(cols[5], pa.bool_()),
                "view": pa.array(cols[6], pa.int32()),
            }
        )
        name = f"rank{self.rank:05d}-g{self.generation:03d}-e{cols[0][0]:04d}-s{cols[1][0]:09d}.parquet"
        with atomic_path(self.dir / name) as tmp:
            pq.write_table(t, tmp)
        self.rows = []
