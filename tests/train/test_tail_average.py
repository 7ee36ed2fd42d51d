"""The weights' tail average (``--ema_tail``): its arithmetic against one written out here, tied weights
kept once, the average swapped in and out for a validation, and a checkpoint's weights read with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsgpt2.checkpoints.weights import with_average
from dsgpt2.errors import ConfigError
from dsgpt2.settings.options import STEPS_OR_SHARE
from dsgpt2.train.average import TailAverage, check_average, tail_steps


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.wte.weight
        self.norm = torch.nn.LayerNorm(3)


@pytest.mark.parametrize("tail", [3, 0.5])
def test_the_average_of_the_last_three_of_six_steps_is_an_ema_of_span_three(tail: float) -> None:
    """Tail 3 of 6 (``--ema_tail 3``, or half the run: ``0.5``): the average is the weights after step 4,
    then each later step's taken in at 2 / (3 + 1); the tied head is one weight (an alias), not averaged
    twice; steps before the tail are not seen."""
    torch.manual_seed(0)
    model = Tied()
    average = TailAverage(model, tail, 6)
    state = SimpleNamespace(step=0, average=None)
    seen = {}
    for step in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        seen[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        state.step = step
        average.after_step(state)
        assert (state.average is None) == (step <= 3)
    assert set(state.average["weights"]) == {"wte.weight", "norm.weight", "norm.bias"}
    assert state.average["aliases"] == {"head.weight": "wte.weight"}
    for name in state.average["weights"]:
        want = seen[4][name]
        for step in (5, 6):
            want = want + 0.5 * (seen[step][name] - want)
        torch.testing.assert_close(state.average["weights"][name], want)


def test_a_validation_sees_the_average_and_training_the_raw_weights_after() -> None:
    model = Tied()
    average = TailAverage(model, 2, 4)
    state = SimpleNamespace(step=3, average=None)
    average.after_step(state)
    with torch.no_grad():
        model.wte.weight.mul_(3.0)
    raw = model.wte.weight.detach().clone()
    with average.applied(state, when=False) as applied:
        assert not applied and torch.equal(model.wte.weight, raw)
    with average.applied(state, when=True) as applied:
        assert applied and torch.equal(model.head.weight, state.average["weights"]["wte.weight"])
    assert torch.equal(model.wte.weight, raw)
    with average.applied(SimpleNamespace(average=None), when=True) as applied:
        assert not applied


def test_a_checkpoints_weights_are_its_averages_where_it_holds_one() -> None:
    raw = {"wte.weight": torch.zeros(2), "head.weight": torch.zeros(2), "other": torch.ones(1)}
    average = {"weights": {"wte.weight": torch.full((2,), 5.0)}, "aliases": {"head.weight": "wte.weight"}}
    got = with_average(raw, average)
    assert got["wte.weight"].tolist() == got["head.weight"].tolist() == [5.0, 5.0]
    assert got["other"].tolist() == [1.0] and with_average(raw, None) is raw


def test_a_tail_longer_than_the_run_or_under_zero_3_is_refused() -> None:
    assert check_average(0, 10, 3) is None
    assert "from step 8, an EMA of span 3" in str(check_average(3, 10, 2))
    with pytest.raises(ConfigError, match=r"--ema_tail 11: must be at most --train_iters 10"):
        check_average(11, 10, 0)
    with pytest.raises(ConfigError, match=r"--ema_tail 3: ZeRO stage 3 holds a slice"):
        check_average(3, 10, 3)


def test_a_tail_is_steps_or_a_share_of_the_run_rounded_up() -> None:
    """``--ema_tail`` reads a whole number as steps and a number in (0, 1) as that share of
    ``--train_iters`` (a recipe's tail follows a shortened run); anything else is refused as it is typed."""
    assert [tail_steps(t, 1000) for t in (200, 0.2, 0.0005, 1)] == [200, 200, 1, 1]
    assert tail_steps(0.2, 7) == 2
    assert "from step 241, an EMA of span 60 (--ema_tail 0.2 of 300 steps)" in str(check_average(0.2, 300, 0))
    assert [STEPS_OR_SHARE.parse(t) for t in ("200", "0.2", "0")] == [200, 0.2, 0]
    assert type(STEPS_OR_SHARE.parse("200")) is int
    for bad in (1.5, -1, float("nan"), True, 200.5):
        assert not STEPS_OR_SHARE.holds(bad), bad
    with pytest.raises(
        ConfigError, match=r"--ema_tail must be 0, a whole number of steps or a share in \(0, 1\), got 1.5"
    ):
        STEPS_OR_SHARE.check("--ema_tail", 1.5)
