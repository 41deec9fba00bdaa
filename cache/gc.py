"""``reelcache cache gc --root R [--delete]``: the store's entries that nothing references.

References: every cache's unit sidecars (``ROOT/latents/<cache>/NNNNNN.parquet``: shard/offset and
text_shard/text_offset of its rows), every cache's frozen plan (``_plan/input.parquet``: the entries
its units will reuse) and every manifest under ``ROOT/manifests``. An entry of a store index that
none of them names is garbage, and so is a store shard no index lists (a killed unit's). ``--delete``
removes each shard whose entries are all garbage and drops those entries from the indexes; a shard
that still holds a live entry is kept (counted in the report). Units that are running (their lease
exists) are skipped.

Units run while gc runs (a reference scan reads every sidecar, plan and manifest of the root: minutes on
a big one). gc never deletes what a unit published after gc started, by the order of its reads:

1. the store first: its shards are listed (name and identity: inode, size, mtime), the leases of their
   units checked, then the indexes read, and the leases checked again. A unit that held its lease at
   either check is left alone. A unit publishes its shards and indexes while it holds its lease and its
   sidecar before it lets the lease go, so a unit that held none at the second check has its sidecar in
   place before step 2 reads it (or failed, and removed its files itself). A unit that finished between the
   listing and the first check (its shards listed, its index not yet) held it at neither: the indexes read
   for orphans are those there after that check, so its index names its shards, which are no orphans;
2. then the references;
3. only what step 1 listed can be deleted, and only while it is the file step 1 saw (same inode, size
   and mtime): a shard or index published after the listing, also one under a listed name (a re-run
   of a killed unit writes the same names), is not touched. An index is rewritten only if unchanged.

Why not an age cutoff: a shard's mtime is its last write, which may come before gc starts while its
rename into place comes after. Why not gc and units excluding each other: a big cache job always has
units running, so gc would never start (or every unit would wait for a scan of minutes). A plan made
while gc runs may reuse an entry gc then deletes: run ``cache plan`` and ``cache gc --delete`` apart.

A root in S3 (``s3://bucket/prefix``, docs/STORAGE.md) goes through the same steps (``collect``, ``gc``) over
its objects (``Bucket``): the store is listed (paginated ListObjectsV2; an object's identity is its ETag and
size), the indexes and then the references (sidecars, frozen plans, manifests) are brought into the root's local
mirror (base/s3.py: ``sync_down``) and read there; a unit is running while its lease object is held by a live run
(a stale lease, its holder gone, is no run); a deletion is a DELETE with ``If-Match`` on the ETag the listing saw
and an index is rewritten by a PUT with ``If-Match``, so an object published since under a listed name is not
touched; a shard's entries are counted from its tar headers read by ranged reads (base/s3io.py). gc also lists
the root's incomplete multipart uploads (a killed unit's shard uploads) and, with ``--delete``, aborts those of
units that are not running; those of a running unit, and uploads that are no unit's, are left alone (listed
first, then the leases checked: an upload started after the listing is not touched).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.base import s3
from reelcache.base.shards import HOLE
from reelcache.cache.store import TEXT_INDEX, VIDEO_INDEX
from reelcache.catalog.references import read_or_say as _read
from reelcache.catalog.references import references
from reelcache.files import atomic_path
from reelcache.log import say

_SHARD = re.compile(r"store/[^/]+/[^/]+/[^/]+\.tar")
_INDEX = re.compile(r"store/(video|text)/[^/]+/[^/]+\.parquet")
_REFS = re.compile(r"latents/[^/]+/([0-9]+\.parquet|_plan/input\.parquet)|manifests/[^/]+\.parquet")
_REFS_UNDER = ("latents/", "manifests/")  # what a root in S3 lists for them (base/s3.py: sync_down's under)


def _unit(rel: str) -> tuple[str, str]:
    """(cache, unit) of a store shard ``store/<kind>/<cache>/<unit>-<plan>-KK.tar`` or its index
    ``...<unit>-<plan>.parquet``."""
    parts = rel.split("/")
    return parts[-2], parts[-1].split("-", 1)[0]


def _identity(path: Path):
    """Which file `path` names now (None: none): a file renamed over it is another one."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class Folder:
    """The store and references of a root that is a folder: files, read where they are."""

    def __init__(self, root):
        self.root = self.local = Path(root)

    def listing(self) -> dict:
        """rel -> identity of every store shard and index."""
        files = [*(self.root / "store").glob("*/*/*.tar"), *sorted((self.root / "store").glob("*/*/*.parquet"))]
        return {
            p.relative_to(self.root).as_posix(): _identity(p)
            for p in files
            if _SHARD.fullmatch(p.relative_to(self.root).as_posix())
            or _INDEX.fullmatch(p.relative_to(self.root).as_posix())
        }

    def running(self, units) -> set:
        """The units among `units` that hold a lease now (they are being written)."""
        return {(c, u) for c, u in set(units) if (self.root / "latents" / c / f"{u}.lease").exists()}

    def fetch_indexes(self, seen: dict) -> list[str]:
        """The store's indexes there now (after the listing and the first lease check), their rels."""
        return [
            r
            for p in (self.root / "store").glob("*/*/*.parquet")
            if _INDEX.fullmatch(r := p.relative_to(self.root).as_posix())
        ]

    def fetch_references(self, units=()) -> None:
        pass

    def size(self, rel: str, ident) -> int:
        return ident[1]

    def remove(self, rel: str, ident) -> bool:
        """Delete `rel` if it is still the file the listing saw (a re-run may have published its name since)."""
        p = self.root / rel
        if _identity(p) != ident:
            return False
        p.unlink(missing_ok=True)
        return True

    def rewrite(self, rel: str, ident, table) -> bool:
        """The index `rel` as `table` (no rows: removed), if it is still the file the listing saw."""
        p = self.root / rel
        if _identity(p) != ident:
            return False  # published again since the listing: it names the new shards, not those deleted
        if table.num_rows == 0:
            p.unlink()
        else:
            with atomic_path(p) as tmp:
                pq.write_table(table, tmp)
        return True

    def entries(self, rel: str, ident) -> int:
        import tarfile

        with tarfile.open(self.root / rel) as tf:
            return sum(1 for m in tf if m.isfile() and m.name != HOLE)

    def uploads(self) -> list:
        return []


