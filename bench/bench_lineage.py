"""make bench (lineage part): `reelcache lineage` for one clip and for 10k clips over a synthetic root at scale.

The root is made here, in DuckDB: a catalog of N clips (``clips``, two cached views each in ``latents``, a
caption shared by every 50 clips), one manifest holding every clip, and one run of S steps on R ranks with B
clips per rank and step: its consumed log as the trainer writes it (train/loader.py ConsumedLog: a part per
rank every ``every`` steps, named as ConsumedLog names them; the columns and types are checked against a part
written by ConsumedLog itself), a checkpoint's state.json every ``every`` steps. Clip order is a permutation
per epoch. The run's log is indexed (lineage/index.py; its time is measured), then ``lineage`` (lineage/lineage.py,
the command's code) is timed for one clip and for 10k clips, each once untimed first (page cache), then the
median of ``BENCH_REPS`` runs; last (so the parts' first read warms nothing the indexed runs use), the same
without the index (moved aside, then put back): the run's parts read directly, the baseline the index is for.
The end is a table (markdown) with each time (wall and CPU seconds), its goal and the 1-minute load average
when it was taken.

Goals at the replication's scale (1.3M clips, 100k steps x 192 ranks): one clip < 2 s, 10k clips < 30 s. The
default here is that scale; on a small shared machine set it down, e.g.

    BENCH_LINEAGE_CLIPS=130000 BENCH_LINEAGE_STEPS=10000 .venv/bin/python bench/bench_lineage.py

(BENCH_LINEAGE_RANKS, _BATCH, _EVERY: 192, 2, 1000; BENCH_OUT: where the root is made, bench-out/lineage).
At full scale the root is 1.1 GB (left in place for a rerun to replace), made and indexed in about 2 minutes on an
idle 2-core machine; the unindexed baseline adds about 3.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from reelcache.catalog.db import open_catalog
from reelcache.catalog.sql import read_only_connection
from reelcache.lineage import index
from reelcache.lineage.lineage import lineage
from reelcache.train.loader import ConsumedLog

OUT = Path(os.environ.get("BENCH_OUT", "bench-out")) / "lineage"
N = int(os.environ.get("BENCH_LINEAGE_CLIPS", 1_300_000))
STEPS = int(os.environ.get("BENCH_LINEAGE_STEPS", 100_000))
RANKS = int(os.environ.get("BENCH_LINEAGE_RANKS", 192))
BATCH = int(os.environ.get("BENCH_LINEAGE_BATCH", 2))
EVERY = int(os.environ.get("BENCH_LINEAGE_EVERY", 1000))
REPS = int(os.environ.get("BENCH_REPS", 3))
P = 1_000_003  # prime: i -> (i * P + epoch) mod N is a permutation when N is not a multiple of P


def clip_sql(i: str) -> str:
    return f"lpad(to_hex(hash({i})), 20, '0')"


def make_root(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    (root / "manifests").mkdir(parents=True)
    con = open_catalog(root, write=True)
    con.execute(
        f"""INSERT INTO clips (clip_id, source, unit, "row", path, text, status, shard, shard_offset, ext, file_size,
                               content_hash)
            SELECT {clip_sql("i")}, 'synthetic', 'synthetic/' || lpad((i // 4096)::VARCHAR, 6, '0'), i,
                   '/videos/' || i || '.mp4', 'caption ' || (i // 50), 'ok',
                   'raw/synthetic/' || lpad((i // 4096)::VARCHAR, 6, '0') || '-00.tar', (i % 4096) * 2000000,
                   'mp4', 1990000, sha256(i::VARCHAR)
            FROM range({N}) t(i)"""
    )
    con.execute(
        f"""INSERT INTO latents (clip_id, cache, unit, status, bucket, window_start, shard, shard_offset, view,
                                 video_key, reused, text_key, text_shard, text_offset)
            SELECT {clip_sql("i")}, 'c', 'c/' || (i // 1024), 'ok', '240p/51/0.56', v * 17,
                   'store/video/c/' || (i // 1024) || '-p-00.tar', (i % 1024) * 2 + v, v,
                   md5(i::VARCHAR || v), false, md5('t' || (i // 50)), 'store/text/c/0-p-00.tar', i // 50
            FROM range({N}) t(i), range(2) w(v)"""
    )
    con.execute(
        f"COPY (SELECT clip_id, shard, shard_offset FROM clips ORDER BY clip_id) TO "
        f"'{root / 'manifests/all-0123456789abcdef.parquet'}' (FORMAT parquet)"
    )
    con.close()
    run = root / "runs/bench"
    tmp = run / "_parts"
    run.mkdir(parents=True)
    per_epoch = N // (RANKS * BATCH)
    index = f"((((s % {per_epoch}) * {RANKS * BATCH} + r * {BATCH} + k) * {P}) + s // {per_epoch}) % {N}"
    con = duckdb.connect()
    con.execute(f"SET temp_directory = '{root / '_duckdb_tmp'}'")
    con.execute(
        f"""COPY (
            SELECT 0::INTEGER AS generation, (s // {per_epoch})::INTEGER AS epoch, (s % {per_epoch})::BIGINT AS step,
                   r::INTEGER AS rank,
                   {clip_sql(index)} AS clip_id,
                   '240p/51/0.56' AS bucket, false AS pad, 0::INTEGER AS view,
                   r AS part_rank, (s // {EVERY}) AS part
            FROM range({STEPS}) a(s), range({RANKS}) b(r), range({BATCH}) c(k)
        ) TO '{tmp}' (FORMAT parquet, PARTITION_BY (part_rank, part))"""
    )
    consumed = run / "consumed"
    consumed.mkdir(parents=True)
    for f in tmp.rglob("*.parquet"):
        r = int(f.parent.parent.name.split("=")[1])
        part = int(f.parent.name.split("=")[1])
        s0 = part * EVERY
        f.rename(consumed / f"rank{r:05d}-g000-e{s0 // per_epoch:04d}-s{s0 % per_epoch:09d}.parquet")
    shutil.rmtree(tmp)
    for s in range(EVERY, STEPS + 1, EVERY):
        ck = run / f"ckpt-{s:08d}"
        ck.mkdir()
        loader = {"epoch": s // per_epoch, "step": s % per_epoch, "generation": 0}
        (ck / "state.json").write_text(json.dumps({"global_step": s, "loader": loader}))
    # the parts have the columns and types of the trainer's own writer
    ref = ConsumedLog(root / "_ref", 0, every=1)
    ref.add(0, 0, ["a"], "240p/51/0.56", False, [0])
    want = pq.read_schema(next((root / "_ref").glob("*.parquet")))
    got = pq.read_schema(next(consumed.glob("*.parquet")))
    assert got.remove_metadata().equals(want.remove_metadata()), (got, want)
    shutil.rmtree(root / "_ref")


def timed(fn) -> tuple[float, float, object]:
    """(the medians of BENCH_REPS timed calls' wall and CPU seconds, the result of one untimed call first: the
    page cache). CPU seconds are the process's, every thread's (DuckDB's too): what contention does not change."""
    got = fn()
    ts, cs = [], []
    for _ in range(REPS):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return statistics.median(ts), statistics.median(cs), got


def load() -> float:
    """The 1-minute load average now: the machine may be shared, so each time is given with it."""
    return os.getloadavg()[0]


def main() -> None:
    root = OUT / "root"
    run = root / "runs/bench"
    rows = []  # (what, seconds, CPU seconds, goal, load)
    t0, c0 = time.perf_counter(), time.process_time()
    make_root(root)
    files = len(list((run / "consumed").glob("*.parquet")))
    consumed = STEPS * RANKS * BATCH
    print(f"synthetic root: {N} clips, {STEPS} steps x {RANKS} ranks x {BATCH} = {consumed} consumed rows in {files} "
          f"parts, {STEPS // EVERY} checkpoints", flush=True)  # fmt: skip
    rows.append(("synthetic root made", time.perf_counter() - t0, time.process_time() - c0, "", load()))
    t0, c0 = time.perf_counter(), time.process_time()
    index.update(run)
    rows.append(("index of the consumed log, once (then each call indexes only new parts)", time.perf_counter() - t0,
                 time.process_time() - c0, "", load()))  # fmt: skip
    with read_only_connection(root) as con:
        ids = [r[0] for r in con.execute("SELECT clip_id FROM clips USING SAMPLE 10000 ROWS (reservoir, 7)").fetchall()]

        def both(how: str) -> None:
            for sel, goal in ((ids[:1], "< 2 s"), (ids, "< 30 s")):
                t, cpu, got = timed(lambda sel=sel: lineage(con, root, sel))
                steps = sum(len(r["steps"]) for it in got for r in it["runs"])
                what = "one clip" if len(sel) == 1 else f"{len(sel)} clips"
                rows.append((f"lineage, {what}, {how} ({steps} trained steps found)", t, cpu, goal, load()))
                print(f"{rows[-1][0]}: {t:.2f} s, {cpu:.2f} CPU s (load {rows[-1][-1]:.1f})", flush=True)

        both("indexed")
        aside = run / "lineage.bench-aside"
        (run / index.DIR).rename(aside)
        try:
            both("unindexed: the log's parts")
        finally:
            aside.rename(run / index.DIR)
    print(f"\nlineage at {N} clips, {STEPS} steps x {RANKS} ranks x {BATCH} = {consumed} consumed rows in {files} "
          f"parts, {STEPS // EVERY} checkpoints; lineage: median of {REPS} runs after one untimed\n")  # fmt: skip
    print("| measured | seconds | CPU seconds | goal | load (1 min) |\n|---|---|---|---|---|")
    for what, t, cpu, goal, ld in rows:
        print(f"| {what} | {t:.2f} | {cpu:.2f} | {goal} | {ld:.1f} |")


if __name__ == "__main__":
    main()
