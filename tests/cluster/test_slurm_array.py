"""Slurm, for real: a one-node cluster on this machine (tests/slurm_local.py) runs the jobs.

The cluster itself first: it starts, runs a step and a batch job, hands each task of a GPU job its
own fake GPU in CUDA_VISIBLE_DEVICES, gives a two-task job the variables a launcher reads, and
leaves no process behind when it stops, also with a job still running.

Then ``reelcache slurm submit``: the demo's ingest units as one job array with the merge after it,
one unit requeued mid-run and once more when finished, give the catalog and shards of the units
run here one after another; a failing unit is retried by requeueing its task, the --then job waits
for the last attempt and names the unit that never succeeded; each bad input is one line and
submits nothing; an --account where accounting is off is said to be unchecked.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from slurm_local import local_slurm_or_skip
from support import ingest, sql

from reelcache.cli import main
from reelcache.log import LINE_PREFIX

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


# --- reelcache slurm submit ----------------------------------------------------------------------

# `ingest run` whose unit 000000, on its first attempt only, stops once its first shard is complete
# and visible (the unit is not: no sidecar), so that the test requeues it there.
HELD_AFTER_FIRST_SHARD = """
import os, sys, time
from reelcache.ingest import run
write = run.write
def held(r, **kw):
    if kw["writer"].finished and "SLURM_RESTART_COUNT" not in os.environ:
        time.sleep(120)
    return write(r, **kw)
if sys.argv[-1].endswith("/000000"):
    run.write = held
from reelcache.cli import main
sys.exit(main(["ingest", "run", *sys.argv[1:]]))
"""


def submit(slurm, units: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "reelcache", "slurm", "submit", *map(str, args)],
        input=units,
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not check or done.returncode == 0, done.stderr
    return done


def _plan(root: Path, data: Path, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "reelcache", "ingest", "plan", "--root", root, "--source", "openvid"]
        + ["--meta", data / "OpenVid-demo.csv", "--videos", data / "videos", "--rows-per-unit", "8"]
        + ["--max-file-mb", "8", *extra],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _wait_for(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def test_demo_ingest_as_a_job_array_with_a_requeued_unit_equals_the_local_run(slurm, demo_dataset, tmp_path):
    """The demo's units as one array and a merge after it; unit 0 is requeued (scontrol requeue) with
    its first shard written and no sidecar, and again once finished. The catalog and the shards
    equal those of the same units run here one after another: a unit run twice is one unit."""
    root, jobdir = tmp_path / "root", tmp_path / "job"
    units = _plan(root, demo_dataset, "--shard-mb", "0.3")
    assert len(units.split()) == 5
    done = submit(
        slurm,
        units,
        "--partition",
        slurm.partition,
        "--dir",
        jobdir,
        "--retries",
        0,  # the requeue is Slurm's, not a retry of a failure
        "--then",
        f"{sys.executable} -m reelcache catalog merge --root {root}",
        "--",
        sys.executable,
        "-c",
        HELD_AFTER_FIRST_SHARD,
        "--root",
        root,
        "--wait",
    )
    array, then = done.stdout.split()
    src = root / "raw/openvid"
    _wait_for(lambda: (src / "000000-00.tar").exists() and (src / "000000.lease").exists(), "first shard of unit 0")
    assert not (src / "000000.parquet").exists()
    slurm.run("scontrol", "requeue", f"{array}_0")
    records = {r["ArrayTaskId"]: r for r in slurm.wait(array)}
    assert {k: r["JobState"] for k, r in records.items()} == {str(i): "COMPLETED" for i in range(5)}
    assert records["0"]["Restarts"] == "1" and {r["Restarts"] for k, r in records.items() if k != "0"} == {"0"}
    assert slurm.wait(then)[0]["JobState"] == "COMPLETED"

    log0 = (jobdir / f"logs/{array}_0.out").read_text()
    assert "DUE TO JOB REQUEUE" in log0 and "restart 1" in log0  # the same task, started again
    clean = tmp_path / "clean"
    ingest(clean, demo_dataset, "--shard-mb", "0.3")  # the same units, one after another, here
    q = "SELECT * FROM clips ORDER BY clip_id"
    assert sql(root, q) == sql(clean, q)
    assert sql(root, "SELECT count(*) = count(DISTINCT clip_id) FROM clips") == [(True,)]
    assert _members(root) == _members(clean)
    assert not list(src.glob("*.lease")) and not list(src.glob(".*tmp*"))

    # requeued once finished: the task runs again and skips its unit; the catalog does not change
    slurm.run("scontrol", "requeue", f"{array}_0")
    assert slurm.wait(array)[0]["JobState"] == "COMPLETED"
    assert "openvid/000000: already done, skipped" in (jobdir / f"logs/{array}_0.out").read_text()
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    assert sql(root, q) == sql(clean, q)


def _members(root: Path) -> dict:
    return {p.name: [(m.name, m.size) for m in tarfile.open(p)] for p in sorted((root / "raw/openvid").glob("*.tar"))}


# `bash -c FLAKY flaky WORKDIR UNIT`: unit a fails on its first attempt only, b on every attempt, c
# never; each attempt notes the GPUs Slurm gave it.
FLAKY = """
dir=$1; unit=$2
echo "${CUDA_VISIBLE_DEVICES-unset}" >> "$dir/gpus.$unit"
case $unit in
  a) [ -e "$dir/a.failed-once" ] && exit 0; touch "$dir/a.failed-once"; exit 3 ;;
  b) exit 4 ;;
