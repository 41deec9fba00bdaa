"""`cache gc` over a store index that is not parquet: one line, nothing deleted (issue 30.5; was a pyarrow
traceback). The root is built by hand: the index a unit of cache `t` would write, overwritten with text, beside
its shard, a sidecar and a manifest that are real parquet files."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.cli import main


def test_gc_over_an_index_that_is_not_parquet_is_one_line_and_deletes_nothing(tmp_path, capsys):
    root = tmp_path / "root"
    store = root / "store/video/t"
    store.mkdir(parents=True)
    (store / "000003-p1.parquet").write_text("not a parquet file\n")
    (store / "000003-p1-00.tar").write_bytes(b"\0" * 1024)  # an unlisted shard: what gc would call an orphan
    (root / "latents/t").mkdir(parents=True)
    pq.write_table(
        pa.table({"shard": ["store/video/t/000003-p1-00.tar"], "shard_offset": [512]}),
        root / "latents/t/000003.parquet",
    )
    (root / "manifests").mkdir()
    pq.write_table(
        pa.table({"clip_id": ["c"], "shard": ["store/video/t/000003-p1-00.tar"], "shard_offset": [512]}),
        root / "manifests/m-0123456789abcdef.parquet",
    )
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    capsys.readouterr()
    assert main(["cache", "gc", "--root", str(root), "--delete"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [
        "reelcache: error: cache gc: store/video/t/000003-p1.parquet is not readable parquet (Parquet magic bytes not "
        "found in footer); nothing was deleted: restore it, or write it again: delete latents/t/000003.parquet and "
        f"run `reelcache cache run --root {root} t/000003`"
    ], err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
