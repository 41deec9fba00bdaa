"""tests/regression.py's comparison alone (the reference run itself is
test_train.py::test_debug_stage_losses_equal_the_regression_record, slow)."""

from __future__ import annotations


def test_the_regression_tolerance_passes_rounding_and_fails_real_changes():
    """differences() with the measured sizes (tests/regression.py): rounding passes, a real change fails."""
    import regression

    record = {"torch": "t", "ranks": 2, "losses": [3.7221, 3.7296, 3.4323]}

    def moved(*deltas):
        return regression.differences(record, {**record, "losses": [a + d for a, d in zip(record["losses"], deltas)]})

    assert moved(0, 7e-7, -7e-7) == [] and moved(0, 3.2e-7, 2.9e-7) == []
    assert len(moved(0, 1.8e-5, 0)) == 1 and "more than 5e-06" in moved(0, 0, -1.8e-5)[0]  # AdamW eps 1e-8
    assert len(moved(0, 5e-2, 6e-2)) == 2  # the warm-up off by one
    assert regression.TOLERANCE == 5e-6
