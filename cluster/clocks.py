"""``reelcache cluster clocks``: each node's clock against this one's, and each clock's own health.

Clock skew broke the replication's NCCL every ~30 minutes, from a node whose clock ran backwards.
Per node this reports: the offset against the head (the machine running the command), the sync
daemon's own view (``chronyc tracking``, else ``timedatectl show``), and whether a tight loop of
realtime reads on the node ever saw the clock go back (an ERROR).

Why not through GNU parallel like the other commands: an offset is only as good as its bracket
(t0, remote read, t1; offset = remote - (t0+t1)/2 +- (t1-t0)/2), and parallel gives a job either
no stdin or whole ``--pipe`` blocks, each to a new process, so the ssh connect and the Python
start would sit inside every bracket (measured on this machine with ``-S :``, no ssh at all:
+280 ms offset +- 300 ms, the read falling late in the bracket, against +-0.005 ms on a held
channel). Instead the head opens the ssh session itself, by the same sshlogin rules ($PARALLEL_SSH,
a login's own ssh command, ``:`` = a local process), keeps it open, and the agent answers each
line on its stdin with its clock: a bracket then holds one channel round trip (well under a
millisecond on a cluster network). All
sessions connect at once; sampling is node after node so that no other session's traffic widens a
bracket; the sample with the smallest round trip is kept. The price is that sshloginfile features
parallel adds beyond ssh itself (``--controlmaster``, host groups) are not reproduced here.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import socket
import subprocess
import time

from reelcache import UserError
from reelcache.cluster.hosts import agent_code, agent_result, agent_shell, node_logins, node_name

# An offset beyond which a node is an ERROR (exit 1), not a warning: a sync daemon that finds its clock this
# far off corrects it by a step (chrony's usual `makestep 1 3`; ntpd steps above 128 ms, systemd-timesyncd
# above 400 ms), a jump of the realtime clock under the running job, what the backwards check flags and
# what preceded the replication's NCCL failures; torch's elastic rendezvous (c10d) also drops a node whose
# wall clock is more than 10 s behind (a heartbeat every 5 s, dead after 3 missed).
ERROR_MS = 1000.0
WHY_ERROR = (
    "its sync daemon will step the clock (a jump under the running job, what preceded the replication's NCCL "
    "failures), and torch's elastic rendezvous drops a node 10 s behind"
)


def parse_chronyc(text: str) -> dict:
    """``chronyc tracking``: 'System time : X seconds fast|slow of NTP time' -> signed offset (fast > 0)."""
    kv = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            kv[k.strip().lower()] = v.strip()
    out = {
        "leap": kv.get("leap status"),
        "reference": kv.get("reference id"),
        "stratum": int(kv["stratum"]) if kv.get("stratum", "").isdigit() else None,
        "offset_s": None,
    }
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
    return "no sync daemon answers", None  # neither chronyc nor timedatectl here answered (the agent asked both)


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
        self.p = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
        )
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
        except OSError:  # the node's end went away: its line() then says so
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


def clock_check(
    logins: list[str], python: str, samples: int = 16, reads: int = 200_000, timeout: float = 60.0
) -> dict[str, dict]:
    """login -> {"offset_ns", "uncertainty_ns", "backwards", "daemon", "host"} or {"error"}."""
    req = {"op": "clocks", "reads": reads}
    sessions, out = {}, {}
    for lg in logins:  # all connect at once
        try:
            sessions[lg] = _Session(lg, req, python)
        except OSError as e:
            out[lg] = {"error": f"cannot start {e.filename or 'ssh'}: {e.strerror}"}
    deadline = time.monotonic() + timeout
    for lg, s in sessions.items():
        ready = s.line(deadline)
        while ready is not None and not ready.startswith('{"ready"'):
            ready = s.line(deadline)  # whatever a login script printed first
        if ready is None:
            out[lg] = {"error": f"unreachable: {s.fail()}"}
            continue
        m = measure(s, samples, deadline)
        if m is None:
            out[lg] = {"error": f"no answer: {s.fail()}"}
            continue
        out[lg] = {"offset_ns": m[0], "uncertainty_ns": m[1]}
        s.send("end\n")  # the node now runs its backwards check and asks its daemon
    for lg, s in sessions.items():
        if "error" in out[lg]:
            continue
        res = None
        while res is None and (line := s.line(deadline)) is not None:
            res = agent_result(line)
        if res is None:
            out[lg] = {"error": f"no final report: {s.fail()}"}
            continue
        s.p.stdin.close()
        s.p.wait()
        out[lg].update(res)
    return {lg: out[lg] for lg in logins}


def cmd_clocks(a) -> int:
    if a.samples < 1:
        raise UserError("--samples must be >= 1 (round trips a node; the shortest counts)")
    logins = node_logins(a.hostfile, a.nodelist)
    print(
        f"clocks vs {socket.gethostname()} (offset > 0: the node is ahead); {a.samples} round trips a node, "
        f"the shortest kept; {a.reads} reads for steps back"
    )
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
            print(
                f"  ERROR: the realtime clock went back {b['back']} time(s) in {b['reads']} reads "
                f"(at most {b['worst_ns'] / 1e6:.3f} ms): NCCL timeouts follow; check the clocksource and NTP"
            )
            errors += 1
        if abs(off) - unc > a.error_ms:
            print(f"  ERROR: offset {off:+.3f} ms is beyond --error-ms {a.error_ms:g}: {WHY_ERROR}")
            errors += 1
        elif abs(off) > a.warn_ms:
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
