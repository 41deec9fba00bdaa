"""Views (issue 17): a cache of ``views = K`` draws K (bucket, window) views per clip, and the loader
shows one per epoch, so that a stage samples clips as Open-Sora 1.2's online sampler does.

The rule is computed here from the bucket table's numbers alone (Open-Sora's B1,
configs/buckets/opensora12-stage1.toml, read as TOML; base/buckets.py is not called): a
resolution is eligible when H x W >= 0.8 x its pixel budget (DATASETS.md); trying resolutions from
the largest budget down, the lengths that fit (N > T) are offered longest first, each with its
probability p_t; the first one offered is kept with p_res (0 for a batch size of 0), else the clip is
demoted to the next resolution, as it is when no length is offered. That gives each clip shape its
distribution over (resolution, T), and the draws `cache plan` makes and the loader shows at epochs
0..K-1 are held to it.

Statistic: total variation (TV) distance between what n clips show and the rule. For n samples of a
distribution p, E|p_hat_i - p_i| <= sqrt(p_i (1 - p_i) / n), so E[TV] <= 1/2 sum_i sqrt(p_i (1-p_i) / n);
one sample moves TV by at most 1/n, so (McDiarmid) TV exceeds that by more than sqrt(ln(10^4) / 2n)
with probability below 10^-4: the bound asserted is their sum (0.07-0.09 for one epoch's buckets of
2,000 clips, 0.09-0.20 for pairs of epochs). The per-epoch shares alone cannot tell a fresh draw per
epoch from one fixed draw per clip (a clip's single draw is a draw from p too), so the test is on
PAIRS of epochs: (bucket at epoch e, bucket at epoch e + 1) must be distributed as p x p, independent
draws. One fixed draw per clip (a single-view cache: view 0 at every epoch) puts all the mass on the
diagonal, TV = 1 - sum p_i^2 (0.73-0.90 here), and fails the bound; the test shows that too.
"""

from __future__ import annotations

import math
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import REPO

B1 = REPO / "configs/buckets/opensora12-stage1.toml"
# Pixel budgets of the resolution names (DATASETS.md, "Open-Sora 1.2 buckets").
BUDGET = {
    "144p": 36_864,
    "240p": 102_240,
    "360p": 230_400,
    "480p": 409_920,
    "720p": 921_600,
    "1080p": 2_073_600,
    "256": 65_536,
    "512": 262_144,
    "1024": 1_048_576,
    "2048": 4_194_304,
}
K = 5  # stages 1 and 2 train 5 epochs
SEED = 7  # the loader's (run.seed); the cache's is 42
# (height, width, frames): every resolution eligible with only 360p and below offering video lengths;
# 720p with 102 and 51 fitting; 480p with only 51; 240p with 204, 102 and 51 (and the p_t gates); an image.
SHAPES = [(1080, 1920, 500), (720, 1280, 120), (480, 854, 60), (240, 426, 250), (1080, 1920, 1)]
CLIPS = 2000  # per shape


def rule(table: dict, height: int, width: int, frames: int) -> dict:
    """{(resolution, T) or None: probability} for one clip shape, from the TOML table's numbers."""
    out: Counter = Counter()
    reach = 1.0  # probability that the draw is still looking when it comes to this resolution
    for res in sorted(table, key=lambda r: -BUDGET[r]):
        if height * width < 0.8 * BUDGET[res]:
            continue
        silent, demoted = 1.0, 0.0  # no length offered yet; offered and not kept
        for t, spec in sorted(((int(t), s) for t, s in table[res].items()), reverse=True):
            if not ((t == 1 and frames == 1) or (t > 1 and frames > t)):
                continue
            keep, batch = spec if isinstance(spec, list) else (1.0, spec)
            p_res, p_t = keep if isinstance(keep, list) else (keep, 1.0)
            p_res = p_res if batch else 0.0
            offered = reach * silent * p_t
            out[(res, t)] += offered * p_res
            demoted += offered * (1 - p_res)
            silent *= 1 - p_t
        reach = reach * silent + demoted
    out[None] += reach
    return {k: v for k, v in out.items() if v > 0}


def tv(counts: Counter, p: dict) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(k, 0) / n - p.get(k, 0.0)) for k in set(counts) | set(p))


