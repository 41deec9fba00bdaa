"""``reelcache slurm submit``: a stage's units as one Slurm job array, with retries and a merge after.

    reelcache ingest plan --root /data/rc ... | reelcache slurm submit --partition cpu --max-running 64 \\
        --then "reelcache catalog merge --root /data/rc" -- reelcache ingest run --root /data/rc --wait

Units come from stdin (or ``--units FILE``), one a line, and go to ``DIR/units.txt``; one array job
``--array=0-(n-1)%N`` runs ``COMMAND UNIT_i`` in task i; ``--then`` is one more job, after the array.
The job directory (``--dir``, on storage every node sees) keeps all of it: ``units.txt``, the two
scripts (``array.sbatch``, ``then.sbatch``: ``sbatch`` them again by hand if need be), ``logs/``
(``<array>_<task>.out``, opened in append mode so a retried task's earlier attempts stay above),
``status/<task>.ok`` or ``.failed`` (one line per failed attempt), ``failed.txt`` (written by the
``--then`` job: the units that never succeeded, ready to pipe into another submit) and ``job.json``.

Why plain sbatch scripts. The units are already commands that anything can run (GNU parallel
does today); a rendered script is what an operator reads, edits and resubmits, and needs nothing
on the nodes but bash. submitit pickles a Python callable per task: the nodes would need the same
Python and reelcache to unpickle, and its job folders hold pickles, not commands. Both scripts
come from one template (``TEMPLATE``) and ``scontrol``/``sinfo``/``sbatch`` are the only tools.

Retries. Slurm retries nothing that exits non-zero (``--requeue`` covers node failures and
preemption only), so a task whose unit fails counts the failure in ``status/<task>.failed`` and,
up to ``--retries`` times, requeues itself (``scontrol requeue <array>_<task>``): the same task
and job id (``SLURM_RESTART_COUNT`` + 1), placed anew, perhaps on another node, after Slurm's
requeue delay (``cred_expire + 1``, 121 s by default). The array stays one job, so the ``--then``
job's dependency still waits for it (a requeued task is pending, not ended). Failures, not
restarts, are counted: a requeue by an admin or a node failure does not use up a retry.

A unit run twice is still one unit. A requeue kills a running task (SIGTERM, then SIGKILL) and
starts it again from the top; the unit commands are idempotent: a finished unit is skipped
(its sidecar exists), a killed one is cleaned and redone, and its lease keeps two runs apart.
The killed run's lease stays behind: on the same node it is stale at once (its pid is gone); on
another node only after ``TTL_S`` (300 s) without a heartbeat, which ``run --wait`` waits out
(without ``--wait`` the run exits 2 naming the holder, and the retry is used up). Hence ``--wait``
in the examples.

``--then`` depends on ``afterany`` of the array, not ``afterok``: with ``afterok`` one unit that
fails for good leaves the merge pending for ever (DependencyNeverSatisfied). A merge is
idempotent and incremental, so merging what finished is always right; the ``--then`` job then
lists the units that did not finish (``failed.txt``) and exits 1 when there are any, or with the
command's own status.

Before anything is submitted, each of these is one line (a UserError): no units, a unit twice, no
Slurm controller answering, a partition that does not exist, more units than the cluster's
``MaxArraySize`` allows in one array, more GPUs or CPUs per task than any node of the partition has
(the array would pend for ever), a command that does not exist here (every unit would fail with
127 and use up its retries), an account that ``sacctmgr`` does not know, a job directory that
cannot be written.
Where accounting is off (``AccountingStorageType=accounting_storage/none``) Slurm accepts any
``--account`` and nothing can check it: that is said as a warning.

The cache runs one unit per GPU: ``--gpus-per-task 1``. Slurm then sets ``CUDA_VISIBLE_DEVICES``
to the task's GPU, and ``cache run`` uses ``cuda`` (its first visible device) by default.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from reelcache import UserError
from reelcache.log import say

EXAMPLES = """\
examples:
  reelcache ingest plan --root /data/rc --source openvid --meta OpenVid-1M.csv --videos /data/openvid \\
    | reelcache slurm submit --partition cpu --cpus-per-task 4 --max-running 200 --time 2:00:00 \\
        --then "reelcache catalog merge --root /data/rc" -- reelcache ingest run --root /data/rc --wait
  reelcache cache plan --root /data/rc --config configs/cache/wan-stage1.toml \\
    | reelcache slurm submit --partition gpu --gpus-per-task 1 --cpus-per-task 8 --account vision \\
        --then "reelcache catalog merge --root /data/rc" -- reelcache cache run --root /data/rc --wait
  reelcache slurm submit --partition cpu --units slurm-jobs/rc-ingest-run-20260101-120000/failed.txt \\
        -- reelcache ingest run --root /data/rc --wait          # again, only the units that failed

