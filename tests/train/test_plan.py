"""The epoch plan as a pure function: upsampled repeats never share a micro-batch, copies are spread
across the epoch, the selection keeps its shares, batches stay storage-local, old states are refused."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from reelcache.base.buckets import BucketConfig
from reelcache.train.plan import Source, clear_cache, epoch_plan

B16 = BucketConfig.from_dict({"240p": {17: 16}})
MIXED = BucketConfig.from_dict({"144p": {17: 4, 33: 2}, "240p": {17: 3, 33: 2}})


def source(name: str, n: int, weight: float, buckets=("240p/17/0.56",), per_shard: int = 100, seed: int = 0) -> Source:
    """n clips in shards of `per_shard` consecutive members (storage order = clip order)."""
    rng = np.random.default_rng(seed)
    content = hashlib.sha256(repr((name, n, buckets, per_shard, seed)).encode()).hexdigest()  # plans are cached by it
    return Source(
        content,
        np.array([f"{name}{i:06d}" for i in range(n)], dtype=object),
        np.array(buckets, dtype=object)[rng.integers(0, len(buckets), n)],
        np.array([f"{name}/{i // per_shard:06d}-00.tar" for i in range(n)], dtype=object),
        (np.arange(n, dtype=np.int64) % per_shard) * 4096 + 512,
        float(weight),
    )


def batches(plan):
    return [plan.batch(i) for i in range(plan.num_batches)]


def copies_gap(plan) -> np.ndarray:
    """For every pair of consecutive copies of one sample: how many micro-batches apart they are."""
    batch_of = np.repeat(np.arange(plan.num_batches), np.diff(plan.starts))
    o = np.lexsort((batch_of, plan.order))
    same = plan.order[o][1:] == plan.order[o][:-1]
    return (batch_of[o][1:] - batch_of[o][:-1])[same]


def test_the_10k_mix_has_no_micro_batch_with_a_clip_twice():
    # 6,000 + 4,000 clips at 50/50: the second is upsampled to 5,000 (1,000 clips twice). Plan
    # version 1 put copies side by side in storage order, so 159 of these 625 batches held a repeat.
    sources = [source("a", 6000, 0.5), source("b", 4000, 0.5)]
    for seed, epoch in [(0, 0), (1, 3), (7, 1)]:
        plan = epoch_plan(sources, B16, seed=seed, epoch=epoch)
        # rounds of 9,000 first copies and 1,000 second copies: 563 + 63 batches, two partial
        assert plan.num_batches == 626 and len(plan.order) == 10_000
        assert sum(len(set(b.tolist())) < len(b) for b in batches(plan)) == 0
        gaps = copies_gap(plan)
        assert len(gaps) == 1000  # every repeat is there, once
        # spread: a clip's two copies sit about half an epoch apart, never in neighbouring steps. So a
        # global step of W ranks (W consecutive micro-batches, whatever the resume point) holds no clip
        # twice for any W up to the smallest gap (here >= 156 ranks).
        assert gaps.min() >= 625 // 4 and abs(np.median(gaps) - 312) < 40


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.8, 0.2), (0.95, 0.05)])
def test_heavy_upsampling_over_buckets_never_repeats_in_a_batch(weights):
    # b's 40 clips are drawn 2.5x .. 4.75x: repeats must spread over many batches in every bucket,
    # including buckets where b has fewer clips than the batch size.
    buckets = ("144p/17/0.56", "144p/33/0.56", "240p/17/1.00", "240p/33/0.56")
    sources = [source("b", 40, weights[0], buckets, per_shard=7, seed=1), source("a", 160, weights[1], buckets, seed=2)]
    plan = epoch_plan(sources, MIXED, seed=3, epoch=2)
    total = sum(len(s) for s in sources)
    assert len(plan.order) == total
    b_count = round(weights[0] / sum(weights) * total)
    assert int((plan.order < 40).sum()) == b_count  # the asked share, exactly
    counts = np.bincount(plan.order[plan.order < 40], minlength=40)
    assert counts.max() - counts.min() <= 1  # whole passes, then a subset
    for i, b in enumerate(batches(plan)):
        assert len(set(b.tolist())) == len(b), f"batch {i} repeats a clip: {b}"
        assert 0 < len(b) <= MIXED.batch_size(plan.buckets[plan.bucket[i]])
        assert len({sources[0].bucket[j] if j < 40 else sources[1].bucket[j - 40] for j in b}) == 1
    # the last batch of a round is partial: but no more partial batches than (bucket, round) pairs
    full = [len(b) == MIXED.batch_size(plan.buckets[plan.bucket[i]]) for i, b in enumerate(batches(plan))]
    rounds = -(-b_count // 40)
    assert full.count(False) <= 4 * rounds


def test_the_plan_is_a_pure_function_and_changes_per_epoch():
    sources = [source("a", 3000, 0.3), source("b", 500, 0.7)]
    a = epoch_plan(sources, B16, seed=5, epoch=1, block=64)
    clear_cache()
    fresh = [source("a", 3000, 0.3), source("b", 500, 0.7)]  # equal content, new objects
    b = epoch_plan(fresh, B16, seed=5, epoch=1, block=64)
    assert a is not b and np.array_equal(a.order, b.order) and np.array_equal(a.starts, b.starts)
    assert a.fingerprint == b.fingerprint
    for other in (epoch_plan(sources, B16, seed=5, epoch=2), epoch_plan(sources, B16, seed=6, epoch=1)):
        assert not np.array_equal(a.order, other.order)
        assert sorted(a.order.tolist()) != sorted(other.order.tolist())  # b's subset is redrawn too


def test_batches_stay_within_few_storage_regions():
    # One source, no repeats: a batch is cut from one block of 64 consecutive members (plus its
    # neighbour when a batch straddles two blocks), so it touches at most 2 shards of 100. The grid
    # moves each epoch, wrapping its last block around: every epoch keeps that.
    for epoch in range(4):
        plan = epoch_plan([source("a", 10_000, 1.0)], B16, seed=0, epoch=epoch)
        shards = [len({int(j) // 100 for j in b}) for b in batches(plan)]
        assert max(shards) <= 3 and np.mean(shards) < 1.6
    # With repeats, round-0 blocks are the unit too: a batch still reads a handful of regions.
    plan = epoch_plan([source("a", 6000, 0.5), source("b", 4000, 0.5)], B16, seed=0, epoch=0)
    shards = [len({(int(j) >= 6000, int(j) % 6000 // 100) for j in b}) for b in batches(plan)]
    assert np.mean(shards) < 3


def test_the_block_grid_moves_between_epochs():
    # Blocks of 64 neighbours, shuffled inside, cut into batches of 16: with the same blocks every epoch
    # two clips that share a batch share one again the next epoch with probability 15/63 = 0.238 (they
    # are in the same block, always). A grid shifted per epoch splits such pairs across blocks: about
    # a third of them, so the share drops; locality stays (test_batches_stay_within_few_storage_regions).
    import itertools

    s = source("a", 10_000, 1.0)

    def together(epoch):
        plan = epoch_plan([s], B16, seed=0, epoch=epoch)
        return {p for b in batches(plan) for p in itertools.combinations(sorted(b.tolist()), 2)}

    pairs = [together(e) for e in range(5)]
    again = [len(a & b) / len(a) for a, b in zip(pairs, pairs[1:])]
    assert np.mean(again) < 0.2 and min(again) > 0.05, again  # fixed blocks: 0.238 every epoch


def test_buckets_are_spread_evenly_over_the_epoch():
    # Each bucket's batches are spread across the epoch (stratified), not clumped by chance: in
    # every tenth of the epoch, each bucket has its share of batches within a couple.
    buckets = ("144p/17/0.56", "144p/33/0.56", "240p/17/1.00", "240p/33/0.56")
    plan = epoch_plan([source("a", 4000, 1.0, buckets)], MIXED, seed=11, epoch=0)
    m = plan.num_batches
    for code in range(len(plan.buckets)):
        where = np.flatnonzero(plan.bucket == code)
        per_tenth = np.bincount(where * 10 // m, minlength=10)
        assert per_tenth.max() - per_tenth.min() <= 3, (plan.buckets[code], per_tenth)


def test_a_clip_in_two_manifests_is_never_twice_in_a_batch():
    # "hq" is a subset of "all" (the same members: shard and offset): drawing both at weight 1
    # gives its clips two copies, which must be treated like upsampled repeats.
    full = source("all", 3000, 0.5)
    keep = np.arange(0, 3000, 3)
    hq = Source("h" * 64, full.clip_id[keep], full.bucket[keep], full.shard[keep], full.offset[keep], 0.5)
    plan = epoch_plan([full, hq], B16, seed=2, epoch=0)
    clip = np.concatenate([full.clip_id, hq.clip_id])
    seen = [clip[b] for b in batches(plan)]
    assert sum(len(set(c.tolist())) < len(c) for c in seen) == 0
    counts = np.unique(np.concatenate(seen), return_counts=True)[1]
    assert counts.max() >= 2 and len(np.concatenate(seen)) == 4000


def test_packed_argsort_is_lexsort():
    from reelcache.train.plan import argsort

    rng = np.random.default_rng(0)
    for bounds in ([3, 5, 7], [2, 2**20, 2**40], [2**30, 2**30, 2**30]):  # with ties; the last overflows 63 bits
        keys = [rng.integers(0, b, 5000) for b in bounds]
        assert np.array_equal(argsort(keys, bounds), np.lexsort(keys[::-1]))