class Bucket(Folder):
    """The store and references of a root in S3: objects listed and deleted there, indexes and references read
    from the root's local mirror (module docstring)."""

    def __init__(self, root):
        self.url = s3.parse(root)
        self.root = self.local = s3.mirror_dir(root)

    def listing(self) -> dict:
        base = len(self.url.key) + 1 if self.url.key else 0
        out = {}
        for o in s3.list_objects(self.url / "store/"):
            rel = o["Key"][base:]
            if _SHARD.fullmatch(rel) or _INDEX.fullmatch(rel):
                out[rel] = (o["ETag"], int(o["Size"]))
        return out

    def running(self, units) -> set:
        from reelcache.base.lease import is_stale, read_holder

        out = set()
        for c, u in set(units):
            h = read_holder(self.url / "latents" / c / f"{u}.lease")
            if h is not None and not is_stale(h):
                out.add((c, u))
        return out

    def fetch_indexes(self, seen: dict) -> list[str]:
        """The store's indexes, mirrored now (listed again after the first lease check), their rels."""
        files = s3.sync_down(self.url, self.local, lambda rel: _INDEX.fullmatch(rel) is not None, under=("store/",))
        return [p.relative_to(self.local).as_posix() for p in files]

    def fetch_references(self, units=()) -> None:
        """The references mirrored; and the sidecar of each unit in `units` (those with a store index) that the
        listing did not show is looked for by a HEAD: a briefly stale listing must not hide what a unit's own
        entries are referenced by."""
        s3.sync_down(self.url, self.local, lambda rel: _REFS.fullmatch(rel) is not None, under=_REFS_UNDER)
        for c, u in sorted(set(units)):
            rel = f"latents/{c}/{u}.parquet"
            if not (self.local / rel).exists() and s3.head(self.url / rel) is not None:
                (self.local / rel).parent.mkdir(parents=True, exist_ok=True)
                s3.download(self.url / rel, self.local / rel)

    def remove(self, rel: str, ident) -> bool:
        try:
            s3.delete(self.url / rel, if_match=ident[0])
        except s3.PreconditionFailed:
            return False
        (self.local / rel).unlink(missing_ok=True)
        return True

    def rewrite(self, rel: str, ident, table) -> bool:
        if table.num_rows == 0:
            return self.remove(rel, ident)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        try:
            s3.put(self.url / rel, sink.getvalue().to_pybytes(), if_match=ident[0])
        except s3.PreconditionFailed:
            return False
        (self.local / rel).unlink(missing_ok=True)  # brought down again by the next sync
        return True

    def entries(self, rel: str, ident) -> int:
        import tarfile

        from reelcache.base.s3io import S3File

        with tarfile.open(fileobj=S3File(self.url / rel, ident[1]), mode="r:") as tf:
            return sum(1 for m in tf if m.isfile() and m.name != HOLE)

    def uploads(self) -> list:
        return s3.list_uploads(self.url / "")


