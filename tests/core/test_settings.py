"""Every config value is typed and ranged where its field is declared, and checked when read.

The cases are generated from the config classes themselves (reelcache/settings.py): each field of
every config, nested sections and table rows included, gets values of the wrong type and values
just outside its declared range, read through that config's own reader; each must be one line
naming the key. A field without a declaration fails ``test_every_field_declares_itself``, so a
new field cannot skip validation. The command line is walked the same way, from the parser.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import subprocess
import sys
import tomllib
import typing

import pytest
from support import REPO

from reelcache import UserError
from reelcache.args import Arg
from reelcache.base.buckets import BucketConfig
from reelcache.cache.plan import CacheConfig
from reelcache.cli import build_parser, main
from reelcache.eval.samples import PRESETS, Preset
from reelcache.ingest.plan import IngestConfig
from reelcache.settings import build, check, hints, rule_of
from reelcache.train import config as train_config
from reelcache.train.config import TrainConfig, load_config

STAGE = REPO / "configs" / "train" / "debug" / "stage1.toml"


# Each config: (its class, the smallest valid table, the reader a file's table goes through).
def _tiny_cache() -> dict:
    with open(REPO / "configs" / "cache" / "tiny.toml", "rb") as f:
        return tomllib.load(f)


CONFIGS = {
    "train": (TrainConfig, {"data": {"manifests": [{"name": "m"}], "buckets": "b.toml"}}, train_config._build),
    "cache": (CacheConfig, _tiny_cache(), lambda doc: CacheConfig.from_dict(doc, "tiny.toml")),
    "ingest": (
        IngestConfig,
        {"source": "s", "format": "csv", "videos": "/videos"},
        lambda doc: build(IngestConfig, doc),
    ),
    "buckets": (BucketConfig, {"table": [["240p", 17, 1.0, 1.0, 4]]}, lambda doc: build(BucketConfig, doc)),
    "eval-preset": (Preset, {"frames": 17, "height": 72, "width": 128, "batch": 2}, lambda doc: build(Preset, doc)),
}


@dataclasses.dataclass
class Leaf:
    config: str
    owner: type  # the dataclass that declares it
    key: str  # as errors name it: data.manifests[0].weight, table[0].keep
    path: tuple  # where it sits in the config's table
    hint: object
    rule: object


def _members(hint) -> tuple:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, type(int | None)) else (hint,)


def _walk(config: str, cls, key: str = "", path: tuple = ()):
    """Every field under ``cls``: sections, the sections a list holds (its first element), table rows."""
    for f in dataclasses.fields(cls):
        hint, rule = hints(cls)[f.name], rule_of(f)
        k, p = f"{key}.{f.name}" if key else f.name, (*path, f.name)
        yield Leaf(config, cls, k, p, hint, rule)
        for m in _members(hint):
            args = typing.get_args(m)
            if dataclasses.is_dataclass(m):
                yield from _walk(config, m, k, p)
            elif typing.get_origin(m) is list and args and dataclasses.is_dataclass(args[0]):
                yield from _walk(config, args[0], f"{k}[0]", (*p, 0))
        if rule is not None and rule.rows is not None:
            for i, r in enumerate(dataclasses.fields(rule.rows)):
                yield Leaf(config, rule.rows, f"{k}[0].{r.name}", (*p, 0, i), hints(rule.rows)[r.name], rule_of(r))


LEAVES = [leaf for name, (cls, _, _) in CONFIGS.items() for leaf in _walk(name, cls)]
CLASSES = sorted({leaf.owner for leaf in LEAVES}, key=lambda c: c.__name__)


def _with(leaf: Leaf, value) -> dict:
    doc = copy.deepcopy(CONFIGS[leaf.config][1])
    d = doc
    for step in leaf.path[:-1]:
        if isinstance(step, str) and step not in d:
            d[step] = {}
        d = d[step]
    d[leaf.path[-1]] = value
    return doc


def _read(leaf: Leaf, value):
    return CONFIGS[leaf.config][2](_with(leaf, value))


# -- what the tests call wrong, typed here independently of reelcache/settings.py -------------------------------------

POOL = ["abc", 2.5, True, 3, [1], {"x": 1}, None]


def _takes(hint, v) -> bool:
    """Whether a value has the type of a hint (not its range)."""
    if any(_takes(m, v) for m in _members(hint) if m is not hint):
        return True
    origin = typing.get_origin(hint) or hint
    return {
        int: type(v) is int,
        float: type(v) in (int, float),
        bool: type(v) is bool,
        str: type(v) is str,
        type(None): v is None,
        list: type(v) is list,
        tuple: type(v) is list,
        dict: type(v) is dict,
    }.get(origin, dataclasses.is_dataclass(origin) and type(v) is dict)


def _outside(hint, r) -> list:
    """Values just outside a field's declared range (its own metadata), shaped like the field."""
    scalar = next(m for m in _members(hint) if m is not type(None))
    origin, args = typing.get_origin(scalar), typing.get_args(scalar)
    element = args[-1] if origin in (list, dict) else args[0] if origin is tuple else scalar
    step = 1 if element is int else 0.5
    bad = [
        v
        for v in (r.ge - step if r.ge is not None else None, r.gt, r.lt, r.le + step if r.le is not None else None)
        if v is not None
    ]
    if r.choices is not None:
        bad.append("not-a-choice")
    if r.pattern is not None:
        bad += [s for s in ("", "a/b", ".hidden", "s3://Not_A_Bucket") if not re.fullmatch(r.pattern.regex, s)]
    if origin is list:
        return [[v] for v in bad]
    if origin is dict:
        return [{"x": v} for v in bad]
    if origin is tuple:
        return [[v] * len(args) for v in bad]
    return bad


