"""``reelcache takedown``: withdraw clips from a root, everywhere, and name the checkpoints that saw them.

A dry run by default: what would be removed (the clips, with every other clip of the same video; their raw
members and bytes; their latents and caption embeddings nothing else references: cache gc's references,
catalog/references.py, the withdrawn clips' own rows left out), and the manifests and runs that hold them.
``--apply`` holds the root's takedown lease (one at a time), finishes unfinished journals, merges the catalog
(a copy of the video in a unit not merged yet is found too) and plans; then:

1. the journal ``ROOT/withdrawn/<id>.json`` is written (atomically): the clips and every span to remove,
   computed once, here, from the shards' headers;
2. the record ``ROOT/withdrawn/<id>.parquet`` (catalog/withdrawn.py): from now on ingest rejects the video
   under any name (its content hash), and training refuses manifests holding it;
3. every shard holding one of them is rewritten with the samples as holes (lineage/holes.py: atomically, no
   other byte moves, so every offset recorded anywhere stays right);
4. the sidecars say so: the clips' ingest rows become ``rejected`` / ``withdrawn`` without a shard, their
   latent rows ``rejected`` / ``withdrawn`` without a location, the store's indexes lose the removed entries;
   then ``catalog merge`` loads them (so a merge later never brings the clips back), and new manifests,
   which take ok clips only, leave them out;
5. a copy of the video that merge brought in as ok is withdrawn by a follow-up takedown (``followed_by``); the
   viewer's files of the clips (ROOT/view-cache/, catalog/withdrawn.py: view_cache_files) are deleted;
6. the journal is marked done.

Killed at any point (SIGKILL), every shard is whole (the old file or the new one), and running ``takedown``
again (any selection, or none) first finishes every journal not marked done: each step is idempotent.
Checkpoints are reported, never touched: deleting weights is the user's call.

A root in S3 (``s3://``, docs/STORAGE.md) is worked on in its local mirror, by the same steps (``Files``): what
the plan reads is mirrored first (the record and journals, the sidecars, caches' plans, the store's indexes, the
manifests, and each shard it looks into, downloaded whole); each file a step writes (the journal, the record,
a rewritten shard, sidecar or index) is uploaded whole once written, before the next step, so a killed takedown
leaves S3 as a killed one leaves a folder, and its rerun finishes it from the journal in S3. The lease is an
object (base/lease.py). An object can only be replaced whole: a shard with holes is uploaded again entire.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import re
import socket
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.base import lease as leases
from reelcache.base.shards import content_hash
from reelcache.catalog.db import arrow_schema
from reelcache.catalog.references import references
from reelcache.catalog.withdrawn import DIR, read_record, view_cache_files, withdrawn_dir
from reelcache.files import atomic_path
from reelcache.lineage.holes import punch, sample_spans
from reelcache.lineage.lineage import lineage
from reelcache.log import say

JOURNAL_VERSION = 1
LEASE = "takedown.lease"  # ROOT/withdrawn/takedown.lease: held by the one takedown --apply running

# What a takedown reads of a root in S3 besides its shards (mirrored first): catalog merge's files (the sidecars,
# the store's caption indexes, the record), the journals, the caches' plans and the manifests (gc's references).
READ = re.compile(
    r"(raw|latents)/[^/]+/[0-9][^/]*\.parquet|store/(text|video)/[^/]+/[^/]+\.parquet|withdrawn/[^/]+\.(parquet|json)"
    r"|latents/[^/]+/_plan/input\.parquet|manifests/[^/]+\.(parquet|json)"
)


# What lineage reads of the runs in S3 (mirrored, never pruned: a run training on this machine keeps its parts and
# checkpoints in the mirror before they go up, train/runfiles.py): the consumed log's parts, checkpoints' state.
RUNS = re.compile(r"runs/[^/]+/consumed/[^/]+|runs/[^/]+/ckpt-\d{8}/state\.json")
# The folders of the root those two name, each listed (base/s3.py: sync_down's under): nothing else of the root.
SYNCED_UNDER = ("raw/", "latents/", "store/", "withdrawn/", "manifests/", "runs/")


class Files:
    """The root a takedown reads and rewrites: a folder, or a root in S3 worked on in its local mirror. ``root``
    is the local folder; ``get(rel)`` a file there (for S3, the object downloaded now: never a stale copy), None
    when it does not exist; ``put(rel)`` publishes a file written there (for S3: uploaded whole)."""

    def __init__(self, root):
        from reelcache.base import s3

        self.given = root
        self.remote = s3.parse(root) if s3.is_url(root) else None
        self.root = s3.mirror_dir(root) if self.remote else Path(root)

    def sync(self) -> None:
        """Mirror what the plan reads besides the shards (only what changed)."""
        if self.remote is not None:
            from reelcache.base import s3

            def read(rel: str) -> bool:
                return READ.fullmatch(rel) is not None

            # one listing of each folder read: the runs' files are mirrored too, never pruned
            keep = lambda rel: read(rel) or RUNS.fullmatch(rel) is not None  # noqa: E731
            s3.sync_down(self.remote, self.root, keep, prune=read, under=SYNCED_UNDER)

    def get(self, rel: str) -> Path | None:
        path = self.root / rel
        if self.remote is not None:
            from reelcache.base import s3

            try:
                s3.download(self.remote / rel, path)
            except s3.S3Error:
                if s3.head(self.remote / rel) is not None:
                    raise  # the store failed, after its retries
                path.unlink(missing_ok=True)
        return path if path.exists() else None

    def put(self, rel: str) -> None:
        if self.remote is not None:
            from reelcache.base import s3

            s3.upload_file(self.root / rel, self.remote / rel)


def _holes(files: Files, where: dict[str, set[int]]) -> dict[str, list[list]]:
    """shard -> [[start, end, key], ...] of the samples whose member data start at the given offsets."""
    out = {}
    for shard, offsets in sorted(where.items()):
        path = files.get(shard)
        if path is None:
            continue
        spans = sample_spans(path, offsets)
        if files.remote is not None:  # the mirror keeps no shard: finish downloads it again, as it is then
            path.unlink()
        out[shard] = sorted({tuple(v) for v in spans.values()})
    return {k: [list(s) for s in v] for k, v in out.items() if v}


def plan(con, root, clip_ids: list[str], reason: str) -> dict:
    """What a takedown of `clip_ids` removes (nothing is changed): the journal of an --apply. `root`: a folder, or
    an S3 root (`con` then on its mirror's catalog: ``Files``)."""
    files = Files(root)
    files.sync()
    root = files.root
    already = set(read_record(root, ["clip_id"])["clip_id"].to_pylist())
    con.register("_pick", pa.table({"clip_id": pa.array(sorted(set(clip_ids)), pa.string())}))
    try:
        rows = con.execute(
            """SELECT clip_id, source, path, shard, shard_offset, file_size, content_hash FROM clips
               WHERE clip_id IN (SELECT clip_id FROM _pick)
                  OR content_hash IN (SELECT content_hash FROM clips WHERE clip_id IN (SELECT clip_id FROM _pick))
               ORDER BY clip_id"""
        ).fetchall()
    finally:
        con.unregister("_pick")
    clips = {}
    for cid, source, path, shard, off, size, h in rows:
        if cid in already:
            continue
        if h is None and shard and (path := files.get(shard)):  # ingested before clips had a content hash
            h = content_hash(path, off, size)
        clips[cid] = {"clip_id": cid, "source": source, "path": path, "shard": shard, "offset": off,
                      "bytes": size or 0, "content_hash": h}  # fmt: skip
    ids = sorted(clips)
    con.register("_w", pa.table({"clip_id": pa.array(ids, pa.string())}))
    try:
        lat = con.execute(
            """SELECT clip_id, cache, view, shard, shard_offset, video_key, text_key, text_shard, text_offset
               FROM latents WHERE clip_id IN (SELECT clip_id FROM _w) AND status = 'ok'"""
        ).fetchall()
        sidecars = [
            r[0]
            for r in con.execute(
                """SELECT DISTINCT u.sidecar FROM units u JOIN (
                       SELECT 'ingest' AS stage, unit FROM clips WHERE clip_id IN (SELECT clip_id FROM _w)
                       UNION SELECT 'cache', unit FROM latents WHERE clip_id IN (SELECT clip_id FROM _w)
                   ) x ON x.stage = u.stage AND x.unit = u.unit ORDER BY 1"""
            ).fetchall()
        ]
    finally:
        con.unregister("_w")
    # what else still names a store entry: gc's references (every cache's sidecars, merged or not, frozen cache
    # plans, manifests), the withdrawn clips' own rows (this takedown's and earlier ones') left out
    refs = references(root, exclude=set(ids) | already, who="takedown")
    where = defaultdict(set)
    for c in clips.values():
        if c["shard"]:
            where[c["shard"]].add(c["offset"])
    latents, kept_text, text_removed = [], set(), set()
    for cid, cache, view, shard, off, vkey, tkey, tshard, toff in lat:
        latents.append({"clip_id": cid, "cache": cache, "view": view, "shard": shard, "offset": off, "video_key": vkey})
        if shard and (shard, off) not in refs:
            where[shard].add(off)
        if tkey and tshard:
            if (tshard, toff) in refs:
                kept_text.add(tkey)
            else:
                text_removed.add(tkey)
                where[tshard].add(toff)
    holes = _holes(files, where)
    with duckdb.connect() as readers:  # lineage's reader of manifests and consumed logs
        info = lineage(con, root, ids, files=readers) if ids else []
    manifests = sorted({(m["name"], m["fingerprint"], m["path"]) for it in info for m in it["manifests"]})
    runs = defaultdict(set)
    for it in info:
        for r in it["runs"]:
            runs[r["run"]].update(r["checkpoints"])
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    digest = hashlib.sha256(json.dumps([ids, reason]).encode()).hexdigest()[:8]
    return {
        "version": JOURNAL_VERSION,
        "id": f"{at.replace('-', '').replace(':', '')}-{digest}",
        "reason": reason,
        "at": at,
        "by": f"{getpass.getuser()}@{socket.gethostname()}",
        "selected": sorted(set(clip_ids)),
        "already": sorted(set(clip_ids) & already),
        "clips": [clips[c] for c in ids],
        "latents": latents,
        "text_removed": sorted(text_removed),
        "text_kept": sorted(kept_text),
        "holes": holes,
        "sidecars": sidecars,
        "manifests": [{"name": n, "fingerprint": f, "path": p} for n, f, p in manifests],
        "runs": {r: sorted(c) for r, c in sorted(runs.items())},
        "done": False,
    }


def summary(j: dict) -> str:
    raw = [c for c in j["clips"] if c["shard"]]
    hole_bytes = sum(e - s for spans in j["holes"].values() for s, e, _ in spans)
    samples = sum(map(len, j["holes"].values()))
    caches = ", ".join(sorted({x["cache"] for x in j["latents"]})) or "-"
    lines = [
        f"takedown {j['id']}: {len(j['clips'])} clip(s) ({j['reason']})"
        + (f"; already withdrawn: {', '.join(j['already'])}" if j["already"] else ""),
    ]
    extra = sorted({c["clip_id"] for c in j["clips"]} - set(j["selected"]))
    if extra:
        lines.append(f"  the same video under other names, withdrawn too: {', '.join(extra)}")
    lines += [
        f"  raw members: {len(raw)}, {sum(c['bytes'] for c in raw)} video bytes",
        f"  latents: {len(j['latents'])} row(s) in cache(s) {caches}",
        f"  captions removed: {len(j['text_removed'])}; kept (other live clips use them): {len(j['text_kept'])}",
        f"  shards rewritten: {len(j['holes'])}, {hole_bytes} bytes removed in {samples} sample(s)",
    ]
    for m in j["manifests"]:
        fp = str(m["fingerprint"])[:16]
        lines.append(
            f"  manifest {m['name']} {fp} ({m['path']}) holds it: training over it refuses, unless told to skip"
        )
    for run, ckpts in j["runs"].items():
        lines.append(f"  run {run} trained on it; checkpoints that saw it (not touched): {', '.join(ckpts) or '-'}")
    return "\n".join(lines)


def _journal(files: Files, j: dict) -> None:
    d = withdrawn_dir(files.root)
    d.mkdir(parents=True, exist_ok=True)
    with atomic_path(d / f"{j['id']}.json") as tmp:
        tmp.write_text(json.dumps(j, indent=1))
    files.put(f"{DIR}/{j['id']}.json")


def _record(files: Files, j: dict) -> None:
    rel = f"{DIR}/{j['id']}.parquet"
    if files.get(rel) is not None:
        return
    path = files.root / rel
    at = _ts(j["at"])
    rows = [
        {"clip_id": c["clip_id"], "content_hash": c["content_hash"], "takedown": j["id"], "reason": j["reason"],
         "withdrawn_at": at, "withdrawn_by": j["by"], "source": c["source"], "path": c["path"]}
        for c in j["clips"]
    ]  # fmt: skip
    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema("withdrawn")), tmp)
    files.put(rel)