def _store(root):
    return Bucket(root) if s3.is_url(root) else Folder(root)


def _upload_unit(url: s3.Url, key: str) -> tuple[s3.Url, str] | None:
    """The lease of the unit an incomplete upload is a file of, and the unit's name; None: no unit's."""
    rel = key[len(url.key) + 1 :] if url.key else key
    if m := re.fullmatch(r"raw/([^/]+)/([0-9]+)-[0-9]+\.tar", rel):  # an ingest unit's shard
        return url / f"raw/{m[1]}/{m[2]}.lease", f"{m[1]}/{m[2]}"
    if m := re.fullmatch(r"store/(?:video|text)/([^/]+)/([0-9]+)-[^/]+", rel):  # a cache unit's store shard
        return url / f"latents/{m[1]}/{m[2]}.lease", f"{m[1]}/{m[2]}"
    if m := re.fullmatch(r"(raw|latents)/([^/]+)/([0-9]+)\.parquet", rel):  # a unit's sidecar
        return url / f"{m[1]}/{m[2]}/{m[3]}.lease", f"{m[2]}/{m[3]}"
    return None


def collect(root) -> dict:
    """{'garbage': [(kind, index, shard, offset, bytes)], 'orphans': [rels], 'live': n, 'seen': {rel: identity}}:
    the store as listed before the references were read (module docstring); rels are root-relative."""
    store = _store(root)
    seen = store.listing()
    running = store.running(map(_unit, seen))
    present = store.fetch_indexes(seen)
    tables = []
    for rel in sorted(r for r in seen if r.endswith(".parquet")):
        kind = rel.split("/")[1]
        try:
            t = _read(
                store.local, store.local / rel, lambda p: pq.read_table(p, columns=["shard", "shard_offset", "bytes"])
            )
            tables.append((kind, rel, t))
        except FileNotFoundError:  # removed since listed (a failed unit's): nothing of it to collect
            continue
    running |= store.running(map(_unit, seen))  # after the indexes were read: see 1. above
    # an index published since the listing (its unit finished between the listing and the first lease check, so
    # no check saw it running): its entries are not collected, but its shards, listed before it, are no orphans
    listed = set()
    for rel in sorted(set(present) - set(seen)):
        try:
            t = _read(store.local, store.local / rel, lambda p: pq.read_table(p, columns=["shard"]))
        except FileNotFoundError:
            continue
        listed.update(t["shard"].to_pylist())
    store.fetch_references(_unit(t[1]) for t in tables)
    refs = references(store.local)
    garbage, live = [], 0
    for kind, index, t in tables:
        if _unit(index) in running:
            continue
        for sh, o, n in zip(*(t[c].to_pylist() for c in t.column_names)):
            listed.add(sh)
            if (sh, o) in refs:
                live += 1
            elif sh in seen:  # an entry whose shard came after the listing is new: not garbage
                garbage.append((kind, index, sh, o, n))
    orphans = [r for r in seen if r.endswith(".tar") and r not in listed and _unit(r) not in running]
    return {"garbage": garbage, "orphans": orphans, "live": live, "seen": seen, "store": store}


