"""The loader on shards in S3 (a real SeaweedFS, tests/s3_local.py): batches byte-identical to the same shards on
a local disk, in process and with data workers, after an elastic resume, and through the faults a store has;
each member one exact ranged GET (counted by the fault proxy)."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from latent_data import write_latents
from support import REPO

from reelcache.base import s3fetch
from reelcache.base.buckets import BucketConfig
from reelcache.train.loader import LatentLoader

SIZES = BucketConfig.from_toml(REPO / "configs/buckets/tiny.toml")


@pytest.fixture(scope="module")
def store_data(tmp_path_factory):
    """A store-format manifest (latent and caption in two shards), members of 8..110 kB, on a local disk."""
    root = tmp_path_factory.mktemp("s3latents")
    manifest = write_latents(root, 40, name="s", seed=3, store=True, channels=48, text_dim=1024, shard_bytes=600_000)
    return root, manifest


def upload(s3_server, root: Path, s3root: str) -> None:
    """Every shard under root/latents to s3root/latents, with a plain boto3 client of the test's (no proxy)."""
    bucket, _, prefix = s3root[5:].partition("/")
    c = s3_server.client()
    for p in sorted((root / "latents").rglob("*.tar")):
        c.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(root).as_posix()}")


def same(a, b) -> None:
    import torch

    assert a["clip_id"] == b["clip_id"] and a["index"] == b["index"] and a["step"] == b["step"]
    for k in ("x", "text", "text_mask", "text_len"):
        assert torch.equal(a[k], b[k]), k


def gets(proxy) -> list[tuple[str, str, int]]:
    return [(m, p, n) for m, p, n in proxy.bodies if m == "GET" and ".tar" in p]


@pytest.mark.slow
def test_s3_batches_equal_local_with_and_without_workers_one_exact_get_per_member(store_data, s3_server, s3_proxy):
    root, manifest = store_data
    upload(s3_server, root, s3_proxy.root)
    ref = list(LatentLoader([manifest], SIZES, root=root, seed=4, workers=0))
    s3_proxy.clear()
    got = list(LatentLoader([manifest], SIZES, root=root, shard_root=s3_proxy.root, seed=4, workers=0, fetch_threads=4))
    assert len(got) == len(ref) > 5
    for a, b in zip(got, ref):
        same(a, b)
    # one GET per member, a store sample's two members two GETs; bytes sent per byte used <= 1.05
    members = 2 * sum(len(b["clip_id"]) for b in got)
    sent = gets(s3_proxy)
    assert len(sent) == members
    used = 0
    for shard, offsets in (("shard", "shard_offset"), ("text_shard", "text_offset")):
        t = pq.read_table(manifest).to_pydict()
        size = {}
        for s in set(t[shard]):  # the members' sizes, by tarfile on the local copies (an independent reference)
            with tarfile.open(root / s) as tar:
                size.update({(s, m.offset_data): m.size for m in tar})
        sizes = {c: size[s, o] for c, s, o in zip(t["clip_id"], t[shard], t[offsets])}
        used += sum(sizes[c] for b in got for c in b["clip_id"])
    assert sum(n for _, _, n in sent) / used <= 1.05
    s3_proxy.clear()
    two = list(LatentLoader([manifest], SIZES, root=root, shard_root=s3_proxy.root, seed=4, workers=2))
    assert len(two) == len(ref)
    for a, b in zip(two, ref):
        same(a, b)
    assert len(gets(s3_proxy)) == members


@pytest.mark.slow
def test_s3_elastic_resume_mid_epoch_at_another_world_size_equals_local(store_data, s3_server, s3_proxy):
    root, manifest = store_data
    upload(s3_server, root, s3_proxy.root)
    two = [
        LatentLoader([manifest], SIZES, root=root, shard_root=s3_proxy.root, rank=r, world_size=2, seed=9)
        for r in range(2)
    ]
    for ld in two:
        it = iter(ld)
        for _ in range(3):
            next(it)
        it.close()
    state = two[0].state_dict()
    assert state["consumed"] == 6
    for r in range(3):
        local = LatentLoader([manifest], SIZES, root=root, rank=r, world_size=3, seed=9)
        remote = LatentLoader(
            [manifest], SIZES, root=root, shard_root=s3_proxy.root, rank=r, world_size=3, seed=9, workers=r % 2 * 2
        )
        local.load_state_dict(state)
        remote.load_state_dict(state)
        a, b = list(remote), list(local)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            same(x, y)


