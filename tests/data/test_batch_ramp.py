"""The batch-size ramp's arithmetic: micro-batches per step, and the step each micro-batch falls in."""

from __future__ import annotations

import pytest

from dsgpt2.data.ramp import BatchRamp, check_ramp
from dsgpt2.errors import ConfigError


def test_the_speedrun_ramp_rises_in_equal_stages_to_the_full_batch() -> None:
    """G = 3 over 600 steps: 1 micro-batch for steps 1-300, 2 for 301-600, 3 from 601 (with micro-batch 8:
    the speedrun's 8 → 16 → 24 sequences)."""
    ramp = BatchRamp(3, 600)
    assert [ramp.accum(s) for s in (0, 299, 300, 599, 600, 10_000)] == [1, 1, 2, 2, 3, 3]
    assert ramp.micros_before(300) == 300 and ramp.micros_before(600) == 900
    assert ramp.micros_before(601) == 903
    assert ramp.describe(8, 1) == (
        "batch ramp: 8 sequences a step at first, rising in 2 stage(s) to 24 from step 601 (--batch_ramp 600)"
    )


@pytest.mark.parametrize(("grad_accum", "steps"), [(1, 0), (4, 0), (2, 5), (3, 7), (4, 10), (1, 9)])
def test_each_micro_batch_falls_in_the_step_that_takes_it(grad_accum: int, steps: int) -> None:
    """Walking the steps one micro-batch at a time: ``step_of`` names the step each one is read in, and
    ``micros_before`` the micro-batches before each step, on the ramp and after it."""
    ramp = BatchRamp(grad_accum, steps)
    micro = 0
    for step in range(steps + 12):
        assert ramp.micros_before(step) == micro
        for _ in range(ramp.accum(step)):
            assert ramp.step_of(micro) == step, (step, micro)
            micro += 1
    assert sum(ramp.accum(s) for s in range(steps)) == ramp.micros_before(steps)


def test_no_ramp_is_the_plain_accumulation() -> None:
    plain = BatchRamp(4)
    assert plain.ramping == 0 and {plain.accum(s) for s in range(9)} == {4}
    assert [plain.step_of(m) for m in range(9)] == [m // 4 for m in range(9)]
    assert BatchRamp(1, 50).ramping == 0  # nothing to ramp to


def test_a_ramp_needs_a_config_that_accumulates() -> None:
    with pytest.raises(ConfigError, match=r"--batch_ramp 200: .* which is 1 in ds\.json; use a config"):
        check_ramp(200, 1, "ds.json")
    assert check_ramp(0, 1, "ds.json") == BatchRamp(1)
    assert check_ramp(200, 2, "ds.json").accum(199) == 1
