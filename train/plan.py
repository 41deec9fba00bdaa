"""The epoch plan: which samples form which micro-batch, in which order. A pure function.

    plan = epoch_plan(sources, bucket_config, seed, epoch)

depends only on the manifests' content (their fingerprints), their mixing weights, the bucket
batch sizes, the seed and the epoch: never on the number of ranks or workers. It is built
in five steps, each a numpy pass over the manifest (about a second at 1.3M samples):

0. views: a manifest of a cache with K views (catalog/manifest.py) has a row per (clip, view). At
   epoch e a clip shows view v(e) = pi[e mod K], pi a permutation of 0..K-1 seeded by (seed, clip
   id): a stage of K epochs shows each view once, so where the draws differ no clip is seen the
   same way twice, and every epoch's views are independent draws by Open-Sora's rule (as its
   sampler draws a bucket every epoch). A view the cache has no latent for (its draw fit no bucket,
   or did not decode) leaves the clip out of that epoch, as Open-Sora's sampler skips a clip whose
   draw finds no bucket. The samples of the epoch are the rows of the views shown;
1. selection: with one manifest, every sample once. With several, weight w_i draws
   round(w_i * total) samples from manifest i: a fresh random subset when that is fewer than it
   has, whole passes plus a subset when more (upsampling). A pass holds each clip at most once
   (a clip in several manifests, i.e. stored at the same shard and offset, counts its copies
   across all of them);
2. storage order: selected samples sorted by (bucket, pass, shard, offset), i.e. as they lie on disk;
3. block shuffle per bucket: pass 0 (every distinct sample) is cut into blocks of ``block``
   consecutive samples, the grid shifted by a random offset in [0, block) drawn per (seed, epoch,
   bucket) so that block boundaries, and with them the clips that share batches, move from epoch
   to epoch (the block that the shift pushes past the end wraps around to the first samples: one
   block per bucket reads two regions), and the blocks get a random order; each pass takes its
   samples block by block in that order, rotated by p/K of it (K passes in the bucket), shuffled
   inside each block, and is cut into micro-batches of the bucket's batch size. A micro-batch never
   spans two passes, so it never holds a clip twice; the rotation puts a clip's copies about 1/K of
   the epoch apart. The last batch of each pass may be smaller (no sample is dropped or repeated to fill
   it). Reads stay within a few shard regions per batch, so streaming from slow storage stays
   sequential (later passes of a subsample read their pass-0 block's members that were drawn
   again, so their batches span a few more blocks);
4. merge: every (bucket, pass) batch sequence is spread evenly over the epoch (its j-th of k
   batches is placed at (j + U)/k, U uniform), keeping its order: each bucket keeps its share of
   the steps throughout the epoch, and the rotation of step 3 carries over to the global order.

The trade-off: partial batches at the end of every (bucket, pass) instead of every bucket (a
few per epoch), for never repeating a clip inside a micro-batch. Because copies sit about
M/K micro-batches apart (M per epoch), a global step of W ranks (W consecutive micro-batches)
holds no clip twice either while W stays well below M/K (bench: closest copies at 1.3M).

Ranks consume global micro-batches r, r+R, r+2R, ... from a position (a global count of
micro-batches consumed), so the position survives a change of world size. Every rank takes
ceil(remaining / R) steps; where the last round has fewer batches than ranks, the ranks
without one get a padding batch (a real batch repeated with loss weight 0), so no rank ever
skips a collective on its own and no sample counts twice.
"""

from __future__ import annotations

import hashlib
import math
import warnings
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pyarrow as pa

from reelcache.base.buckets import BucketConfig

PLAN_VERSION = 3  # 2: repeats in separate micro-batches, spread across the epoch; 3: views, a moving block grid


