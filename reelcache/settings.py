"""Typed settings: every config field declares its type, range and meaning where it is declared.

    lr: float = setting(1.6e-4, "base lr; with schedule=1cycle, the final lr", ge=0)

The type is the field's annotation; ``setting`` puts a ``Rule`` (documentation, bounds, choices,
a name pattern) into the dataclass field's metadata, so a field keeps its validation wherever
it moves. One checker serves every config: ``build(cls, doc)`` reads a table (a TOML file, a
plan's JSON) into the dataclass, refusing unknown keys, making nested sections and tuples, and
checking each value before the class is constructed; ``check(obj)`` walks an instance, nested
sections included. A bad value is one line naming the key, the value as given and what is
allowed, raised as ``UserError`` (the CLI prints it and exits 2):

    optim.lr = 'abc': expected a number >= 0

Types are strict where a loose value would train something else than written: an int is not a
bool and not 2.5, a float accepts an int but not inf or nan, a list is checked element by
element, and the bounds of a collection apply to each of its numbers. Rules that relate two
fields (a 1cycle schedule needs max_lr) stay explicit checks in each config, run after these.

The same rules type the command line (reelcache/args.py): ``arg(int, ge=1)`` is an argparse
``type=``, and ``option("reelcache.ingest.plan:IngestConfig.workers")`` takes a config field's type
and rule, imported only when the option is given (the parser builds without importing the stages).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass

from reelcache import UserError

_META = "reelcache.setting"


@dataclass(frozen=True)
class Pattern:
    """A string rule: a regular expression the whole value must match, and how users read it."""

    regex: str
    text: str


NAME = Pattern(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", "a name of letters, digits, '-', '_' and '.'")
TEXT = Pattern(r"(?s).+", "a non-empty string")


@dataclass(frozen=True)
class Rule:
    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    pattern: Pattern | None = None
    rows: type | None = None  # a table of tuples whose positions are this dataclass's fields
    off: float | None = None  # one value outside the bounds that is allowed: "0 = off"

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt, self.choices, self.pattern, self.rows))


def setting(
    default=dataclasses.MISSING,
    doc: str = "",
    *,
    factory=dataclasses.MISSING,
    ge=None,
    gt=None,
    le=None,
    lt=None,
    choices=None,
    pattern: Pattern | None = None,
    rows: type | None = None,
    off=None,
):
    """A dataclass field with its documentation and rule; no default and no factory: a required key.
    ``off``: a value that switches the thing off, allowed outside the bounds (``ge=3, off=0``)."""
    rule = Rule(doc, ge, gt, le, lt, tuple(choices) if choices is not None else None, pattern, rows, off)
    return dataclasses.field(default=default, default_factory=factory, metadata={_META: rule})


def rule_of(f: dataclasses.Field) -> Rule | None:
    return f.metadata.get(_META)


@functools.cache
def hints(cls) -> dict:
    """The resolved annotations of a dataclass (they are strings under ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


# ---------------------------------------------------------------------------------------------
# what a value may be


def _members(hint) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _container(hint):
    """(list | tuple | dict | None, element hints) of a hint such as ``list[float]`` or bare ``dict``."""
    origin = typing.get_origin(hint) or hint
    return (origin, typing.get_args(hint)) if origin in (list, tuple, dict) else (None, ())


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _bounds(rule: Rule | None) -> str:
    if rule is None:
        return ""
    lo = (rule.ge, "[", ">=") if rule.ge is not None else (rule.gt, "(", ">") if rule.gt is not None else None
    hi = (rule.le, "]", "<=") if rule.le is not None else (rule.lt, ")", "<") if rule.lt is not None else None
    off = f" (or {_num(rule.off)}: off)" if rule.off is not None else ""
    if lo and hi:
        return f" in {lo[1]}{_num(lo[0])}, {_num(hi[0])}{hi[1]}{off}"
    if lo or hi:
        x, _, op = lo or hi
        return f" {op} {_num(x)}{off}"
    return off


def describe(hint, rule: Rule | None = None, many: bool = False) -> str:
    """What a value of this hint under this rule is, in words: 'a number in [0, 1]', 'a list of 2 numbers'."""
    parts = [_describe(m, rule, many) for m in _members(hint) if m is not type(None)]
    return " or ".join(dict.fromkeys(parts))


def _describe(hint, rule, many) -> str:
    if rule is not None and rule.choices is not None:
        return ("values among " if many else "one of ") + ", ".join(repr(c) for c in rule.choices)
    if hint is bool:
        return "booleans" if many else "true or false"
    if hint in (int, float):
        word = {int: ("an integer", "integers"), float: ("a number", "numbers")}[hint][many]
        return word + _bounds(rule)
    if hint is str:
        if rule is not None and rule.pattern is not None:
            return rule.pattern.text
        return "strings" if many else "a string"
    kind, args = _container(hint)
    if kind is dict:
        return ("tables" if many else "a table") + (f" of {describe(args[1], rule, True)}" if args else "")
    if kind in (list, tuple):
        head = "lists" if many else "a list"
        if rule is not None and rule.rows is not None:
            return f"{head} of rows [{', '.join(f.name for f in dataclasses.fields(rule.rows))}]"
        if kind is tuple and args and args[-1] is not Ellipsis:
            return f"{head} of {len(args)} {describe(args[0], rule, True)}"
        return head + (f" of {describe(args[0], rule, True)}" if args else "")
    if dataclasses.is_dataclass(hint):
        return "tables" if many else "a table"
    return getattr(hint, "__name__", str(hint))


def _in_range(v, rule: Rule | None) -> bool:
    if rule is None or (rule.off is not None and v == rule.off):
        return True
    return (
        (rule.ge is None or v >= rule.ge)
        and (rule.gt is None or v > rule.gt)
        and (rule.le is None or v <= rule.le)
        and (rule.lt is None or v < rule.lt)
    )


def valid(v, hint, rule: Rule | None = None) -> bool:
    """Whether ``v`` is a value of ``hint`` within ``rule`` (every element, for a collection)."""
    return any(_valid(v, m, rule) for m in _members(hint))


def _valid(v, hint, rule) -> bool:
    if hint is typing.Any:
        return True
    if hint is type(None):
        return v is None
    if rule is not None and rule.choices is not None and hint in (str, int, float):
        return _valid(v, hint, None) and v in rule.choices
    if hint is bool:
        return isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool) and _in_range(v, rule)
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and _in_range(v, rule)
    if hint is str:
        return isinstance(v, str) and (
            rule is None or rule.pattern is None or re.fullmatch(rule.pattern.regex, v) is not None
        )
    kind, args = _container(hint)
    if kind is dict:
        return (
            isinstance(v, dict)
            and all(isinstance(k, str) for k in v)
            and (not args or all(valid(x, args[1], rule) for x in v.values()))
        )
    if kind in (list, tuple):
        if not isinstance(v, (list, tuple)):
            return False
        if kind is tuple and args and args[-1] is not Ellipsis:
            return len(v) == len(args) and all(valid(x, a, rule) for x, a in zip(v, args))
        return not args or all(valid(x, args[0], rule) for x in v)
    if isinstance(hint, type):
        return isinstance(v, hint)
    return True