def _assert_one_line_naming(e: pytest.ExceptionInfo, key: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert re.search(rf"(^|: ){re.escape(key)}(\[\d+\])? = ", msg), (key, msg)


# ---------------------------------------------------------------------------------------------


def test_every_field_declares_itself():
    undeclared = [
        f"{c.__name__}.{f.name}"
        for c in CLASSES
        for f in dataclasses.fields(c)
        if rule_of(f) is None or not rule_of(f).doc
    ]
    assert not undeclared, f"declare these with reelcache.settings.setting(default, doc, ...): {undeclared}"


# Fields whose only rule is their type (their values are checked across fields, or are free-form).
UNRANGED = {
    "train": {"data.buckets", "data.cache_dir", "model.overrides"},
    "cache": {"extra", "video_encoder.extra", "text_encoder.extra"},
}


def test_every_field_that_can_have_a_range_has_one():
    def plain(leaf):
        return all(
            m in (bool, type(None))
            or dataclasses.is_dataclass(m)
            or (typing.get_origin(m) is list and dataclasses.is_dataclass(typing.get_args(m)[0]))
            for m in _members(leaf.hint)
        )

    unranged = {(leaf.config, leaf.key) for leaf in LEAVES if not leaf.rule.bounded and not plain(leaf)}
    assert unranged == {(c, k) for c, keys in UNRANGED.items() for k in keys}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_smallest_table_is_valid(name):
    check(CONFIGS[name][2](copy.deepcopy(CONFIGS[name][1])))


def test_the_defaults_are_valid():
    for c in CLASSES:
        if all(
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            for f in dataclasses.fields(c)
        ):
            check(c())
    for p in PRESETS.values():
        check(p)


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: f"{leaf.config}:{leaf.key}")
def test_a_wrong_type_is_one_line_naming_the_key(leaf):
    wrong = [v for v in POOL if not _takes(leaf.hint, v)]
    assert wrong
    for v in wrong:
        with pytest.raises(UserError) as e:
            _read(leaf, v)
        _assert_one_line_naming(e, leaf.key)


