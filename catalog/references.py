"""Which store entries something on the root names: what ``cache gc`` keeps and a takedown keeps the bytes of.

A store entry (cache/store.py) is named by a ``(shard, offset)`` pair in a cache's unit sidecars, in a frozen
cache plan (the entries its units will reuse) and in the manifests. Both deleters read all of them before
they delete anything, and stop with one line naming a file they cannot read and how it is written again.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from reelcache import UserError


def _pairs(table, shard: str, offset: str) -> set:
    if shard not in table.column_names or offset not in table.column_names:
        return set()
    return {(s, int(o)) for s, o in zip(table[shard].to_pylist(), table[offset].to_pylist()) if s is not None}


def read_or_say(root: Path, path: Path, read, who: str = "cache gc"):
    """`read(path)`, or a UserError naming a file `who` cannot read (before it deletes anything), and how
    that file is written again: gc and a takedown must know every reference to delete safely."""
    try:
        return read(path)
    except FileNotFoundError:
        raise  # gone since it was listed: the caller knows what that means
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
        raise UserError(f"{who}: {rel} is not readable parquet ({reason}); nothing was deleted: {again}") from None


def references(root: Path, exclude=(), who: str = "cache gc") -> set:
    """(shard, offset) of every store entry a cache's unit sidecars (``latents/<cache>/NNNNNN.parquet``), a
    frozen cache plan (``latents/<cache>/_plan/input.parquet``: the entries its units will reuse) or a manifest
    (``manifests/*.parquet``) names: its video latent, caption embedding, reused entry. Rows of the clips in
    `exclude` are left out (a takedown's own: what else still uses their entries)."""
    root, exclude = Path(root), sorted(set(exclude))
    refs: set = set()
    files = [*root.glob("latents/*/[0-9]*.parquet"), *root.glob("latents/*/_plan/input.parquet")]
    wanted = {"shard", "shard_offset", "text_shard", "text_offset", "reuse_shard", "reuse_offset"}
    wanted |= {"clip_id"} if exclude else set()

    def read(p):
        return pq.read_table(p, columns=[c for c in pq.read_schema(p).names if c in wanted])

    for p in files + sorted(root.glob("manifests/*.parquet")):
        t = read_or_say(root, p, read, who)
        if exclude and "clip_id" in t.column_names:
            t = t.filter(
                pc.invert(pc.fill_null(pc.is_in(t["clip_id"], value_set=pa.array(exclude, pa.string())), False))
            )
        refs |= _pairs(t, "shard", "shard_offset") | _pairs(t, "text_shard", "text_offset")
        refs |= _pairs(t, "reuse_shard", "reuse_offset")
    return refs
