"""Slurm, for real: a one-node cluster on this machine (tests/slurm_local.py) runs the jobs.

The cluster itself first: it starts, runs a step and a batch job, hands each task of a GPU job its
own fake GPU in CUDA_VISIBLE_DEVICES, gives a two-task job the variables a launcher reads, and
leaves no process behind when it stops, also with a job still running.
"""

from __future__ import annotations

import os
import time

import pytest
from slurm_local import local_slurm_or_skip

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with local_slurm_or_skip(tmp_path_factory.mktemp("slurm"), max_array_size=16) as cluster:
        yield cluster


def _env_of(text: str) -> dict:
    return dict(line.split("=", 1) for line in text.split() if "=" in line)


def test_a_step_a_batch_job_and_a_gpu_per_task(slurm, tmp_path):
    assert slurm.run("srun", "hostname").stdout.strip() == slurm.node
    out = tmp_path / "batch.out"
    assert slurm.sbatch("--output", out, "--wrap", "echo hello from $SLURM_JOB_ID")[0]["JobState"] == "COMPLETED"
    assert out.read_text().startswith("hello from ")
    if not slurm.gpus:
        pytest.skip(slurm.no_gpus)
    step = slurm.run(
        "srun", "--ntasks=2", "--gpus-per-task=1", "bash", "-c", "echo $SLURM_PROCID $CUDA_VISIBLE_DEVICES"
    )
    assert sorted(step.stdout.splitlines()) == ["0 0", "1 1"]
    # each task of an array gets its own allocation: with one GPU a task, CUDA_VISIBLE_DEVICES names one device
    job = slurm.sbatch(
        "--array=0-1",
        "--ntasks=1",  # sbatch refuses --gpus-per-task without --ntasks (or --gpus)
        "--gpus-per-task=1",
        "--output",
        tmp_path / "gpu-%a.out",
        "--wrap",
        "echo $CUDA_VISIBLE_DEVICES; sleep 1",
    )
    assert {r["JobState"] for r in job} == {"COMPLETED"}
    seen = sorted((tmp_path / f"gpu-{i}.out").read_text().strip() for i in range(2))
    assert seen == ["0", "1"]  # the two tasks ran at once, each on its own GPU


def test_what_each_task_of_a_two_task_job_sees(slurm, tmp_path):
    """The variables a launcher reads in ``sbatch --nodes=1 --ntasks-per-node=2``: the batch script
    runs once (as task 0 of the allocation); ``srun`` inside it starts the two tasks."""
    script = tmp_path / "two.sh"
    script.write_text(
        "#!/bin/bash\n"
        "echo batch $(env | grep ^SLURM_ | sort | tr '\\n' ' ')\n"
        'srun bash -c \'echo task $(env | grep ^SLURM_ | sort | tr "\\n" " ")\'\n'
    )
    out = tmp_path / "two.out"
    slurm.sbatch("--nodes=1", "--ntasks-per-node=2", "--output", out, script)
    lines = out.read_text().splitlines()
    batch = _env_of(next(x for x in lines if x.startswith("batch ")))
    tasks = sorted((_env_of(x) for x in lines if x.startswith("task ")), key=lambda e: e["SLURM_PROCID"])
    assert (batch["SLURM_PROCID"], batch["SLURM_LOCALID"], batch["SLURM_NTASKS"]) == ("0", "0", "2")
    assert batch["SLURM_JOB_NODELIST"] == slurm.node and "SLURM_RESTART_COUNT" not in batch
    assert [(t["SLURM_PROCID"], t["SLURM_LOCALID"], t["SLURM_NODEID"]) for t in tasks] == [
        ("0", "0", "0"),
        ("1", "1", "0"),
    ]
    assert {(t["SLURM_NTASKS"], t["SLURM_JOB_NODELIST"], t["SLURM_STEP_ID"]) for t in tasks} == {("2", slurm.node, "0")}


def test_stop_leaves_no_process_behind(tmp_path):
    with local_slurm_or_skip(tmp_path / "c") as cluster:
        cluster.run("sbatch", "--output", "/dev/null", "--wrap", "sleep 300")
        deadline = time.monotonic() + 30
        while "RUNNING" not in cluster.run("squeue", "--noheader", "--format", "%T").stdout:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        running = cluster.leftovers()
        assert len(running) >= 5  # munged, slurmctld, slurmd, the job's slurmstepd and its shell, sleep
    assert cluster.leftovers() == []
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in running)


def test_a_missing_program_is_named_in_one_line(tmp_path, monkeypatch):
    import slurm_local

    monkeypatch.setattr(slurm_local, "SBIN", ())
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(slurm_local.SlurmUnavailable, match=r"^munged slurmctld slurmd sbatch .* not installed"):
        slurm_local.LocalSlurm(tmp_path / "c").start()
    assert not (tmp_path / "c").exists()


def _zombie(pid: int) -> bool:
    try:
        text = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return text[text.rindex(")") + 2] == "Z"