RANGED = [leaf for leaf in LEAVES if leaf.rule.bounded and leaf.rule.rows is None]


@pytest.mark.parametrize("leaf", RANGED, ids=lambda leaf: f"{leaf.config}:{leaf.key}")
def test_a_value_out_of_range_is_one_line_naming_the_key(leaf):
    outside = _outside(leaf.hint, leaf.rule)
    assert outside
    for v in outside:
        with pytest.raises(UserError) as e:
            _read(leaf, v)
        _assert_one_line_naming(e, leaf.key)
        assert "expected" in str(e.value)


@pytest.mark.parametrize(
    "leaf",
    [leaf for leaf in RANGED if leaf.rule.ge is not None or leaf.rule.le is not None],
    ids=lambda leaf: f"{leaf.config}:{leaf.key}",
)
def test_the_bounds_themselves_are_allowed(leaf):
    scalar = next(m for m in _members(leaf.hint) if m is not type(None))
    origin, args = typing.get_origin(scalar), typing.get_args(scalar)
    for v in (b for b in (leaf.rule.ge, leaf.rule.le) if b is not None):
        value = [v] if origin is list else {"x": v} if origin is dict else [v] * len(args) if origin is tuple else v
        _read(leaf, value)


# The values at and past each range's edge that matter, written here independently of the declarations:
# (config, key) -> (refused, accepted), and why. A range that admits a useless or broken value (an EMA
# that never moves, a watchdog that calls the median step a hang) or refuses a meaningful one fails
# here; the generated cases above only prove that *a* range is enforced. A new ranged number must add
# its row (test_every_ranged_number_states_its_edges).
EDGES = {
    ("train", "ema.decay"): ([1.0, 1, 1.5, -0.1], [0.0, 0.5, 0.9999]),  # 1: never moves; 0: no EMA
    ("train", "optim.betas"): ([1.0, -0.1], [0.0, 0.9, 0.999]),  # 1: a moment that never moves
    ("train", "optim.adam_eps"): ([0.0, -1e-8], [1e-15, 1e-8]),  # 0: divides by 0 where the 2nd moment is 0
    ("train", "optim.lr"): ([-1e-4], [0.0, 1e-4]),  # 0: weights stay as loaded (documented)
    ("train", "optim.weight_decay"): ([-0.01], [0.0, 0.1]),
    ("train", "parallel.grad_clip"): ([-1.0], [0.0, 1.0]),  # 0: off
    ("train", "optim.warmup_steps"): ([-1], [0, 1000]),
    ("train", "optim.min_lr"): ([-1e-5], [0.0, 1e-5]),
    ("train", "optim.max_lr"): ([-1e-5], [0.0, 1e-4]),
    ("train", "optim.cooldown_steps"): ([-1], [0, 100]),
    ("train", "flow.caption_dropout"): ([1.0, 1.5, -0.1], [0.0, 0.1, 0.99]),  # 1: the text never reaches the model
    ("train", "flow.mask_ratios"): ([1.5, -0.1], [0.0, 1.0]),
    ("train", "data.manifests[0].weight"): ([-0.5], [0.0, 1.0]),
    ("train", "data.workers"): ([-1], [0, 4]),  # 0: read in the training process
    ("train", "data.prefetch"): ([0], [1, 2]),
    ("train", "data.block"): ([0], [1, 64]),
    ("train", "data.fetch_ahead"): ([0], [1, 64]),  # shards in S3: at least the sample being read
    ("train", "data.fetch_threads"): ([0], [1, 8]),
    ("train", "data.cache_gb"): ([0.0, -1.0], [0.5, 100.0]),  # 0 GB: a cache that keeps nothing (leave cache_dir empty)
    ("train", "conditioning.default_fps"): ([0.0, -24.0], [24.0]),  # 0 fps: no frame interval
    ("train", "conditioning.image_fps"): ([-1.0], [0.0, 120.0]),  # 0: as a video's
    ("train", "run.seed"): ([-1], [0, 42]),
    ("train", "run.epochs"): ([0], [1]),
    ("train", "run.max_steps"): ([-1], [0, 1]),  # 0: all epochs
    ("train", "checkpoint.every"): ([-1], [0, 1]),  # 0: at the end and on a stop request
    ("train", "checkpoint.keep_last"): ([-1], [0, 1]),  # 0: all
    ("train", "checkpoint.keep_every"): ([-1], [0, 1000]),
    ("train", "log.every"): ([0], [1, 10]),
    ("train", "guard.spike_z"): ([-1.0, 0.5, 2.9], [0.0, 3.0, 6.0]),  # 0: off; < 3: ordinary steps are spikes
    ("train", "guard.window"): ([1, 0], [2, 100]),  # the std of one loss is 0: every step a spike
    ("train", "guard.max_bad_steps"): ([0], [1, 5]),
    ("train", "watchdog.factor"): ([1.0, 0.5, 0.0], [1.5, 10.0]),  # <= 1: a median step is a hang
    ("train", "watchdog.floor_s"): ([-1.0], [0.0, 600.0]),
    ("train", "watchdog.limit_s"): ([-1.0], [0.0, 3600.0]),  # 0: wait for NCCL
    ("cache", "video_encoder.seed"): ([-1], [0]),
    ("cache", "video_encoder.max_tokens"): ([0], [1, 300]),
    ("cache", "text_encoder.seed"): ([-1], [0]),
    ("cache", "text_encoder.max_tokens"): ([0], [1, 300]),
    ("cache", "seed"): ([-1], [0]),
    ("cache", "views"): ([0], [1, 5]),
    ("cache", "clips_per_unit"): ([0], [1, 256]),
    ("cache", "batch_size"): ([0], [1, 8]),
    ("cache", "text_batch_size"): ([0], [1, 64]),
    ("cache", "workers"): ([0], [1, 4]),
    ("cache", "decode_timeout"): ([0.0], [0.5, 120.0]),
    ("cache", "worker_memory_mb"): ([1, 300, 1023], [1024, 8192]),  # < ~400 MB: a good 1080p clip fails to decode
    ("cache", "shard_mb"): ([0.0], [0.5, 1000.0]),
    ("ingest", "rows_per_unit"): ([0], [1, 1000]),
    ("ingest", "shard_mb"): ([0.0], [0.5, 1000.0]),
    ("ingest", "probe_timeout"): ([0.0], [0.5, 30.0]),
    ("ingest", "decode_timeout"): ([0.0], [0.5, 600.0]),
    ("ingest", "workers"): ([0], [1, 8]),
    ("ingest", "worker_memory_mb"): ([1, 300, 1023], [1024, 8192]),  # 300 MB: a good file became `undecodable`
    ("ingest", "thresholds.max_file_mb"): ([0.0], [0.5, 50.0]),
    ("ingest", "thresholds.min_frames"): ([-1], [0, 17]),
    ("ingest", "thresholds.min_seconds"): ([-0.5], [0.0, 2.0]),
    ("buckets", "table[0].num_frames"): ([0], [1, 51]),
    ("buckets", "table[0].keep"): ([1.5, -0.1], [0.0, 1.0]),
    ("buckets", "table[0].keep_t"): ([1.5, -0.1], [0.0, 1.0]),
    ("buckets", "table[0].batch"): ([-1], [0, 4]),  # 0: never kept
    ("buckets", "frame_interval"): ([0], [1, 3]),
    ("buckets", "default_batch_size"): ([0], [1]),
    ("eval-preset", "frames"): ([0], [1, 102]),
    ("eval-preset", "height"): ([0], [72, 720]),
    ("eval-preset", "width"): ([0], [128, 1280]),
    ("eval-preset", "batch"): ([0], [1, 8]),
    ("eval-preset", "steps"): ([0], [1, 30]),
    ("eval-preset", "cfg_scale"): ([-1.0], [0.0, 1.0, 7.0]),  # 0: the null caption only; 1: no guidance
    ("eval-preset", "fps"): ([0.0], [24.0]),
    ("eval-preset", "seed"): ([-1], [0, 42]),
}
RANGED_NUMBERS = [leaf for leaf in RANGED if leaf.rule.choices is None and leaf.rule.pattern is None]


