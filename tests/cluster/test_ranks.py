"""The rank record (cluster/ranks.py): what the trainer writes, what dump and stop read, judged against
the kernel's /proc.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time

import pytest
from support import boot_id, proc_stat

from reelcache import UserError
from reelcache.cluster import agent, ranks

# The keys of a record as the trainer has written them since it records its launcher: read() must
# keep reading them, and write() writes exactly these.
TRAINER_KEYS = [
    "rank",
    "world_size",
    "local_rank",
    "host",
    "pid",
    "proc_start",
    "boot_id",
    "started",
    "launcher_pid",
    "launcher_proc_start",
    "stacks",
]


def test_a_rank_record_names_this_process_as_the_kernel_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = ranks.write("run", 1, 2, 1, "stacks/rank00001.txt")
    assert path.resolve() == tmp_path / "run/ranks/rank00001.json"
    doc = json.loads(path.read_text())
    assert list(doc) == TRAINER_KEYS
    assert (doc["rank"], doc["world_size"], doc["local_rank"]) == (1, 2, 1)
    assert (doc["pid"], doc["proc_start"]) == (os.getpid(), proc_stat(os.getpid())[1])
    assert (doc["launcher_pid"], doc["launcher_proc_start"]) == (os.getppid(), proc_stat(os.getppid())[1])
    assert doc["host"] == socket.gethostname() and doc["boot_id"] == boot_id()
    assert doc["stacks"] == str(tmp_path / "stacks/rank00001.txt") and abs(doc["started"] - time.time()) < 60
    assert ranks.proc_start(os.getpid()) == proc_stat(os.getpid())[1]
    (rec,) = ranks.read("run")
    assert rec.to_json() == doc
    # the agent on a node judges the record it is sent by /proc, as ranks.py wrote it: this process,
    # alive; the same pid with another start time is another process
    assert agent.verify(rec.to_json()) == ""
    assert "reused" in agent.verify(dataclasses.replace(rec, proc_start=rec.proc_start - 1).to_json())


def test_rank_0_removes_the_records_of_an_earlier_larger_launch(tmp_path):
    for r in (10, 2, 0, 1):
        ranks.write(tmp_path, r, 12, r % 8, None)
    assert [r.rank for r in ranks.read(tmp_path)] == [0, 1, 2, 10]  # by rank
    ranks.write(tmp_path, 1, 2, 1, None)  # a relaunch on 2 ranks: rank 1 removes nothing
    assert [r.rank for r in ranks.read(tmp_path)] == [0, 1, 2, 10]
    ranks.write(tmp_path, 0, 2, 0, None)
    assert [(r.rank, r.world_size) for r in ranks.read(tmp_path)] == [(0, 2), (1, 2)]


def test_a_malformed_rank_record_is_refused_by_name(tmp_path):
    path = ranks.write(tmp_path, 0, 1, 0, None)
    doc = json.loads(path.read_text())
    for text, why in (
        ("{", "Expecting property name"),
        (json.dumps([doc]), "a rank record is a JSON object, not list"),
        (json.dumps({**doc, "pid": "123"}), "pid must be an integer >= 0, not '123'"),
        (json.dumps({**doc, "proc_start": 1.5}), "proc_start must be an integer >= 0 or null, not 1.5"),
        (json.dumps({k: v for k, v in doc.items() if k not in ("host", "stacks")}), "no host, stacks"),
        (json.dumps({**doc, "rank": 3}), "it records rank 3"),
    ):
        path.write_text(text)
        with pytest.raises(UserError) as e:
            ranks.read(tmp_path)
        assert f"malformed rank record {path}: " in str(e.value) and why in str(e.value), str(e.value)
    # a record from before the launcher was recorded reads; a newer writer's extra key is ignored
    path.write_text(json.dumps({**{k: v for k, v in doc.items() if not k.startswith("launcher")}, "gpu": 3}))
    (rec,) = ranks.read(tmp_path)
    assert rec.launcher_pid is None and rec.launcher_proc_start is None and rec.pid == doc["pid"]
    path.unlink()
    with pytest.raises(UserError, match="no rank records in"):
        ranks.read(tmp_path)