@pytest.mark.slow
def test_s3_faults_mid_body_short_body_and_503_give_identical_batches(store_data, s3_server, s3_proxy):
    root, manifest = store_data
    upload(s3_server, root, s3_proxy.root)
    ref = list(LatentLoader([manifest], SIZES, root=root, seed=2))

    def ranged(kind):
        return lambda m, p: m == "GET" and ".tar" in p and kind in p  # video or caption shards

    faults = [
        s3_proxy.add("reset", ranged("/s/"), times=3),
        s3_proxy.add("short", ranged("-text/"), times=3),
        s3_proxy.add("slowdown", ranged(".tar"), times=2),
        s3_proxy.add("slowdown", ranged(".tar"), times=1, retry_after=0),
    ]
    got = list(LatentLoader([manifest], SIZES, root=root, shard_root=s3_proxy.root, seed=2, fetch_threads=3))
    assert all(f.hits == f.times for f in faults)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        same(a, b)


def test_member_ends_bound_every_member_by_its_neighbour_or_the_tar_end(store_data):
    """The one-GET span of each member holds its header and all its data and at most 511 bytes of padding past
    it (sizes from tarfile, the shard's size from the file: independent of the code under test)."""
    root, manifest = store_data
    t = pq.read_table(manifest).to_pydict()
    urls = [f"s3://b/{s}" for s in t["shard"]]
    sizes = {f"s3://b/{s}": (root / s).stat().st_size for s in set(t["shard"])}
    ends = s3fetch.member_ends(urls + urls[:3], np.array(t["shard_offset"] + t["shard_offset"][:3]), sizes)
    assert (ends[-3:] == ends[:3]).all()  # two rows at one member (two views) share its span
    for s, o, e in zip(t["shard"], t["shard_offset"], ends):
        with tarfile.open(root / s) as tar:
            size = {m.offset_data: m.size for m in tar}[o]
        assert o + size <= e < o + size + 512
    assert (s3fetch.member_ends(["/x.tar", "s3://b/none.tar"], np.array([512, 512]), {}) == -1).all()


@pytest.mark.slow
def test_s3_shard_rewritten_since_the_manifest_is_one_line_and_a_missing_one_is_said_before_reading(
    store_data, s3_server, s3_root, tmp_path
):
    root, manifest = store_data
    upload(s3_server, root, s3_root)
    t = pq.read_table(manifest)
    moved = tmp_path / "moved.parquet"
    offsets = [o + 512 for o in t["shard_offset"].to_pylist()]
    pq.write_table(t.set_column(t.schema.get_field_index("shard_offset"), "shard_offset", [offsets]), moved)
    with pytest.raises(ValueError, match=r"no tar member starts at byte \d+ \(rewritten since the manifest"):
        list(LatentLoader([moved], SIZES, root=root, shard_root=s3_root, seed=1))
    first = t["shard"][0].as_py()
    bucket, _, prefix = s3_root[5:].partition("/")
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/{first}")
    with pytest.raises(ValueError, match=re.escape(f"latent shard {first} is missing")):
        LatentLoader([manifest], SIZES, root=root, shard_root=s3_root, seed=1)


@pytest.mark.parametrize(
    "override, line",
    [
        ("data.fetch_threads=0", "data.fetch_threads = 0: expected an integer in [1, 256]"),
        ("data.fetch_ahead=many", "data.fetch_ahead = 'many': expected an integer in [1, 100000]"),
        ("data.shard_root=s3://Bad_Bucket/x", "data.shard_root = 's3://Bad_Bucket/x': expected a folder, or s3://"),
    ],
)
def test_a_bad_loader_s3_setting_is_one_line_naming_the_key(override, line):
    from reelcache import UserError
    from reelcache.train.config import load_config

    with pytest.raises(UserError) as e:
        load_config(REPO / "configs/train/debug/stage1.toml", [override])
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