def _shaped(leaf: Leaf, v):
    """A number as the field holds it: each element of a tuple, one value of a dict or list."""
    scalar = next(m for m in _members(leaf.hint) if m is not type(None))
    origin, args = typing.get_origin(scalar), typing.get_args(scalar)
    return {"x": v} if origin is dict else [v] * len(args) if origin is tuple else v


def test_every_ranged_number_states_its_edges():
    assert {(leaf.config, leaf.key) for leaf in RANGED_NUMBERS} == set(EDGES)


@pytest.mark.parametrize("leaf", RANGED_NUMBERS, ids=lambda leaf: f"{leaf.config}:{leaf.key}")
def test_the_edges_that_matter_are_refused_or_allowed(leaf):
    refused, accepted = EDGES[leaf.config, leaf.key]
    for v in refused:
        with pytest.raises(UserError) as e:
            _read(leaf, _shaped(leaf, v))
        _assert_one_line_naming(e, leaf.key)
    for v in accepted:
        _read(leaf, _shaped(leaf, v))


def test_the_issue_examples_say_exactly_what_is_allowed():
    def error(*overrides):
        with pytest.raises(UserError) as e:
            load_config(STAGE, list(overrides))
        return str(e.value)

    assert error("optim.lr=abc") == "optim.lr = 'abc': expected a number >= 0"
    assert error("run.epochs=2.5") == "run.epochs = 2.5: expected an integer >= 1"
    assert error("checkpoint.every=-3") == "checkpoint.every = -3: expected an integer >= 0"
    assert error("flow.caption_dropout=1.5") == "flow.caption_dropout = 1.5: expected a number in [0, 1)"
    assert error("optim.betas=[0.9]") == "optim.betas = [0.9]: expected a list of 2 numbers in [0, 1)"
    assert (
        error('data.manifests=[{name="a", weight=[0.5, -1]}]')
        == "data.manifests[0].weight = [0.5, -1]: expected a number >= 0 or a list of numbers >= 0"
    )
    assert error("model.compile=1") == "model.compile = 1: expected true or false"
    assert error("optim=3") == "optim = 3: expected a table"
    assert error("optim.lr=inf") == "optim.lr = inf: expected a number >= 0"
    assert error("guard.spike_z=2") == "guard.spike_z = 2: expected a number >= 3 (or 0: off)"
    assert load_config(STAGE, ["optim.lr=0.0", "checkpoint.every=0"]).optim.lr == 0.0  # 0: frozen; 0: at the end