def _ts(text: str):
    import datetime as dt

    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ")


def _set(table: pa.Table, mask, values: dict) -> pa.Table:
    for name, value in values.items():
        if name in table.column_names:
            col = table[name]
            table = table.set_column(
                table.column_names.index(name), name, pc.if_else(mask, pa.scalar(value, col.type), col)
            )
    return table


def _rewrite_sidecar(files: Files, rel: str, j: dict, text_removed: set) -> None:
    """An ingest or cache sidecar with the withdrawn clips' ok rows marked (idempotent: written only when changed)."""
    path = files.get(rel)
    if path is None:
        return
    t = pq.read_table(path)
    mask = pc.is_in(t["clip_id"], pa.array([c["clip_id"] for c in j["clips"]], pa.string()))
    mask = pc.and_(mask, pc.equal(t["status"], "ok"))  # a rejected row keeps its reason (the record has the rest)
    detail = f"takedown {j['id']}: {j['reason']}"
    new = _set(t, mask, {"status": "rejected", "reject_reason": "withdrawn", "reject_detail": detail})
    new = _set(new, mask, {"shard": None, "shard_offset": None, "video_key": None})
    if "text_key" in new.column_names and text_removed:
        gone = pc.and_(mask, pc.is_in(new["text_key"], pa.array(sorted(text_removed), pa.string())))
        new = _set(new, pc.fill_null(gone, False), {"text_shard": None, "text_offset": None})
    if new.equals(t):
        return
    compression = pq.ParquetFile(path).metadata.row_group(0).column(0).compression.lower() if t.num_rows else "zstd"
    with atomic_path(path) as tmp:
        pq.write_table(new, tmp, compression=compression if compression != "uncompressed" else "none")
    files.put(rel)


