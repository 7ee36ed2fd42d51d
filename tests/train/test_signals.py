"""The stop the ranks agree on: decided by what every rank reported, never by a signal that landed while
the ranks were comparing (that rank would stop a step before the others, and the others wait forever)."""

from __future__ import annotations

import os
import signal

import pytest

from dsgpt2.train import signals
from dsgpt2.train.signals import StopRequest


def test_a_signal_landing_during_the_agreement_counts_at_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stop = StopRequest()
    reported: list[list[int]] = []

    def sum_while_a_signal_lands(values: list[int], device: object) -> list[int]:
        reported.append(values)
        if len(reported) == 1:
            stop._stop(signal.SIGINT, None)  # the handler runs while this rank waits for the others
        return values  # one rank: the sum is what it reported

    monkeypatch.setattr(signals, "all_sum", sum_while_a_signal_lands)
    assert stop.agreed("cpu") is False and stop.name == "SIGINT"  # the others reported nothing
    assert stop.agreed("cpu") is True and reported[1] == [1, 0]


def test_a_rank_without_a_signal_takes_the_others_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="dsgpt2.train.trainer")
    stop = StopRequest()
    monkeypatch.setattr(signals, "all_sum", lambda values, device: [0, 1])  # another rank got SIGTERM
    assert stop.agreed("cpu") is True and stop.name == "SIGTERM"
    stop.over()  # the loop ended on it: said as the others' stop, and only so
    assert "stopping with the other ranks (SIGTERM)" in caplog.text and "SIGTERM: saving" not in caplog.text
    monkeypatch.setattr(signals, "all_sum", lambda values, device: values)
    assert StopRequest().agreed("cpu") is False


def test_a_rank_whose_own_ctrl_c_lands_after_it_took_the_others_stop_announces_it_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a loaded machine the process group's SIGINT can reach one rank after the others already
    stopped it: the same stop (named SIGINT, announced once), not a second Ctrl-C that raises."""
    caplog.set_level("WARNING", logger="dsgpt2.train.trainer")
    monkeypatch.setattr(signals, "all_sum", lambda values, device: [1, 0])  # another rank got SIGINT
    stop = StopRequest()
    assert stop.agreed("cpu") is True and stop.name == "SIGINT"
    stop._stop(signal.SIGINT, None)  # this rank's own, late: no KeyboardInterrupt
    assert stop.name == "SIGINT" and caplog.text.count("SIGINT: saving a checkpoint") == 1
    with pytest.raises(KeyboardInterrupt):  # a further one is the user's second Ctrl-C
        stop._stop(signal.SIGINT, None)


def test_a_process_forked_from_the_rank_ignores_the_inherited_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The launcher signals a rank's whole tree: a DataLoader worker caught before it ignores the stop
    signals runs the rank's handler, which must neither announce a stop nor raise there."""
    stop = StopRequest()
    stop.install()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the handler it inherited, called as a signal would
            try:
                stop._stop(signal.SIGTERM, None)
                stop._stop(signal.SIGINT, None)  # in the rank itself, a second signal raises
                os.write(write, repr(stop.name).encode())
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 100) == b"None"
        os.waitpid(pid, 0)
        assert stop.name is None and "saving a checkpoint" not in caplog.text
        stop._stop(signal.SIGTERM, None)
        assert stop.name == "SIGTERM"
    finally:
        stop.restore()  # its announcement, due in a second, would land in another test