def bound(p: dict, n: int) -> float:
    """TV of n draws from p stays below this with probability >= 1 - 10^-4 (module docstring)."""
    return 0.5 * sum(math.sqrt(q * (1 - q) / n) for q in p.values()) + math.sqrt(math.log(1e4) / (2 * n))


def label(bucket):
    return None if bucket is None else (bucket.split("/")[0], int(bucket.split("/")[1]))


def _config(root: Path, name: str, views: int, buckets=B1, kind="sd-per-frame", seed=42, **more) -> Path:
    p = root / f"{name}.toml"
    extra = "".join(f"{k} = {v}\n" for k, v in more.items())
    p.write_text(
        f'name = "{name}"\nmanifest = "m"\nbuckets = "{buckets}"\nseed = {seed}\nviews = {views}\n{extra}'
        f'[video_encoder]\nkind = "{kind}"\ntiny = true\ndtype = "float32"\n'
        '[text_encoder]\nkind = "t5"\ntiny = true\ndtype = "float32"\n'
    )
    return p


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """`cache plan` of K = 5 and K = 1 over CLIPS clips of each shape (a manifest written here: no
    video is read while planning); returns (root, rows of K = 5, rows of K = 1)."""
    from reelcache.cache.plan import CacheConfig, make_plan

    root = tmp_path_factory.mktemp("views")
    rows = []
    for s, (h, w, n) in enumerate(SHAPES):
        for i in range(CLIPS):
            rows.append(
                {"clip_id": f"s{s}-{i:05d}", "shard": "raw/x/000000-00.tar", "shard_offset": 512 * (len(rows) + 1)}
                | {"file_size": 1000, "num_frames": n, "width": w, "height": h, "text": "a dog runs", "fps": 30.0}
            )
    (root / "manifests").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), root / "manifests" / "m-0000000000000000.parquet")
    out = []
    for name, views in (("k5", K), ("k1", 1)):
        cfg = CacheConfig.from_toml(_config(root, name, views, clips_per_unit=4096))
        make_plan(root, cfg)
        out.append(pq.read_table(root / "latents" / name / "_plan" / "input.parquet").to_pylist())
    return root, out[0], out[1]


def shown(rows: list[dict], views: int, seed: int = SEED, epochs: int = K) -> dict:
    """{clip_id: [the plan row the loader shows at epoch 0, 1, ...]}, chosen by the loader's own rule
    (train/plan.py: epoch_rows over a Source of these rows)."""
    from reelcache.train.plan import Source, epoch_rows

    ids = np.array([r["clip_id"] for r in rows], dtype=object)
    src = Source(
        "x" * 64,
        ids,
        np.array([r["bucket"] or "-" for r in rows], dtype=object),
        np.array(["s"] * len(rows), dtype=object),
        np.arange(len(rows), dtype=np.int64),
        view=np.array([r["view"] for r in rows], dtype=np.int32) if views > 1 else None,
        views=views,
    )
    out: dict = {}
    for e in range(epochs):
        idx = epoch_rows(src, seed, e)
        assert len(idx) == len(set(ids))  # one row per clip and epoch
        for i in idx:
            out.setdefault(rows[i]["clip_id"], []).append(rows[i])
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_views_over_epochs_are_independent_draws_of_the_open_sora_rule(planned, shape):
    _, rows5, rows1 = planned
    with open(B1, "rb") as f:
        p = rule(tomllib.load(f)["buckets"], *shape)
    s = SHAPES.index(shape)
    mine = [r for r in rows5 if r["clip_id"].startswith(f"s{s}-")]
    by_clip = shown(mine, K)
    assert all(sorted(r["view"] for r in rs) == list(range(K)) for rs in by_clip.values())  # each view once
    n = len(by_clip)
    for e in range(K):  # every epoch's share of each bucket is the rule's
        assert tv(Counter(label(rs[e]["bucket"]) for rs in by_clip.values()), p) < bound(p, n)
    pq_ = {(a, b): p[a] * p[b] for a in p for b in p}  # two epochs: independent draws
    pair_bound = bound(pq_, n)
    for e in range(K - 1):
        pairs = Counter((label(rs[e]["bucket"]), label(rs[e + 1]["bucket"])) for rs in by_clip.values())
        assert tv(pairs, pq_) < pair_bound, (e, tv(pairs, pq_), pair_bound)
    # one fixed draw per clip (a single-view cache shows view 0 every epoch) fails the same test
    fixed = shown([r for r in rows1 if r["clip_id"].startswith(f"s{s}-")], 1)
    assert all(len({r["bucket"] for r in rs}) == 1 for rs in fixed.values())
    pairs = Counter((label(rs[0]["bucket"]), label(rs[1]["bucket"])) for rs in fixed.values())
    if len(p) > 1:
        assert tv(pairs, pq_) > pair_bound and tv(pairs, pq_) > 0.9 * (1 - sum(q * q for q in p.values()))


