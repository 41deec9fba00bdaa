"""Difficulty: a real tagger counts nouns; levels are quintiles; the hardest 0.01% is one WHERE."""

from __future__ import annotations

import duckdb

from reelcache.catalog.db import schema_sql
from reelcache.catalog.levels import count_nouns, recompute_levels, tagger_name


def test_pattern_tagger_counts_nouns():
    counts = count_nouns(["A dog runs on the beach.", "They run quickly.", "A chef cuts onions and carrots in a kitchen.", ""])
    assert counts[0] == 2 and counts[1] == 0 and counts[2] >= 4 and counts[3] == 0
    assert tagger_name("pattern").startswith("textblob-")


def test_levels_are_quintiles_and_pct_cut_is_exact():
    con = duckdb.connect()
    con.execute(schema_sql())
    con.execute("""INSERT INTO clips (clip_id, source, unit, "row", status, noun_count)
                   SELECT 'c' || i, 's', 's/000000', i, 'ok', i % 100 FROM range(100000) t(i)""")
    con.execute("""INSERT INTO clips (clip_id, source, unit, "row", status, noun_count, reject_reason)
                   VALUES ('bad', 's', 's/000000', 100000, 'rejected', 7, 'too_short')""")
    recompute_levels(con)
    levels = dict(con.execute("SELECT level, count(*) FROM clips WHERE status='ok' GROUP BY 1").fetchall())
    assert sorted(levels) == [1, 2, 3, 4, 5] and all(19000 <= n <= 21000 for n in levels.values())
    assert con.execute("SELECT level, noun_pct FROM clips WHERE clip_id = 'bad'").fetchall() == [(None, None)]
    (dropped,), = con.execute("SELECT count(*) FROM clips WHERE status='ok' AND NOT noun_pct < 99.99").fetchall()
    assert dropped == 10                                   # exactly 0.01% of 100,000, ties broken by id
    mono = con.execute("SELECT max(noun_count) FILTER (level = 1) < min(noun_count) FILTER (level = 5) "
                       "FROM clips").fetchall()
    assert mono == [(True,)]
