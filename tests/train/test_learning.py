"""When a step counts as learning nothing: a finite, non-zero loss with a gradient norm of exactly 0."""

from __future__ import annotations

import pytest
import torch

from dsgpt2.errors import NoGradient
from dsgpt2.train.learning import check_learns, grad_norm


def test_a_finite_loss_with_no_gradient_stops_the_run_naming_torch_and_the_way_out() -> None:
    losses = [torch.tensor(6.2), torch.tensor(6.3)]
    with pytest.raises(NoGradient) as stopped:
        check_learns(7, losses, 0.0, compiled=True)
    message = str(stopped.value)
    assert message.startswith(
        "step 7 learns nothing: its loss was 6.2500 and its gradient norm 0, under torch "
    )
    assert torch.__version__ in message and "--no_compile" in message and "\n" not in message
    assert stopped.value.exit_code == 2
    with pytest.raises(NoGradient, match="the model is not compiled"):
        check_learns(7, losses, 0.0, compiled=False)


@pytest.mark.parametrize(
    ("losses", "norm"),
    [
        ([6.2, 6.3], 0.4),  # it learns
        ([6.2, 6.3], None),  # no norm read at this step
        ([0.0, 0.0], 0.0),  # context-only blocks: nothing to predict, rightly no gradient
        ([float("nan"), 6.3], 0.0),  # a non-finite loss is the micro-loop's to skip
    ],
)
def test_what_is_not_a_step_that_learns_nothing(losses: list[float], norm: float | None) -> None:
    check_learns(3, [torch.tensor(x) for x in losses], norm, compiled=True)


def test_the_norm_by_hand_is_the_norm_of_every_gradient() -> None:
    model = torch.nn.Linear(3, 2)
    assert grad_norm(model) == 0.0  # no gradient yet
    model(torch.ones(1, 3)).sum().backward()
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert grad_norm(model) == pytest.approx(float(want))
