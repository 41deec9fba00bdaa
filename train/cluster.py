"""``reelcache cluster gpus|clocks|dump|stop``: the operator's checks before and during a run.

The replication lost days to operations, not to the model: stale processes from an earlier job
holding GPUs, NCCL crashing every 30 minutes because one node's clock ran backwards, a frozen
job found only by py-spy on every node, and a ``pkill -f python.*train.py`` that stops whatever
matches on every host. Each check here reads a hostfile in GNU parallel's sshloginfile format
(one sshlogin a line: ``host``, ``user@host``, ``N/host``, ``ssh -p 2222 host``, ``:`` for this
machine; ``#`` comments), prints a table per node and exits 1 when something is wrong.

Transport. Every node runs the same stdlib-only agent (``cluster_agent.py``, sent as source in
one ``python -c`` argument). ``gpus``, ``dump`` and ``stop`` go through GNU parallel, one
``parallel --nonall -S LOGIN`` per node started together, so parallel's sshlogin rules ($PARALLEL_SSH,
per-login ssh commands, ``:``) apply unchanged and each node's output, stderr and exit status
stay apart (an unreachable node is named, not lost in a shared joblog).
``clocks`` holds its own ssh sessions instead (``cluster_clocks.py`` says why).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from reelcache import UserError

EXAMPLES = """\
examples:
  reelcache cluster gpus   --hostfile nodes.txt --expect-idle     # before launching: no stale GPU processes
  reelcache cluster clocks --hostfile nodes.txt --warn-ms 50     # offsets vs this node, sync daemon, clock steps back
  reelcache cluster dump   --run /data/rc/runs/stage1           # py-spy of every rank of THIS run
  reelcache cluster stop   --run /data/rc/runs/stage1 --grace 30 # SIGTERM, then SIGKILL, to exactly its recorded pids

The hostfile is GNU parallel's sshloginfile (the one ingest and cache use; ':' = this machine).
Exit status 1: a node unreachable, a GPU process with --expect-idle, a clock error (or a warning
with --strict), a rank that could not be dumped, a process that survived stop.
"""


def read_hostfile(path) -> list[str]:
    """The sshlogins of a GNU parallel sshloginfile, with any ``N/`` (job slots) prefix removed."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read hostfile {path}: {e.strerror}") from None
    logins = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            logins.append(re.sub(r"^\d+/", "", line))
    logins = list(dict.fromkeys(logins))  # a node named twice is checked once
    if not logins:
        raise UserError(f"hostfile {path} names no host (one sshlogin a line; ':' is this machine)")
    return logins


def agent_code(req: dict) -> str:
    """One line of Python: the agent's source and the request, base64 (immune to any quoting layer)."""
    src = (
        Path(__file__).with_name("cluster_agent.py").read_text()
        + f"\nmain(json.loads({json.dumps(json.dumps(req))}))\n"
    )
    b64 = base64.b64encode(src.encode()).decode()
    return f"import base64;exec(compile(base64.b64decode('{b64}'),'reelcache-cluster-agent','exec'))"


def agent_shell(req: dict, python: str) -> str:
    return f"{shlex.quote(python)} -c {shlex.quote(agent_code(req))}"


def _result(stdout: str):
    for line in reversed(stdout.splitlines()):
        if line.startswith('{"result"'):
            return json.loads(line)["result"]
    return None


