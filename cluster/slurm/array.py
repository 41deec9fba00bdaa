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

The scripts come from the one template (script.py); plain sbatch, not submitit (why: script.py).

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

Before anything is submitted, what would fail is one line (checks.py), and so are no units and a
unit twice, and a job directory that cannot be written.

The cache runs one unit per GPU: ``--gpus-per-task 1``. Slurm then sets ``CUDA_VISIBLE_DEVICES``
to the task's GPU, and ``cache run`` uses ``cuda`` (its first visible device) by default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from reelcache import UserError
from reelcache.cluster.slurm import checks, options, script
from reelcache.cluster.slurm.client import answers, slurm
from reelcache.cluster.slurm.options import Resources
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


ARRAY_BODY = """\
dir={dir}
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
dir={dir}
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
    """What ``slurm submit`` was asked for (the CLI's arguments, typed)."""

    command: list[str]
    units: list[str]
    res: Resources = field(default_factory=Resources)
    max_running: int | None = None
    retries: int = 1
    dir: str | None = None
    then: str | None = None
    command_check: bool = True
    dry_run: bool = False


def request(a, units: list[str]) -> Request:
    """The parsed arguments of ``slurm submit`` (options.add_arguments(p, "array")), typed."""
    return Request(
        command=a.command[1:] if a.command[:1] == ["--"] else a.command,
        units=units,
        res=options.resources(a),
        max_running=a.max_running,
        retries=a.retries,
        dir=a.dir,
        then=a.then,
        command_check=not a.no_command_check,
        dry_run=a.dry_run,
    )


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


def job_name(command: list[str]) -> str:
    """``rc-ingest-run`` for ``reelcache ingest run --root R``: the program's first two words."""
    words = [w for w in command[1:] if not w.startswith("-")][:2]
    return "rc-" + "-".join(re.sub(r"[^A-Za-z0-9_.]", "", w) for w in words) if words else Path(command[0]).name


def _directives(res: Resources, name: str, out: str, extra: list[str]) -> list[str]:
    own = [f"--job-name={name}", f"--output={out}", "--open-mode=append", f"--chdir={os.getcwd()}", "--ntasks=1"]
    return own + extra + res.directives()


def render(req: Request, jobdir: Path, name: str) -> tuple[str, str | None]:
    """The array's script and the --then job's (None without --then)."""
    throttle = f"%{req.max_running}" if req.max_running else ""
    extra = [f"--array=0-{len(req.units) - 1}{throttle}", "--requeue"]
    d = shlex.quote(str(jobdir))
    array = script.render(
        what=f"{len(req.units)} units (units.txt), one a task",
        command="slurm submit",
        again=shlex.quote(str(jobdir / "array.sbatch")),
        directives=_directives(req.res, name, str(jobdir / "logs/%A_%a.out"), extra),
        body=ARRAY_BODY.format(dir=d, command=shlex.join(req.command), retries=req.retries, attempts=req.retries + 1),
    )
    if not req.then:
        return array, None
    merge = dataclasses.replace(req.res, gpus_per_task=None)  # the --then command needs no GPU
    then = script.render(
        what="the --then command, once every unit of the array has ended",
        command="slurm submit",
        again=f"--dependency=afterany:<array job id> {shlex.quote(str(jobdir / 'then.sbatch'))}",
        directives=_directives(merge, f"{name}-then", str(jobdir / "logs/then-%j.out"), []),
        body=THEN_BODY.format(dir=d, then=req.then, again=shlex.quote(again_command(req, jobdir))),
    )
    return array, then


def again_command(req: Request, jobdir: Path) -> str:
    """The submit that runs only the units that did not finish, with the resources this one asked for
    (a GPU unit run again without --gpus-per-task would get no GPU), and the --then command after them."""
    words = ["reelcache", "slurm", "submit", *req.res.options(), "--units", str(jobdir / "failed.txt")]
    words += ["--max-running", str(req.max_running)] if req.max_running else []
    words += ["--retries", str(req.retries)] if req.retries != 1 else []
    words += [] if req.command_check else ["--no-command-check"]
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


def _write(jobdir: Path, req: Request, array: str, then: str | None) -> None:
    try:
        for sub in ("logs", "status"):
            (jobdir / sub).mkdir(parents=True, exist_ok=True)
        (jobdir / "units.txt").write_text("".join(u + "\n" for u in req.units))
        (jobdir / "array.sbatch").write_text(array)
        if then:
            (jobdir / "then.sbatch").write_text(then)
    except OSError as e:
        raise UserError(f"cannot write the job directory {jobdir}: {e.strerror or e} (give a writable --dir)") from None


def check(req: Request) -> list[str]:
    """What the command needs here, then the cluster (on a dry run only where one answers): warnings."""
    if not req.command:
        raise UserError("no command: end with -- COMMAND, e.g. -- reelcache ingest run --root /data/rc --wait")
    if req.command_check:
        checks.check_command(req.command)
    if req.dry_run and not answers():
        return []
    return checks.check(req.res, tasks=len(req.units))


def submit(req: Request) -> dict:
    """Check, write the job directory, submit the array (and the --then job). Returns job.json's content."""
    for warning in check(req):
        say(f"warning: {warning}")
    name = req.res.job_name or job_name(req.command)
    jobdir = _job_dir(req, name)
    array, then = render(req, jobdir, name)
    _write(jobdir, req, array, then)
    record = {
        "dir": str(jobdir),
        "units": len(req.units),
        "command": req.command,
        "then": req.then,
        "partition": req.res.partition,
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "array_job": None,
        "then_job": None,
    }
    if req.dry_run:
        print(array + (then or ""), end="")
        say(
            f"dry run: {jobdir}/array.sbatch"
            + (f" and {jobdir}/then.sbatch" if then else "")
            + " written, nothing submitted"
        )
        return record
    try:
        record["array_job"] = script.sbatch(jobdir / "array.sbatch")
    except UserError:
        shutil.rmtree(jobdir)  # nothing was submitted: nothing to keep, and the same --dir works again
        raise
    if then:
        try:
            record["then_job"] = script.sbatch(jobdir / "then.sbatch", f"--dependency=afterany:{record['array_job']}")
        except UserError as e:
            slurm("scancel", record["array_job"])  # all or nothing: no array without its merge
            raise UserError(f"{e} (the --then job; array {record['array_job']} cancelled)") from None
    (jobdir / "job.json").write_text(json.dumps(record, indent=1) + "\n")
    _said_submitted(req, record)
    return record


def _said_submitted(req: Request, record: dict) -> None:
    throttle = f", at most {req.max_running} at once" if req.max_running else ""
    where = f" on partition {req.res.partition}" if req.res.partition else ""
    say(
        f"{len(req.units)} units: job array {record['array_job']}{where}{throttle}, "
        f"{req.retries} retr{'y' if req.retries == 1 else 'ies'} each; logs in {record['dir']}/logs/"
    )
    if record["then_job"]:
        say(f"then: job {record['then_job']} once every unit has ended (afterany): {req.then}")


def cmd_submit(a) -> int:
    """``reelcache slurm submit``: units from stdin (or --units), the command after ``--``."""
    if a.units:
        try:
            lines = Path(a.units).read_text().splitlines()
        except OSError as e:
            raise UserError(f"cannot read --units {a.units}: {e.strerror}") from None
    elif sys.stdin.isatty():
        raise UserError("units are read from stdin: pipe a plan into it, or give --units FILE")
    else:
        lines = sys.stdin.read().splitlines()
    record = submit(request(a, read_units(lines)))
    for key in ("array_job", "then_job"):
        if record[key]:
            print(record[key])
    return 0
