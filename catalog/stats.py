"""``catalog stats``: what is in the catalog, as text and as one PNG of histograms.

The text (stdout) gives counts per source and status, every reject reason with an example,
the disagreements between source tables and files, and the difficulty levels. The PNG
(``ROOT/stats/catalog.png`` by default) shows resolution, duration, fps, aspect ratio, level
and reject reasons: the distributions people would rather see than read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from reelcache.catalog.db import open_catalog
from reelcache.catalog.query import print_table

SECTIONS = {
    "sources": """SELECT source, count(*) AS rows, count(*) FILTER (status = 'ok') AS ok,
                         count(*) FILTER (status = 'rejected') AS rejected,
                         round(sum(file_size) FILTER (status = 'ok') / 1e9, 3) AS ok_gb,
                         round(sum(duration) FILTER (status = 'ok') / 3600, 2) AS ok_hours
                  FROM clips GROUP BY 1 ORDER BY 1""",
    "reject reasons": """SELECT reject_reason, count(*) AS n, any_value(reject_detail) AS example
                         FROM clips WHERE status = 'rejected' GROUP BY 1 ORDER BY 2 DESC""",
    "resolution (ok clips, by height)": """SELECT height, count(*) AS n, round(avg(duration), 2) AS avg_s
                         FROM clips WHERE status = 'ok' GROUP BY 1 ORDER BY 1""",
    "levels (nouns in the caption)": """SELECT level, count(*) AS n, min(noun_count) AS min_nouns,
                         max(noun_count) AS max_nouns, any_value(noun_tagger) AS tagger
                         FROM clips WHERE status = 'ok' GROUP BY 1 ORDER BY 1""",
    "table vs file disagreements": """SELECT split_part(stated_mismatch, ' ', 1) AS field, count(*) AS n,
                         any_value(stated_mismatch) AS example
                         FROM clips WHERE stated_mismatch IS NOT NULL GROUP BY 1 ORDER BY 2 DESC""",
}


def stats(root, out_dir: str | None = None) -> Path:
    con = open_catalog(root)
    try:
        for title, q in SECTIONS.items():
            rel = con.sql(q)
            rows = rel.fetchall()
            print(f"\n== {title}")
            print_table(rel.columns, rows, 100) if rows else print("(none)")
        data = {
            k: con.sql(q).fetchnumpy()
            for k, q in {
                "ok": "SELECT height, duration, fps, aspect_ratio, level FROM clips WHERE status = 'ok'",
                "rej": "SELECT reject_reason, count(*) AS n FROM clips WHERE status = 'rejected' GROUP BY 1 ORDER BY 2",
            }.items()
        }
    finally:
        con.close()
    out = Path(out_dir) if out_dir else Path(root) / "stats"
    out.mkdir(parents=True, exist_ok=True)
    png = out / "catalog.png"
    _plot(data, png)
    print(f"\nplots: {png}")
    return png


def _plot(data: dict, png: Path) -> None:
    ok = data["ok"]
    fig = Figure(figsize=(15, 8.5))  # no pyplot: no backend to choose, no global figure to close
    axes = fig.subplots(2, 3)
    panels = [
        ("height", "height (px, displayed)", 30),
        ("duration", "duration (s)", 40),
        ("fps", "frame rate (fps)", 40),
        ("aspect_ratio", "aspect ratio (height / width)", 40),
    ]
    for ax, (col, label, bins) in zip(axes.flat, panels):
        v = np.asarray(ok[col], dtype=float)
        v = v[np.isfinite(v)]
        ax.hist(v, bins=bins, color="#3b6ea5") if len(v) else None
        ax.set_title(label)
        ax.set_ylabel("ok clips")
    lv = np.asarray(ok["level"], dtype=float)
    lv = lv[np.isfinite(lv)].astype(int)
    axes[1, 1].bar(range(1, 6), [int((lv == k).sum()) for k in range(1, 6)], color="#5a9e6f")
    axes[1, 1].set_title("difficulty level (nouns in caption, quintiles)")
    axes[1, 1].set_xticks(range(1, 6))
    rej = data["rej"]
    names = [str(x) for x in rej["reject_reason"]]
    axes[1, 2].barh(names, rej["n"], color="#c0504d")
    axes[1, 2].set_title(f"rejected rows by reason ({int(np.sum(rej['n'])) if len(names) else 0})")
    fig.suptitle(f"reelcache catalog: {len(ok['height'])} ok clips")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
