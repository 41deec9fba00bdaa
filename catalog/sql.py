"""SQL a user writes, on the catalog: the one place such text reaches DuckDB, and why it cannot write.

Four places take SQL from a user: ``catalog sql QUERY``, ``catalog manifest --where``,
``catalog export --where`` and the web viewer's filters (view/store.py). Each gets two guards, either
of which alone would keep the catalog intact against a mistake, and both against a clause written
to break out:

- the text is parsed by DuckDB's own parser before it runs. A ``--where`` fragment must be one
  expression: it is placed alone on its lines inside ``SELECT 1 FROM clips WHERE (`` ... ``)``,
  the result must be exactly one SELECT statement, and its parentheses (DuckDB's tokens, so a
  ``')'`` inside a string does not count) must never close more than they opened. A clause such
  as ``true); DROP TABLE clips; --`` or ``true) UNION SELECT ...`` is refused in one line before
  anything runs. A query (``catalog sql``) must be exactly one SELECT (``WITH``, ``FROM``,
  ``DESCRIBE``, ``SHOW`` and ``SUMMARIZE`` parse as SELECTs) or EXPLAIN: no ``COPY``, ``ATTACH``,
  ``INSERT``, ``SET``, ``CALL``; ``--out`` writes a file.
- it runs on a read-only connection (``read_only_connection``), so even a statement the parser
  let through could not change the catalog file (DuckDB also refuses to ``COPY`` onto a file it
  has attached); and that connection reaches no other file (``enable_external_access = false``,
  locked: catalog/db.py), so such a statement could not write one either (``COPY ... TO``,
  ``ATTACH``). ``--out`` and ``export`` write the result's rows through a connection of their own
  that never sees the user's text (catalog/query.py). ``catalog sql`` alone keeps file access: its
  one SELECT may read parquet files (a run's metrics and consumed log, docs/TRAIN.md).

``catalog manifest`` writes one row into the ``manifests`` table: it selects on a read-only
connection, closes it, and opens the catalog for writing only to record the manifest it made.

Usage::

    where = check_where(user_text)                        # UserError: one line, nothing ran
    with read_only_connection(root) as con:
        con.sql(f"SELECT ... FROM clips WHERE {where_sql(where)}")

The viewer parses its filters the same way (``check_where``, ``where_sql``) but keeps a connection of its
own (view/store.py), read-only with external access off (as catalog/db.py's ``NO_FILES``), because it
holds one across requests and closes it when a writer waits; it does not use ``read_only_connection``.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import duckdb

from reelcache import UserError
from reelcache.catalog.db import open_catalog

QUERY_TYPES = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _paren_depths(text: str):
    """Running depth of DuckDB-token parentheses in `text` (strings and comments do not count)."""
    tokens = duckdb.tokenize(text)
    depth = 0
    for i, (pos, kind) in enumerate(tokens):
        if kind != duckdb.token_type.operator:
            continue
        end = tokens[i + 1][0] if i + 1 < len(tokens) else len(text)
        for ch in text[pos:end]:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            yield depth


def check_where(fragment: str, option: str = "--where") -> str:
    """`fragment` stripped, if it is one SQL expression; else UserError naming `option` (nothing runs)."""
    where = str(fragment).strip()
    if not where:
        raise UserError(f'{option} is empty: give a condition on clips, e.g. {option} "height >= 240"')
    shown = where if len(where) <= 120 else where[:117] + "..."
    try:
        depths = list(_paren_depths(where))
        statements = duckdb.extract_statements(f"SELECT 1 FROM clips WHERE (\n{where}\n)")
    except duckdb.Error as e:
        raise UserError(f"{option} {shown!r} is not one SQL condition: {_first_line(e)}") from e
    if min(depths, default=0) < 0 or (depths and depths[-1] != 0):
        raise UserError(f"{option} {shown!r}: its parentheses do not balance; it must be one condition on clips")
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
        raise UserError(f"{option} {shown!r} must be one condition on clips, not a statement of its own")
    return where


def where_sql(where: str) -> str:
    """A checked fragment as a parenthesised condition, on lines of its own (a trailing `--` comment
    ends at its line, not at the closing parenthesis)."""
    return f"(\n{where}\n)"


def check_query(query: str) -> str:
    """`query` without a trailing ';', if it is exactly one SELECT or EXPLAIN; else UserError."""
    text = str(query).strip()
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as e:
        raise UserError(f"SQL failed: {_first_line(e)}") from e
    if len(statements) != 1:
        raise UserError(f"give one SQL statement, not {len(statements)}: the catalog runs one SELECT at a time")
    kind = statements[0].type
    if kind not in QUERY_TYPES:
        raise UserError(
            f"the catalog is read-only here: a {kind.name} statement is refused; give one SELECT "
            "(use --out FILE.csv|.json|.parquet to write its result)"
        )
    return text.rstrip().rstrip(";").rstrip()


@contextmanager
def read_only_connection(root: str | Path):
    """A read-only DuckDB connection to ROOT/catalog.duckdb, closed on exit (UserError when there is
    no catalog, or when a merge holds it for writing)."""
    con = open_catalog(root)
    try:
        yield con
    finally:
        con.close()