def test_model_overrides_are_stdit3_fields_of_their_type():
    with pytest.raises(UserError, match=r"^model.overrides.depth = 'x': expected an integer$"):
        load_config(STAGE, ['model.overrides={depth="x"}'])
    with pytest.raises(UserError, match=r"^model.overrides: unknown keys \['depht'\]"):
        load_config(STAGE, ["model.overrides={depht=2}"])
    with pytest.raises(UserError, match="divisible by num_heads"):
        load_config(STAGE, ["model.overrides={num_heads=3}"])
    with pytest.raises(UserError, match="^flow.mask_ratios: unknown mask names"):
        load_config(STAGE, ["flow.mask_ratios={nope=0.1}"])


def test_model_presets_named_by_the_config_are_the_models():
    from reelcache.train.model import PRESETS
    from reelcache.train.sections import MODEL_PRESETS

    assert MODEL_PRESETS == tuple(PRESETS)


def test_a_bad_bucket_file_is_one_line_naming_it_before_training(tmp_path):
    bad = tmp_path / "b.toml"
    bad.write_text("[buckets.144p]\n17 = [1.5, 4]\n")
    with pytest.raises(UserError) as e:
        load_config(STAGE, [f'data.buckets="{bad}"'])
    assert str(e.value) == f"{bad}: buckets.144p.17.keep = 1.5: expected a number in [0, 1]"
    with pytest.raises(UserError, match="no such file"):
        load_config(STAGE, ['data.buckets="nowhere.toml"'])
    bad.write_text("[buckets.144p]\n17 = [[1.0, 0.5, 3], 4]\n")
    with pytest.raises(UserError, match=r"buckets.144p.17 = \[\[1.0, 0.5, 3\], 4\]: expected a batch size"):
        BucketConfig.from_toml(bad)


