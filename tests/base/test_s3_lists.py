"""What each reader of a root in S3 lists (base/s3.py: ``sync_down``'s ``under``), against the real SeaweedFS
through the fault proxy (tests/s3_local.py: FaultProxy, which records every request): a root holds ~100k store
objects and the runs' consumed logs (tens of thousands of parts a run), so each caller lists only the folders it
reads. For each caller: the listings sent are exactly the folders named here (the reference, written out by hand
from what the caller globs afterwards), an object outside them is neither listed nor fetched, and every file the
caller reads is in its mirror."""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from reelcache.base import s3

CONSUMED = "runs/r1/consumed/rank00000-000000.parquet"  # a run's consumed-log part: tens of thousands a run
OUTSIDE = "zz/x.parquet"  # in no folder any caller reads

# Every object of the test root, and which callers read it (mirror it).
ROOT = {
    "raw/openvid/000000.parquet": {"merge", "takedown"},
    "raw/openvid/000000-00.tar": set(),
    "raw/openvid/_plan/plan.json": {"ingest_plan"},
    "raw/openvid/_plan/input.parquet": {"ingest_plan"},
    "latents/c1/000000.parquet": {"merge", "gc_refs", "takedown", "cache_plan"},
    "latents/c1/cache.json": {"cache_plan", "view"},
    "latents/c1/_plan/plan.json": {"cache_plan", "view"},
    "latents/c1/_plan/input.parquet": {"gc_refs", "takedown", "cache_plan"},
    "latents/c2/000001.parquet": {"merge", "gc_refs", "takedown"},
    "store/video/c1/000000-p-00.tar": set(),
    "store/video/c1/000000-p.parquet": {"gc_indexes", "takedown", "cache_plan"},
    "store/text/c1/000000-p-00.tar": set(),
    "store/text/c1/000000-p.parquet": {"merge", "gc_indexes", "takedown", "cache_plan"},
    "manifests/m-abc.parquet": {"gc_refs", "takedown", "cache_plan", "run_inputs", "view"},
    "manifests/m-abc.json": {"takedown", "run_inputs", "view"},
    "withdrawn/t1.parquet": {"merge", "takedown", "run_inputs"},
    "withdrawn/t1.json": {"takedown"},
    CONSUMED: {"takedown"},
    "runs/r1/ckpt-00000004/state.json": {"takedown"},
    "runs/r1/metrics/rank00000.parquet": set(),
    OUTSIDE: set(),
}

# caller -> the sub-prefixes of the root it lists
LISTED = {
    "merge": {"raw/", "latents/", "store/text/", "withdrawn/"},
    "gc_indexes": {"store/"},
    "gc_refs": {"latents/", "manifests/"},
    "takedown": {"raw/", "latents/", "store/", "withdrawn/", "manifests/", "runs/"},
    "cache_plan": {"manifests/", "store/", "latents/c1/"},
    "run_inputs": {"manifests/", "withdrawn/"},
    "view": {"manifests/", "latents/"},
    "ingest_plan": {"raw/openvid/_plan/"},
}


def _sync(caller: str, root: str) -> None:
    if caller == "merge":
        from reelcache.catalog.merge import local_root

        local_root(root)
    elif caller == "gc_indexes":
        from reelcache.cache.gc import Bucket

        Bucket(root).fetch_indexes({})
    elif caller == "gc_refs":
        from reelcache.cache.gc import Bucket

        Bucket(root).fetch_references()
    elif caller == "takedown":
        from reelcache.lineage.takedown import Files

        Files(root).sync()
    elif caller == "cache_plan":
        from reelcache.cache.plan import local_root

        local_root(root, "c1")
    elif caller == "run_inputs":
        from reelcache.train.runfiles import mirrored_inputs

        mirrored_inputs(root)
    elif caller == "view":
        from reelcache.view.server import view_root

        view_root(root)
    elif caller == "ingest_plan":
        from reelcache.ingest.plan import sync_plan

        sync_plan(root, "openvid")


def _upload(s3_server, root: str) -> None:
    u, c = s3.parse(root), s3_server.client()
    for rel in ROOT:
        c.put_object(Bucket=u.bucket, Key=f"{u.key}/{rel}", Body=rel.encode())


def _seen(proxy, root: str) -> tuple[set[str], set[str]]:
    """(the sub-prefixes of `root` listed, the objects of `root` read by a GET) in the proxy's requests."""
    u = s3.parse(root)
    listed, got = set(), set()
    for method, path in proxy.requests:
        parts = urlsplit(path)
        q = parse_qs(parts.query)
        if method == "GET" and "list-type" in q:
            prefix = q.get("prefix", [""])[0]
            assert prefix.startswith(f"{u.key}/"), f"a listing of {prefix!r}, above the root"
            listed.add(prefix[len(u.key) + 1 :])
        elif method == "GET" and "uploads" not in q:  # GetObject (botocore may add ?x-id=GetObject)
            key = unquote(parts.path).split("/", 2)[2]
            if key.startswith(f"{u.key}/"):
                got.add(key[len(u.key) + 1 :])
    return listed, got


@pytest.mark.parametrize("caller", sorted(LISTED))
def test_each_caller_lists_only_what_it_reads(caller, s3_server, s3_proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    root = s3_proxy.root
    _upload(s3_server, root)
    s3_proxy.clear()
    _sync(caller, root)
    listed, got = _seen(s3_proxy, root)
    assert listed == LISTED[caller]
    needed = {rel for rel, who in ROOT.items() if caller in who}
    local = s3.mirror_dir(root)
    mirrored = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    assert needed <= mirrored, f"{caller} did not mirror {sorted(needed - mirrored)}"
    assert {r for r in mirrored if r in ROOT} == needed  # nothing of the root it does not read
    assert got == needed  # each object it reads fetched once, nothing else
    for rel in {OUTSIDE, CONSUMED} - needed:
        assert not any(rel.startswith(p) for p in listed), f"{caller} listed {rel}"


def test_sync_down_under_prunes_only_what_it_listed(s3_server, s3_proxy, tmp_path):
    """A mirrored file under a folder not listed is left alone (no HEAD, not removed): it was not listed, so its
    absence from the listing says nothing; one under a listed folder whose object is gone is removed."""
    root = s3_proxy.root
    _upload(s3_server, root)
    local = tmp_path / "m"
    for rel in ("manifests/gone.parquet", "runs/r9/consumed/rank00000-000009.parquet"):
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(b"left")
    s3_proxy.clear()
    files = s3.sync_down(root, local, lambda rel: rel.endswith(".parquet"), under=("manifests/", "withdrawn/"))
    rels = sorted(p.relative_to(local).as_posix() for p in files)
    assert rels == ["manifests/m-abc.parquet", "withdrawn/t1.parquet"]
    assert not (local / "manifests/gone.parquet").exists()
    assert (local / "runs/r9/consumed/rank00000-000009.parquet").read_bytes() == b"left"
    heads = [p for m, p in s3_proxy.requests if m == "HEAD"]
    assert len(heads) == 1 and heads[0].endswith("/manifests/gone.parquet"), heads
    with pytest.raises(ValueError, match="under='/runs/'"):
        s3.sync_down(root, local, lambda rel: True, under=("/runs/",))
