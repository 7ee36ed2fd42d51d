"""An interpreter with what a command imports imported once, forked for each Python command.

A trainer process spends ~5 of its ~6 s on a tiny run importing torch, DeepSpeed and transformers, and
the suite starts about a hundred. ``run_python`` runs each command as a fork of a server that imported
them once per test worker, as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would: its own argv,
environment, working directory, stdin from /dev/null, stdout and stderr captured, default signal
handlers, and the interpreter's exit (non-daemon threads joined, atexit hooks, exit code, a traceback
and 1 on an uncaught exception) short of tearing the interpreter down. Commands that build or run a
model fork from tests/forks.py's server (torch, DeepSpeed, transformers: the one the deepspeed
launcher's processes and ``dsgpt2 serve`` fork from too); the others (ingest, vocab, dedup, info, ...)
from the lighter one below, one command at a time. Tests that signal a process group, or look a
process up by its parent, still start real processes.

    python tests/zygote.py corpus      # a server: one JSON request per line on stdin, replies on stdout
    python tests/zygote.py forks DIR   # tests/forks.py's
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pace import deadline, note_launch

# Two servers per test worker: commands that build or run a model fork from one holding torch, DeepSpeed
# and transformers (tests/forks.py's); the others from one holding only what they import.
PRELOAD = {
    "model": (
        "torch",
        "deepspeed",
        "transformers",
        "transformers.models.gpt2.modeling_gpt2",
        "dsgpt2.train.trainer",
        "dsgpt2.model.gpt2",
        # Muon's update (a new run's optimizer) is DeepSpeed's, whose torch.compile imports Inductor: 1.3 of
        # the 2 s a forked tiny run spent in its own process.
        "deepspeed.runtime.zero.muon.original_muon",
        "dsgpt2.cli.main",
        "matplotlib.pyplot",
    ),
    "corpus": ("dsgpt2.cli.main", "dsgpt2.db.wrapper", "dsgpt2.db.idx", "pymongo", "tokenizers"),
}
MODEL_COMMANDS = {"train", "tokenize", "plan", "lineage", "export", "evaluate", "generate", "chat", "serve",
                  "demo"}  # fmt: skip


def _child(request: dict[str, Any]) -> None:
    """In the fork: become ``python SCRIPT``/``python -m MODULE``, then end as that interpreter would."""
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                           (2, request["err"], os.O_WRONLY)):  # fmt: skip
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    run_main(request["argv"])


def run_main(argv: list[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__``, as ``python ARGV`` would, then end as
    its interpreter ends (``end``): never returns."""
    import runpy

    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        end(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        end(1, interrupted=True)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        end(1)
    end(0)


def end(code: object, interrupted: bool = False) -> None:
    """End this fork as Python ends a process, save the teardown: non-daemon threads joined, atexit
    hooks (logging's flush, weakref finalizers, multiprocessing's children), stdout and stderr flushed,
    the exit status Python gives ``sys.exit(code)`` (a message printed and 1), or the death by SIGINT of
    an unhandled Ctrl-C. Tearing the interpreter down would touch every preloaded object, copying pages
    the fork shares with its server: a quarter of a second a command."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # Python's exit status where stdout cannot take what is left
        status = status or 120
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


def _preload(kind: str) -> Any:
    """Import ``kind``'s modules; returns the server's reply stream (its stdout; fd 1 is /dev/null then)."""
    import gc
    import importlib

    from dsgpt2.accelerator import prepare_deepspeed_environment

    prepare_deepspeed_environment()  # as the trainer does before it imports DeepSpeed
    gc.disable()  # no full passes over the imports; collected once and frozen after them
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for name in PRELOAD[kind]:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the forks' collections leave the preloaded objects' pages shared
    gc.enable()
    return reply


def serve(kind: str) -> None:
    reply = _preload(kind)
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            reply.close()
            _child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status, usage = os.wait4(pid, 0)
        reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status), "faults": usage.ru_minflt}) + "\n")
        reply.flush()


class Zygote:
    """The test process's side: one server, one command at a time."""

    def __init__(self, kind: str, *args: str) -> None:
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, kind, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            start_new_session=True,  # a process group its forks may signal without reaching the tests
            cwd=Path(__file__).resolve().parent.parent,
        )
        self.lock = threading.Lock()
        self._pending = b""
        self.faults = 0
        ready = self._read(600)
        self.errors.seek(0)
        said = self.errors.read().decode()
        # A warning printed while importing would reach no test's stderr: none may be printed.
        if ready != "ready" or said.strip():
            raise RuntimeError(f"zygote did not start cleanly: {ready!r} {said[-3000:]}")
        if kind == "forks":
            # A fresh interpreter importing what a launch imports: the suite's pace measured for free.
            note_launch(time.monotonic() - started)

    def _read(self, timeout: float) -> str | None:
        """The server's next reply line; None if none came within ``timeout``. Read from the pipe itself,
        as a buffered reader could hold a second reply (a fork that ended at once) that select()
        would not see."""
        assert self.proc.stdout is not None
        fd, until = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = until - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return ""
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def run(
        self, argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float
    ) -> tuple[int, str, str]:
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "out"), Path(tmp, "err")
            out.touch()
            err.touch()
            request = {"argv": argv, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self._read(deadline(60)) or "{}")["pid"]
            done = self._read(timeout)
            if done is None:
                os.kill(pid, signal.SIGKILL)
                self._read(deadline(60))
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            ended = json.loads(done)
            self.faults = int(ended["faults"])  # the fork's page faults: pages it copied or touched
            return ended["code"], out.read_text(), err.read_text()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(deadline(30))
        self.errors.close()


_zygotes: dict[str, Zygote] = {}


def run_python(
    args: list[str], cwd: Path | str, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` as a fork of
    the server of its kind (each started on first use, once per test worker); ``timeout``: by default
    300 s at the suite's pace (tests/pace.py)."""
    # ``-m dsgpt2 COMMAND`` or ``-m bench.audit OUT train|dsgpt2 COMMAND``
    model = args[0] != "-m" or bool(MODEL_COMMANDS.intersection(args[2:5]))
    limit = deadline(300) if timeout is None else timeout
    if model:  # a fork of the server the launches fork from: one interpreter holding torch per worker
        from forks import python_that_forks

        done = subprocess.run(
            [python_that_forks(), *args], cwd=cwd, env=os.environ if env is None else env,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit,
        )  # fmt: skip
        return subprocess.CompletedProcess([sys.executable, *args], done.returncode, done.stdout, done.stderr)
    kind = "corpus"
    if kind not in _zygotes:
        import atexit

        _zygotes[kind] = Zygote(kind)
        atexit.register(_zygotes[kind].close)
    code, out, err = _zygotes[kind].run(list(args), cwd, dict(os.environ if env is None else env), limit)
    return subprocess.CompletedProcess([sys.executable, *args], code, out, err)


if __name__ == "__main__":
    if sys.argv[1] == "forks":
        from forks import serve_forks

        serve_forks(Path(sys.argv[2]), _preload("model"))
    else:
        serve(sys.argv[1])
