"""A run's consumed log read for lineage (lineage/lineage.py run_steps), through its index (lineage/index.py)
or not, against the log read with pyarrow: a log written by the trainer's own writer (ConsumedLog) over two
ranks, two epochs and a resume that logged some steps again (generation 1)."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.lineage import index
from reelcache.lineage.lineage import run_steps
from reelcache.train.loader import ConsumedLog

STEPS = 6  # per epoch
CLIPS = [f"clip{i:02d}" for i in range(12)]


def _log(run: Path) -> None:
    """Epoch 0 and 1 by generation 0 on 2 ranks (2 clips a rank and step, parts every 2 steps), killed after
    epoch 1 step 3; generation 1 resumed from the checkpoint at epoch 1 step 2 and logged steps 2.. again
    with other clips (a different world of the same plan would; what matters is which generation wins)."""
    for gen, epochs in ((0, [(0, range(STEPS)), (1, range(4))]), (1, [(1, range(2, STEPS))])):
        for rank in range(2):
            log = ConsumedLog(run / "consumed", rank, every=2)
            log.generation = gen
            for epoch, steps in epochs:
                for s in steps:
                    k = (epoch * STEPS + s) * 4 + rank * 2 + gen
                    log.add(epoch, s, [CLIPS[k % 12], CLIPS[(k + 1) % 12]], "b", pad=(s == 5 and rank == 1))
                log.flush()
    for gs, (e, s, g) in {2: (0, 2, 0), 6: (1, 0, 0), 8: (1, 2, 0), 10: (1, 4, 1), 12: (2, 0, 1)}.items():
        ck = run / f"ckpt-{gs:08d}"
        ck.mkdir(parents=True)
        (ck / "state.json").write_text(
            json.dumps({"global_step": gs, "loader": {"epoch": e, "step": s, "generation": g}})
        )


def _truth(run: Path, clip: str) -> list[tuple]:
    rows = pq.read_table(run / "consumed").to_pylist()
    newest = {}
    for r in rows:
        newest[(r["epoch"], r["step"])] = max(newest.get((r["epoch"], r["step"]), -1), r["generation"])
    states = {int(p.name[5:]): json.loads((p / "state.json").read_text())["loader"] for p in run.glob("ckpt-*")}
    out = []
    for r in rows:
        if r["clip_id"] != clip or r["pad"] or r["generation"] != newest[(r["epoch"], r["step"])]:
            continue
        first = min((g for g, st in states.items() if st["generation"] >= r["generation"]
                     and (st["epoch"], st["step"]) > (r["epoch"], r["step"])), default=None)  # fmt: skip
        out.append((r["epoch"], r["step"], r["epoch"] * STEPS + r["step"], r["rank"], r["generation"], first))
    return sorted(out)


def _steps(run: Path) -> dict[str, list[tuple]]:
    """What run_steps finds for every clip, asked at once."""
    con = duckdb.connect()
    con.register("_sel", pa.table({"clip_id": CLIPS}))
    steps, ckpts = run_steps(con, run)
    out = {c: [] for c in CLIPS}
    for s in steps:
        first = s["checkpoint_step"]
        out[s["clip_id"]].append((s["epoch"], s["step"], s["global_step"], s["rank"], s["generation"], first))
    return {c: sorted(v) for c, v in out.items()}


def test_the_log_read_through_its_index_or_not_gives_what_pyarrow_reads(tmp_path):
    run = tmp_path / "runs/r"
    _log(run)
    truth = {c: _truth(run, c) for c in CLIPS}
    assert any(any(t[4] == 1 for t in v) for v in truth.values())  # the resume's rows win where they exist
    assert _steps(run) == truth  # no index: the parts
    every = sorted((run / "consumed").iterdir())
    early, late = every[: len(every) // 2], every[len(every) // 2 :]
    for p in late:  # half indexed, half not
        p.rename(tmp_path / p.name)
    assert index.update(run) == len(early)
    for p in late:
        (tmp_path / p.name).rename(run / "consumed" / p.name)
    assert _steps(run) == truth  # one segment and the parts it does not cover
    assert index.update(run) == len(late) and index.update(run) == 0
    assert len(index.segments(run)) == 2 and _steps(run) == truth
    seg = pq.read_table(index.segments(run)[0][0].with_suffix(".parquet"))
    assert seg["clip_id"].to_pylist() == sorted(seg["clip_id"].to_pylist())  # sorted: row groups can be skipped


def test_a_run_named_with_a_quote_is_indexed(tmp_path):
    """COPY ... TO takes no parameter: the index's path is a SQL literal, a quote in it doubled."""
    run = tmp_path / "runs/it's #1"
    _log(run)
    truth = {c: _truth(run, c) for c in CLIPS}
    assert index.update(run) > 0 and _steps(run) == truth


def test_a_log_part_lineage_cannot_read_is_one_line_naming_the_run(tmp_path):
    """A corrupt part (or one older than the log's columns): lineage says which run and stops, no traceback
    and no answer that leaves that run out (a takedown must name every run that trained on a clip)."""
    import pytest

    from reelcache import UserError
    from reelcache.catalog.db import open_catalog
    from reelcache.lineage.lineage import lineage

    root = tmp_path / "root"
    _log(root / "runs/r")
    (root / "runs/r/consumed/zz-broken.parquet").write_bytes(b"PAR1 not parquet at all PAR1")
    open_catalog(root, write=True).close()
    con = open_catalog(root)
    try:
        with pytest.raises(UserError, match=r"^run r: its consumed log .* cannot be read .*restore or move"):
            lineage(con, root, ["clip00"], update_index=True)
    finally:
        con.close()
