"""The exceptions dsgpt2 raises on purpose.

Every error a user can cause or fix derives from :class:`DsGpt2Error`. The
command line turns one into a single line on stderr and its ``exit_code``;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any


class DsGpt2Error(Exception):
    """Root of every error dsgpt2 raises for a user to read and fix."""

    exit_code = 2


class ConfigError(DsGpt2Error):
    """A configuration file, flag or environment variable is invalid."""


class NoRoomError(DsGpt2Error):
    """The disk filled while a file or directory was written: nothing half-written is kept where it goes
    (free space, re-run)."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """What a library's exception says, for one line of ours: its first line, and the second where the
    first only introduces it ("Validation error for field 'n_embd':"); its type where it says nothing."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return (" ".join(lines[:2]) if lines[0].endswith(":") else lines[0])[:limit]


def usage_error(command: str, message: str) -> ConfigError:
    """A command's one-line usage error, worded as every ``dsgpt2`` command words it."""
    return ConfigError(f"dsgpt2 {command}: {message} (see `dsgpt2 {command} --help`)")


# The database.


class MongoUnavailableError(DsGpt2Error):
    """The MongoDB server cannot be reached or keeps failing."""


class DiskFullError(MongoUnavailableError):
    """The disk holding an embedded database is full: what was written before is kept (free space, re-run)."""


class ServerLostError(MongoUnavailableError):
    """The server stopped answering while a command ran, or kept failing past the retries: what was done is
    kept (re-run to resume)."""

    exit_code = 3


# The corpus.


class CorpusError(DsGpt2Error):
    """The corpus in MongoDB is not usable as it is (broken idx, empty collection)."""


class BadDocumentError(CorpusError):
    """A document has no usable text and strict mode is on."""


class LeaseHeld(CorpusError):
    """A live process holds the lease (``holder``, its last sign of life ``age`` seconds ago)."""

    def __init__(self, holder: str, age: float) -> None:
        super().__init__(f"{holder} holds it (its last sign of life {age:.0f}s ago)")
        self.holder, self.age = holder, age


class LeaseContested(CorpusError):
    """Other processes kept taking the lease while this one tried."""


class LeaseLost(CorpusError):
    """Another process took the lease over: this one was silent for longer than the lease."""


class CorpusValidationError(CorpusError):
    """``validate`` found problems in one or more collections."""

    exit_code = 1


class IngestError(DsGpt2Error):
    """An input file cannot be read or does not match the requested format."""


# A training run.


class PeerLostError(DsGpt2Error):
    """Another rank of the run died or stopped answering: this one stops too (re-run to resume)."""

    exit_code = 3


class CheckpointError(DsGpt2Error):
    """A checkpoint to resume from is missing, incomplete or does not match this run."""


class LineageError(DsGpt2Error):
    """The run's reading cannot be replayed as it was (the corpus changed, an older checkpoint)."""


class TrainingAborted(DsGpt2Error):
    """Training stopped on purpose: non-finite losses in a row, or a lost database."""

    exit_code = 3


class NoGradient(DsGpt2Error):
    """A step's loss was finite but no gradient reached the weights: the run would learn nothing."""


# Serving.


class GenerationFailed(DsGpt2Error):
    """Decoding failed inside the engine (the server log has the traceback)."""

    exit_code = 1  # the server's failure, not the request's


class RequestError(DsGpt2Error):
    """A request the server refuses (400 by default), answered with the reason: on the OpenAI routes as
    OpenAI's error object (:meth:`body`), on /generate as ``{"error": reason}``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        # The client's mistake (4xx) is a user's error, as a bad flag is; a 5xx one the server's.
        self.exit_code = 2 if status < 500 else 1

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}
