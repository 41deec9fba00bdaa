"""Sidecar schemas (catalog/db.py: arrow_schema, sidecar_table) are the catalog's tables, from schema.sql."""

from __future__ import annotations

import pytest

from reelcache.catalog.db import arrow_schema, open_catalog, sidecar_table


@pytest.mark.parametrize("table", ["clips", "latents"])
def test_a_sidecar_has_the_columns_and_types_of_its_catalog_table(tmp_path, table):
    """What merge inserts by name: the sidecar schema (from schema.sql) against a real catalog's table."""
    con = open_catalog(tmp_path, write=True)
    described = con.execute(f"DESCRIBE {table}").fetchall()
    assert arrow_schema(table).names == [name for name, *_ in described]
    row = {"clip_id": "c", "unit": "u/000000", "status": "ok"}
    if table == "clips":
        row |= {"source": "s", "row": 0, "num_frames": 17, "has_audio": False}
    else:
        row |= {"cache": "k", "shape": [4, 5, 8, 8], "view": 1, "plan": {"not": "a column"}}
    side = sidecar_table(table, [row], strict=table == "clips")
    con.register("side", side)
    names_types = lambda rows: [(n, t) for n, t, *_ in rows]  # noqa: E731
    assert names_types(con.execute("DESCRIBE SELECT * FROM side").fetchall()) == names_types(described)
    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM side")
    assert con.execute(f"SELECT clip_id, status FROM {table}").fetchall() == [("c", "ok")]
    with pytest.raises(AssertionError, match="not_a_column"):
        sidecar_table(table, [row | {"not_a_column": 1}])