def _rewrite_indexes(files: Files, j: dict) -> None:
    """The store's indexes without the entries that are holes now (an entry whose data lie in a removed span)."""
    files.sync()
    folders = {str(Path(shard).parent) for shard in j["holes"] if shard.startswith("store/")}
    for folder in sorted(folders):
        for idx in sorted((files.root / folder).glob("[!.]*.parquet")):
            t = pq.read_table(idx)
            keep = [
                not any(s <= o < e for s, e, _ in j["holes"].get(sh, []))
                for sh, o in zip(t["shard"].to_pylist(), t["shard_offset"].to_pylist())
            ]
            if all(keep):
                continue
            with atomic_path(idx) as tmp:
                pq.write_table(t.filter(pa.array(keep, pa.bool_())), tmp)
            files.put(idx.relative_to(files.root).as_posix())


def finish(root, j: dict) -> dict:
    """Apply a journal's takedown, every step idempotent (module docstring). The caller holds the takedown
    lease (`_lease`): the temporaries removed here are a killed takedown's, never a running one's."""
    from reelcache.catalog.merge import merge

    files = Files(root)
    root = files.root
    _record(files, j)
    removed = 0
    for folder in sorted({(root / shard).parent for shard in j["holes"]}):  # what a killed rewrite left
        for tmp in folder.glob(".*.takedown*"):
            tmp.unlink(missing_ok=True)
    for shard, spans in sorted(j["holes"].items()):
        if (path := files.get(shard)) is not None:
            punched = punch(path, [(s, e) for s, e, _ in spans])
            if punched:
                files.put(shard)
            removed += punched
            if files.remote is not None:  # the mirror keeps no shard
                path.unlink()
    text_removed = set(j["text_removed"])
    for rel in j["sidecars"]:
        _rewrite_sidecar(files, rel, j, text_removed)
    _rewrite_indexes(files, j)
    merge(files.given)
    late, followed = _copies_merged_since(root, j), []
    if late:  # ingest units that checked the record before it was written, merged just now: the same video
        say(f"takedown {j['id']}: the same video under other names, merged since it was planned: {', '.join(late)}")
        from reelcache.catalog.sql import read_only_connection

        with read_only_connection(root) as con:
            more = plan(con, files.given, late, j["reason"])
        if more["clips"]:
            print(summary(more), flush=True)
            _journal(files, more)
            followed.append(finish(files.given, more)["id"])
    for c in j["clips"]:  # the viewer's thumbnail and previews of it (view/preview.py)
        for p in view_cache_files(root, c["clip_id"]):
            p.unlink(missing_ok=True)
    j = {**j, "done": True} | ({"followed_by": followed} if followed else {})
    _journal(files, j)
    say(f"takedown {j['id']}: applied ({removed} bytes removed now); checkpoints were not touched")
    return j


