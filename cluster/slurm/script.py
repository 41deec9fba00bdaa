"""The one template every job script is rendered from, writing it, and ``sbatch``.

Plain sbatch scripts, not submitit: a job is shell (a unit's command, ``srun`` starting one
``torchrun`` per node, ``eval serve``), a rendered script is what an operator reads, edits and
submits again by hand, and the nodes need nothing but bash (submitit pickles a Python callable per
task: the nodes would need the same Python and reelcache to unpickle it, and its job folders hold
pickles, not commands). ``scontrol``, ``sinfo`` and ``sbatch`` are the only tools.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from reelcache import UserError
from reelcache.cluster.slurm.client import said, slurm

TEMPLATE = """\
#!/bin/bash
# {what}, written by `reelcache {command}` at {when}.
# Submit it again by hand with: sbatch {again}
{directives}
set -uo pipefail
{body}"""


def directive_lines(directives: list[str]) -> str:
    """``#SBATCH`` lines; sbatch reads them word by word, so a value with a space is refused in one line."""
    for x in directives:
        if re.search(r"\s", x):
            raise UserError(f"#SBATCH {x}: a value with a space cannot be an sbatch directive (a path? move it)")
    return "\n".join(f"#SBATCH {x}" for x in directives)


def render(*, what: str, command: str, again: str, directives: list[str], body: str) -> str:
    """A job script: what it is, who wrote it and how to submit it again, its directives, its body."""
    return TEMPLATE.format(
        what=what,
        command=command,
        when=time.strftime("%Y-%m-%d %H:%M:%S"),
        again=again,
        directives=directive_lines(directives),
        body=body,
    )


def write(script: Path, text: str) -> None:
    try:
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write the job script {script}: {e.strerror or e}") from None


def sbatch(script: Path, *options: str) -> str:
    """Submit a script (``options`` before it, e.g. a dependency); its job id."""
    done = slurm("sbatch", "--parsable", *options, str(script))
    if done.returncode:
        raise UserError(f"sbatch refused the job ({script.name}): {said(done)}")
    return done.stdout.strip().split(";")[0]  # "id" or "id;cluster"
