"""reelcache/log.py: one logger, time and rank on every line, library warnings through it once.

Where the environment matters (RANK, the process's warnings state) the code runs in a fresh
interpreter, as a command would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from reelcache.log import LINE_PREFIX, say
from reelcache.progress import fmt_eta

TIME = r"\d\d:\d\d:\d\d"
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"

# A library that warns: one FutureWarning text from two lines (shown once), and a plain UserWarning.
FAKELIB = """
import warnings

def old():
    warnings.warn("old() is going away", FutureWarning)

def older():
    warnings.warn("old() is going away", FutureWarning)  # same text, another line: still once

def hint():
    warnings.warn("use new() instead")
"""


def _python(tmp_path, code: str, rank: str | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "fakelib.py").write_text(FAKELIB)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONWARNINGS")}
    if rank is not None:
        env["RANK"] = rank
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tmp_path), env.get("PYTHONPATH"))))
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_a_line_carries_the_time_and_the_rank(tmp_path):
    code = """
        from reelcache.log import setup_logging
        from reelcache.log import say
        setup_logging()
        say("hello")
        say("two\\nlines")
    """
    p = _python(tmp_path, code, rank="3")
    assert p.stdout == ""  # stdout stays machine-readable
    assert re.fullmatch(rf"{TIME} r3 hello\n{TIME} r3 two\n{TIME} r3 lines\n", p.stderr), p.stderr
    assert LINE_PREFIX.sub("", p.stderr) == "hello\ntwo\nlines\n"


def test_a_single_process_command_has_no_rank_tag(tmp_path):
    p = _python(tmp_path, "from reelcache.log import say; say('hello')")
    assert re.fullmatch(rf"{TIME} hello\n", p.stderr), p.stderr


def test_library_warnings_arrive_once_through_the_logger_in_one_line(tmp_path):
    code = """
        from reelcache.log import log_to_file, setup_logging
        setup_logging()
        log_to_file("rank2.log")
        import fakelib
        for _ in range(3):
            fakelib.old()
        fakelib.older()
        fakelib.hint()
    """
    p = _python(tmp_path, code, rank="2")
    assert re.fullmatch(
        rf"{TIME} r2 warning: old\(\) is going away \(FutureWarning\)\n{TIME} r2 warning: use new\(\) instead\n",
        p.stderr,
    ), p.stderr
    assert "fakelib.py" not in p.stderr  # not Python's "path:line: Category: text" and the source line
    lines = (tmp_path / "rank2.log").read_text().splitlines()
    assert len(lines) == 2 and re.fullmatch(rf"{ISO} r2 warning: use new\(\) instead", lines[1]), lines


def test_setup_is_idempotent(tmp_path):
    code = """
        from reelcache.log import log_to_file, setup_logging
        from reelcache.log import say
        setup_logging()
        setup_logging()
        assert log_to_file("log/rank0.log") is log_to_file("log/rank0.log")
        say("once")
    """
    p = _python(tmp_path, code, rank="0")
    assert re.fullmatch(rf"{TIME} r0 once\n", p.stderr), p.stderr
    assert re.fullmatch(rf"{ISO} r0 once\n", (tmp_path / "log/rank0.log").read_text())


def test_a_command_logs_and_routes_warnings_and_keeps_libraries_quiet(tmp_path):
    """run_command (every CLI command, the trainer on each rank) sets it all up; its error line stays bare."""
    code = """
        import logging, warnings
        from reelcache import UserError
        from reelcache.cli import run_command
        from reelcache.log import say

        def command():
            say("working")
            logging.getLogger("colossalai").info("booster ready")
            logging.getLogger("bitsandbytes").warning("no CPU kernel")
            warnings.warn("TypedStorage is deprecated", UserWarning)
            import fakelib
            fakelib.hint()
            raise UserError("bad input")

        raise SystemExit(0 if run_command(command) == 2 else 1)
    """
    p = _python(tmp_path, code, rank="1")
    assert re.fullmatch(
        rf"{TIME} r1 working\n{TIME} r1 warning: use new\(\) instead\nreelcache: error: bad input\n", p.stderr
    ), p.stderr


def test_say_writes_to_the_stderr_of_the_moment(capsys):
    """In-process callers (tests with capsys) see say's lines: the handler does not keep an old stderr."""
    say("first")
    assert capsys.readouterr().err.endswith(" first\n")
    say("second")
    out, err = capsys.readouterr()
    assert out == "" and err.endswith(" second\n") and "first" not in err


def test_fmt_eta():
    assert [fmt_eta(s) for s in (0, 42, 425, 10920, 187200)] == ["0s", "42s", "7m05s", "3h02m", "2d04h"]
