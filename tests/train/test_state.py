"""train/state.py's TrainState (all of state.json) and where the run's wandb id lives, against the
committed state.json of a version-2 checkpoint (tests/fixtures/train-v2, written by the trainer
before the id moved out of it). The trainer resuming and logging into one wandb run:
test_train.py::test_requeued_run_resumes_prunes_logs_one_wandb_run_and_clips_at_1 (slow)."""

from __future__ import annotations

import json

import pytest
from latent_data import write_latents
from support import REPO

from reelcache.base.buckets import BucketConfig
from reelcache.train.guard import GuardConfig
from reelcache.train.loader import LatentLoader
from reelcache.train.runlog import LogConfig, read_run_id
from reelcache.train.state import TrainState

V2_STATE = REPO / "tests/fixtures/train-v2/state.json"


@pytest.fixture()
def state(tmp_path) -> TrainState:
    """A TrainState over the manifest the fixture's run trained on (the same 8 test latents: the same
    data fingerprint), at step 0."""
    manifest = write_latents(tmp_path, 8, name="fix")
    loader = LatentLoader(
        [manifest], BucketConfig.from_toml(REPO / "configs/buckets/tiny.toml"), root=tmp_path, seed=42, read=False
    )
    return TrainState(loader, GuardConfig().build(), "v2", 1, "tiny")


def test_a_version_2_state_json_restores_the_counters_the_position_and_the_guard(state):
    saved = json.loads(V2_STATE.read_text())
    state.load_state_dict(saved)
    assert (state.global_step, state.opt_steps, state.loader.consumed, state.loader.epoch) == (2, 2, 2, 0)
    assert list(state.guard.window) == saved["guard"]["window"]
    assert not hasattr(state, "legacy_wandb_id")  # its wandb_id is not read (docs/CHANGELOG.md)


def test_state_json_is_the_train_states_and_holds_no_wandb_id(state):
    state.load_state_dict(json.loads(V2_STATE.read_text()))
    state.init_from, state.init_weights = "/w/ckpt-00000002", "model"
    doc = json.loads(json.dumps(state.state_dict()))
    assert set(doc) == {
        "global_step", "opt_steps", "loader", "guard", "run", "world_size", "model_preset", "init_from",
        "init_weights", "saved_at", "versions",
    }  # fmt: skip
    assert (doc["run"], doc["world_size"], doc["model_preset"], doc["init_weights"]) == ("v2", 1, "tiny", "model")
    # the position travels unchanged; the resume is counted (the consumed log keeps the newest generation)
    assert doc["loader"] == {**json.loads(V2_STATE.read_text())["loader"], "generation": 1}
    assert "torch" in doc["versions"]


@pytest.mark.slow  # two offline wandb runs: ~3 s
def test_the_wandb_id_is_the_run_directorys(tmp_path):
    """The id file wins; without one, a new id, written to the file, so every later start finds it there."""
    run = tmp_path / "run"
    assert read_run_id(run) is None

    def start():
        log = LogConfig(wandb_mode="offline").build(
            run_dir=run, enabled=True, name="r", config={}, generation=0, total_steps=1
        )
        log.finish()
        return log.run_id

    fresh = start()
    assert len(fresh) == 12 and read_run_id(run) == fresh
    assert start() == fresh  # the file's