def test_view_0_is_the_single_draw_and_windows_are_uniform(planned):
    from reelcache.base.buckets import BucketConfig
    from reelcache.cache.plan import CacheConfig, identity

    root, rows5, rows1 = planned
    key = ("bucket", "num_frames", "height", "width", "window_start", "no_bucket")
    view0 = {r["clip_id"]: tuple(r[k] for k in key) for r in rows5 if r["view"] == 0}
    assert view0 == {r["clip_id"]: tuple(r[k] for k in key) for r in rows1}  # K = 1 caches keep their draws
    one = CacheConfig.from_toml(root / "k1.toml")
    assert "views" not in identity(one, BucketConfig.from_toml(B1), "fp")  # nor their cache.json
    # windows: uniform over the valid starts 0 .. N - span, by view; a 480 x 854 clip of 60 frames only
    # ever fits length 51 (at 360p, 240p, 256 or 144p), so N - span = 9: ten starts
    for r in rows5:
        if r["bucket"]:
            n = SHAPES[int(r["clip_id"][1])][2]
            assert 0 <= r["window_start"] <= n - r["num_frames"]
    starts = [r["window_start"] for r in rows5 if r["clip_id"].startswith("s2-")]
    counts = np.bincount(starts, minlength=10)
    assert len(counts) == 10 and len(starts) == K * CLIPS
    chi2 = float(((counts - len(starts) / 10) ** 2 / (len(starts) / 10)).sum())
    assert chi2 < 27.88, counts  # chi-square, 9 degrees of freedom, p = 0.001
    # identical draws (same bucket and window) are stored once: the later view names the earlier
    for clip_rows in _by_clip(rows5).values():
        for r in clip_rows:
            same = [q["view"] for q in clip_rows if q["view"] < r["view"] and r["bucket"] and _draw(q) == _draw(r)]
            assert r["same_as"] == (same[0] if same else None)


def _by_clip(rows):
    out: dict = {}
    for r in rows:
        out.setdefault(r["clip_id"], []).append(r)
    return out


def _draw(r):
    return (r["bucket"], r["window_start"])


def test_windows_of_two_views_are_independent(planned):
    """A fixed clip shape with ten valid starts: (view a, view b)'s starts fall on all 100 pairs
    evenly (chi-square, 99 degrees of freedom, p = 0.001: 148.2), not on the diagonal."""
    _, rows5, _ = planned
    by = _by_clip([r for r in rows5 if r["clip_id"].startswith("s2-")])
    pairs = [(rs[a]["window_start"], rs[b]["window_start"]) for rs in by.values() for a, b in ((0, 1), (2, 3))]
    counts = np.zeros((10, 10))
    for x, y in pairs:
        counts[x, y] += 1
    expected = len(pairs) / 100
    assert len(pairs) == 2 * CLIPS and float(((counts - expected) ** 2 / expected).sum()) < 148.2


@pytest.mark.slow
def test_cache_plan_prints_the_cost_of_views(planned, caplog):
    from reelcache.cache.plan import CacheConfig, make_plan

    root, _, _ = planned
    make_plan(root, CacheConfig.from_toml(_config(root, "k2", 2, clips_per_unit=4096)))
    lines = caplog.messages
    head = next(i for i, line in enumerate(lines) if "what views cost" in line)
    assert lines[head + 1].split() == [
        *("K", "encodes", "per", "clip", "new", "Gpixels", "x", "K=1", "format", "1", "store", "added", "GPU-hours")
    ]
    table = [line.split() for line in lines[head + 2 : head + 5]]
    assert [t[:2] for t in table][:2] == [["1", f"{CLIPS * len(SHAPES):,}"], ["*", "2"]] and table[2][0] == "3"
    per_clip = [float([x for x in t if x != "*"][2]) for t in table]
    assert per_clip[0] == 1.0 and 1.0 < per_clip[1] <= 2.0 and per_clip[1] < per_clip[2] <= 3.0
