"""``cluster dump`` and ``cluster stop``: act on exactly one run's recorded ranks, never a pattern.

Each rank of a run records itself in ``RUN/ranks/`` (``ranks.py``: host, pid, the kernel's start
time of that pid and the boot id, a triple no later process can match). On each rank's host the
agent opens a pidfd, then checks the triple, and signals through the pidfd, so neither a dump
nor a stop can reach another process; a record whose pid now belongs to someone else is reported
and skipped.

``dump`` writes ``RUN/dumps/<UTC time>/rank<R>.txt`` (py-spy's stacks of every thread; without
py-spy, the tail the rank's faulthandler appends on SIGUSR1) and ``summary.txt``: each rank's
innermost main-thread frames, the innermost frame grouped across ranks, and the frames every rank
shares. A hang shows there as all ranks in one collective, or all but one (the odd one is named).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

from reelcache.cluster import ranks
from reelcache.cluster.hosts import login_for, read_hostfile, run_agents
from reelcache.cluster.ranks import RankRecord


def by_login(recs: list[RankRecord], logins: list[str] = ()) -> dict[str, list[RankRecord]]:
    """Ranks grouped by the sshlogin that reaches their host."""
    groups: dict[str, list[RankRecord]] = {}
    for r in recs:
        groups.setdefault(login_for(r.host, list(logins)), []).append(r)
    return groups


def _logins(a) -> list[str]:
    return read_hostfile(a.hostfile) if a.hostfile else []


# ---------------------------------------------------------------- stacks

PYSPY_THREAD = re.compile(r'^Thread (\S+) \(([^)]*)\): "(.*)"')
PYSPY_FRAME = re.compile(r"^\s+(\S.*?) \((.*):(\d+)\)\s*$")
FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_stacks(text: str) -> list[dict]:
    """Threads of a py-spy dump or a faulthandler traceback: name, main?, frames innermost first."""
    threads = []
    for line in text.splitlines():
        if m := PYSPY_THREAD.match(line):
            threads.append({"name": m[3], "main": m[3] == "MainThread", "frames": []})
        elif m := FH_THREAD.match(line):
            # the signal handler runs in the main thread: faulthandler calls it the current one
            threads.append({"name": m[2], "main": m[1] == "Current thread", "frames": []})
        elif threads and (m := PYSPY_FRAME.match(line)):
            threads[-1]["frames"].append((m[1], m[2], int(m[3])))
        elif threads and (m := FH_FRAME.match(line)):
            threads[-1]["frames"].append((m[3], m[1], int(m[2])))
    return threads


def main_frames(text: str) -> list[tuple]:
    threads = parse_stacks(text)
    main = next((t for t in threads if t["main"]), threads[0] if threads else None)
    return main["frames"] if main else []


def _key(frame) -> str:
    return f"{frame[0]} ({Path(frame[1]).name})"


def _show(frame) -> str:
    return f"{frame[0]} ({frame[1]}:{frame[2]})"


def summarize(stacks: dict[int, list[tuple]], depth: int = 6) -> list[str]:
    """Innermost frames per rank, ranks grouped by innermost frame, frames shared by all (or all but one)."""
    ranks = sorted(r for r, f in stacks.items() if f)
    lines = ["innermost main-thread frames of each rank (innermost first):"]
    for r in sorted(stacks):
        shown = " <- ".join(_show(f) for f in stacks[r][:depth]) or "(no Python frame)"
        lines.append(f"  rank {r:05d}: {shown}")
    if not ranks:
        return lines
    lines += ["", "innermost frame, grouped:"]
    groups = Counter(_key(stacks[r][0]) for r in ranks)
    for key, n in groups.most_common():
        who = " ".join(str(r) for r in ranks if _key(stacks[r][0]) == key)
        lines.append(f"  {n} of {len(ranks)} ranks in {key}: ranks {who}")
    holders = {}
    for r in ranks:
        for k in {_key(f) for f in stacks[r]}:
            holders.setdefault(k, set()).add(r)
    order = [_key(f) for f in stacks[ranks[0]]]
    common = [k for k in dict.fromkeys(order) if len(holders[k]) == len(ranks)]
    lines += ["", f"frames on the main thread of all {len(ranks)} dumped ranks (innermost first):"]
    lines += [f"  {k}" for k in common] or ["  (none)"]
    if len(ranks) >= 3:
        odd = {}
        for k in dict.fromkeys(_key(f) for r in ranks for f in stacks[r]):  # innermost first
            who = holders[k]
            if len(who) == len(ranks) - 1:
                odd.setdefault((set(ranks) - who).pop(), []).append(k)
        for r, keys in sorted(odd.items()):
            lines.append(f"  all ranks but {r} are in: {', '.join(keys[:depth])}")
    return lines


# ---------------------------------------------------------------- commands


def cmd_dump(a) -> int:
    run = Path(a.run)
    recs = ranks.read(run)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = run / "dumps" / stamp
    out.mkdir(parents=True, exist_ok=True)
    groups = by_login(recs, _logins(a))
    info = {r.rank: r for r in recs}
    jobs = {
        lg: {
            "op": "dump",
            "ranks": [r.to_json() for r in rs],
            "timeout": a.timeout,
            "native": a.native,
            "method": a.method,
        }
        for lg, rs in groups.items()
    }
    answers = run_agents(jobs, a.python, timeout=30 + 2 * a.timeout * max(len(rs) for rs in groups.values()))
    stacks, notes, bad = {}, [], 0
    for lg, (res, err) in answers.items():
        if res is None or "error" in res:
            why = err if res is None else res["error"]
            for r in groups[lg]:
                notes.append(f"rank {r.rank}: host {r.host} not dumped: {why}")
            bad += 1
            continue
        for r in res["ranks"]:
            rec = info[r["rank"]]
            where = f"host {rec.host} pid {rec.pid}"
            if "skipped" in r:
                notes.append(f"rank {r['rank']}: {r['skipped']}, skipped ({where})")
            elif "error" in r:
                notes.append(f"rank {r['rank']}: not dumped ({where}): {r['error']}")
                bad += 1
            else:
                path = out / f"rank{r['rank']:05d}.txt"
                path.write_text(f"# rank {r['rank']} of {rec.world_size}, {where}, {r['method']}, {stamp}\n{r['text']}")
                stacks[r["rank"]] = main_frames(r["text"])
                print(f"rank {r['rank']}: {path} ({r['method']})")
                if r.get("py_spy_error"):
                    notes.append(f"rank {r['rank']}: {r['py_spy_error']}; used the SIGUSR1 stacks instead")
    summary = [f"reelcache cluster dump of {run} at {stamp}: {len(stacks)} of {len(recs)} ranks dumped", ""]
    summary += summarize(stacks) + ([""] + notes if notes else [])
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    for n in notes:
        print(n)
    print(f"summary: {out / 'summary.txt'}")
    return 1 if bad or not stacks else 0


def cmd_stop(a) -> int:
    recs = ranks.read(a.run)
    groups = by_login(recs, _logins(a))
    info = {r.rank: r for r in recs}
    jobs = {lg: {"op": "stop", "ranks": [r.to_json() for r in rs], "grace": a.grace} for lg, rs in groups.items()}
    answers = run_agents(jobs, a.python, timeout=a.grace + 60)
    bad = 0
    for lg, (res, err) in sorted(answers.items()):
        if res is None:
            print(f"host {lg}: UNREACHABLE, ranks {[r.rank for r in groups[lg]]} not stopped: {err}")
            bad += 1
            continue
        for r in res["ranks"]:
            rec = info[r["rank"]]
            print(f"rank {r['rank']:05d} host {rec.host} pid {rec.pid}: {r['result']}")
            bad += r["survived"]
    return 1 if bad else 0