def gc(root, delete: bool = False) -> dict:
    found = collect(root)
    store, seen = found["store"], found["seen"]
    by_shard = defaultdict(list)
    for g in found["garbage"]:
        by_shard[g[2]].append(g)
    live_shards = {sh for sh in by_shard if store.entries(sh, seen[sh]) > len(by_shard[sh])}
    total = sum(g[4] for g in found["garbage"]) + sum(store.size(r, seen[r]) for r in found["orphans"])
    for kind in ("video", "text"):
        mine = [g for g in found["garbage"] if g[0] == kind]
        say(f"cache gc: {len(mine)} unreferenced {kind} entries, {sum(g[4] for g in mine):,} bytes")
    say(f"cache gc: {len(found['orphans'])} store shards no index lists (killed units); {total:,} bytes in all")
    kept = sum(g[4] for sh in live_shards for g in by_shard[sh])
    if kept:
        say(f"cache gc: {kept:,} of those bytes share shards with live entries and stay until those go")
    uploads = _uploads(root, store)
    out = {"entries": len(found["garbage"]), "bytes": total, "orphans": len(found["orphans"]), "deleted": 0}
    out["uploads"] = len(uploads["dead"])
    if not delete:
        return out
    gone = {sh for sh in sorted(by_shard) if sh not in live_shards and store.remove(sh, seen[sh])}
    orphans = sum(store.remove(r, seen[r]) for r in found["orphans"])
    for index in {g[1] for g in found["garbage"] if g[2] in gone}:
        p = store.local / index
        if not p.exists():
            continue
        t = pq.read_table(p)
        t = t.filter(pa.array([sh not in gone for sh in t["shard"].to_pylist()]))
        store.rewrite(index, seen[index], t.cast(VIDEO_INDEX if "video_key" in t.column_names else TEXT_INDEX))
    aborted = 0
    for up in uploads["dead"]:
        s3.abort_upload(store.url.bucket, up["Key"], up["UploadId"])
        aborted += 1
    say(f"cache gc: deleted {len(gone) + orphans} shards" + (f", aborted {aborted} uploads" if aborted else ""))
    out.update(deleted=len(gone), aborted=aborted)
    return out


def _uploads(root, store) -> dict:
    """The root's incomplete multipart uploads, listed first and then split by their units' leases: 'dead' (no
    unit holds a live lease: a killed run's), 'running' and 'other' (no unit's file)."""
    found = store.uploads()
    out = {"dead": [], "running": [], "other": []}
    if not found:
        return out
    from reelcache.base.lease import is_stale, read_holder

    for up in found:
        unit = _upload_unit(store.url, up["Key"])
        if unit is None:
            out["other"].append(up)
            continue
        h = read_holder(unit[0])
        out["running" if h is not None and not is_stale(h) else "dead"].append(up)
    size = lambda ups: ", ".join(u["Key"][len(store.url.key) + 1 :] for u in ups[:3]) + (" ..." if len(ups) > 3 else "")  # noqa: E731
    say(
        f"cache gc: {len(found)} incomplete multipart uploads under {root}: {len(out['dead'])} of units not running"
        + (f" ({size(out['dead'])})" if out["dead"] else "")
        + f", {len(out['running'])} of running units (left alone)"
        + (f", {len(out['other'])} of no unit (left alone: {size(out['other'])})" if out["other"] else "")
    )
    return out


def has_live(root: Path, shard: str, garbage: int) -> bool:
    """A shard holds entries besides its `garbage` ones (counted from its tar's members; a takedown's hole,
    lineage/holes.py, is no entry)."""
    return Folder(root).entries(shard, None) > garbage