@dataclass(frozen=True, eq=False)
class Source:
    """One manifest's samples, in manifest order (clip_id sorted), and its mixing weight.

    Identity is (fingerprint, weight): the fingerprint is a hash of the content.
    """

    fingerprint: str
    clip_id: np.ndarray  # object array of str
    bucket: np.ndarray  # object array of str
    shard: np.ndarray  # object array of str
    offset: np.ndarray  # int64
    weight: float = 1.0
    fps: np.ndarray | None = None  # float64 frame rate of each clip (the model's fps input), if the manifest has it
    view: np.ndarray | None = None  # int32 view of each row (a cache of several views); None: one view
    views: int = 1  # K: the cache's views per clip
    clip_key: np.ndarray | None = None  # uint64 hash of each row's clip id (clip_keys), computed if None
    # object array: each row's caption shard, None where the sample holds its caption (a manifest without
    # these columns: cache format 1, or samples written by another tool); base/latents.py reads either
    text_shard: np.ndarray | None = None
    text_offset: np.ndarray | None = None  # int64: where its caption embedding starts (0 where none)

    def __post_init__(self):
        if self.text_shard is None:  # every row's caption in its sample
            object.__setattr__(self, "text_shard", np.full(len(self.clip_id), None, dtype=object))
            object.__setattr__(self, "text_offset", np.zeros(len(self.clip_id), dtype=np.int64))

    def __len__(self):
        return len(self.clip_id)

    def __hash__(self):
        return hash((self.fingerprint, self.weight))

    def __eq__(self, other):
        return isinstance(other, Source) and (self.fingerprint, self.weight) == (other.fingerprint, other.weight)


@dataclass
class Plan:
    """One epoch's micro-batches over the concatenated sources."""

    fingerprint: str  # of the whole stage: manifests, weights, batch sizes, plan version
    order: np.ndarray  # int64 sample indices (into the concatenated sources), batch after batch
    starts: np.ndarray  # int64, len M+1: batch i is order[starts[i]:starts[i+1]]
    bucket: np.ndarray  # int32 bucket code of each batch
    buckets: list[str]  # bucket names by code

    @property
    def num_batches(self) -> int:
        return len(self.starts) - 1

    def batch(self, i: int) -> np.ndarray:
        return self.order[self.starts[i] : self.starts[i + 1]]

    def rank_batches(self, consumed: int, rank: int, world: int) -> list[tuple[int, bool]]:
        """(batch index, is padding) for each remaining step of `rank`, from global position `consumed`."""
        m = self.num_batches
        steps = math.ceil(max(0, m - consumed) / world)
        out = []
        for k in range(steps):
            i = consumed + k * world + rank
            out.append((i, False) if i < m else (i % m, True))
        return out


def stage_fingerprint(sources: list[Source], sizes: BucketConfig, block: int) -> str:
    h = hashlib.sha256(f"plan{PLAN_VERSION}|{sizes.key()}|{block}".encode())
    for s in sources:
        h.update(f"|{s.fingerprint}:{s.weight!r}:views={s.views}".encode())
    return h.hexdigest()


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


_M64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def clip_keys(clip_id: np.ndarray) -> np.ndarray:
    """uint64 per row: blake2b-64 of its clip id (rows of one clip are adjacent, hashed once)."""
    n = len(clip_id)
    new = np.ones(n, dtype=bool)
    if n > 1:
        new[1:] = clip_id[1:] != clip_id[:-1]
    heads = np.flatnonzero(new)
    keys = np.fromiter(
        (int.from_bytes(hashlib.blake2b(str(clip_id[i]).encode(), digest_size=8).digest(), "little") for i in heads),
        dtype=np.uint64,
        count=len(heads),
    )
    return keys[np.cumsum(new) - 1] if n else keys


def shown_view(keys: np.ndarray, views: int, seed: int, epoch: int) -> np.ndarray:
    """The view each clip (by clip_keys) shows at `epoch`: pi[epoch mod K], pi the clip's permutation of
    0..K-1, seeded by (seed, clip id): the order of K splitmix64 draws of (seed, clip, j)."""
    draws = np.empty((len(keys), views), dtype=np.uint64)
    for j in range(views):
        salt = _mix(np.array([(int(seed) * 0x9E3779B97F4A7C15 + j + 1) & _M64], dtype=np.uint64))[0]
        draws[:, j] = _mix(keys ^ salt)
    return np.argsort(draws, axis=1, kind="stable")[:, epoch % views].astype(np.int32)


def epoch_rows(s: Source, seed: int, epoch: int) -> np.ndarray:
    """Indices of the source's rows that `epoch` shows: the view of each clip that this epoch shows."""
    if s.view is None or s.views == 1:
        return np.arange(len(s), dtype=np.int64)
    keys = s.clip_key if s.clip_key is not None else clip_keys(s.clip_id)
    return np.flatnonzero(s.view == shown_view(keys, s.views, seed, epoch)).astype(np.int64)


