"""Which clips a `lineage` or `takedown` is about: clip ids, a SQL condition, a file of ids, or a video file.

``--like VIDEO_FILE`` finds the clips whose raw bytes are that file's (a removal request comes as a file or
a link, not as a clip id): its content hash (base/shards.py: content_hash) against ``clips.content_hash``;
clips ingested before the catalog had that column are hashed from their raw shard members, only those of
the file's exact size.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from reelcache import UserError
from reelcache.base.shards import content_hash
from reelcache.catalog.sql import check_where, where_sql


def read_id_file(path) -> list[str]:
    """One clip id a line; blank lines and `#` comments are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--file {path}: cannot read it as text ({e})") from None
    ids = [ln.split("#", 1)[0].strip() for ln in lines]
    return [i for i in ids if i]


def like(con, root: Path, video) -> list[str]:
    """Clip ids whose raw bytes are the file `video`'s."""
    try:
        h = content_hash(video)
        size = Path(video).stat().st_size
    except OSError as e:
        raise UserError(f"--like {video}: cannot read it ({e})") from None
    found = [r[0] for r in con.execute("SELECT clip_id FROM clips WHERE content_hash = ? ORDER BY 1", [h]).fetchall()]
    for cid, shard, off in con.execute(
        "SELECT clip_id, shard, shard_offset FROM clips WHERE content_hash IS NULL AND shard IS NOT NULL "
        "AND file_size = ? ORDER BY 1",
        [size],
    ).fetchall():
        try:
            if content_hash(root / shard, off, size) == h:
                found.append(cid)
        except OSError:
            continue  # a shard that cannot be read: not this file, as far as we can tell
    return sorted(found)


def select(con, root, ids=(), where: str | None = None, file=None, like_file=None) -> list[str]:
    """The selected clip ids (sorted, unique), every id checked against the catalog before any work:
    an unknown id is one line naming it."""
    root = Path(root)
    given = [x is not None and x != [] and x != () for x in (ids, where, file, like_file)]
    if sum(given) != 1:
        raise UserError("give the clips one way: CLIP_ID ..., --where SQL, --file LIST or --like VIDEO_FILE")
    if where is not None:
        where = check_where(where)
        try:
            rows = con.execute(f"SELECT clip_id FROM clips WHERE {where_sql(where)} ORDER BY 1").fetchall()
        except Exception as e:  # duckdb.Error: a column that does not exist, a type mismatch
            raise UserError(f"--where {where!r} failed: {str(e).splitlines()[0]}") from None
        out = [r[0] for r in rows]
        if not out:
            raise UserError(f"no clips match --where {where!r}")
        return out
    if like_file is not None:
        out = like(con, root, like_file)
        if not out:
            raise UserError(f"--like {like_file}: no clip of this root has the same bytes (content hash)")
        return out
    wanted = sorted(set(read_id_file(file) if file is not None else ids))
    if not wanted:
        raise UserError(f"--file {file}: no clip ids in it (one a line)")
    con.register("_wanted", pa.table({"clip_id": wanted}))
    try:
        known = {r[0] for r in con.execute("SELECT clip_id FROM clips SEMI JOIN _wanted USING (clip_id)").fetchall()}
    finally:
        con.unregister("_wanted")
    if missing := [c for c in wanted if c not in known]:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise UserError(f"no clip {', '.join(map(repr, missing[:3]))}{more} in the catalog of {root}")
    return wanted
