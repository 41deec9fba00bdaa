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

``clocks`` cannot go through parallel: an offset is only as good as its bracket (t0, remote read,
t1; offset = remote - (t0+t1)/2 +- (t1-t0)/2), and parallel gives a job either no stdin or whole
``--pipe`` blocks, each to a new process, so the ssh connect and the Python start would sit
inside every bracket (measured on this machine with ``-S :``, no ssh at all: +280 ms offset
+- 300 ms, the read falling late in the bracket, against +-0.005 ms on a held channel). Instead the head opens the ssh session itself, by the same
sshlogin rules, keeps it open, and the agent answers each line on its stdin with its clock: a
bracket then holds one channel round trip (well under a millisecond on a cluster network). All
sessions connect at once; sampling is node after node so that no other session's traffic widens a
bracket; the sample with the smallest round trip is kept. The price is that sshloginfile features
parallel adds beyond ssh itself (``--controlmaster``, host groups) are not reproduced here.
"""

from __future__ import annotations

import base64
import json
import os
import re
import select
import shlex
import socket
import subprocess
import sys
import threading
import time
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
    logins = list(dict.fromkeys(logins))        # a node named twice is checked once
    if not logins:
        raise UserError(f"hostfile {path} names no host (one sshlogin a line; ':' is this machine)")
    return logins


def agent_code(req: dict) -> str:
    """One line of Python: the agent's source and the request, base64 (immune to any quoting layer)."""
    src = (Path(__file__).with_name("cluster_agent.py").read_text()
           + f"\nmain(json.loads({json.dumps(json.dumps(req))}))\n")
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
    try:
        procs = {login: subprocess.Popen(["parallel", "--nonall", "-S", login, agent_shell(req, python)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True) for login, req in jobs.items()}
    except FileNotFoundError:
        raise UserError("GNU parallel is not installed here (apt-get install parallel)") from None
    out = {}

    def collect(login, p):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            out[login] = (None, f"no answer within {timeout:.0f} s")
            return
        res = _result(so)
        out[login] = (res, "" if res is not None else
                      (se.strip() or so.strip() or f"parallel exited {p.returncode}")[-400:])

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
        return None                 # "[N/A]", "[Not Supported]": nvidia-smi's words for no value


def parse_gpu_csv(text: str) -> list[dict]:
    """``--query-gpu=index,uuid,name,memory.used,memory.total,power.draw,utilization.gpu
    --format=csv,noheader,nounits``: one line a GPU."""
    gpus = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) != 7 or not f[0].isdigit():
            continue
        gpus.append({"index": int(f[0]), "uuid": f[1], "name": f[2], "mem_used": _num(f[3]),
                     "mem_total": _num(f[4]), "power": _num(f[5]), "util": _num(f[6])})
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
    lines = [f"  {len(gpus)} x {', '.join(names)}",
             f"  {'gpu':>3}  {'memory used / total MiB':>24}  {f'power W (mean of {len(samples)})':>20}  {'util %':>6}  procs"]
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


# ---------------------------------------------------------------- clocks

def parse_chronyc(text: str) -> dict:
    """``chronyc tracking``: 'System time : X seconds fast|slow of NTP time' -> signed offset (fast > 0)."""
    kv = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            kv[k.strip().lower()] = v.strip()
    out = {"leap": kv.get("leap status"), "reference": kv.get("reference id"),
           "stratum": int(kv["stratum"]) if kv.get("stratum", "").isdigit() else None, "offset_s": None}
    m = re.match(r"([\d.]+) seconds (fast|slow)", kv.get("system time", ""))
    if m:
        out["offset_s"] = float(m[1]) * (1 if m[2] == "fast" else -1)
    out["synced"] = out["leap"] is not None and out["leap"].lower() != "not synchronised"
    return out


def parse_timedatectl(text: str) -> dict:
    kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    synced = kv.get("NTPSynchronized")
    return {"synced": None if synced is None else synced == "yes", "ntp": kv.get("NTP")}


