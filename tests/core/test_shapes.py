"""One shape for every component built from a config section (DESIGN.md, "Train"): the component's
constructor takes the section object itself, first, and as keywords only what is known at run time; the
section's ``build(**runtime)`` passes ``self``. No constructor unpacks the section into its fields, restates
their defaults or renames them. The walk covers every section of ``TrainConfig`` (a new one must be
placed here) and the cache's encoder sections."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from reelcache.cache.encoders import TextEncoder, VideoEncoder
from reelcache.cache.plan import CacheConfig
from reelcache.cache.spec import EncoderSpec
from reelcache.train.checkpoint import CheckpointConfig, Checkpointer
from reelcache.train.config import TrainConfig
from reelcache.train.flow import Conditioning
from reelcache.train.guard import Guard, GuardConfig
from reelcache.train.parallel import Parallel
from reelcache.train.runlog import LogConfig, RunLog
from reelcache.train.sections import (
    ConditioningConfig,
    DataConfig,
    EMAConfig,
    FlowConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    StepConfig,
)
from reelcache.train.step import EMA, Step
from reelcache.train.watchdog import Watchdog, WatchdogConfig

# section -> the constructor its build() calls with itself
BUILDS = {
    ConditioningConfig: Conditioning,
    OptimConfig: Parallel.optimizer,  # torch's AdamW or ColossalAI's HybridAdam, made by the Parallel
    StepConfig: Step,
    EMAConfig: EMA,
    ParallelConfig: Parallel.setup,
    CheckpointConfig: Checkpointer,
    LogConfig: RunLog,
    GuardConfig: Guard,
    WatchdogConfig: Watchdog,
}
# sections with no component of their own: read whole by the ones that use them
READ_WHOLE = {
    FlowConfig: (Step, "flow"),  # rectified flow's draws, in the step
    RunConfig: None,  # the run's name, seed and length: the trainer's own
}
# sections whose component is not built from the section object, and why
OTHER = {
    # STDiT3 takes the STDiT3Config that only the section makes (ModelConfig.stdit3: eval builds its model
    # through it too); its build() adds the seed and the gradient checkpointing
    ModelConfig: "STDiT3(self.stdit3())",
    # the loader is built from manifests alone by train simulate, the viewer and eval (no [data] there)
    DataConfig: "LatentLoader(manifests, buckets, ...)",
}


def _params(ctor) -> list[inspect.Parameter]:
    fn = ctor.__init__ if inspect.isclass(ctor) else ctor
    return [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]


def _assert_takes_the_section(section, ctor) -> None:
    first, *rest = _params(ctor)
    assert first.annotation in (section, section.__name__), f"{ctor.__qualname__}: first parameter is not a {section}"
    fields = {f.name for f in dataclasses.fields(section)}
    unpacked = sorted(fields & {p.name for p in rest})
    assert not unpacked, f"{ctor.__qualname__} takes {section.__name__}'s fields {unpacked} a second way"
    assert all(p.kind is p.KEYWORD_ONLY for p in rest), f"{ctor.__qualname__}: run-time values by keyword"


def _build_passes_self(section, ctor) -> bool:
    tree = ast.parse(textwrap.dedent(inspect.getsource(section.build)))
    name = ctor.__name__ if inspect.isclass(ctor) else ctor.__name__
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called == name and node.args[0].id == "self":
                return True
    return False


def test_every_train_section_builds_its_component_one_way():
    sections = {type(getattr(TrainConfig(), f.name)) for f in dataclasses.fields(TrainConfig)}
    placed = BUILDS.keys() | READ_WHOLE.keys() | OTHER.keys()
    assert sections == placed, f"sections not placed in this test: {sorted(s.__name__ for s in sections - placed)}"
    for section, ctor in BUILDS.items():
        _assert_takes_the_section(section, ctor)
        assert _build_passes_self(section, ctor), f"{section.__name__}.build does not call {ctor.__name__}(self, ...)"
    for section, user in READ_WHOLE.items():
        assert not hasattr(section, "build"), section
        if user:
            cls, keyword = user
            assert {p.name: p.annotation for p in _params(cls)}[keyword] in (section, section.__name__)


def test_the_cache_encoders_take_their_section():
    specs = {f.name for f in dataclasses.fields(CacheConfig) if f.type in (EncoderSpec, "EncoderSpec")}
    assert specs == {"video_encoder", "text_encoder"}
    for ctor in (VideoEncoder, TextEncoder):
        first, *rest = _params(ctor)
        assert first.annotation in (EncoderSpec, "EncoderSpec")
        assert not {f.name for f in dataclasses.fields(EncoderSpec)} & {p.name for p in rest}


def test_the_check_fails_on_a_component_that_unpacks_its_section():
    """The walk's rule catches the shape it forbids (Guard before this rule: its fields, renamed)."""

    class Unpacked:
        def __init__(self, spike_z: float = 6.0, window: int = 100, max_bad: int = 5):
            pass

    class Section(GuardConfig):
        def build(self):
            return Unpacked(self.spike_z, self.window, self.max_bad_steps)

    try:
        _assert_takes_the_section(Section, Unpacked)
    except AssertionError:
        pass
    else:
        raise AssertionError("an unpacking constructor passed the check")
    assert not _build_passes_self(Section, Unpacked)