# -- the command line -------------------------------------------------------------------------


def _actions(parser: argparse.ArgumentParser, prog=""):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, f"{prog} {name}".strip())
        elif a.option_strings or a.dest != "help":
            yield prog, a


ACTIONS = list(_actions(build_parser()))


def test_no_option_takes_an_unranged_number():
    bare = [f"{prog} {a.option_strings or a.dest}" for prog, a in ACTIONS if a.type in (int, float)]
    assert not bare, f"use reelcache.args.arg(int, ge=...) or option(...): {bare}"


TYPED = [(prog, a) for prog, a in ACTIONS if isinstance(a.type, Arg)]


@pytest.mark.parametrize("prog,action", TYPED, ids=[f"{p} {a.option_strings[0]}" for p, a in TYPED])
def test_an_option_out_of_type_or_range_is_argparses_one_line(prog, action):
    hint, rule = action.type.hint, action.type.rule
    texts = (["abc"] if hint in (int, float) else []) + [str(v) for v in _outside(hint, rule)]
    assert texts
    for text in texts:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^expected .*, got {re.escape(repr(text))}$"):
            action.type(text)


def test_option_choices_are_the_configs():
    from reelcache.ingest.sources import FORMATS

    def choices(prog, option):
        return tuple(next(a.choices for p, a in ACTIONS if p == prog and option in a.option_strings))

    fields = {
        f.name: rule_of(f).choices
        for c in (IngestConfig, train_config.RunConfig, train_config.LogConfig)
        for f in dataclasses.fields(c)
    }
    assert choices("ingest plan", "--source") == FORMATS
    assert choices("ingest plan", "--verify") == fields["verify"]
    assert choices("ingest plan", "--tagger") == fields["tagger"]
    assert choices("train", "--wandb-mode") == fields["wandb_mode"]
    assert choices("eval serve", "--preset") == choices("eval once", "--preset") == tuple(PRESETS)


@pytest.mark.parametrize(
    "override,line",
    [
        ("--optim.lr=abc", "optim.lr = 'abc': expected a number >= 0"),
        ("--run.epochs=2.5", "run.epochs = 2.5: expected an integer >= 1"),
        ("--checkpoint.every=-3", "checkpoint.every = -3: expected an integer >= 0"),
        ("--flow.caption_dropout=1.5", "flow.caption_dropout = 1.5: expected a number in [0, 1)"),
    ],
)
def test_train_refuses_a_bad_value_in_one_line_before_any_work(tmp_path, capsys, override, line):
    assert main(["train", str(STAGE), "--root", str(tmp_path), override]) == 2
    out, err = capsys.readouterr()
    assert err == f"reelcache: error: {line}\n" and not out
    assert not list(tmp_path.iterdir())  # no run directory, no file