def daemon_summary(d: dict) -> tuple[str, str | None]:
    """One cell for the table, and a warning if the daemon says the clock is not synchronised."""
    if d.get("tool") == "chronyc":
        c = parse_chronyc(d["out"])
        off = "?" if c["offset_s"] is None else f"{c['offset_s'] * 1e3:+.3f} ms"
        cell = f"chrony: {off} vs NTP, leap {c['leap']}, stratum {c['stratum']}"
        return cell, None if c["synced"] else f"chrony: {c['leap']}"
    if d.get("tool") == "timedatectl":
        t = parse_timedatectl(d["out"])
        cell = f"timedatectl: NTPSynchronized={'yes' if t['synced'] else 'no'}"
        return cell, None if t["synced"] else "timedatectl: NTPSynchronized=no"
    return f"unavailable ({' '.join(str(d.get('err', '')).split())[:100]})", None


class _Session:
    """One node's agent on a persistent channel: ssh by the sshlogin's rules, or a local process for ':'."""

    def __init__(self, login: str, req: dict, python: str):
        self.login = login
        if login == ":":
            argv = [python, "-c", agent_code(req)]
        else:
            words = shlex.split(login)
            ssh = words[:-1] if len(words) > 1 else shlex.split(os.environ.get("PARALLEL_SSH", "ssh"))
            argv = [*ssh, words[-1], agent_shell(req, python)]
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  bufsize=0)
        self.buf = b""

    def line(self, deadline: float) -> str | None:
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def send(self, text: str) -> bool:
        try:
            self.p.stdin.write(text.encode())
            return True
        except OSError:             # the node's end went away: its line() then says so
            return False

    def fail(self) -> str:
        self.p.kill()
        return (self.p.communicate()[1] or b"").decode().strip()[-400:] or f"exited {self.p.returncode}"


