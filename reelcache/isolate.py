"""Run a function over many items in child processes that can be killed (ingest probes, cache decodes).

A corrupt or hostile video can hang FFmpeg (a stalled network mount, a decoder stuck in a
loop) or crash it outright. ``isolated_map`` runs ``fn(item)`` in long-lived worker processes
and gives each call a deadline: a worker past its deadline is SIGKILLed and replaced, and a
worker that dies takes only its current item with it. Results come back in input order, as
``(item, result)`` or ``(item, Failed(reason, detail))``; the caller never sees an exception
from a worker. Workers are started with "spawn" so that no thread pool or lock state of the
parent (pyarrow, DuckDB) is inherited.

Each worker has up to two items in flight: the next one waits in its pipe while it works on the
current one, so a worker never idles for the parent's round trip (on a loaded machine each wake-up
can cost a scheduler slice, which halved the rate of one-at-a-time workers). An item's deadline
starts when the worker begins it, i.e. when the previous result arrives. When a worker is killed
(timeout) or dies, only its current item fails; the item queued behind it goes back to the front
of the work list. The trade-off: pipe traffic per item (~50 µs), negligible next to opening a file.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import resource
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any


@dataclass
class Failed:
    reason: str  # "timeout" | "crashed" | "error"
    detail: str


def _worker(conn, fn, memory_mb, init):
    if init is not None:
        init()
    if memory_mb:
        limit = int(memory_mb) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send("ready")  # deadlines start only once the worker has imported everything
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        seq, item = msg
        try:
            out = (seq, True, fn(item))
        except MemoryError:
            out = (seq, False, Failed("crashed", "out of memory (worker memory limit)"))
        except Exception as e:  # noqa: BLE001 - any error on one item is that item's result
            out = (
                seq,
                False,
                e if _picklable(e) else Failed("error", "".join(traceback.format_exception_only(type(e), e)).strip()),
            )
        conn.send(out)


def _picklable(e) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False


class _Slot:
    def __init__(self, ctx, fn, memory_mb, init):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, fn, memory_mb, init), daemon=True)
        self.proc.start()
        child.close()
        self.jobs: deque = deque()  # [seq, item, deadline]: the head is being worked on, deadline set

    def wait_ready(self, timeout: float = 300.0):
        try:
            ok = self.conn.poll(timeout) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            raise RuntimeError(f"worker process did not start within {timeout:g} s ({_death(self.proc)})")

    def outcome(self, ready: list, timeout: float):
        """What the item being worked on came to: its result, Failed (crashed, past its deadline), or None:
        still running. ``ready``: what ``wait`` found ready."""
        seq, _, deadline = self.jobs[0]
        if self.conn in ready or self.conn.poll():
            try:
                rseq, _, value = self.conn.recv()
                assert rseq == seq
                return value
            except (EOFError, OSError):
                return Failed("crashed", _death(self.proc))
        if self.proc.sentinel in ready or not self.proc.is_alive():
            return Failed("crashed", _death(self.proc))
        if time.monotonic() >= deadline:
            return Failed("timeout", f"no answer within {timeout:g} s; worker killed")
        return None

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


def isolated_map(
    fn: Callable[[Any], Any],
    items: Iterable,
    *,
    workers: int = 1,
    timeout: float = 30.0,
    memory_mb: int | None = None,
    init: Callable[[], None] | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Yield (item, fn(item) | exception raised by fn | Failed) for each item, in order.

    ``init`` runs once in each worker before it reports ready (imports, warm-up), so that
    deadlines measure the work on an item, never a worker's start-up.
    """
    ctx = mp.get_context("spawn")
    todo = deque(enumerate(items))
    slots = [_Slot(ctx, fn, memory_mb, init) for _ in range(max(1, min(workers, len(todo) or 1)))]
    for s in slots:
        s.wait_ready()
    done: dict[int, tuple[Any, Any]] = {}
    nxt = 0
    depth = 2
    try:
        while todo or any(s.jobs for s in slots):
            for i in range(len(slots)):
                while todo and len(slots[i].jobs) < depth:
                    s = slots[i]
                    seq, item = todo.popleft()
                    try:
                        s.conn.send((seq, item))
                    except OSError:  # the worker died already: this item is not to blame
                        todo.appendleft((seq, item))
                        if s.jobs:
                            break  # its head is reported crashed below, the rest redone
                        s.kill()  # it died idle, holding nothing: a new one takes the item
                        slots[i] = _Slot(ctx, fn, memory_mb, init)
                        slots[i].wait_ready()
                        continue
                    s.jobs.append([seq, item, None])
                s = slots[i]
                if s.jobs and s.jobs[0][2] is None:
                    s.jobs[0][2] = time.monotonic() + timeout
            busy = [s for s in slots if s.jobs]
            soonest = min(s.jobs[0][2] for s in busy)
            ready = wait(
                [s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=max(0.0, soonest - time.monotonic())
            )
            for i, s in enumerate(slots):
                if not s.jobs:
                    continue
                seq, item, _ = s.jobs[0]
                if (result := s.outcome(ready, timeout)) is None:
                    continue
                done[seq] = (item, result)
                s.jobs.popleft()
                if s.jobs:
                    s.jobs[0][2] = time.monotonic() + timeout  # the worker starts on the next one now
                if isinstance(result, Failed) and result.reason in ("timeout", "crashed"):
                    s.kill()
                    todo.extendleft(reversed([(q, it) for q, it, _ in s.jobs]))  # not started: redo elsewhere
                    slots[i] = _Slot(ctx, fn, memory_mb, init)
                    slots[i].wait_ready()
            while nxt in done:
                yield done.pop(nxt)
                nxt += 1
    finally:
        for s in slots:
            try:
                s.conn.send(None)
            except (OSError, ValueError):
                pass
            s.proc.join(timeout=1)
            s.kill()


def _death(proc) -> str:
    proc.join(timeout=1)
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"worker killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"worker killed by signal {-code}"
    return f"worker exited with status {code}"