def test_a_ctrl_c_whose_relayed_sigterm_comes_first_is_named_sigint_and_not_a_second_ctrl_c(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the deepspeed launcher a Ctrl-C reaches a rank as the terminal's SIGINT and the launcher's
    SIGTERM, in either order on a loaded machine: one stop, named SIGINT, announced once."""
    monkeypatch.setattr(signals, "all_sum", lambda values, device: values)
    caplog.set_level("WARNING", logger="dsgpt2.train.trainer")
    stop = StopRequest()
    stop._stop(signal.SIGTERM, None)
    assert "saving a checkpoint" not in caplog.text  # waits for a SIGINT of the same Ctrl-C
    stop._stop(signal.SIGINT, None)  # no KeyboardInterrupt: the pair, not a second Ctrl-C
    assert stop.name == "SIGINT" and stop.agreed("cpu") is True
    assert caplog.text.count("saving a checkpoint") == 1 and "SIGINT: saving a checkpoint" in caplog.text

    # A Ctrl-C well after a SIGTERM is the user's second one: it stops at once.
    caplog.clear()
    stop = StopRequest()
    stop._stop(signal.SIGTERM, None)
    stop._at -= signals.PAIRED
    assert stop.agreed("cpu") is True and "SIGTERM: saving a checkpoint" in caplog.text
    with pytest.raises(KeyboardInterrupt):
        stop._stop(signal.SIGINT, None)


def test_a_sigterm_alone_is_announced_without_waiting_for_the_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    caplog.set_level("WARNING", logger="dsgpt2.train.trainer")
    monkeypatch.setattr(signals, "PAIRED", 0.05)
    stop = StopRequest()
    stop._stop(signal.SIGTERM, None)
    deadline = time.monotonic() + 10
    while "SIGTERM: saving a checkpoint" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert caplog.text.count("SIGTERM: saving a checkpoint") == 1 and stop.name == "SIGTERM"


@pytest.mark.parametrize("ends", ["returning", "raising"])
def test_the_trainer_gives_the_signals_back_and_leaves_no_announcement_due(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, ends: str
) -> None:
    """Trained in-process (a notebook, ``bench host``), the run's handlers end with it, however it ends:
    a Ctrl-C afterwards is the caller's again, and a SIGTERM of the last step is not announced later
    into whatever runs next (nor as the run's end when the run failed)."""
    from dsgpt2.train.trainer import Trainer

    caplog.set_level("WARNING", logger="dsgpt2.train.trainer")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    trainer = Trainer.__new__(Trainer)  # its loop alone stands in for the run
    trainer.stop = StopRequest()

    def loop() -> dict:
        assert signal.getsignal(signal.SIGTERM) == trainer.stop._stop
        trainer.stop._stop(signal.SIGTERM, None)  # during the last step: its announcement due in PAIRED
        if ends == "raising":
            raise RuntimeError("the run failed")
        return {"stopped": "done"}

    monkeypatch.setattr(trainer, "_train", loop)
    if ends == "raising":
        with pytest.raises(RuntimeError):
            trainer.train()
    else:
        assert trainer.train() == {"stopped": "done"}
    assert {s: signal.getsignal(s) for s in before} == before
    timer = trainer.stop._timer
    assert timer is not None
    timer.join(10)  # cancelled, it ends at once; due, it would have logged in PAIRED
    assert not timer.is_alive() and "SIGTERM" not in caplog.text
    assert trainer.stop.stopped_by is None


def test_a_stop_left_pending_by_the_last_step_is_announced_as_changing_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", logger="dsgpt2.train.trainer")
    stop = StopRequest()
    stop._stop(signal.SIGTERM, None)
    stop.over()  # the loop ended on --train_iters before the ranks compared
    assert caplog.text.count("SIGTERM after the last step: the run ends as it would have") == 1
    stop._stop(signal.SIGTERM, None)  # the launcher relaying it: nothing more said
    stop.restore()
    assert caplog.text.count("SIGTERM") == 1 and stop.stopped_by is None


def test_a_sigterm_of_the_last_step_is_said_to_change_nothing_whenever_its_announcement_comes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its announcement waits for a paired SIGINT; on a loaded machine the loop may end before or after
    that wait: either way the words are the same, said once."""
    caplog.set_level("WARNING", logger="dsgpt2.train.trainer")
    said = "SIGTERM came with the last step: the run ends as it would have, its final checkpoint written"
    for announced_first in (True, False):
        caplog.clear()
        stop = StopRequest()
        stop.last_step()
        stop._stop(signal.SIGTERM, None)
        if announced_first:
            assert stop._timer is not None
            stop._timer.join(10)
        stop.over()
        stop.restore()
        assert caplog.text.count("SIGTERM") == 1 and said in caplog.text, caplog.text
        assert stop.stopped_by is None


def test_a_ctrl_c_announced_during_the_last_step_is_then_said_to_change_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", logger="dsgpt2.train.trainer")
    stop = StopRequest()
    stop._stop(signal.SIGINT, None)  # said at once, as a stop
    stop.over()
    assert "SIGINT: saving a checkpoint after the current step" in caplog.text
    assert "SIGINT came with the last step: the run ends as it would have" in caplog.text
    assert stop.stopped_by is None


def test_a_handler_not_set_from_python_comes_back_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: list[tuple[int, object]] = []

    def fake_signal(signum: int, handler: object) -> object:
        set_to.append((signum, handler))
        return None  # what signal.signal says of a handler installed outside Python

    monkeypatch.setattr(signals.signal, "signal", fake_signal)
    stop = StopRequest()
    stop.install()
    stop.restore()
    assert set_to[2:] == [(signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.SIG_DFL)]


def test_a_request_installed_again_starts_with_no_stop() -> None:
    stop = StopRequest()
    stop.install()
    try:
        stop._stop(signal.SIGINT, None)
    finally:
        stop.restore()
    stop.install()
    try:
        assert stop.name is None and stop.agreed("cpu") is False
    finally:
        stop.restore()
