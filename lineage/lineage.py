"""``reelcache lineage``: from clips to everything the root made of them, as joins in DuckDB.

For each selected clip (lineage/select.py):

- its source row (``clips``) and raw shard member (shard, offset of the video's data, bytes), and whether a
  takedown withdrew it (``withdrawn``);
- the clips whose raw bytes are the same video (``content_hash``) or whose caption is the same text;
- every cache's latents of it (``latents``: cache, view, bucket, window, store key and shard) and the caption
  embedding (``text_key``, its shard) with the number of clips that share it;
- every manifest that holds it (ROOT/manifests/*.parquet, read directly: name and fingerprint from the
  catalog's ``manifests`` table, else the ``.json`` beside the file);
- every run whose consumed log (ROOT/runs/<run>/consumed/*.parquet, train/loader.py: ConsumedLog) has it:
  the steps that trained on it (per (epoch, step) the newest generation's rows, padding excluded: what
  trained after a resume), the global step (the steps of the log before it: a run from step 0), the first
  checkpoint written after it (the first whose loader position, in a generation at least the row's, is
  past the step: the first weights it reached, and every later checkpoint of the run holds them too) and
  that checkpoint's eval samples (ROOT/runs/<run>/eval/ckpt-*/<preset>/sample_*.mp4, eval/).

Everything is a query over the catalog and the parquet files, the selection a registered table, never a
Python loop over log rows. A run's consumed log is read through its index (lineage/index.py: the same rows
sorted by clip id, so one clip reads a few row groups, not every part), which `reelcache lineage` brings up to
date first; parts it does not cover yet are read from the log itself.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import duckdb
import pyarrow as pa

from reelcache import UserError
from reelcache.lineage import index
from reelcache.log import say
from reelcache.train.checkpoint import list_checkpoints, read_state

SAME_CAPTION_SHOWN = 20  # clips listed per shared caption (the count is always given)

CLIP_SQL = """
SELECT c.clip_id, c.source, c.unit, c."row", c.path, c.relpath, c.text, c.status, c.reject_reason,
       c.shard, c.shard_offset, c.ext, c.file_size, c.content_hash,
       w.takedown, w.reason AS withdrawn_reason, w.withdrawn_at, w.withdrawn_by
FROM clips c SEMI JOIN _sel s ON s.clip_id = c.clip_id
LEFT JOIN withdrawn w ON w.clip_id = c.clip_id
ORDER BY c.clip_id
"""
SAME_CONTENT_SQL = """
SELECT s.clip_id, o.clip_id AS other
FROM clips s JOIN clips o ON o.content_hash = s.content_hash AND o.clip_id <> s.clip_id
WHERE s.clip_id IN (SELECT clip_id FROM _sel) AND s.content_hash IS NOT NULL
ORDER BY 1, 2
"""
SAME_CAPTION_SQL = """
SELECT s.clip_id, count(*) AS n, list(o.clip_id ORDER BY o.clip_id)[1:$shown] AS others
FROM clips s JOIN clips o ON o.text = s.text AND o.clip_id <> s.clip_id
WHERE s.clip_id IN (SELECT clip_id FROM _sel) AND s.text IS NOT NULL AND s.text <> ''
GROUP BY 1 ORDER BY 1
"""
LATENTS_SQL = """
SELECT l.clip_id, l.cache, l.view, l.status, l.reject_reason, l.bucket, l.window_start, l.shape, l.shard,
       l.shard_offset, l.video_key, l.reused, l.text_key, l.text_shard, l.text_offset,
       (SELECT count(DISTINCT t.clip_id) FROM latents t WHERE t.text_key = l.text_key) AS text_shared_by