Prints the array's job id (and the --then job's) on stdout; everything is in the job directory
(--dir): units.txt, array.sbatch, then.sbatch, logs/, status/, failed.txt, job.json.
"""

# One template for both jobs: the array (one unit a task) and the --then job.
TEMPLATE = """\
#!/bin/bash
# {what}, written by `reelcache slurm submit` at {when}.
# Submit it again by hand with: sbatch {script}
{directives}
set -uo pipefail
dir={dir}
{body}"""

ARRAY_BODY = """\
i=$SLURM_ARRAY_TASK_ID
unit=$(sed -n "$((i + 1))p" "$dir/units.txt")
failures=$(cat "$dir/status/$i.failed" 2>/dev/null | wc -l)
echo "$(date '+%F %T') unit $unit: task $i of array $SLURM_ARRAY_JOB_ID on $(hostname)," \\
    "attempt $((failures + 1)) of {attempts}, restart ${{SLURM_RESTART_COUNT:-0}}"
rm -f "$dir/status/$i.ok"
{command} "$unit"
rc=$?
if [ "$rc" -eq 0 ]; then
    echo "$(hostname) $(date '+%F %T') restart ${{SLURM_RESTART_COUNT:-0}}" > "$dir/status/$i.ok"
    exit 0
fi
echo "exit $rc on $(hostname) at $(date '+%F %T'), restart ${{SLURM_RESTART_COUNT:-0}}" >> "$dir/status/$i.failed"
if [ "$failures" -lt {retries} ]; then
    echo "$(date '+%F %T') unit $unit failed (exit $rc): requeued for retry $((failures + 1)) of {retries}"
    # The requeue ends this script (SIGTERM) and starts the task again later, on whatever node.
    scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_$i" && sleep 600
fi
echo "$(date '+%F %T') unit $unit failed (exit $rc)"
exit "$rc"
"""

THEN_BODY = """\
{then}
rc=$?
: > "$dir/failed.txt"
n=0
while IFS= read -r unit; do
    [ -e "$dir/status/$n.ok" ] || printf '%s\\n' "$unit" >> "$dir/failed.txt"
    n=$((n + 1))
done < "$dir/units.txt"
failed=$(wc -l < "$dir/failed.txt")
if [ "$failed" -gt 0 ]; then
    echo "$failed of $n units did not finish (logs: $dir/logs/, status: $dir/status/); to run just" \\
        "them again, and merge after them:"
    echo {again}
    [ "$rc" -eq 0 ] && rc=1
