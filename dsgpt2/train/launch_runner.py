"""The ``deepspeed`` runner as ``dsgpt2 launch`` starts it (``python -m dsgpt2.train.launch_runner ARGS``):
DeepSpeed's own, except that arguments its parser refuses (a flag it does not have, a value of the wrong
kind) are one line naming them and exit code 2, where the runner prints its whole usage, and that it ends
with ``dsgpt2 launch``: that command killed (SIGKILL, which it cannot pass on), the runner's process group
(the node launcher, the ranks, their DataLoader workers) is killed too, as a killed single process is gone
with its workers, rather than training on unwatched beside the same command run again."""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import signal
import sys
from collections.abc import Sequence

UNRECOGNIZED = "unrecognized arguments: "
# The pid of the `dsgpt2 launch` that started this runner, in the runner's environment only.
LAUNCH_PID = "DSGPT2_LAUNCH_PID"
# What the kernel sends the runner when that command dies (PR_SET_PDEATHSIG); the ranks never get it.
ORPHANED = signal.SIGUSR1


def refusal(said: str) -> str:
    """The one line for what the runner's parser wrote on refusing its arguments (its usage, then
    ``runner.py: error: MESSAGE``): the message, a flag meant where one was misspelt, where to look."""
    lines = said.strip().splitlines()
    message = lines[-1].partition(": error: ")[2] if lines else ""
    message = message or "the deepspeed launcher refused these arguments"
    if message.startswith("the following arguments are required: user_script"):
        message = "name the script to launch after the launcher's flags (dsgpt2 launch --num_gpus 2 SCRIPT)"
    hint = ""
    if message.startswith(UNRECOGNIZED):
        flags = re.findall(r"\[(--[\w-]+)", said)  # the usage lists every flag of the runner
        for token in message[len(UNRECOGNIZED) :].split():
            close = difflib.get_close_matches(token.split("=", 1)[0], flags, n=1)
            if token.startswith("--") and close:
                hint = f"; did you mean {close[0]}?"
                break
    return f"dsgpt2 launch: error: {message}{hint} (see `deepspeed --help` for the launcher's flags)"


def main(argv: Sequence[str]) -> int:
    """Check ``argv`` with the runner's parser, then run the runner; its exit code."""
    die_with_launch(os.environ.pop(LAUNCH_PID, None))
    from dsgpt2.accelerator import prepare_deepspeed_environment

    prepare_deepspeed_environment()
    from deepspeed.launcher import runner

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            runner.parse_args(list(argv))
    except SystemExit as exit_:
        if not exit_.code:  # --help: its text went to stdout
            raise
        sys.stderr.write(refusal(said.getvalue()) + "\n")
        return 2
    runner.main(list(argv))
    return 0


def die_with_launch(launch_pid: str | None) -> None:
    """Have the kernel signal this runner when ``dsgpt2 launch`` (``launch_pid``) dies, even by SIGKILL
    (Linux), and then kill the runner's process group, which ``dsgpt2 launch`` made for it alone. A runner
    that leads no group of its own (run by a wrapper that forks it elsewhere) kills nothing."""
    if launch_pid is None or not sys.platform.startswith("linux") or os.getpgrp() != os.getpid():
        return
    import ctypes

    signal.signal(ORPHANED, lambda signum, frame: os.killpg(os.getpgrp(), signal.SIGKILL))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, ORPHANED)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launch_pid):  # it died before the request: nothing would send the signal
        os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