esac
"""


def test_a_failed_unit_is_retried_and_the_then_job_waits_and_names_what_failed(slurm, tmp_path):
    """--retries 1: a unit failing once succeeds on its retry, one failing always fails twice; the
    --then job runs after the last attempt and lists the unit that never succeeded (exit 1). With
    --gpus-per-task 1 each attempt sees one GPU in CUDA_VISIBLE_DEVICES."""
    if not slurm.gpus:
        pytest.skip(slurm.no_gpus)
    work, jobdir = tmp_path / "work", tmp_path / "job"
    work.mkdir()
    done = submit(
        slurm,
        "a\nb\n\nc\n",  # a blank line is no unit
        *("--partition", slurm.partition, "--dir", jobdir, "--retries", 1, "--gpus-per-task", 1),
        *("--then", f"date +%s.%N > {work}/then"),
        *("--", "bash", "-c", FLAKY, "flaky", work),
    )
    array, then = done.stdout.split()
    tasks = {r["ArrayTaskId"]: r for r in slurm.wait(array)}
    (after,) = slurm.wait(then)
    assert [(tasks[i]["JobState"], tasks[i]["Restarts"], tasks[i]["ExitCode"]) for i in "012"] == [
        ("COMPLETED", "1", "0:0"),
        ("FAILED", "1", "4:0"),
        ("COMPLETED", "0", "0:0"),
    ]
    assert (jobdir / "units.txt").read_text() == "a\nb\nc\n"
    assert sorted(p.name for p in (jobdir / "status").iterdir()) == ["0.failed", "0.ok", "1.failed", "2.ok"]
    assert len((jobdir / "status/1.failed").read_text().splitlines()) == 2
    # the --then job: after the last attempt of every unit, and it names the one that failed
    assert (after["JobState"], after["ExitCode"]) == ("FAILED", "1:0")
    assert all(after["StartTime"] >= t["EndTime"] for t in tasks.values())
    assert (work / "then").exists() and (jobdir / "failed.txt").read_text() == "b\n"
    said = (jobdir / f"logs/then-{then}.out").read_text()
    assert "1 of 3 units did not finish" in said
    again = said.split("and merge after them:\n")[1].rstrip("\n")  # docs/CLUSTER.md's failed-units row, filled in
    assert shlex.split(again) == [
        *("reelcache", "slurm", "submit", "--partition", slurm.partition, "--gpus-per-task", "1"),
        *(
            "--units",
            str(jobdir / "failed.txt"),
            "--then",
            f"date +%s.%N > {work}/then",
            "--",
            "bash",
            "-c",
            FLAKY,
            "flaky",
            str(work),
        ),
    ]
    gpus = {u: (work / f"gpus.{u}").read_text().split() for u in "abc"}
    assert [len(g) for g in gpus.values()] == [2, 2, 1] and set(sum(gpus.values(), [])) <= {"0", "1"}


def _jobs_known(slurm) -> int:
    return len(slurm.run("squeue", "--noheader", "--states=all").stdout.splitlines())


@pytest.mark.parametrize(
    ("units", "args", "message"),
    [
        ("a\n", ("--partition", "nosuch"), "partition 'nosuch' does not exist on this cluster (partitions: debug)"),
        (
            "".join(f"u{i}\n" for i in range(17)),
            ("--partition", "debug"),
            "17 units are more than one job array may hold here (MaxArraySize=16, indices 0..15): "
            "plan larger units, or submit the units in parts of 16",
        ),
        (
            "a\n",
            ("--partition", "debug", "--gpus-per-task", "3"),
            "--gpus-per-task 3: no node of partition debug has more than 2 GPUs",
        ),
        ("a\nb\na\n", ("--partition", "debug"), "unit a is given twice (lines 1 and 3): each unit once"),
        ("\n", ("--partition", "debug"), "no units: pipe a plan's units in"),
        ("a\n", ("--partition", "debug", "--time", "soon"), "--time soon: not a Slurm time"),
        (
            "a\n",
            ("--partition", "debug", "--sbatch-arg=--time=soon"),
            "sbatch refused the job (array.sbatch): sbatch: error: Invalid --time",
        ),
    ],
    ids=["partition", "array-size", "gpus", "twice", "none", "time", "sbatch"],
)
def test_bad_input_is_one_line_and_submits_nothing(slurm, tmp_path, units, args, message):
    if "--gpus-per-task" in args and slurm.gpus != 2:
        pytest.skip(slurm.no_gpus or "the message is for 2 GPUs")
    before = _jobs_known(slurm)
    done = submit(slurm, units, *args, "--dir", tmp_path / "job", "--", "true", check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"reelcache: error: {message}") and done.stderr.count("\n") == 1, done.stderr
    assert _jobs_known(slurm) == before
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("case", ["cpus", "command", "dir"])
def test_what_would_fail_only_inside_the_cluster_is_one_line_before_submitting(slurm, tmp_path, case):
    """More CPUs per task than a node has (the array would pend for ever), a program that does not exist
    (every unit would exit 127 and use up its retries), a job directory that cannot be written."""
    jobdir, command = tmp_path / "job", ["true"]
    if case == "cpus":
        args, message = (
            ["--cpus-per-task", "999"],
            f"--cpus-per-task 999: no node of partition debug has more than {slurm.cpus} CPUs",
        )
    elif case == "command":
        args, command = [], ["reelcache-no-such-program", "--root", "x"]
        message = "command 'reelcache-no-such-program' not found here (not a file, not on PATH)"
    else:
        (tmp_path / "file").write_text("")
        args, jobdir = [], tmp_path / "file/job"
        message = f"cannot write the job directory {jobdir}: "
    before = _jobs_known(slurm)
    done = submit(slurm, "a\n", "--partition", "debug", *args, "--dir", jobdir, "--", *command, check=False)
    assert done.returncode == 2 and done.stderr.startswith(f"reelcache: error: {message}"), done.stderr
    assert done.stderr.count("\n") == 1 and _jobs_known(slurm) == before, done.stderr
    if case == "command":  # where it exists only on the compute nodes: --no-command-check
        done = submit(
            slurm, "a\n", "--partition", "debug", "--no-command-check", "--dry-run", "--dir", jobdir, "--", *command
        )
        assert '\nreelcache-no-such-program --root x "$unit"\n' in (jobdir / "array.sbatch").read_text()


def test_an_account_where_accounting_is_off_is_said_not_pretended(slurm, tmp_path):
    done = submit(
        slurm, "a\n", "--partition", "debug", "--account", "nosuch", "--dry-run", "--dir", tmp_path / "j", "--", "true"
    )
    (line,) = LINE_PREFIX.sub("", done.stderr).splitlines()[:1]
    assert line == (
        "warning: accounting is off on this cluster (AccountingStorageType=accounting_storage/none): "
        "Slurm accepts any --account, so 'nosuch' cannot be checked"
    )
    assert "#SBATCH --account=nosuch" in (tmp_path / "j/array.sbatch").read_text()
    assert done.stdout == (tmp_path / "j/array.sbatch").read_text()  # a dry run prints what it wrote