def _dataclass_of(hint):
    """The dataclass a field holds (``Section``) or lists (``list[Section]``), and whether it is a list."""
    for m in _members(hint):
        if dataclasses.is_dataclass(m):
            return m, False
        kind, args = _container(m)
        if kind is list and args and dataclasses.is_dataclass(args[0]):
            return args[0], True
    return None, False


# ---------------------------------------------------------------------------------------------
# checking and reading


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _fail(key: str, v, allowed: str):
    raise UserError(f"{key} = {v!r}: expected {allowed}")


def _check_value(v, hint, rule: Rule | None, key: str) -> None:
    """Raise the one-line UserError for a value of a field: ``key = value: expected ...``."""
    sub, many = _dataclass_of(hint)
    if rule is not None and rule.rows is not None and isinstance(v, (list, tuple)):
        names = dataclasses.fields(rule.rows)
        for i, row in enumerate(v):
            if not isinstance(row, (list, tuple)) or len(row) != len(names):
                _fail(f"{key}[{i}]", row, f"a row [{', '.join(f.name for f in names)}]")
            for f, x in zip(names, row):
                _check_value(x, hints(rule.rows)[f.name], rule_of(f), f"{key}[{i}].{f.name}")
        return
    if sub is not None and not many and isinstance(v, sub):
        check(v, key)
        return
    if sub is not None and many and isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if not isinstance(x, sub):
                _fail(f"{key}[{i}]", x, "a table")
            check(x, f"{key}[{i}]")
        return
    if not valid(v, hint, rule):
        _fail(key, v, describe(hint, rule))