fi
exit "$rc"
"""


@dataclass
class Request:
    """What `submit` was asked for (the CLI's arguments, typed)."""

    command: list[str]
    units: list[str]
    partition: str
    account: str | None = None
    max_running: int | None = None
    retries: int = 1
    time: str | None = None
    cpus_per_task: int = 1
    gpus_per_task: int | None = None
    mem: str | None = None
    job_name: str | None = None
    dir: str | None = None
    then: str | None = None
    sbatch_args: tuple[str, ...] = ()
    dry_run: bool = False


def read_units(lines) -> list[str]:
    """One unit a line, blank lines skipped; a unit given twice would run twice at once, so it is an error."""
    units, seen = [], {}
    for n, line in enumerate(lines, 1):
        unit = line.strip()
        if not unit:
            continue
        if unit in seen:
            raise UserError(f"unit {unit} is given twice (lines {seen[unit]} and {n}): each unit once")
        seen[unit] = n
        units.append(unit)
    if not units:
        raise UserError("no units: pipe a plan's units in (reelcache ingest plan ... | reelcache slurm submit ...)")
    return units


def slurm(*cmd: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise UserError(f"{cmd[0]} not found: run this where Slurm's commands are (a login node)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{' '.join(cmd)} did not answer in 120 s: is slurmctld up?") from None


def _said(done: subprocess.CompletedProcess) -> str:
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def cluster_config() -> dict[str, str]:
    """``scontrol show config`` as a dict (``Key = value`` lines)."""
    done = slurm("scontrol", "show", "config")
    if done.returncode:
        raise UserError(f"scontrol show config: {_said(done)}")
    return {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in done.stdout.splitlines()) if v}


def node_gpus(gres: str) -> int:
    """GPUs in a node's Gres string: ``gpu:2``, ``gpu:a100:8(S:0-1)``, ``gpu:a100:4,gpu:v100:2``, ``(null)``."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def check_controller(done: subprocess.CompletedProcess) -> None:
    """A UserError when a client's answer says that no controller answered (not what the client asked about)."""
    said = done.stderr + done.stdout
    if done.returncode and ("Unable to contact slurm controller" in said or "Unable to establish" in said):
        conf = os.environ.get("SLURM_CONF", "the default slurm.conf")
        raise UserError(f"no Slurm controller answers ({_said(done)}): is slurmctld up, and is {conf} this cluster's?")


def check_partition(partition: str) -> list[str]:
    """A UserError if no controller answers or the partition does not exist; warnings (it is not UP)."""
    done = slurm("scontrol", "show", "partition", partition, "--oneliner")
    check_controller(done)
    if done.returncode or not done.stdout.strip():
        names = slurm("sinfo", "--noheader", "--format", "%R").stdout.split()
        raise UserError(
            f"partition {partition!r} does not exist on this cluster (partitions: {', '.join(names) or 'none'})"
        )
    state = re.search(r"\bState=(\S+)", done.stdout)
    if state and state.group(1) != "UP":
        return [f"partition {partition} is {state.group(1)}: the jobs wait until it is UP"]
    return []


def partition_gpus(partition: str) -> list[int]:
    """The GPUs of each node of the partition."""
    return [node_gpus(g) for g in _per_node(partition, "%G")]


def partition_cpus(partition: str) -> list[int]:
    """The CPUs of each node of the partition."""
    return [int(c) for c in _per_node(partition, "%c") if c.strip().isdigit()]


def _per_node(partition: str, field: str) -> list[str]:
    nodes = slurm("sinfo", "--noheader", "--Node", "--partition", partition, "--format", f"%N|{field}").stdout
    return list(dict(line.split("|", 1) for line in nodes.splitlines() if "|" in line).values())  # a node once


def check_cpus(cpus: int, partition: str, what: str = "--cpus-per-task") -> None:
    """A UserError when no node of the partition has `cpus` CPUs (the job would pend for ever)."""
    most = max(partition_cpus(partition), default=0)
    if cpus > most:
        raise UserError(f"{what} {cpus}: no node of partition {partition} has more than {most} CPUs")


def check_command(command: list[str]) -> None:
    """A UserError when the units' program does not exist here: every unit would fail with 127."""
    if shutil.which(command[0]) is None:
        raise UserError(
            f"command {command[0]!r} not found here (not a file, not on PATH): every unit would fail with "
            "exit status 127; give the program's path, or run where it is installed"
        )


def job_ended(job: str) -> bool | None:
    """Whether a job (and every requeue of it) has ended: True, False (pending, running, requeued), or
    None when the controller does not answer (the caller asks again later)."""
    done = slurm("squeue", "--noheader", "--jobs", str(job), "--format", "%T")
    if done.returncode:
        return True if "Invalid job id" in done.stderr else None
    return not done.stdout.strip()


def check_account(account: str, config: dict[str, str]) -> list[str]:
    """A UserError if the cluster's accounting does not know the account; warnings (it keeps none)."""
    storage = config.get("AccountingStorageType", "accounting_storage/none")
    if storage == "accounting_storage/none":
        return [
            f"accounting is off on this cluster (AccountingStorageType={storage}): Slurm accepts any "
            f"--account, so {account!r} cannot be checked"
        ]
    known = slurm("sacctmgr", "--noheader", "--parsable2", "show", "account", account, "format=Account")
    if known.returncode:
        return [f"--account {account} not checked: sacctmgr: {_said(known)}"]
    if account not in known.stdout.split():
        raise UserError(f"account {account!r} does not exist (sacctmgr show account {account})")
    return []


def check(req: Request) -> list[str]:
    """Every check that can be made before submitting: raises UserError, returns warnings."""
    warnings = check_partition(req.partition)
    config = cluster_config()
    max_array = int(config.get("MaxArraySize", "1001"))
    if len(req.units) > max_array:
        raise UserError(
            f"{len(req.units)} units are more than one job array may hold here (MaxArraySize={max_array}, "
            f"indices 0..{max_array - 1}): plan larger units, or submit the units in parts of {max_array}"
        )
    check_command(req.command)
    if req.cpus_per_task > 1:
        check_cpus(req.cpus_per_task, req.partition)
    if req.gpus_per_task:
        most = max(partition_gpus(req.partition), default=0)
        if req.gpus_per_task > most:
            raise UserError(
                f"--gpus-per-task {req.gpus_per_task}: no node of partition {req.partition} has more than "
                f"{most} GPU{'s' if most != 1 else ''}"
            )
    if req.account:
        warnings += check_account(req.account, config)
    return warnings


def job_name(command: list[str]) -> str:
    """``rc-ingest-run`` for ``reelcache ingest run --root R``: the program's first two words."""
    words = [w for w in command[1:] if not w.startswith("-")][:2]
    return "rc-" + "-".join(re.sub(r"[^A-Za-z0-9_.]", "", w) for w in words) if words else Path(command[0]).name


def directives(req: Request, name: str, out: str, extra: list[str]) -> str:
    lines = [f"--job-name={name}", f"--partition={req.partition}", f"--output={out}", "--open-mode=append"]
    lines += [f"--chdir={os.getcwd()}", "--ntasks=1", f"--cpus-per-task={req.cpus_per_task}"]
    lines += [f"--account={req.account}"] if req.account else []
    lines += [f"--time={req.time}"] if req.time else []
    lines += [f"--mem={req.mem}"] if req.mem else []
    lines += extra + list(req.sbatch_args)
    for x in lines:
        if re.search(r"\s", x):  # sbatch reads #SBATCH lines word by word
            raise UserError(f"#SBATCH {x}: a value with a space cannot be an sbatch directive (a path? move it)")
    return "\n".join(f"#SBATCH {x}" for x in lines)


def render(req: Request, jobdir: Path, name: str) -> tuple[str, str | None]:
    """The array's script and the --then job's (None without --then)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    command = shlex.join(req.command)
    throttle = f"%{req.max_running}" if req.max_running else ""
    extra = [f"--array=0-{len(req.units) - 1}{throttle}", "--requeue"]
    extra += [f"--gpus-per-task={req.gpus_per_task}"] if req.gpus_per_task else []
    array = TEMPLATE.format(
        what=f"{len(req.units)} units (units.txt), one a task",
        when=when,
        script=shlex.quote(str(jobdir / "array.sbatch")),
        directives=directives(req, name, str(jobdir / "logs/%A_%a.out"), extra),
        dir=shlex.quote(str(jobdir)),
        body=ARRAY_BODY.format(command=command, retries=req.retries, attempts=req.retries + 1),
    )
    if not req.then:
        return array, None
    then = TEMPLATE.format(
        what="the --then command, once every unit of the array has ended",
        when=when,
        script=f"--dependency=afterany:<array job id> {shlex.quote(str(jobdir / 'then.sbatch'))}",
        directives=directives(req, f"{name}-then", str(jobdir / "logs/then-%j.out"), []),
        dir=shlex.quote(str(jobdir)),
        body=THEN_BODY.format(then=req.then, again=shlex.quote(again_command(req, jobdir))),
    )
    return array, then


def again_command(req: Request, jobdir: Path) -> str:
    """The submit that runs only the units that did not finish, with the resources this one asked for
    (a GPU unit run again without --gpus-per-task would get no GPU), and the --then command after them."""
    words = ["reelcache", "slurm", "submit", "--partition", req.partition, "--units", str(jobdir / "failed.txt")]
    options = {
        "--account": req.account,
        "--max-running": req.max_running,
        "--retries": req.retries if req.retries != 1 else None,
        "--time": req.time,
        "--cpus-per-task": req.cpus_per_task if req.cpus_per_task != 1 else None,
        "--gpus-per-task": req.gpus_per_task,
        "--mem": req.mem,
        "--job-name": req.job_name,
    }
    words += [w for k, v in options.items() if v is not None for w in (k, str(v))]
    words += [f"--sbatch-arg={x}" for x in req.sbatch_args]
    words += ["--then", req.then] if req.then else []
    return shlex.join([*words, "--", *req.command])


def _job_dir(req: Request, name: str) -> Path:
    if req.dir:
        d = Path(req.dir).resolve()
        if d.exists() and any(d.iterdir()):
            raise UserError(f"job directory {d} is not empty: give another --dir")
        return d
    base = Path("slurm-jobs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    d, n = base, 1
    while d.exists():
        n += 1
        d = base.with_name(f"{base.name}-{n}")
    return d


def _sbatch(*args: str) -> str:
    done = slurm("sbatch", "--parsable", *args)
    if done.returncode:
        raise UserError(f"sbatch refused the job: {_said(done)}")
    return done.stdout.strip().split(";")[0]  # "id" or "id;cluster"


def submit(req: Request) -> dict:
    """Check, write the job directory, submit the array (and the --then job). Returns job.json's content."""
    if not req.command:
        raise UserError("no command: end with -- COMMAND, e.g. -- reelcache ingest run --root /data/rc --wait")
    for warning in check(req):
        say(f"warning: {warning}")
    name = req.job_name or job_name(req.command)
    jobdir = _job_dir(req, name)
    array, then = render(req, jobdir, name)
    try:
        for sub in ("logs", "status"):
            (jobdir / sub).mkdir(parents=True, exist_ok=True)
        (jobdir / "units.txt").write_text("".join(u + "\n" for u in req.units))
        (jobdir / "array.sbatch").write_text(array)
        if then:
            (jobdir / "then.sbatch").write_text(then)
    except OSError as e:
        raise UserError(f"cannot write the job directory {jobdir}: {e.strerror or e} (give a writable --dir)") from None
    record = {
        "dir": str(jobdir),
        "units": len(req.units),
        "command": req.command,
        "then": req.then,
        "partition": req.partition,
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "array_job": None,
        "then_job": None,
    }
    if req.dry_run:
        say(
            f"dry run: {jobdir}/array.sbatch"
            + (f" and {jobdir}/then.sbatch" if then else "")
            + " written, nothing submitted"
        )
        return record
    try:
        record["array_job"] = _sbatch(str(jobdir / "array.sbatch"))
    except UserError:
        shutil.rmtree(jobdir)  # nothing was submitted: nothing to keep, and the same --dir works again
        raise
    if then:
        try:
            record["then_job"] = _sbatch(f"--dependency=afterany:{record['array_job']}", str(jobdir / "then.sbatch"))
        except UserError as e:
            slurm("scancel", record["array_job"])  # all or nothing: no array without its merge
            raise UserError(f"{e} (the --then job; array {record['array_job']} cancelled)") from None
    (jobdir / "job.json").write_text(json.dumps(record, indent=1) + "\n")
    throttle = f", at most {req.max_running} at once" if req.max_running else ""
    say(
        f"{len(req.units)} units: job array {record['array_job']} on partition {req.partition}{throttle}, "
        f"{req.retries} retr{'y' if req.retries == 1 else 'ies'} each; logs in {jobdir}/logs/"
    )
    if then:
        say(f"then: job {record['then_job']} once every unit has ended (afterany): {req.then}")
    return record


def cmd_submit(a) -> int:
    """``reelcache slurm submit``: units from stdin (or --units), the command after ``--``."""
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.units:
        try:
            lines = Path(a.units).read_text().splitlines()
        except OSError as e:
            raise UserError(f"cannot read --units {a.units}: {e.strerror}") from None
    elif sys.stdin.isatty():
        raise UserError("units are read from stdin: pipe a plan into it, or give --units FILE")
    else:
        lines = sys.stdin.read().splitlines()
    req = Request(
        command=command,
        units=read_units(lines),
        partition=a.partition,
        account=a.account,
        max_running=a.max_running,
        retries=a.retries,
        time=a.time,
        cpus_per_task=a.cpus_per_task,
        gpus_per_task=a.gpus_per_task,
        mem=a.mem,
        job_name=a.job_name,
        dir=a.dir,
        then=a.then,
        sbatch_args=tuple(a.sbatch_arg),
        dry_run=a.dry_run,
    )
    record = submit(req)
    for key in ("array_job", "then_job"):
        if record[key]:
            print(record[key])
    return 0