def measure(s: _Session, samples: int, deadline: float):
    """NTP-style offset (ns) of the node vs this machine: the bracket with the smallest round trip."""
    best = None
    for _ in range(samples):
        t0 = time.time_ns()
        sent = s.send("t\n")
        r = s.line(deadline)
        t1 = time.time_ns()
        if not sent or r is None or not r.isdigit():
            return None
        rtt = t1 - t0
        if best is None or rtt < best[1]:
            best = (int(r) - (t0 + t1) // 2, rtt)
    return best[0], best[1] // 2


def clock_check(logins: list[str], python: str, samples: int = 16, reads: int = 200_000,
                timeout: float = 60.0) -> dict[str, dict]:
    """login -> {"offset_ns", "uncertainty_ns", "backwards", "daemon", "host"} or {"error"}."""
    req = {"op": "clocks", "reads": reads}
    sessions, out = {}, {}
    for lg in logins:                                                  # all connect at once
        try:
            sessions[lg] = _Session(lg, req, python)
        except OSError as e:
            out[lg] = {"error": f"cannot start {e.filename or 'ssh'}: {e.strerror}"}
    deadline = time.monotonic() + timeout
    for lg, s in sessions.items():
        ready = s.line(deadline)
        while ready is not None and not ready.startswith('{"ready"'):
            ready = s.line(deadline)            # whatever a login script printed first
        if ready is None:
            out[lg] = {"error": f"unreachable: {s.fail()}"}
            continue
        m = measure(s, samples, deadline)
        if m is None:
            out[lg] = {"error": f"no answer: {s.fail()}"}
            continue
        out[lg] = {"offset_ns": m[0], "uncertainty_ns": m[1]}
        s.send("end\n")                 # the node now runs its backwards check and asks its daemon
    for lg, s in sessions.items():
        if "error" in out[lg]:
            continue
        res = None
        while res is None and (line := s.line(deadline)) is not None:
            res = _result(line)
        if res is None:
            out[lg] = {"error": f"no final report: {s.fail()}"}
            continue
        s.p.stdin.close()
        s.p.wait()
        out[lg].update(res)
    return {lg: out[lg] for lg in logins}


def cmd_clocks(a) -> int:
    logins = read_hostfile(a.hostfile)
    print(f"clocks vs {socket.gethostname()} (offset > 0: the node is ahead); {a.samples} round trips a node, "
          f"the shortest kept; {a.reads} reads for steps back")
    res = clock_check(logins, a.python, a.samples, a.reads, a.timeout)
    errors = warnings = 0
    print(f"{'node':<28} {'offset vs head':>24}  {'steps back':>10}  sync daemon")
    for lg in logins:
        r = res[lg]
        if "error" in r:
            print(f"{lg:<28} ERROR: {r['error']}")
            errors += 1
            continue
        off, unc = r["offset_ns"] / 1e6, r["uncertainty_ns"] / 1e6
        b = r["backwards"]
        cell, daemon_warn = daemon_summary(r["daemon"])
        print(f"{node_name(lg, r):<28} {f'{off:+.3f} +- {unc:.3f} ms':>24}  {b['back']:>10}  {cell}")
        if b["back"]:
            print(f"  ERROR: the realtime clock went back {b['back']} time(s) in {b['reads']} reads "
                  f"(at most {b['worst_ns'] / 1e6:.3f} ms): NCCL timeouts follow; check the clocksource and NTP")
            errors += 1
        if abs(off) > a.warn_ms:
            print(f"  WARNING: offset {off:+.3f} ms exceeds --warn-ms {a.warn_ms}")
            warnings += 1
        elif unc > a.warn_ms:
            print(f"  WARNING: round trip too slow ({2 * unc:.1f} ms) to check --warn-ms {a.warn_ms}")
            warnings += 1
        if daemon_warn:
            print(f"  WARNING: {daemon_warn}")
            warnings += 1
    print(f"{errors} error(s), {warnings} warning(s)")
    return 1 if errors or (a.strict and warnings) else 0


# ---------------------------------------------------------------- the command group

def add_commands(top) -> None:
    import argparse

    fmt = argparse.RawDescriptionHelpFormatter
    cl = top.add_parser("cluster", help="per-node checks over a hostfile; dump or stop exactly one run's ranks",
                        epilog=EXAMPLES, formatter_class=fmt)
    sub = cl.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--python", default=sys.executable,
                       help="Python on the nodes that runs the agent (default: this one's path)")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds a node has to answer (60)")

    g = sub.add_parser("gpus", help="GPUs, memory, mean power and GPU processes per node", epilog=EXAMPLES,
                       formatter_class=fmt)
    g.add_argument("--hostfile", required=True, help="GNU parallel sshloginfile (':' = this machine)")
    g.add_argument("--expect-idle", action="store_true", help="exit 1 if any GPU process runs (stale jobs)")
    g.add_argument("--reads", type=int, default=5, help="power reads to average (5)")
    common(g)
    g.set_defaults(fn=lambda a: _exit(cmd_gpus(a)))
    c = sub.add_parser("clocks", help="offset vs this node, sync daemon state, a clock that went back",
                       epilog=EXAMPLES, formatter_class=fmt)
    c.add_argument("--hostfile", required=True)
    c.add_argument("--warn-ms", type=float, default=50.0, help="warn above this offset (50)")
    c.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    c.add_argument("--samples", type=int, default=16, help="round trips per node; the shortest counts (16)")
    c.add_argument("--reads", type=int, default=200_000, help="tight-loop clock reads per node (200000)")
    common(c)
    c.set_defaults(fn=lambda a: _exit(cmd_clocks(a)))
    d = sub.add_parser("dump", help="py-spy dump of every recorded rank of a run into RUN/dumps/<time>/",
                       epilog=EXAMPLES, formatter_class=fmt)
    d.add_argument("--run", required=True, help="the run directory, e.g. ROOT/runs/stage1")
    d.add_argument("--timeout", type=float, default=30.0, help="seconds per rank's dump (30)")
    d.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too; slower)")
    d.add_argument("--method", choices=["auto", "py-spy", "signal"], default="auto",
                   help="auto: py-spy, else SIGUSR1 (the trainer's faulthandler stack file)")
    d.add_argument("--python", default=sys.executable, help="Python on the nodes that runs the agent")
    d.add_argument("--hostfile", help="sshloginfile whose lines say how to reach the recorded hosts "
                                      "(user@host, ssh -p ...); default: ssh to the recorded host name")
    d.set_defaults(fn=lambda a: _exit(_procs().cmd_dump(a)))
    s = sub.add_parser("stop", help="SIGTERM, then SIGKILL after --grace, to exactly a run's recorded pids",
                       epilog=EXAMPLES, formatter_class=fmt)
    s.add_argument("--run", required=True)
    s.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL (30)")
    s.add_argument("--python", default=sys.executable, help="Python on the nodes that runs the agent")
    s.add_argument("--hostfile", help="sshloginfile whose lines say how to reach the recorded hosts")
    s.set_defaults(fn=lambda a: _exit(_procs().cmd_stop(a)))


def _procs():
    from reelcache.train import cluster_procs

    return cluster_procs


def _exit(code: int) -> None:
    if code:
        raise SystemExit(code)
