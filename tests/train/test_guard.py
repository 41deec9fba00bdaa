"""train/guard.py alone: the spike rule, the skip policy, the streak that survives a resume, and the
message that names the checkpoint to resume from. The guard in a real run of two ranks is
test_train.py::test_divergence_guard_skips_a_nan_step_on_every_rank_and_stops_after_n (slow)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from reelcache.train.guard import Guard, GuardConfig


def test_guard_spike_rule():
    g = Guard(GuardConfig(spike_z=4.0, window=10, max_bad_steps=2))
    for v in [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.1, 0.9, 1.0, 1.0]:
        assert g.verdict(v, 1.0) is None
        g.record(v, False)
    # window mean 1.0, sample std 0.0667: 1.2 is z = 3.0, 1.3 is z = 4.5
    assert g.verdict(1.2, 1.0) is None
    assert "spike" in g.verdict(1.3, 1.0)
    assert "gradient norm is inf" in g.verdict(1.0, float("inf"))
    g.record(1.3, True)
    assert not g.exhausted
    g.record(1.3, True)
    assert g.exhausted


def test_a_spike_is_skipped_even_when_non_finite_steps_are_not():
    g = Guard(GuardConfig(spike_z=4.0, window=4, max_bad_steps=3, skip_nonfinite=False))
    for v in (1.0, 1.1, 0.9, 1.0):
        g.record(v, False)
    assert "spike" in g.verdict(5.0, 1.0) and g.skips(5.0, 1.0)
    assert g.verdict(float("inf"), 1.0) and not g.skips(float("inf"), 1.0)
    assert g.verdict(1.0, float("nan")) and not g.skips(1.0, float("nan"))
    # the streak's first stepped step survives a resume and ends with the next good step
    g.record(float("nan"), True, stepped_at=11)
    g.record(float("nan"), True, stepped_at=12)
    h = GuardConfig(skip_nonfinite=False).build()
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert (h.bad, h.stepped_from) == (2, 11)
    h.record(1.0, False)
    assert (h.bad, h.stepped_from) == (0, None)


def test_the_diverged_message_names_a_checkpoint_from_before_the_stepped_nan(tmp_path):
    from reelcache.train.trainer import Trainer

    run = tmp_path / "runs/r"
    for step in (0, 5, 10, 15):
        (run / f"ckpt-{step:08d}").mkdir(parents=True)
        (run / f"ckpt-{step:08d}/state.json").write_text("{}")
    g = Guard(GuardConfig(max_bad_steps=2, skip_nonfinite=False))
    g.record(float("nan"), True, stepped_at=12)  # ckpt-15 holds the NaN weights
    fake = SimpleNamespace(
        run_dir=run, root=tmp_path, root_url=None, ckpt=SimpleNamespace(home=run),
        state=SimpleNamespace(global_step=17, guard=g),
    )  # fmt: skip
    assert f"--load {run / 'ckpt-00000010'}" in Trainer._diverged_message(fake)
    g = Guard(GuardConfig(max_bad_steps=2))  # skipped bad steps left the weights alone: the newest checkpoint is good
    g.record(float("nan"), True)
    fake.state.guard = g
    assert f"--load {run / 'ckpt-00000015'}" in Trainer._diverged_message(fake)
