"""Difficulty: a real tagger counts nouns; levels are equal-size quintiles even when noun counts tie;
the hardest 0.01% is one WHERE."""

from __future__ import annotations

import hashlib
import random

import duckdb

from reelcache.catalog.db import schema_sql
from reelcache.catalog.levels import count_nouns, recompute_levels, tagger_name


def test_pattern_tagger_counts_nouns():
    counts = count_nouns(
        ["A dog runs on the beach.", "They run quickly.", "A chef cuts onions and carrots in a kitchen.", ""]
    )
    assert counts[0] == 2 and counts[1] == 0 and counts[2] >= 4 and counts[3] == 0
    assert tagger_name("pattern").startswith("textblob-")


def _catalog(rows):
    con = duckdb.connect()
    con.execute(schema_sql())
    import pyarrow as pa

    new = pa.table(
        {
            "clip_id": [r[0] for r in rows],
            "source": ["s"] * len(rows),
            "unit": ["s/0"] * len(rows),
            "row": list(range(len(rows))),
            "status": [r[1] for r in rows],
            "noun_count": [r[2] for r in rows],
        }
    )
    con.register("new", new)
    con.execute("INSERT INTO clips BY NAME SELECT * FROM new")
    recompute_levels(con)
    return con


def test_levels_are_equal_quintiles_on_tied_counts_by_an_independent_reference():
    # The usual shape: few distinct counts, one of them a third of all clips, ids in ingest order.
    rng = random.Random(7)
    counts = [rng.choice([2, 4, 4, 4, 5, 6, 6, 7, 9, 12]) for _ in range(1003)]
    rows = [(f"{i:020x}", "ok", n) for i, n in enumerate(counts)] + [("bad", "rejected", 3)]
    con = _catalog(rows)
    got = dict(con.execute("SELECT clip_id, level FROM clips WHERE status = 'ok'").fetchall())
    # reference: rank by (count, md5 of the id), five slices of equal size
    order = sorted(((n, hashlib.md5(c.encode()).hexdigest(), c) for c, s, n in rows if s == "ok"))
    want = {c: 1 + 5 * r // len(order) for r, (_, _, c) in enumerate(order)}
    assert got == want
    sizes = [
        n
        for _, n in con.execute("SELECT level, count(*) FROM clips WHERE status='ok' GROUP BY 1 ORDER BY 1").fetchall()
    ]
    assert len(sizes) == 5 and max(sizes) - min(sizes) <= 1
    mono = con.execute(
        "SELECT bool_and(hi <= lo) FROM (SELECT max(noun_count) FILTER (level = k) AS hi, "
        "min(noun_count) FILTER (level = k + 1) AS lo FROM clips, range(1, 5) t(k) GROUP BY k)"
    ).fetchall()
    assert mono == [(True,)]
    assert con.execute("SELECT level, noun_pct FROM clips WHERE clip_id = 'bad'").fetchall() == [(None, None)]
    # the same clips inserted in another order get the same levels
    shuffled = rows[:]
    rng.shuffle(shuffled)
    assert dict(_catalog(shuffled).execute("SELECT clip_id, level FROM clips WHERE status = 'ok'").fetchall()) == got


def test_pct_cut_drops_exactly_the_hardest_share():
    con = duckdb.connect()
    con.execute(schema_sql())
    con.execute("""INSERT INTO clips (clip_id, source, unit, "row", status, noun_count)
                   SELECT 'c' || i, 's', 's/000000', i, 'ok', i % 100 FROM range(100000) t(i)""")
    recompute_levels(con)
    ((dropped,),) = con.execute("SELECT count(*) FROM clips WHERE status='ok' AND NOT noun_pct < 99.99").fetchall()
    assert dropped == 10  # exactly 0.01% of 100,000
    assert con.execute("SELECT min(noun_count) FROM clips WHERE NOT noun_pct < 99.99").fetchall() == [(99,)]
    levels = dict(con.execute("SELECT level, count(*) FROM clips GROUP BY 1").fetchall())
    assert levels == {k: 20000 for k in range(1, 6)}
