"""The shard writer (base/shards.py) tells a source that cannot be read from our own write that failed."""

from __future__ import annotations

import pytest


def test_the_shard_writer_tells_a_bad_source_from_a_failed_write(tmp_path):
    """Source problems are the sample's (SourceError, shard cut back); the writer goes on."""
    import webdataset as wds

    from reelcache.base.shards import ShardWriter, ShortRead, SourceError

    src = tmp_path / "v.bin"
    src.write_bytes(b"x" * 3000)
    w = ShardWriter(tmp_path, "000000", 1 << 20, fsync=False)
    w.write_sample("a", [("bin", str(src), 3000), ("txt", b"first", None)])
    with pytest.raises(ShortRead, match="read 3000 of 5000 bytes"):
        w.write_sample("b", [("bin", str(src), 5000), ("txt", b"second", None)])
    with pytest.raises(SourceError, match="cannot open"):
        w.write_sample("c", [("bin", str(tmp_path / "gone.bin"), 10)])
    w.write_sample("d", [("bin", str(src), 3000), ("txt", b"fourth", None)])
    shards = w.close()
    got = [(s["__key__"], s["txt"]) for s in wds.WebDataset([str(p) for p in shards], shardshuffle=False)]
    assert got == [("a", b"first"), ("d", b"fourth")]
