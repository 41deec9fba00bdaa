"""The nodes and the way to them: the hostfile, node names, and the agent transport.

The hostfile is GNU parallel's sshloginfile, the one ingest and cache use: one sshlogin a line
(``host``, ``user@host``, ``N/host``, ``ssh -p 2222 host``, ``:`` for this machine; ``#`` comments).

Transport. Every node runs the same stdlib-only agent (``agent.py``, sent as source in one
``python -c`` argument). ``gpus``, ``dump`` and ``stop`` go through GNU parallel, one
``parallel --nonall -S LOGIN`` per node started together, so parallel's sshlogin rules ($PARALLEL_SSH,
per-login ssh commands, ``:``) apply unchanged and each node's output, stderr and exit status
stay apart (an unreachable node is named, not lost in a shared joblog).
``clocks`` holds its own ssh sessions instead (``clocks.py`` says why). The agent answers with
one JSON line ``{"result": ...}``; whatever a login script prints before it is skipped.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
from pathlib import Path

from reelcache import UserError
from reelcache.cluster import agent


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


def expand_nodelist(expr: str) -> list[str]:
    """A Slurm node list (``SLURM_JOB_NODELIST``) as ``scontrol show hostnames`` expands it:
    ``gpu[01-03,7],cpu5`` -> gpu01 gpu02 gpu03 gpu7 cpu5. Commas separate names outside brackets and
    ranges inside them; a range keeps its lower bound's zero padding; several bracket groups in one
    name expand as a product, the leftmost varying slowest."""
    names: list[str] = []
    for part in _split_top(expr.strip()):
        pieces = re.split(r"\[([^\]]*)\]", part)  # text, group, text, group, ..., text
        combos = [""]
        for k, piece in enumerate(pieces):
            options = _expand_group(piece, expr) if k % 2 else [piece]
            combos = [c + o for c in combos for o in options]
        names.extend(combos)
    if not names or any(not n or "[" in n or "]" in n for n in names):
        raise UserError(f"node list {expr!r} is not a Slurm node list (e.g. gpu[01-04,07],cpu1)")
    return list(dict.fromkeys(names))


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in expr:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur] if p]


def _expand_group(group: str, expr: str) -> list[str]:
    out = []
    for r in group.split(","):
        lo, _, hi = r.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise UserError(f"node list {expr!r}: {r!r} is not a number or a range lo-hi")
        out.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1))
    return out


def node_logins(hostfile=None, nodelist: str | None = None) -> list[str]:
    """The nodes a cluster check runs on: a hostfile's sshlogins, else a Slurm node list (``--nodelist``,
    else the allocation's ``SLURM_JOB_NODELIST``), in which this machine is ':' (no ssh to itself)."""
    if hostfile:
        return read_hostfile(hostfile)
    nodelist = nodelist or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UserError("give --hostfile (GNU parallel's sshloginfile), --nodelist, or run inside a Slurm allocation")
    here = socket.gethostname().split(".")[0]
    return [":" if n.split(".")[0] == here else n for n in expand_nodelist(nodelist)]


def node_name(login: str, res) -> str:
    """How a node is shown: its login, and for ':' the host name the agent reported."""
    return f": ({res['host']})" if login == ":" and res else login


def login_for(host: str, logins: list[str]) -> str:
    """The sshlogin that reaches a recorded host: ':' for this machine, else the hostfile's line for
    it (``user@gpu01``, ``ssh -p 2222 gpu01``; short and full names match), else the name itself."""
    if host == socket.gethostname():
        return ":"
    for login in logins:
        name = login.split()[-1].rsplit("@", 1)[-1]
        if name == host or name.split(".")[0] == host.split(".")[0]:
            return login
    return host


# ---------------------------------------------------------------- the agent on every node


def agent_code(req: dict) -> str:
    """One line of Python: the agent's source and the request, base64 (immune to any quoting layer)."""
    src = Path(agent.__file__).read_text() + f"\nmain(json.loads({json.dumps(json.dumps(req))}))\n"
    b64 = base64.b64encode(src.encode()).decode()
    return f"import base64;exec(compile(base64.b64decode('{b64}'),'reelcache-cluster-agent','exec'))"


def agent_shell(req: dict, python: str) -> str:
    """The agent as one shell command line (what ssh or ``parallel --nonall`` runs on a node)."""
    return f"{shlex.quote(python)} -c {shlex.quote(agent_code(req))}"


def agent_result(stdout: str):
    """The agent's answer in a node's output (its last ``{"result": ...}`` line), or None."""
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
        res = agent_result(so)
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