@pytest.mark.slow
def test_s3_local_cache_serves_a_second_epoch_without_a_get_and_stays_under_its_limit(
    store_data, s3_server, s3_proxy, tmp_path
):
    root, manifest = store_data
    upload(s3_server, root, s3_proxy.root)
    ref = list(LatentLoader([manifest], SIZES, root=root, seed=6))
    kw = dict(root=root, shard_root=s3_proxy.root, seed=6, cache_dir=tmp_path / "c")
    s3_proxy.clear()
    first = list(LatentLoader([manifest], SIZES, **kw, cache_gb=1.0))
    assert len(gets(s3_proxy)) == 2 * sum(len(b["clip_id"]) for b in first)
    s3_proxy.clear()
    again = list(LatentLoader([manifest], SIZES, **kw, cache_gb=1.0, workers=2))
    assert gets(s3_proxy) == []  # every member from the cache
    for a, b, c in zip(first, again, ref):
        same(a, c)
        same(b, c)
    limit = 600_000
    s3_proxy.clear()
    small = list(LatentLoader([manifest], SIZES, **kw, cache_gb=limit / 1e9))  # evicts, reads again, evicts
    assert len(gets(s3_proxy)) > 0
    for a, c in zip(small, ref):
        same(a, c)
    held = sum(p.stat().st_size for p in (tmp_path / "c").glob("*/*"))
    assert 0 < held <= limit


def test_a_fetcher_and_its_cache_survive_pickling_for_a_spawned_worker(tmp_path):
    import pickle

    f = pickle.loads(pickle.dumps(s3fetch.Fetcher(3, s3fetch.MemberCache(tmp_path, 1000), {"s3://b/x.tar": "e/1"})))
    assert (f.threads, f.cache.dir, f.cache.limit, f.versions) == (3, tmp_path, 1000, {"s3://b/x.tar": "e/1"})
    f.cache.put("s3://b/x.tar", "e/1", 512, b"abc")
    assert f.cache.get("s3://b/x.tar", "e/1", 512) == b"abc" and f.cache.get("s3://b/x.tar", "e/2", 512) is None


def test_loader_simulate_on_an_s3_root_equals_the_same_manifest_on_a_folder(
    store_data, s3_server, s3_root, tmp_path, capsys
):
    """`loader simulate --root s3://...` finds a manifest by name in the root's manifests/ (mirrored down, no shard
    read) and plans every rank's batches as it does on a folder holding the same manifest; a name the root does
    not have is one line."""
    from reelcache.cli import main

    _, manifest = store_data
    name = "sim-0123456789abcdef.parquet"
    local = tmp_path / "local"
    (local / "manifests").mkdir(parents=True)
    (local / "manifests" / name).write_bytes(manifest.read_bytes())
    bucket, _, prefix = s3_root[5:].partition("/")
    s3_server.client().upload_file(str(manifest), bucket, f"{prefix}/manifests/{name}")
    outs = {}
    for where, root in (("folder", str(local)), ("s3", s3_root)):
        outs[where] = tmp_path / f"{where}.parquet"
        args = [
            "loader",
            "simulate",
            "--root",
            root,
            "--manifest",
            "sim",
            "--buckets",
            str(REPO / "configs/buckets/tiny.toml"),
        ]
        assert main([*args, "--world-size", "3", "--seed", "5", "--epochs", "2", "--out", str(outs[where])]) == 0
    got, want = pq.read_table(outs["s3"]).to_pylist(), pq.read_table(outs["folder"]).to_pylist()
    assert got == want and len(want) >= 2 * 40
    capsys.readouterr()
    bad = [
        "loader",
        "simulate",
        "--root",
        s3_root,
        "--manifest",
        "nothere",
        "--buckets",
        str(REPO / "configs/buckets/tiny.toml"),
    ]
    assert main([*bad, "--world-size", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no manifest 'nothere'" in err[0], err