def _copies_merged_since(root: Path, j: dict) -> list[str]:
    """Clips ok in the catalog now whose video (content hash) this takedown withdrew."""
    from reelcache.catalog.sql import read_only_connection

    hashes = sorted({c["content_hash"] for c in j["clips"] if c["content_hash"]})
    if not hashes:
        return []
    with read_only_connection(root) as con:
        rows = con.execute(
            "SELECT clip_id FROM clips WHERE status = 'ok' AND content_hash IN (SELECT unnest(?)) ORDER BY 1",
            [hashes],
        ).fetchall()
    return [r[0] for r in rows]


@contextmanager
def _lease(files: Files):
    """One takedown --apply at a time on a root (base/lease.py: a killed one's lease is stale, taken over)."""
    root = files.given
    if files.remote is not None:
        where = files.remote / DIR / LEASE  # an object lease
    else:
        d = withdrawn_dir(root)
        d.mkdir(parents=True, exist_ok=True)
        where = d / LEASE
    try:
        held = leases.acquire(where)
    except leases.Busy as e:
        raise UserError(f"another takedown is being applied to {root} ({e.holder.describe()}): wait for it") from None
    try:
        yield held
    finally:
        held.release()


def unfinished(root) -> list[dict]:
    files = Files(root)
    files.sync()
    root = files.root
    out = []
    for p in sorted(withdrawn_dir(root).glob("*.json")) if withdrawn_dir(root).is_dir() else []:
        try:
            j = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not j.get("done"):
            out.append(j)
    return out


