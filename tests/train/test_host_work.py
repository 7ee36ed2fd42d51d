"""What the host-work benchmark counts: top-level aten ops outside compiled graphs, and the time a
device was busy (the union of its kernels' intervals)."""

from __future__ import annotations

import torch

from bench.bench_host import covered, outside_compiled


def test_busy_time_is_the_union_of_the_kernels_intervals() -> None:
    assert covered([]) == 0.0
    assert covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # overlap counted once, gaps not at all
    assert covered([(4.0, 5.0), (0.0, 10.0), (2.0, 3.0)]) == 10.0  # nested, in any order


def test_ops_are_counted_once_at_the_top_level() -> None:
    """``F.linear`` dispatches addmm (and a transpose) beneath it: one op for the host, not three."""
    x, w = torch.randn(4, 3), torch.randn(2, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.nn.functional.linear(x, w)
        x.add_(1.0)
    counts = outside_compiled(prof.events())
    assert counts == {"aten::linear": 1, "aten::add_": 1}
