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
        "batch ramp: 8 sequences a step at first, 2 stage(s) below the full 24, which step 601 on take "
        "(--batch_ramp 600)"
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


def test_a_resumed_launch_counts_its_steps_from_where_it_started() -> None:
    """A launch that starts at step 1,000 after 2,095 micro-batches (five skipped as non-finite before):
    its first micro-batch falls in step 1,000 (0-based: 1,000 taken) whatever the earlier launches read a
    step; and a run resumed without its ramp (or with another) counts from its start, not from step 0."""
    ramp = BatchRamp(3, 600).at(1000, 2095)
    assert ramp.step_of(2095) == 1000 and ramp.step_of(2098) == 1001
    plain = BatchRamp(3).at(1000, 2100)
    assert plain.step_of(2100) == 1000 and BatchRamp(3).step_of(2100) == 700
    assert BatchRamp(2, 10).at(4, 4).step_of(4) == 4 and BatchRamp(2, 10).at(4, 4).accum(4) == 1


def test_a_ramp_shorter_than_its_stages_and_a_long_one() -> None:
    """32 micro-batches over 10 steps: 10 stages of one step each (the values in between skipped); a
    ramp of a billion steps costs nothing to make."""
    short = BatchRamp(32, 10)
    assert [short.accum(s) for s in range(11)] == [1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 32]
    assert "10 stage(s) below the full 128" in short.describe(4, 1)
    assert [short.step_of(m) for m in (0, 1, 4, 5)] == [0, 1, 1, 2]
    huge = BatchRamp(8, 10**9)
    assert huge.step_of(huge.micros_before(10**8)) == 10**8 and huge.accum(10**9) == 8


def test_no_ramp_is_the_plain_accumulation() -> None:
    plain = BatchRamp(4)
    assert plain.ramping == 0 and {plain.accum(s) for s in range(9)} == {4}
    assert [plain.step_of(m) for m in range(9)] == [m // 4 for m in range(9)]
    assert BatchRamp(1, 50).ramping == 0  # nothing to ramp to


def test_a_ramp_needs_a_config_that_accumulates() -> None:
    with pytest.raises(ConfigError, match=r"--batch_ramp 200: .* which is 1 in ds\.json; use a config"):
        check_ramp(200, 1, "ds.json")
    # A resume takes its checkpoint's ramp where none is typed: "leave --batch_ramp out" would not do.
    with pytest.raises(ConfigError, match=r"or --batch_ramp 0 for none \(a resumed run takes its checkpoint"):
        check_ramp(600, 1, "ds.json")
    assert check_ramp(0, 1, "ds.json") == BatchRamp(1)
    assert check_ramp(200, 2, "ds.json").accum(199) == 1
