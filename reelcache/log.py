"""One logger for the project: every line says when and, in a distributed job, which rank.

``say(msg)`` is the call everywhere; it logs at INFO on the ``reelcache`` logger, whose console
handler writes to stderr (stdout stays machine-readable) as ``12:03:04 r3 message``: local time to
the second, then ``r<RANK>`` from the environment torchrun sets. A command that is not one rank of
a job (no RANK) gets no tag rather than ``r0``: the tag names a rank, and a stray ``r0`` on
``catalog merge`` would read as rank 0 of a training job when logs are put side by side. A message
of several lines gets the prefix on each, so ``grep ' r3 '`` finds all of rank 3's output.

``setup_logging()`` is what the CLI calls at start (idempotent: each part checks that it is in
place, so a second call adds nothing). Besides the console handler it routes Python warnings
through the logger, each text once per process, as ``12:03:04 r3 warning: text (FutureWarning)``
instead of Python's two lines of path and source, and keeps libraries' chatter off the console
(``quiet_libraries``). ``log_to_file(path)`` adds a file with the full ISO timestamp, e.g. the
trainer's ``runs/<run>/log/rank<N>.log``; warnings go there too.

Without ``setup_logging()`` (the library used from Python, or a test calling a stage directly),
``say`` still prints in the short format, and warnings are left to Python. The console handler
looks up ``sys.stderr`` for each line, so a replaced stderr (pytest's capsys) receives it, and
writes through ``tqdm.write`` so that a line does not tear a progress bar.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path

log = logging.getLogger("reelcache")
# Warnings from any module, ours or a library's, are records of this child: every handler of
# ``reelcache`` (console, files) gets them.
warnings_log = log.getChild("warnings")

# Libraries whose import-time and internal chatter is not about the run: bitsandbytes (imported by
# peft, which diffusers imports when installed) warns that an optional CPU kernel cannot be fetched
# from a hub; ColossalAI logs each plugin's set-up; ZeRO 0.5.0 calls torch names torch 2.x deprecates.
QUIET_LOGGERS = ("bitsandbytes", "colossalai")
QUIET_WARNINGS = (
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    r"TypedStorage is deprecated",
)

# A console line's prefix, for what reads captured output (tests, scripts): LINE_PREFIX.sub("", text)
# leaves the messages as say() was given them.
LINE_PREFIX = re.compile(r"^\d\d:\d\d:\d\d (?:r\d+ )?", re.M)

_lock = threading.Lock()
_seen_warnings: set[tuple[type, str]] = set()


def rank_tag() -> str:
    """``r3`` in rank 3 of a torchrun job, ``""`` outside one (read per line: a worker may set RANK late)."""
    rank = os.environ.get("RANK")
    return f"r{rank}" if rank else ""


class _Format(logging.Formatter):
    """``<time> <rank> [level: ]message`` on every line of the record; the level word only from WARNING up."""

    def __init__(self, iso: bool):
        super().__init__("%(message)s")
        self.iso = iso

    def formatTime(self, record, datefmt=None) -> str:
        if self.iso:
            return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")
        return time.strftime("%H:%M:%S", time.localtime(record.created))

    def format(self, record: logging.LogRecord) -> str:
        body = super().format(record)  # the message, then any traceback
        if record.levelno >= logging.WARNING:
            body = f"{record.levelname.lower()}: {body}"
        head = " ".join(filter(None, (self.formatTime(record), rank_tag()))) + " "
        return "\n".join(head + line for line in body.split("\n"))


class _Console(logging.Handler):
    """stderr as it is now (not as it was at set-up), written around any live tqdm bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream, text = sys.stderr, self.format(record)
            tq = sys.modules.get("tqdm")  # a bar can be live only where tqdm is loaded: --help stays without it
            if tq is not None:
                tq.tqdm.write(text, file=stream)
            else:
                stream.write(text + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _console() -> None:
    if any(isinstance(h, _Console) for h in log.handlers):
        return
    with _lock:
        if not any(isinstance(h, _Console) for h in log.handlers):
            handler = _Console(logging.INFO)
            handler.setFormatter(_Format(iso=False))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            # Our lines are ours to show: a root handler someone else configures would repeat them.
            log.propagate = False


def say(msg: str) -> None:
    """One line of human-facing status: INFO on the ``reelcache`` logger, to stderr."""
    _console()
    log.info(msg)


def say_error(message: str) -> None:
    """The one line a command that fails says: ``reelcache: error: <message>`` on stderr."""
    print(f"reelcache: error: {message}", file=sys.stderr, flush=True)


def warning_text(message, category: type[Warning]) -> str:
    """A warning in one line: its text, and its category where that is not the plain UserWarning."""
    return str(message) if category is UserWarning else f"{message} ({category.__name__})"


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {warning_text(message, category)}\n"


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning``: to the logger, once per (category, text) whatever line issued it."""
    if file is not None:  # a caller that names a stream gets it, as with logging.captureWarnings
        file.write(_format_warning(message, category, filename, lineno, line))
        return
    key = (category, str(message))
    with _lock:
        if key in _seen_warnings:
            return
        _seen_warnings.add(key)
    warnings_log.warning(warning_text(message, category))


def quiet_libraries() -> None:
    """Keep libraries' noise off the console: errors still show. Call before they are imported."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def setup_logging() -> None:
    """The process's output, once: the console handler, warnings through the logger, quiet libraries.

    Idempotent; each part is checked rather than remembered, so a part that something undid (a
    ``warnings.catch_warnings`` block restores ``showwarning`` when it ends) is put back.
    """
    _console()
    # For code that formats a warning itself (or a showwarning put back by someone else): one line too.
    warnings.formatwarning = _format_warning
    if warnings.showwarning is not _show_warning:
        warnings.showwarning = _show_warning
    quiet_libraries()


def log_to_file(path: str | os.PathLike) -> logging.Handler:
    """Also write every line (warnings included) to ``path``, appending, with the ISO timestamp:
    ``2025-05-01T12:03:04.123+02:00 r3 message``. The trainer's is ``runs/<run>/log/rank<N>.log``.

    Calling it again with the same path returns the handler already there. To stop:
    ``reelcache.log.log.removeHandler(h); h.close()``.
    """
    path = Path(path).absolute()
    _console()
    with _lock:
        for h in log.handlers:
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path:
                return h
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setLevel(logging.INFO)
        handler.setFormatter(_Format(iso=True))
        log.addHandler(handler)
        return handler