FROM latents l WHERE l.clip_id IN (SELECT clip_id FROM _sel)
ORDER BY l.clip_id, l.cache, l.view
"""
MANIFESTS_SQL = """
SELECT m.filename AS file, m.clip_id, count(*) AS rows
FROM read_parquet($files, filename = true, union_by_name = true) m
WHERE m.clip_id IN (SELECT clip_id FROM _sel)
GROUP BY ALL ORDER BY 2, 1
"""
# Per (epoch, step) the newest generation trained; global step = the log's steps before it (epochs' lengths
# from the log itself); the first checkpoint after it: the smallest global step among checkpoints of a
# generation >= the row's whose loader position (epoch, step) is past it. {hits} and {steps}: the index's
# segments and the parts no segment covers (lineage/index.py).
STEPS_SQL = """
WITH hit AS ({hits}),
steps AS ({steps}),
newest AS (SELECT epoch, step, max(generation) AS generation FROM steps GROUP BY ALL),
lens AS (SELECT epoch, max(step) + 1 AS n FROM steps GROUP BY epoch),
base AS (SELECT epoch, coalesce(sum(n) OVER (ORDER BY epoch ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
         AS before FROM lens)
SELECT h.clip_id, h.generation, h.epoch, h.step, b.before + h.step AS global_step, h.rank, h.view,
       (SELECT min(c.global_step) FROM _ckpts c WHERE c.generation >= h.generation
          AND (c.epoch > h.epoch OR (c.epoch = h.epoch AND c.step > h.step))) AS checkpoint_step
FROM hit h JOIN newest n USING (epoch, step, generation) JOIN base b USING (epoch)
ORDER BY h.clip_id, global_step, h.rank
"""
HIT_COLUMNS = "clip_id, generation, epoch, step, rank, view"


def _rows(rel) -> list[dict]:
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r)) for r in rel.fetchall()]


def _manifest_names(con, root: Path, files: list[Path]) -> dict[str, dict]:
    """file -> {name, fingerprint}: the catalog's `manifests` row, else the .json beside it, else its stem."""
    known = {
        str(root / p): {"name": n, "fingerprint": fp}
        for n, fp, p in con.execute("SELECT name, fingerprint, path FROM manifests").fetchall()
    }
    out = {}
    for f in files:
        info = known.get(str(f))
        if info is None and f.with_suffix(".json").exists():
            try:
                doc = json.loads(f.with_suffix(".json").read_text())
                info = {"name": doc.get("name"), "fingerprint": doc.get("fingerprint")}
            except (OSError, ValueError):
                info = None
        out[str(f)] = info or {"name": f.stem, "fingerprint": None}
    return out


def checkpoints(run_dir: Path) -> list[dict]:
    """(checkpoint, global step, the loader's generation and position) of a run's complete checkpoints,
    with its eval samples."""
    out = []
    for ck in list_checkpoints(run_dir):
        try:
            st = read_state(ck)
        except (OSError, ValueError):
            continue
        ld = st.get("loader") or {}
        samples = sorted(
            str(p.relative_to(run_dir.parent.parent)) for p in (run_dir / "eval" / ck.name).glob("*/sample_*.mp4")
        )
        out.append(
            {
                "checkpoint": ck.name,
                "global_step": int(st["global_step"]),
                "generation": int(ld.get("generation", 0)),
                "epoch": int(ld.get("epoch", 0)),
                "step": int(ld.get("step", 0)),
                "samples": samples,
            }
        )
    return out


def runs_of(root: Path) -> list[Path]:
    d = root / "runs"
    return sorted(p for p in d.iterdir() if (p / "consumed").is_dir()) if d.is_dir() else []


def run_steps(con, run_dir: Path) -> tuple[list[dict], list[dict]]:  # con: one that may read files
    """(the selected clips' trained steps in this run, its checkpoints): from the run's index where it covers
    the log (lineage/index.py), from the log's parts where it does not."""
    segs, rest = index.covered(run_dir)
    raw = [str(run_dir / "consumed" / n) for n in rest]
    ckpts = checkpoints(run_dir)
    if not segs and not raw:
        return [], ckpts
    sel = "clip_id IN (SELECT clip_id FROM _sel)"
    hits, steps, params = [], [], {}
    if segs:
        params |= {"segs": [f"{s}.parquet" for s in segs], "seg_steps": [f"{s}.steps.parquet" for s in segs]}
        hits.append(f"SELECT {HIT_COLUMNS} FROM read_parquet($segs) WHERE {sel}")
        steps.append("SELECT generation, epoch, step FROM read_parquet($seg_steps)")
    if raw:
        params["raw"] = raw
        hits.append(f"SELECT {HIT_COLUMNS} FROM read_parquet($raw) WHERE NOT pad AND {sel}")
        steps.append("SELECT generation, epoch, step FROM read_parquet($raw)")
    sql = STEPS_SQL.format(hits=" UNION ALL ".join(hits), steps=" UNION ALL ".join(steps))
    con.register(
        "_ckpts",
        pa.table(
            {k: pa.array([c[k] for c in ckpts], pa.int64()) for k in ("global_step", "generation", "epoch", "step")}
        ),
    )
    try:
        return _rows(con.execute(sql, params)), ckpts
    finally:
        con.unregister("_ckpts")


def check_schema(con, root) -> None:
    """Lineage reads `clips.content_hash` and `withdrawn` (schema 3): an older catalog is said in one line."""
    have = {r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'clips'")
            .fetchall()}  # fmt: skip
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "content_hash" not in have or "withdrawn" not in tables:
        raise UserError(
            f"the catalog of {root} predates lineage (no clips.content_hash, no table withdrawn): "
            f"run `reelcache catalog merge --root {root}` once to migrate it"
        )


def lineage(con, root, clip_ids: list[str], files=None, update_index: bool = False) -> list[dict]:
    """The lineage of each clip (module docstring), in clip-id order. `con`: the catalog; `files`: a connection
    that reads the manifests and consumed logs (default: a new in-memory one; a read-only catalog connection
    reaches no file, catalog/db.py); `update_index`: first index each run's parts written since
    (lineage/index.py)."""
    root = Path(root)
    check_schema(con, root)
    own = files is None
    files = duckdb.connect() if own else files
    if update_index:  # `reelcache lineage` keeps each run's index current; the viewer only reads
        for run_dir in runs_of(root):
            try:
                index.update(run_dir)
            except (OSError, UserError, duckdb.Error) as e:  # a folder we may not write, a part it cannot index
                say(f"warning: {run_dir.name}: its consumed log is read unindexed ({str(e).splitlines()[0]})")
    sel = pa.table({"clip_id": pa.array(sorted(set(clip_ids)), pa.string())})
    for c in {id(con): con, id(files): files}.values():
        c.register("_sel", sel)
    try:
        return _lineage(con, files, root)
    finally:
        for c in {id(con): con, id(files): files}.values():
            c.unregister("_sel")
        if own:
            files.close()


def _lineage(con, files_con, root: Path) -> list[dict]:
    clips = {r["clip_id"]: r for r in _rows(con.execute(CLIP_SQL))}
    out = {}
    for cid, r in clips.items():
        out[cid] = {
            "clip_id": cid,
            "source": {
                k: r[k] for k in ("source", "unit", "row", "path", "relpath", "text", "status", "reject_reason")
            },
            "content_hash": r["content_hash"],
            "member": {"shard": r["shard"], "offset": r["shard_offset"], "ext": r["ext"], "bytes": r["file_size"]}
            if r["shard"]
            else None,
            "withdrawn": {
                "takedown": r["takedown"],
                "reason": r["withdrawn_reason"],
                "at": str(r["withdrawn_at"]),
                "by": r["withdrawn_by"],
            }
            if r["takedown"]
            else None,
            "same_content": [],
            "same_caption": {"count": 0, "clips": []},
            "latents": [],
            "captions": [],
            "manifests": [],
            "runs": [],
        }
    for cid, other in con.execute(SAME_CONTENT_SQL).fetchall():
        out[cid]["same_content"].append(other)
    for cid, n, others in con.execute(SAME_CAPTION_SQL, {"shown": SAME_CAPTION_SHOWN}).fetchall():
        out[cid]["same_caption"] = {"count": n, "clips": others}
    seen_text = defaultdict(set)
    for r in _rows(con.execute(LATENTS_SQL)):
        cid = r.pop("clip_id")
        text = {k: r.pop(k) for k in ("text_key", "text_shard", "text_offset", "text_shared_by")}
        out[cid]["latents"].append(r)
        if text["text_key"] and text["text_key"] not in seen_text[cid]:
            seen_text[cid].add(text["text_key"])
            out[cid]["captions"].append(text)
    files = sorted(p for p in (root / "manifests").glob("*.parquet") if not p.name.startswith("."))
    if files:
        names = _manifest_names(con, root, files)
        rel = {str(f): str(f.relative_to(root)) for f in files}
        for r in _rows(files_con.execute(MANIFESTS_SQL, {"files": [str(f) for f in files]})):
            out[r["clip_id"]]["manifests"].append({**names[r["file"]], "path": rel[r["file"]], "rows": r["rows"]})
    for run_dir in runs_of(root):
        try:
            steps, ckpts = run_steps(files_con, run_dir)
        except duckdb.Error as e:  # a corrupt part, a log older than its `view` column: never a partial answer
            raise UserError(
                f"run {run_dir.name}: its consumed log ({run_dir / 'consumed'}) cannot be read "
                f"({str(e).strip().splitlines()[0]}); lineage names every run that trained on a clip, so it "
                f"stops here: restore or move that run folder out of {root / 'runs'}"
            ) from None
        by_step = {c["global_step"]: c for c in ckpts}
        per_clip, first = defaultdict(list), {}
        for s in steps:
            cid, at = s.pop("clip_id"), s.pop("checkpoint_step")
            ck = by_step.get(at)
            s["checkpoint"] = ck["checkpoint"] if ck else None
            s["samples"] = ck["samples"] if ck else []
            per_clip[cid].append(s)
            if at is not None:
                first[cid] = min(first.get(cid, at), at)
        for cid, ss in per_clip.items():
            # the first checkpoint it reached, and every later one of the run (its weights descend from it)
            reached = [c["checkpoint"] for c in ckpts if cid in first and c["global_step"] >= first[cid]]
            out[cid]["runs"].append(
                {
                    "run": run_dir.name,
                    "epochs": sorted({s["epoch"] for s in ss}),
                    "steps": ss,
                    "checkpoints": reached,
                }
            )
    return [out[c] for c in sorted(out)]


def _short(x, n=16) -> str:
    return "-" if x is None else str(x)[:n]


def render(items: list[dict]) -> str:
    """The lineage as text for a terminal: a block per clip."""
    lines = []
    for it in items:
        src, m = it["source"], it["member"]
        lines.append(f"clip {it['clip_id']}  [{src['source']} row {src['row']}, {src['status']}"
                     + (f": {src['reject_reason']}" if src["reject_reason"] else "") + "]")  # fmt: skip
        if it["withdrawn"]:
            w = it["withdrawn"]
            lines.append(f"  WITHDRAWN by takedown {w['takedown']} ({w['reason']}) at {w['at']} by {w['by']}")
        lines.append(f"  source     {src['path']}")
        lines.append(f"  caption    {src['text']!r}")
        lines.append(f"  content    {_short(it['content_hash'], 64)}")
        if m:
            lines.append(f"  member     {m['shard']} @ {m['offset']} ({m['bytes']} bytes, .{m['ext']})")
        if it["same_content"]:
            lines.append(f"  same video {', '.join(it['same_content'])}")
        if it["same_caption"]["count"]:
            sc = it["same_caption"]
            more = f" (+{sc['count'] - len(sc['clips'])} more)" if sc["count"] > len(sc["clips"]) else ""
            lines.append(f"  same text  {', '.join(sc['clips'])}{more}")
        for lat in it["latents"]:
            where = f"{lat['shard']} @ {lat['shard_offset']}" if lat["shard"] else lat["reject_reason"] or "-"
            lines.append(
                f"  latent     {lat['cache']} view {lat['view']} {lat['status']} {lat['bucket'] or '-'} "
                f"window {_short(lat['window_start'])} key {_short(lat['video_key'])} {where}"
            )
        for cap in it["captions"]:
            where = f"{cap['text_shard']} @ {cap['text_offset']}" if cap["text_shard"] else "removed"
            lines.append(
                f"  caption    key {_short(cap['text_key'])} {where} (shared by {cap['text_shared_by']} clip(s))"
            )
        for mf in it["manifests"]:
            lines.append(f"  manifest   {mf['name']} {_short(mf['fingerprint'])} {mf['path']} ({mf['rows']} row(s))")
        for run in it["runs"]:
            lines.append(
                f"  run        {run['run']}: {len(run['steps'])} step(s) in epoch(s) "
                f"{', '.join(map(str, run['epochs']))}; checkpoints that saw it: {', '.join(run['checkpoints']) or '-'}"
            )
            for s in run["steps"]:
                lines.append(
                    f"    step {s['global_step']} (epoch {s['epoch']} step {s['step']}, rank {s['rank']}, "
                    f"view {s['view']}, generation {s['generation']}) -> {s['checkpoint'] or 'no checkpoint yet'}"
                    + (f"; samples {', '.join(s['samples'])}" if s["samples"] else "")
                )
        lines.append("")
    return "\n".join(lines)