def check(obj, where: str = ""):
    """Check every field of a dataclass instance, nested sections too; returns ``obj``."""
    declared = hints(type(obj))
    for f in dataclasses.fields(obj):
        _check_value(getattr(obj, f.name), declared[f.name], rule_of(f), _key(where, f.name))
    return obj


def _convert(v, hint, rule: Rule | None, key: str):
    """A value as a file gives it -> as the field holds it: tables -> sections, lists -> tuples."""
    sub, many = _dataclass_of(hint)
    if sub is not None and not many and isinstance(v, dict):
        return build(sub, v, key)
    if sub is not None and many and isinstance(v, list):
        return [build(sub, x, f"{key}[{i}]") if isinstance(x, dict) else x for i, x in enumerate(v)]
    if isinstance(v, list) and any(_container(m)[0] is tuple for m in _members(hint)):
        return tuple(tuple(x) if rule is not None and rule.rows and isinstance(x, list) else x for x in v)
    return v


def read(cls, doc, where: str = "") -> dict:
    """A table -> the checked keyword arguments of ``cls``: unknown and missing keys are errors."""
    if not isinstance(doc, dict):
        _fail(where or cls.__name__, doc, "a table")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    at = f"{where}: " if where else ""
    if unknown := sorted(set(doc) - set(fields)):
        raise UserError(f"{at}unknown keys {unknown}; known: {sorted(fields)}")
    required = [
        n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing := [n for n in required if n not in doc]:
        raise UserError(f"{at}missing keys {missing}")
    kw = {}
    for name, v in doc.items():
        hint, rule, key = hints(cls)[name], rule_of(fields[name]), _key(where, name)
        if _dataclass_of(hint)[0] is None:  # checked as given; sections are checked as they are built
            _check_value(v, hint, rule, key)
        kw[name] = _convert(v, hint, rule, key)
        if _dataclass_of(hint)[0] is not None:
            _check_value(kw[name], hint, rule, key)
    return kw


def build(cls, doc, where: str = "", *, source=None):
    """``cls`` from a table (a config file's, or a section of it at ``where``), every value checked
    before the class is constructed. ``source`` (a file) prefixes the error."""
    try:
        kw = read(cls, doc, where)
        try:
            return cls(**kw)
        except (TypeError, ValueError) as e:  # the class's own checks (__post_init__)
            raise UserError(f"{where}: {e}" if where else str(e)) from None
    except UserError as e:
        if source is None:
            raise
        raise UserError(f"{source}: {e}") from None


def load_toml(path) -> dict:
    """A TOML file's table; a missing or malformed file is a UserError naming it."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"no config file {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: {e}") from None


def env_seconds(
    name: str, default: float, *, ge: float | None = None, gt: float | None = None, le: float | None = None
) -> float:
    """A duration from the environment variable ``name`` (``default`` when unset), checked against its bounds:
    a bad value is one line naming the variable, the value as given and what is allowed (UserError)."""
    import os

    raw = os.environ.get(name)
    if raw is None:
        return float(default)
    rule = Rule("", ge=ge, gt=gt, le=le)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and _in_range(value, rule)):
        raise UserError(f"{name}={raw!r}: must be seconds{_bounds(rule)} (default {_num(default)})")
    return value
