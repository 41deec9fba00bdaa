"""History rows of offline wandb runs, read from wandb's own file format, not through our code.

A ``run-<id>.wandb`` file is a 7-byte header (``:W&B``, magic, version) followed by a
leveldb-style record log in 32 KiB blocks: each record is crc32 (4), length (2, little-endian),
type (1: full, 2: first, 3: middle, 4: last; 0 pads the rest of a block), then that many bytes of
a protobuf ``Record``; a block with fewer than 7 bytes left is padding.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def history(path: Path) -> list[dict]:
    """The history rows of one offline run file: {key: value} per logged row, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, block, rows, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == 0:
            break
    return rows


def run_files(run_dir: Path) -> list[Path]:
    """Every offline run file under a training run's wandb/ folder, oldest first."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
