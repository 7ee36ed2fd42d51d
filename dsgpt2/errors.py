"""The exceptions dsgpt2 raises on purpose.

Every error a user can cause or fix derives from :class:`DsGpt2Error`. The
command line turns one into a single line on stderr and its ``exit_code``;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class DsGpt2Error(Exception):
    """Root of every error dsgpt2 raises for a user to read and fix."""

    exit_code = 2


class ConfigError(DsGpt2Error):
    """A configuration file, flag or environment variable is invalid."""


class MongoUnavailableError(DsGpt2Error):
    """The MongoDB server cannot be reached or keeps failing."""


class PeerLostError(DsGpt2Error):
    """Another rank of the run died or stopped answering: this one stops too (re-run to resume)."""

    exit_code = 3


class CorpusError(DsGpt2Error):
    """The corpus in MongoDB is not usable as it is (broken idx, empty collection)."""


class BadDocumentError(CorpusError):
    """A document has no usable text and strict mode is on."""


class CorpusValidationError(CorpusError):
    """``validate`` found problems in one or more collections."""

    exit_code = 1


class IngestError(DsGpt2Error):
    """An input file cannot be read or does not match the requested format."""


class DiskFullError(MongoUnavailableError):
    """The disk holding an embedded database is full: what was written before is kept (free space, re-run)."""


class ServerLostError(MongoUnavailableError):
    """The server stopped answering while a long command ran: what was done is kept (re-run to resume)."""

    exit_code = 3
