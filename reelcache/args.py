"""The command line's half of the typed settings (reelcache/settings.py): argparse ``type=``s.

    p.add_argument("--workers", type=arg(int, ge=1))
    p.add_argument("--run", type=option("reelcache.train.config:RunConfig.name"))

An option that sets a config field takes that field's type and rule, imported only when the
option is given: every stage's parser builds without importing the stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from pathlib import Path

from reelcache.settings import Rule, _members, describe, hints, rule_of, valid


class Arg:
    """An argparse ``type=``: parses the text as the hint, then checks the rule. Its error is
    argparse's one line: ``argument --workers: expected an integer >= 1, got '-1'``."""

    def __init__(self, hint=None, rule: Rule | None = None, ref: str | None = None):
        self._hint, self._rule, self.ref = hint, rule, ref

    @property
    def hint(self):
        return self.resolve()[0]

    @property
    def rule(self) -> Rule | None:
        return self.resolve()[1]

    def resolve(self):
        if self.ref is not None and self._hint is None:
            module, _, path = self.ref.partition(":")
            cls_name, _, name = path.rpartition(".")
            cls = getattr(importlib.import_module(module), cls_name)
            f = next(f for f in dataclasses.fields(cls) if f.name == name)
            self._hint = next(m for m in _members(hints(cls)[name]) if m is not type(None))
            self._rule = rule_of(f)
        return self._hint, self._rule

    def __call__(self, text: str):
        hint, rule = self.resolve()
        allowed = describe(hint, rule)
        try:
            value = hint(text) if hint in (int, float) else text
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not valid(value, hint, rule):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        return value

    def __repr__(self) -> str:
        return f"Arg({self.ref or describe(*self.resolve())})"


def arg(hint, *, ge=None, gt=None, le=None, lt=None, choices=None) -> Arg:
    """An option's type and range, e.g. ``arg(int, ge=1)``, ``arg(float, ge=0, le=1)``."""
    return Arg(hint, Rule("", ge, gt, le, lt, tuple(choices) if choices is not None else None))


def option(ref: str) -> Arg:
    """An option that sets a config field: ``option("reelcache.ingest.plan:IngestConfig.workers")``."""
    return Arg(ref=ref)


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {text}")
    return text
