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
   place before step 2 reads it (or failed, and removed its files itself);
2. then the references;
3. only what step 1 listed can be deleted, and only while it is the file step 1 saw (same inode, size
   and mtime): a shard or index published after the listing, also one under a listed name (a re-run
   of a killed unit writes the same names), is not touched. An index is rewritten only if unchanged.

Why not an age cutoff: a shard's mtime is its last write, which may come before gc starts while its
rename into place comes after. Why not gc and units excluding each other: a big cache job always has
units running, so gc would never start (or every unit would wait for a scan of minutes). A plan made
while gc runs may reuse an entry gc then deletes: run ``cache plan`` and ``cache gc --delete`` apart.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.base.shards import HOLE
from reelcache.cache.store import TEXT_INDEX, VIDEO_INDEX
from reelcache.catalog.references import read_or_say as _read
from reelcache.catalog.references import references
from reelcache.files import atomic_path
from reelcache.log import say


def _unit(path: Path) -> tuple[str, str]:
    """(cache, unit) of a store shard ``<unit>-<plan>-KK.tar`` or index ``<unit>-<plan>.parquet``."""
    return path.parent.name, path.name.split("-", 1)[0]


def _running(root: Path, units) -> set:
    """The units among `units` that hold a lease now (they are being written)."""
    return {(c, u) for c, u in set(units) if (root / "latents" / c / f"{u}.lease").exists()}


def _identity(path: Path):
    """Which file `path` names now (None: none): a file renamed over it is another one."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def collect(root) -> dict:
    """{'garbage': [(kind, index, shard, offset, bytes)], 'orphans': [paths], 'live': n, 'seen': {path:
    identity}}: the store as listed before the references were read (module docstring)."""
    root = Path(root)
    seen = {p: _identity(p) for p in sorted((root / "store").glob("*/*/*.tar"))}
    running = _running(root, map(_unit, seen))
    tables = []
    for kind in ("video", "text"):
        for index in sorted((root / "store" / kind).glob("*/*.parquet")):
            seen[index] = _identity(index)
            try:
                t = _read(root, index, lambda p: pq.read_table(p, columns=["shard", "shard_offset", "bytes"]))
                tables.append((kind, index, t))
            except FileNotFoundError:  # removed since listed (a failed unit's): nothing of it to collect
                continue
    running |= _running(root, map(_unit, seen))  # after the indexes were read: see 1. above
    refs = references(root)
    garbage, live, listed = [], 0, set()
    for kind, index, t in tables:
        if _unit(index) in running:
            continue
        for s, o, n in zip(*(t[c].to_pylist() for c in t.column_names)):
            listed.add(s)
            if (s, o) in refs:
                live += 1
            elif root / s in seen:  # an entry whose shard came after the listing is new: not garbage
                garbage.append((kind, index, s, o, n))
    orphans = [
        p for p in seen if p.suffix == ".tar" and str(p.relative_to(root)) not in listed and _unit(p) not in running
    ]
    return {"garbage": garbage, "orphans": orphans, "live": live, "seen": seen}


def gc(root, delete: bool = False) -> dict:
    root = Path(root)
    found = collect(root)
    by_shard = defaultdict(list)
    for g in found["garbage"]:
        by_shard[g[2]].append(g)
    live_shards = {s for s in by_shard if has_live(root, s, len(by_shard[s]))}
    total = sum(g[4] for g in found["garbage"]) + sum(p.stat().st_size for p in found["orphans"])
    for kind in ("video", "text"):
        mine = [g for g in found["garbage"] if g[0] == kind]
        say(f"cache gc: {len(mine)} unreferenced {kind} entries, {sum(g[4] for g in mine):,} bytes")
    say(f"cache gc: {len(found['orphans'])} store shards no index lists (killed units); {total:,} bytes in all")
    kept = sum(g[4] for s in live_shards for g in by_shard[s])
    if kept:
        say(f"cache gc: {kept:,} of those bytes share shards with live entries and stay until those go")
    if not delete:
        return {"entries": len(found["garbage"]), "bytes": total, "orphans": len(found["orphans"]), "deleted": 0}
    seen = found["seen"]

    def remove(p: Path) -> bool:
        """Delete `p` if it is still the file the listing saw (a re-run may have published its name since)."""
        if _identity(p) != seen.get(p):
            return False
        p.unlink(missing_ok=True)
        return True

    gone = {s for s in sorted(by_shard) if s not in live_shards and remove(root / s)}
    orphans = sum(remove(p) for p in found["orphans"])
    for index in {g[1] for g in found["garbage"] if g[2] in gone}:
        if _identity(index) != seen.get(index):
            continue  # published again since the listing: it names the new shards, not those deleted
        t = pq.read_table(index)
        t = t.filter(pa.array([s not in gone for s in t["shard"].to_pylist()]))
        if t.num_rows == 0:
            index.unlink()
        else:
            with atomic_path(index) as tmp:
                pq.write_table(t.cast(VIDEO_INDEX if "video_key" in t.column_names else TEXT_INDEX), tmp)
    say(f"cache gc: deleted {len(gone) + orphans} shards")
    return {"entries": len(found["garbage"]), "bytes": total, "orphans": len(found["orphans"]), "deleted": len(gone)}


def has_live(root: Path, shard: str, garbage: int) -> bool:
    """A shard holds entries besides its `garbage` ones (counted from its tar's members; a takedown's hole,
    lineage/holes.py, is no entry)."""
    import tarfile

    with tarfile.open(root / shard) as tf:
        return sum(1 for m in tf if m.isfile() and m.name != HOLE) > garbage