def test_train_command_exits_2_without_a_traceback(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "reelcache", "train", str(STAGE), "--root", str(tmp_path), "--optim.lr=abc"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert p.returncode == 2 and p.stderr == "reelcache: error: optim.lr = 'abc': expected a number >= 0\n", p.stderr
    assert not list(tmp_path.iterdir())


def test_options_and_config_files_of_other_stages(tmp_path, capsys):
    (tmp_path / "videos").mkdir()
    plan = ["ingest", "plan", "--root", str(tmp_path / "root"), "--source", "csv", "--videos", str(tmp_path / "videos")]
    with pytest.raises(SystemExit) as e:
        main([*plan, "--workers", "-1"])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.splitlines()[-1]
        == "reelcache ingest plan: error: argument --workers: expected an integer >= 1, got '-1'"
    )
    conf = tmp_path / "ingest.toml"
    conf.write_text("[thresholds]\nmin_frames = 2.5\n")
    assert main([*plan, "--config", str(conf)]) == 2
    assert (
        capsys.readouterr().err == f"reelcache: error: {conf}: thresholds.min_frames = 2.5: expected an integer >= 0\n"
    )
    cache = tmp_path / "cache.toml"
    cache.write_text(
        (REPO / "configs" / "cache" / "tiny.toml")
        .read_text()
        .replace("batch_size = 4", "batch_size = 0")
        .replace('"configs/buckets', f'"{REPO}/configs/buckets')
    )
    assert main(["cache", "plan", "--root", str(tmp_path), "--config", str(cache)]) == 2
    assert capsys.readouterr().err == f"reelcache: error: {cache}: batch_size = 0: expected an integer >= 1\n"
    assert not (tmp_path / "root").exists() and not (tmp_path / "latents").exists()


@pytest.mark.parametrize(
    "name, read, raw, expected",
    [
        (
            "REELCACHE_LEASE_TTL_S",
            "lease",
            "soon",
            "REELCACHE_LEASE_TTL_S='soon': must be seconds in [1, 86400] (default 300)",
        ),
        (
            "REELCACHE_LEASE_TTL_S",
            "lease",
            "0.5",
            "REELCACHE_LEASE_TTL_S='0.5': must be seconds in [1, 86400] (default 300)",
        ),
        ("REELCACHE_LEASE_TTL_S", "lease", "7", 7.0),
        (
            "REELCACHE_S3_STALL_S",
            "stall",
            "nan",
            "REELCACHE_S3_STALL_S='nan': must be seconds in [0.1, 3600] (default 120)",
        ),
        (
            "REELCACHE_S3_STALL_S",
            "stall",
            "3601",
            "REELCACHE_S3_STALL_S='3601': must be seconds in [0.1, 3600] (default 120)",
        ),
        ("REELCACHE_S3_STALL_S", "stall", "0.1", 0.1),
        (
            "REELCACHE_COLLECTIVE_TIMEOUT_S",
            "collective",
            "0",
            "REELCACHE_COLLECTIVE_TIMEOUT_S='0': must be seconds > 0 (default 1800)",
        ),
        (
            "REELCACHE_COLLECTIVE_TIMEOUT_S",
            "collective",
            "inf",
            "REELCACHE_COLLECTIVE_TIMEOUT_S='inf': must be seconds > 0 (default 1800)",
        ),
        ("REELCACHE_COLLECTIVE_TIMEOUT_S", "collective", None, 1800.0),
    ],
)
def test_durations_from_the_environment_name_the_variable_the_value_and_the_bounds(
    monkeypatch, name, read, raw, expected
):
    """The three durations read from the environment (lease staleness, an S3 stall, a collective's wait) share
    one reader: a bad value is one line naming the variable, its value as given, the bounds and the default."""
    from reelcache.base import lease, s3
    from reelcache.train import parallel

    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    readers = {"lease": lease._ttl_from_env, "stall": s3.stall_s, "collective": parallel.collective_timeout_s}
    if isinstance(expected, str):
        if read == "lease":  # read at import: the error is kept and said by acquire, before any work
            assert readers[read]() == (300.0, expected)
        else:
            with pytest.raises(UserError) as e:
                readers[read]()
            assert str(e.value) == expected
    else:
        got = readers[read]()
        assert (got[0] if read == "lease" else got) == expected
