"""``dsgpt2 launch``: the ``deepspeed`` launcher, ended by Ctrl-C or SIGTERM as a single process is.

DeepSpeed's launcher makes its own ending of a stop signal sent to its process group (a terminal's
Ctrl-C, ``kill -TERM -- -PGID``): its runner dies of it at once (130 after a KeyboardInterrupt
traceback, 143 after SIGTERM) while the ranks are still writing their checkpoint, and its per-node
launcher passes it to the ranks as a SIGTERM and exits 1 whatever they did. Here the launcher runs in a
process group of its own, and the signal this command gets goes, as it came, to the ranks and their
children only: they save and exit as in a single process, the launcher sees them end as it sees any
run end, and this command exits with their code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from dsgpt2.train.launch_runner import LAUNCH_PID

log = logging.getLogger(__name__)

USAGE = """\
usage: dsgpt2 launch [deepspeed launcher flags] SCRIPT [SCRIPT flags]

Runs the `deepspeed` launcher with these arguments (`deepspeed --help` lists its flags), e.g.
  dsgpt2 launch --num_gpus 2 ds_trainer.py --deepspeed_config ... --config_train ...
and ends as a single process does on Ctrl-C or SIGTERM to this command's process group: every
rank saves a checkpoint after its current step and the command exits 0 (a second Ctrl-C: at once,
130). The plain `deepspeed` command's ranks save the same way, but the launcher itself exits at
once (130 or 143) while they are still saving. One node, or one launch per node with --no_ssh;
a launch over ssh (pdsh) gets the signal as DeepSpeed handles it.
"""

# Passed on as they came; SIGHUP (the terminal closed) too, which ends a single process at once.
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
NODE_LAUNCHER = "deepspeed.launcher.launch"
# DeepSpeed's runner, its refusals of its arguments made one line.
RUNNER = "dsgpt2.train.launch_runner"


def main(argv: Sequence[str]) -> int:
    """Run ``deepspeed ARGV`` in a process group of its own, passing stop signals to its ranks; its
    exit code (128 + N for a launcher ended by signal N, as a shell reports it)."""
    if not argv:
        sys.stderr.write("dsgpt2 launch: error: name the script to launch, e.g. dsgpt2 launch --num_gpus 2 "
                         "ds_trainer.py --deepspeed_config ... (dsgpt2 launch --help)\n")  # fmt: skip
        return 2
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        raise SystemExit(0)  # as argparse ends --help
    received: list[int] = []
    for signum in PASSED_ON:
        signal.signal(signum, lambda signum, frame: received.append(signum))
    # A group of its own: what the terminal or `kill -- -PGID` sends reaches this process alone.
    group: dict[str, Any] = (
        {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    )
    # The runner ends its group if this process is killed (SIGKILL, which passes nothing on).
    env = {**os.environ, LAUNCH_PID: str(os.getpid())}
    runner = subprocess.Popen([sys.executable, "-u", "-m", RUNNER, *argv], env=env, **group)
    passer = SignalPasser(runner.pid)
    while runner.poll() is None:
        passer.pass_on(received)
        time.sleep(0.1)
    code = runner.returncode
    # Where the signal went to the whole group (before the ranks started), the runner ends before
    # its ranks: the prompt comes back once they are gone (DeepSpeed kills them 30 s after it).
    deadline = time.monotonic() + 60
    while passer.group_signalled and _group_alive(runner.pid) and time.monotonic() < deadline:
        _reap_orphans()
        time.sleep(0.1)
    if code < 0:
        return 128 - code
    killed = killing_signal(code)
    if killed is not None:
        if not received:  # not the stop this command was sent
            sys.stderr.write(f"dsgpt2 launch: error: {killed_rank(killed)}\n")
        return 128 + killed
    return code


def killing_signal(code: int) -> int | None:
    """The signal that killed a rank, from the launcher's exit code: DeepSpeed's node launcher exits with
    its dead rank's return code, -N for a rank killed by signal N, which the process status makes 256 - N
    (247 for SIGKILL). None for any other code."""
    signum = 256 - code
    return signum if signum in _DEADLY else None


# What kills a rank without its own exit: the kernel (SIGKILL, memory; SIGSEGV, SIGBUS), an abort, a kill.
_DEADLY = {
    int(s)
    for s in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL,
              signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
}  # fmt: skip


def killed_rank(signum: int) -> str:
    """The line for a launch whose rank was killed by ``signum``."""
    name = signal.Signals(signum).name
    why = ""
    if signum == signal.SIGKILL:
        why = (" (the kernel's out-of-memory killer sends it when memory runs out: `dmesg` or "
               "`journalctl -k` says so; lower the micro-batch or --num_workers)")  # fmt: skip
    elif signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT):
        why = " (a crash inside a native library; the rank's output above shows where)"
    return (f"a rank was killed by {name}{why}; the others were stopped; the same command resumes from "
            "the last whole checkpoint")  # fmt: skip


class SignalPasser:
    """Gives the ranks under ``runner`` (the ``deepspeed`` runner's pid, also its process group) each
    signal this process got, once, and to a rank started after a signal, the signals it missed."""

    def __init__(self, runner: int) -> None:
        self.runner = runner
        self.reached: dict[int, int] = {}  # rank pid → how many of the received signals it got
        self.sent = 0  # how many of the received signals went out
        self.group_signalled = False  # one went to the launcher's whole group

    def pass_on(self, received: list[int]) -> None:
        """Send what arrived since the last call; catch up ranks started since."""
        if not received:
            return
        import psutil

        try:
            launchers = [
                p for p in psutil.Process(self.runner).children(recursive=True) if _is_node_launcher(p)
            ]
        except psutil.NoSuchProcess:
            return
        ranks = [r for launcher in launchers for r in _children(launcher)]
        now = len(received)  # the handler may append meanwhile: those go out at the next call
        for signum in received[self.sent : now]:
            if not launchers:
                # Not started yet, or started over ssh: DeepSpeed's own handling.
                _send_group(self.runner, signum)
                self.group_signalled = True
                continue
            log.debug("passing %s to %d rank(s)", signal.Signals(signum).name, len(ranks))
            for rank in ranks:
                # As a terminal would: the rank and its children (DataLoader workers ignore it).
                for p in [rank, *_children(rank, recursive=True)]:
                    _send(p, signum)
                self.reached[rank.pid] = now
        self.sent = now
        for rank in ranks:
            for signum in received[self.reached.setdefault(rank.pid, 0) : now]:
                _send(rank, signum)
            self.reached[rank.pid] = now


def _is_node_launcher(p: Any) -> bool:
    import psutil

    try:
        return NODE_LAUNCHER in p.cmdline()
    except psutil.Error:
        return False


def _children(p: Any, recursive: bool = False) -> list[Any]:
    import psutil

    try:
        return list(p.children(recursive=recursive))
    except psutil.Error:
        return []


def _send(p: Any, signum: int) -> None:
    import psutil

    with contextlib.suppress(psutil.Error):  # ended meanwhile
        p.send_signal(signum)


def _send_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_orphans() -> None:
    """Where this process is PID 1 (a container without an init), the launcher's orphans are its
    children: reaped, they leave the group."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
