"""The ``deepspeed`` runner as ``dsgpt2 launch`` starts it (``python -m dsgpt2.train.launch_runner ARGS``):
DeepSpeed's own, except that arguments its parser refuses (a flag it does not have, a value of the wrong
kind) are one line naming them and exit code 2, where the runner prints its whole usage."""

from __future__ import annotations

import contextlib
import difflib
import io
import re
import sys
from collections.abc import Sequence

UNRECOGNIZED = "unrecognized arguments: "


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