def run_agents(jobs: dict[str, dict], python: str, timeout: float) -> dict[str, tuple]:
    """Run the agent with each login's request through ``parallel --nonall -S LOGIN``, all at once.
    Returns login -> (result or None, error text)."""
    try:  # a session of its own: on a timeout, parallel and its ssh (which holds the pipes) die together
        procs = {
            login: subprocess.Popen(
                ["parallel", "--nonall", "-S", login, agent_shell(req, python)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for login, req in jobs.items()
        }
    except FileNotFoundError:
        raise UserError("GNU parallel is not installed here (apt-get install parallel)") from None
    out = {}

    def collect(login, p):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            so, se = p.communicate()
            out[login] = (None, f"no answer within {timeout:.0f} s")
            return
        res = _result(so)
        out[login] = (
            res,
            ""
            if res is not None
            else (se.strip() or so.strip() or f"the agent printed nothing (parallel exited {p.returncode})")[-400:],
        )

    threads = [threading.Thread(target=collect, args=item) for item in procs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def node_name(login: str, res) -> str:
    return f": ({res['host']})" if login == ":" and res else login


# ---------------------------------------------------------------- gpus


def _num(v: str):
    v = v.strip()
    try:
        return float(v)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]": nvidia-smi's words for no value


def parse_gpu_csv(text: str) -> list[dict]:
    """``--query-gpu=index,uuid,name,memory.used,memory.total,power.draw,utilization.gpu
    --format=csv,noheader,nounits``: one line a GPU."""
    gpus = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) != 7 or not f[0].isdigit():
            continue
        gpus.append(
            {
                "index": int(f[0]),
                "uuid": f[1],
                "name": f[2],
                "mem_used": _num(f[3]),
                "mem_total": _num(f[4]),
                "power": _num(f[5]),
                "util": _num(f[6]),
            }
        )
    return gpus


def parse_apps_csv(text: str) -> list[dict]:
    """``--query-compute-apps=gpu_uuid,pid,process_name,used_memory``: a process name may hold commas."""
    apps = []
    for line in text.splitlines():
        parts = line.split(",", 2)
        if len(parts) < 3 or not parts[1].strip().isdigit():
            continue
        name, mem = parts[2].rsplit(",", 1) if "," in parts[2] else (parts[2], "")
        apps.append({"gpu_uuid": parts[0].strip(), "pid": int(parts[1]), "name": name.strip(), "mem": _num(mem)})
    return apps


def gpu_report(res: dict) -> tuple[list[str], list[str], int]:
    """Lines for one node's answer, its problems, and its GPU process count."""
    if not res.get("nvidia_smi"):
        return ["  no GPU (no nvidia-smi on this node)"], [], 0
    reads = res["gpu_reads"]
    failed = [r for r in reads if r["rc"] != 0]
    if failed:
        msg = (failed[0]["err"] or failed[0]["out"]).strip()
        if "No devices were found" in msg:
            return [f"  no GPU (nvidia-smi: {msg})"], [], 0
        return [f"  nvidia-smi failed: {msg}"], [f"nvidia-smi failed: {msg[:120]}"], 0
    samples = [parse_gpu_csv(r["out"]) for r in reads]
    gpus = samples[-1]
    if not gpus:
        return ["  no GPU (nvidia-smi lists none)"], [], 0
    apps = parse_apps_csv(res["apps"]["out"]) if res["apps"]["rc"] == 0 else []
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    names = sorted({g["name"] for g in gpus})
    lines = [
        f"  {len(gpus)} x {', '.join(names)}",
        f"  {'gpu':>3}  {'memory used / total MiB':>24}  {f'power W (mean of {len(samples)})':>20}  "
        f"{'util %':>6}  procs",
    ]
    for g in gpus:
        power = [s["power"] for read in samples for s in read if s["index"] == g["index"] and s["power"] is not None]
        mean = f"{sum(power) / len(power):.1f}" if power else "n/a"
        n = sum(1 for a in apps if a["gpu_uuid"] == g["uuid"])
        mem = f"{g['mem_used'] or 0:.0f} / {g['mem_total'] or 0:.0f}"
        util = "n/a" if g["util"] is None else f"{g['util']:.0f}"
        lines.append(f"  {g['index']:>3}  {mem:>24}  {mean:>20}  {util:>6}  {n}")
    if apps:
        lines.append(f"  {'gpu':>3}  {'pid':>8}  {'MiB':>8}  process")
        for a in apps:
            mem = "n/a" if a["mem"] is None else f"{a['mem']:.0f}"
            lines.append(f"  {by_uuid.get(a['gpu_uuid'], '?'):>3}  {a['pid']:>8}  {mem:>8}  {a['name']}")
    return lines, [], len(apps)


def cmd_gpus(a) -> int:
    logins = read_hostfile(a.hostfile)
    answers = run_agents({lg: {"op": "gpus", "reads": a.reads} for lg in logins}, a.python, a.timeout)
    bad = 0
    for login in logins:
        res, err = answers[login]
        print(f"node {node_name(login, res)}")
        if res is None:
            print(f"  UNREACHABLE: {err}")
            bad += 1
            continue
        lines, problems, nproc = gpu_report(res)
        print("\n".join(lines))
        if a.expect_idle and nproc:
            problems.append(f"{nproc} GPU process(es) running (--expect-idle)")
        for p in problems:
            print(f"  ERROR: {p}")
        bad += bool(problems)
    return 1 if bad else 0


# ---------------------------------------------------------------- the command group


def add_commands(top) -> None:
    import argparse

    from reelcache.settings import arg

    fmt = argparse.RawDescriptionHelpFormatter
    cl = top.add_parser(
        "cluster",
        help="per-node checks over a hostfile; dump or stop exactly one run's ranks",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    sub = cl.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument(
            "--python",
            default=sys.executable,
            help="Python on the nodes that runs the agent (default: this one's path)",
        )
        p.add_argument("--timeout", type=arg(float, gt=0), default=60.0, help="seconds a node has to answer (60)")

    g = sub.add_parser(
        "gpus", help="GPUs, memory, mean power and GPU processes per node", epilog=EXAMPLES, formatter_class=fmt
    )
    g.add_argument("--hostfile", required=True, help="GNU parallel sshloginfile (':' = this machine)")
    g.add_argument("--expect-idle", action="store_true", help="exit 1 if any GPU process runs (stale jobs)")
    g.add_argument("--reads", type=arg(int, ge=1), default=5, help="power reads to average (5)")
    common(g)
    g.set_defaults(fn=cmd_gpus)
    c = sub.add_parser(
        "clocks",
        help="offset vs this node, sync daemon state, a clock that went back",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    c.add_argument("--hostfile", required=True)
    c.add_argument("--warn-ms", type=arg(float, ge=0), default=50.0, help="warn above this offset (50)")
    c.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    c.add_argument("--samples", type=arg(int, ge=1), default=16, help="round trips per node; the shortest counts (16)")
    c.add_argument("--reads", type=arg(int, ge=1), default=200_000, help="tight-loop clock reads per node (200000)")
    common(c)
    c.set_defaults(fn=lambda a: _clocks().cmd_clocks(a))
    d = sub.add_parser(
        "dump",
        help="py-spy dump of every recorded rank of a run into RUN/dumps/<time>/",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    d.add_argument("--run", required=True, help="the run directory, e.g. ROOT/runs/stage1")
    d.add_argument("--timeout", type=arg(float, gt=0), default=30.0, help="seconds per rank's dump (30)")
    d.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too; slower)")
    d.add_argument(
        "--method",
        choices=["auto", "py-spy", "signal"],
        default="auto",
        help="auto: py-spy, else SIGUSR1 (the trainer's faulthandler stack file)",
    )
    d.add_argument("--python", default=sys.executable, help="Python on the nodes that runs the agent")
    d.add_argument(
        "--hostfile",
        help="sshloginfile whose lines say how to reach the recorded hosts "
        "(user@host, ssh -p ...); default: ssh to the recorded host name",
    )
    d.set_defaults(fn=lambda a: _procs().cmd_dump(a))
    s = sub.add_parser(
        "stop",
        help="SIGTERM, then SIGKILL after --grace, to exactly a run's recorded pids",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    s.add_argument("--run", required=True)
    s.add_argument("--grace", type=arg(float, ge=0), default=30.0, help="seconds between SIGTERM and SIGKILL (30)")
    s.add_argument("--python", default=sys.executable, help="Python on the nodes that runs the agent")
    s.add_argument("--hostfile", help="sshloginfile whose lines say how to reach the recorded hosts")
    s.set_defaults(fn=lambda a: _procs().cmd_stop(a))


def _clocks():
    from reelcache.train import cluster_clocks

    return cluster_clocks


def _procs():
    from reelcache.train import cluster_procs

    return cluster_procs
