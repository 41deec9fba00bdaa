"""``reelcache cache gc --root R [--delete]``: the store's entries that nothing references.

References: every cache's unit sidecars (``ROOT/latents/<cache>/NNNNNN.parquet``: shard/offset and
text_shard/text_offset of its rows), every cache's frozen plan (``_plan/input.parquet``: the entries
its units will reuse) and every manifest under ``ROOT/manifests``. An entry of a store index that
none of them names is garbage, and so is a store shard no index lists (a killed unit's). ``--delete``
removes each shard whose entries are all garbage and drops those entries from the indexes; a shard
that still holds a live entry is kept (counted in the report). Units that are running (their lease
exists) are skipped.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.cache.store import TEXT_INDEX, VIDEO_INDEX
from reelcache.catalog.shards import atomic_path
from reelcache.progress import say


def _pairs(table, shard: str, offset: str) -> set:
    if shard not in table.column_names or offset not in table.column_names:
        return set()
    return {(s, int(o)) for s, o in zip(table[shard].to_pylist(), table[offset].to_pylist()) if s is not None}


def _read(root: Path, path: Path, read):
    """`read(path)`, or a UserError naming a file gc cannot read (before it deletes anything), and how
    that file is written again: gc must know every reference and every index entry to delete safely."""
    try:
        return read(path)
    except (OSError, pa.ArrowException) as e:
        rel = path.relative_to(root)
        if rel.parts[0] == "manifests":
            again = "make that manifest again (`reelcache catalog manifest`) or delete it"
        else:  # a store index (store/<kind>/<cache>/NNNNNN-<plan>.parquet), a unit sidecar or a frozen plan
            cache, unit = rel.parts[-2] if rel.parts[-2] != "_plan" else rel.parts[-3], rel.stem[:6]
            again = (
                f"restore it, or write it again: delete latents/{cache}/{unit}.parquet and run "
                f"`reelcache cache run --root {root} {cache}/{unit}`"
                if unit.isdigit()
                else f"restore it, or re-plan cache {cache!r} (`reelcache cache plan`)"
            )
        reason = str(e).split(": ", 1)[-1].split(". ")[0] if isinstance(e, pa.ArrowException) else e.strerror or e
        raise UserError(f"cache gc: {rel} is not readable parquet ({reason}); nothing was deleted: {again}") from None


def references(root: Path) -> set:
    """(shard, offset) of every store entry a cache, a plan or a manifest names."""
    refs: set = set()
    files = [*root.glob("latents/*/[0-9]*.parquet"), *root.glob("latents/*/_plan/input.parquet")]
    wanted = {"shard", "shard_offset", "text_shard", "text_offset", "reuse_shard", "reuse_offset"}
    for p in files + sorted(root.glob("manifests/*.parquet")):
        t = _read(root, p, lambda p: pq.read_table(p, columns=[c for c in pq.read_schema(p).names if c in wanted]))
        refs |= _pairs(t, "shard", "shard_offset") | _pairs(t, "text_shard", "text_offset")
        refs |= _pairs(t, "reuse_shard", "reuse_offset")
    return refs


def _running(root: Path, index: Path) -> bool:
    """The index's unit holds a lease (it is being written)."""
    return (root / "latents" / index.parent.name / f"{index.stem.split('-')[0]}.lease").exists()


def collect(root) -> dict:
    """{'garbage': [(kind, index, shard, offset, bytes)], 'orphans': [paths], 'kept_bytes': n, 'live': n}."""
    root = Path(root)
    refs = references(root)
    garbage, live, listed = [], 0, set()
    for kind in ("video", "text"):
        for index in sorted((root / "store" / kind).glob("*/*.parquet")):
            if _running(root, index):
                listed |= {str(p.relative_to(root)) for p in index.parent.glob(f"{index.stem}-*.tar")}
                continue
            t = _read(root, index, lambda p: pq.read_table(p, columns=["shard", "shard_offset", "bytes"]))
            for s, o, n in zip(*(t[c].to_pylist() for c in t.column_names)):
                listed.add(s)
                if (s, o) in refs:
                    live += 1
                else:
                    garbage.append((kind, index, s, o, n))
    orphans = [
        p
        for p in sorted((root / "store").glob("*/*/*.tar"))
        if str(p.relative_to(root)) not in listed and not _running(root, p.with_name(p.name.rsplit("-", 1)[0]))
    ]
    return {"garbage": garbage, "orphans": orphans, "live": live}


def gc(root, delete: bool = False) -> dict:
    root = Path(root)
    found = collect(root)
    by_shard = defaultdict(list)
    for g in found["garbage"]:
        by_shard[g[2]].append(g)
    live_shards = {s for s in by_shard if _has_live(root, s, len(by_shard[s]))}
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
    gone = {s for s in by_shard if s not in live_shards}
    for s in sorted(gone):
        (root / s).unlink(missing_ok=True)
    for p in found["orphans"]:
        p.unlink(missing_ok=True)
    for index in {g[1] for g in found["garbage"] if g[2] in gone}:
        t = pq.read_table(index)
        t = t.filter(pa.array([s not in gone for s in t["shard"].to_pylist()]))
        if t.num_rows == 0:
            index.unlink()
        else:
            with atomic_path(index) as tmp:
                pq.write_table(t.cast(VIDEO_INDEX if "video_key" in t.column_names else TEXT_INDEX), tmp)
    say(f"cache gc: deleted {len(gone) + len(found['orphans'])} shards")
    return {"entries": len(found["garbage"]), "bytes": total, "orphans": len(found["orphans"]), "deleted": len(gone)}


def _has_live(root: Path, shard: str, garbage: int) -> bool:
    """A shard holds entries besides its `garbage` ones (counted from its tar's members)."""
    import tarfile

    with tarfile.open(root / shard) as tf:
        return sum(1 for m in tf if m.isfile()) > garbage