def takedown(root, clip_ids: list[str], reason: str, apply: bool = False) -> dict:
    """Plan (and with `apply`, carry out) a takedown; every unfinished one is finished first when applying."""
    from reelcache.catalog.sql import read_only_connection

    files = Files(root)
    local = files.root  # the catalog's folder: the root, or a root in S3's mirror
    if not reason.strip():
        raise UserError("--reason is empty: say why (the request, a ticket), it is kept in the record")
    if not apply:
        with read_only_connection(local) as con:
            j = plan(con, root, clip_ids, reason)
        return _report(j, apply)
    from reelcache.catalog.merge import merge

    with _lease(files):
        for old in unfinished(root):
            say(f"finishing takedown {old['id']}, left unfinished")
            finish(root, old)
        with read_only_connection(local) as con:
            j = plan(con, root, clip_ids, reason)
        if j["clips"]:  # every finished unit in first (a merge running now is said here, before anything is
            m = merge(root)  # written): a copy of the video sharded since the last merge is withdrawn too
            if any(m["merged_by_stage"].values()) or m["vanished"]:
                with read_only_connection(local) as con:
                    j = plan(con, root, clip_ids, reason)
        j = _report(j, apply)
        if not j["clips"]:
            return j
        _journal(files, j)
        return finish(root, j)


def _report(j: dict, apply: bool) -> dict:
    if not j["clips"]:
        say(f"nothing to withdraw: every selected clip is withdrawn already ({', '.join(j['already'])})")
        return j
    print(summary(j), flush=True)
    if not apply:
        say("dry run: nothing was changed; --apply withdraws them")
    return j