def _select(sources: list[Source], seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Selected sample indices and each one's pass: 0 for a sample's first copy, p for its (p+1)-th."""
    sizes = [len(s) for s in sources]
    base = np.concatenate([[0], np.cumsum(sizes)])
    shown = [epoch_rows(s, seed, epoch) for s in sources]
    if len(sources) == 1:
        return shown[0], np.zeros(len(shown[0]), dtype=np.int32)
    total = sum(map(len, shown))
    wsum = sum(s.weight for s in sources)
    picks, passes = [], []
    for i, (s, rows) in enumerate(zip(sources, shown)):
        n = len(rows)
        need = round(s.weight / wsum * total) if n else 0
        reps = -(-need // n) if need else 0
        idx = np.concatenate([_rng(seed, epoch, 1, i, r).permutation(n) for r in range(reps)] or [[]])
        picks.append(base[i] + rows[idx[:need].astype(np.int64)])
        passes.append((np.arange(need, dtype=np.int64) // max(1, n)).astype(np.int32))
    return np.concatenate(picks), np.concatenate(passes)


def argsort(keys: list[np.ndarray], bounds: list[int]) -> np.ndarray:
    """Indices sorting by keys[0], then keys[1], ... (ints in [0, bound)), ties by index: np.lexsort's
    answer, but from one quicksort of a packed int64 key when the key space fits in 63 bits (about 8x
    faster at 1M rows). Quicksort's order of equal keys is unspecified, so ties go to a stable sort."""
    if math.prod(int(b) for b in bounds) >= 2**63:
        return np.lexsort(keys[::-1])
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for k, b in zip(keys, bounds):
        packed = packed * int(b) + k.astype(np.int64)
    o = np.argsort(packed)
    if len(o) > 1 and (np.diff(packed[o]) == 0).any():
        o = np.argsort(packed, kind="stable")
    return o


def _codes(values: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Dictionary-encode strings (hash-based: fast at millions of rows), codes in sorted-name order."""
    enc = pa.array(values, type=pa.string()).dictionary_encode()
    names = enc.dictionary.to_pylist()
    remap = np.empty(len(names), dtype=np.int32)
    remap[np.argsort(np.array(names, dtype=object))] = np.arange(len(names), dtype=np.int32)
    return sorted(names), remap[enc.indices.to_numpy(zero_copy_only=False)]


@lru_cache(maxsize=4)
def _storage_order(sources: tuple[Source, ...]):
    """Bucket codes and the (bucket, shard, offset) rank of every sample of the concatenated sources;
    and, when manifests share members (one clip in several), each sample's clip: the index of the
    first sample stored at the same place (None when every sample is its own clip)."""
    names, codes = _codes(np.concatenate([s.bucket for s in sources]))
    _, shard_codes = _codes(np.concatenate([s.shard for s in sources]))
    offsets = np.concatenate([s.offset for s in sources])
    n = len(codes)
    top = int(offsets.max()) + 1 if n else 1
    order = argsort([codes, shard_codes, offsets], [len(names), int(shard_codes.max()) + 1 if n else 1, top])
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    sh, off, cd = shard_codes[order], offsets[order], codes[order]
    same = (sh[1:] == sh[:-1]) & (off[1:] == off[:-1]) & (cd[1:] == cd[:-1])
    clip = None
    if same.any():
        head = np.maximum.accumulate(np.where(np.concatenate([[True], ~same]), np.arange(n), 0))
        clip = np.empty(n, dtype=np.int64)
        clip[order] = order[head]
    return names, codes, rank, clip


def epoch_plan(sources: list[Source], sizes: BucketConfig, seed: int, epoch: int, block: int = 64) -> Plan:
    return _cached_plan(tuple(sources), sizes, int(seed), int(epoch), int(block))


def clear_cache() -> None:
    """Forget the plans and storage orders kept for the last sources (the next plan is computed afresh)."""
    _cached_plan.cache_clear()
    _storage_order.cache_clear()


@lru_cache(maxsize=2)
def _cached_plan(sources: tuple[Source, ...], sizes: BucketConfig, seed: int, epoch: int, block: int) -> Plan:
    names, codes, rank, clip = _storage_order(sources)
    sel, pas = _select(list(sources), seed, epoch)
    if clip is not None:
        # Manifests share clips: a clip's copies are numbered across all of them, so a clip drawn
        # from two manifests is two passes, like a clip drawn twice from one.
        ident = clip[sel]
        o = argsort([ident, pas], [len(rank), int(pas.max()) + 1 if len(pas) else 1])
        first = np.searchsorted(ident[o], ident[o])
        pas = np.empty_like(pas)
        pas[o] = np.arange(len(o)) - first
    else:
        ident = sel
    o = argsort([codes[sel], pas, rank[sel]], [len(names), int(pas.max()) + 1 if len(pas) else 1, len(rank)])
    sel, pas, ident, sel_codes = sel[o], pas[o], ident[o], codes[sel[o]]  # bucket, pass, storage order
    batch_sizes = np.array([sizes.batch_size(b) for b in names], dtype=np.int64)
    bounds = np.searchsorted(sel_codes, np.arange(len(names) + 1))
    block_of = np.empty(len(rank), dtype=np.int32)  # scratch: pass-0 block of each clip
    rng_jitter = _rng(seed, epoch, 3)
    shuffled, batch_start, batch_len, batch_bucket, batch_key = [], [], [], [], []
    base = 0
    for b in range(len(names)):
        s, p, c = sel[bounds[b] : bounds[b + 1]], pas[bounds[b] : bounds[b + 1]], ident[bounds[b] : bounds[b + 1]]
        n, bs = len(s), int(batch_sizes[b])
        if n == 0:
            continue
        n0 = int(np.searchsorted(p, 1))  # distinct samples: pass 0, in storage order
        if n0 < bs:
            warnings.warn(
                f"bucket {names[b]!r} has {n0} samples, fewer than its batch size {bs}: partial batches", stacklevel=3
            )
        rng = _rng(seed, epoch, 2, zlib.crc32(names[b].encode()))
        # the grid moves each epoch: blocks start at the offset, the last one wraps around to the first
        # members (block sizes stay those of an unshifted grid, so batches stay aligned to blocks)
        shift = int(_rng(seed, epoch, 4, zlib.crc32(names[b].encode())).integers(block))
        nb = -(-n0 // block)
        block_of[c[:n0]] = ((np.arange(n0) - shift) % n0) // block
        passes = int(p[-1]) + 1
        # Pass p takes its blocks in pass 0's shuffled block order, rotated by p/passes of it:
        # a sample's copies land about 1/passes of the bucket's sequence apart.
        turn = (rng.permutation(nb)[block_of[c]] + p.astype(np.int64) * nb // passes) % nb
        s = s[argsort([p, turn, rng.permutation(n)], [passes, nb, n])]  # per pass: blocks shuffled, then inside each
        first = np.searchsorted(p, p)  # p is sorted: where each sample's pass starts
        pos = np.arange(n) - first  # position inside its pass
        cuts = np.flatnonzero(pos % bs == 0)  # micro-batches never straddle two passes
        pass_len = np.bincount(p, minlength=passes)[p[cuts]]
        # stratified merge key: a group's j-th of k batches goes to (j + U) / k of the epoch
        j, k = pos[cuts] // bs, -(-pass_len // bs)
        batch_key.append((j + rng_jitter.random(len(cuts))) / k)
        shuffled.append(s)
        batch_start.append(base + cuts)
        batch_len.append(np.diff(np.append(cuts, n)))
        batch_bucket.append(np.full(len(cuts), b, dtype=np.int32))
        base += n
    if not shuffled:
        raise ValueError("the epoch plan has 0 micro-batches: the manifests select no samples")
    flat = np.concatenate(shuffled)
    start, length, labels, keys = map(np.concatenate, (batch_start, batch_len, batch_bucket, batch_key))
    # Merge every (bucket, pass) batch sequence into one: sorting by the stratified key keeps each
    # sequence's order and spreads it evenly over the epoch (a bucket's share is steady throughout).
    take = np.argsort(keys, kind="stable")
    start, length, labels = start[take], length[take], labels[take]
    starts = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
    order = flat[np.repeat(start - starts[:-1], length) + np.arange(starts[-1])]
    return Plan(stage_fingerprint(list(sources), sizes, block), order, starts, labels, names)
