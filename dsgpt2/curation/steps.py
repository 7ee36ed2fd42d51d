"""The one protocol of a curation step, and the registry of them.

A :class:`Step` does one thing to one document (:meth:`Step.apply`: the fields to set on it, a mark or a
new text) and declares around it what the rest of the toolkit reads of it: the command that runs it over
the collections in place (:mod:`dsgpt2.curation.passes` drives it: windows, resume, workers, parts), its
options, the fields it marks and what ``FILTER`` and ``dsgpt2 curate report`` read of them
(:class:`Reason`), and the ``dsgpt2 ingest`` flag that runs it on each document as it is stored. Work on
a whole collection at once (grouping hashes, clustering signatures) is a hook of its own,
:meth:`Step.conclude`, which the driver runs once every collection is processed.

Every step is registered in :data:`STEPS` under its name; the curation commands, the ingest flags, the
report's reasons and the reference pages are made from it. A new step is one file with one class and
its ``@STEPS.register(...)`` line (``docs/development.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsgpt2.db.client import Connection, UpdateOne
from dsgpt2.documents import TURNS, declare_marks, forget_marks
from dsgpt2.ranges import even_ranges
from dsgpt2.registry import Registry


@dataclass(frozen=True)
class Reason:
    """What a step leaves out of training, as ``dsgpt2 curate report`` lists it.

    Attributes:
        label: the report's name for it (``"exact duplicate"``).
        query: the documents it selects (``FILTER`` with ``$nor`` of it keeps the rest).
        run: the command that marks it, as a user types it.
        recorded: the path in the collection's meta_info where that command records a complete run (the
            last key may name an entry of a list there).
        of: the field naming the document a selected one repeats, shown with the report's examples.
    """

    label: str
    query: Mapping[str, Any]
    run: str
    recorded: tuple[str, ...]
    of: str | None = None


@dataclass(frozen=True)
class About:
    """The command that runs a step (or the steps of one command): its line in ``dsgpt2 --help``, its
    ``--help`` text and examples."""

    help: str
    description: str
    epilog: str


@dataclass(frozen=True)
class AtIngest:
    """The ``dsgpt2 ingest`` switch that runs a step on each document before it is stored."""

    flag: str
    help: str


@dataclass(frozen=True)
class Split:
    """How a pass's per-document work is split: ``workers`` processes here, and this machine's
    ``part`` (0-based) of ``parts`` idx ranges of each collection."""

    workers: int = 1
    part: int = 0
    parts: int = 1

    def ranges(self, bounds: tuple[int, int]) -> list[tuple[int, int]]:
        """This machine's workers' ``[start, stop)`` ranges of a collection's idx ``bounds`` (both
        inclusive)."""
        lo, hi = bounds
        mine = even_ranges(lo, hi + 1, self.parts)
        if self.part >= len(mine):  # more machines than idx values: nothing here
            return []
        return even_ranges(*mine[self.part], self.workers)


def set_each(updates: Sequence[tuple[Any, dict[str, Any]]]) -> list[Any]:
    """A ``$set`` of each ``(_id, fields)``: the writes of a step that marks document by document."""
    return [UpdateOne({"_id": _id}, {"$set": f}) for _id, f in updates]


@dataclass
class CollectionPart:
    """One collection's part of a step's report: its name and its numbered documents after the run."""

    name: str
    documents: int = 0


@dataclass
class Processed:
    """One collection's part of a run of a step that counts nothing of its own."""

    name: str
    processed: int = 0  # documents this run processed


@dataclass
class Report:
    """What a run of a step did: one part per collection (its ``finish``), and the seconds the run took
    (the driver's measure)."""

    collections: list[Any]
    seconds: float = field(default=0.0, kw_only=True)
    # A run over part of the idx ranges (--part R/M) of a step that marks once every part is done: it
    # counts no marks, so its report says only what it did.
    deferred: bool = field(default=False, kw_only=True)

    def lines(self) -> list[str]:
        """The report as printed."""
        raise NotImplementedError


@dataclass
class StepReport(Report):
    """What a run of a step that counts nothing of its own did: the documents it processed."""

    collections: list[Processed]
    verb: str

    def lines(self) -> list[str]:
        out = [f"{c.name}: {c.processed} document(s) processed by this run ({self.verb})"
               for c in self.collections]  # fmt: skip
        return [*out, f"({self.seconds:.1f}s)"]


class Step:
    """One curation step: what it does to a document, and what it declares about it.

    A subclass is a dataclass of its settings (picklable: worker processes receive it) and sets:

    - ``command``: the command that runs it over the collections (None: it runs only at ingest); the
      steps registered with one command run in their registration order (``dedup``: hash, then sign);
    - ``about``: that command's help (on the first step registered with it);
    - ``settings``: the settings classes of its options (each a :class:`~dsgpt2.settings.options.
      Checked` dataclass: one class may serve several steps of a command);
    - ``marks``: the fields it writes on a document; ``reasons``: what ``FILTER`` and the report read of
      them;
    - ``at_ingest``: the ``dsgpt2 ingest`` switch that runs it on each document before it is stored;
    - ``verb``, ``writing``: what its progress bar and its write retries' messages say it does;
    - ``mark``: the field holding the key a document was processed under (None: ``todo`` says);
    - ``part_note``: what a run over part of the idx ranges leaves to another run, if anything.
    """

    command: ClassVar[str | None] = None
    about: ClassVar[About | None] = None
    settings: ClassVar[tuple[type, ...]] = ()
    marks: ClassVar[tuple[str, ...]] = ()
    reasons: ClassVar[tuple[Reason, ...]] = ()
    at_ingest: ClassVar[AtIngest | None] = None
    verb: ClassVar[str] = ""
    writing: ClassVar[str] = ""
    mark: ClassVar[str | None] = None
    part_note: ClassVar[str | None] = None
    # What the command says when its settings ask for none of its steps (None: the step always runs).
    none_asked: ClassVar[str | None] = None
    # What ingest counts a document this step does not admit as (empty: it admits every document).
    skip_reason: ClassVar[str] = ""

    # ---------------------------------------------------------------- built from the command line

    @classmethod
    def build(cls, settings: Mapping[type, Any]) -> Step | None:
        """The step as the command's parsed ``settings`` (by class) ask for it; None: not asked.

        Raises:
            ConfigError: the settings disagree (naming the flags, :func:`dsgpt2.errors.usage_error`).
        """
        return cls()

    @classmethod
    def for_ingest(cls) -> Step:
        """The step as ``dsgpt2 ingest``'s switch runs it."""
        return cls()

    # ---------------------------------------------------------------- one document

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any] | None:
        """The fields to set on ``doc`` (read with :meth:`fields`; its text in ``text_field``), or None
        to leave it as it is."""
        return None

    # ---------------------------------------------------------------- over a collection, in place

    def key(self) -> Any:
        """What makes a document's mark current: a document marked under another key is processed."""
        raise NotImplementedError

    def todo(self) -> dict[str, Any]:
        """The numbered documents this step has still to process."""
        return {"idx": {"$exists": True}, self.mark: {"$ne": self.key()}}

    def fields(self, text_field: str) -> dict[str, int]:
        """The fields a batch is read with (besides ``_id`` and ``idx``)."""
        return {text_field: 1, TURNS: 1}

    def pending(self, doc: dict[str, Any]) -> bool:
        """Whether a document ``todo`` read is still to process: for a condition ``todo`` leaves out
        because it has no one index to ride (an ``$or``; see :func:`conjoin`)."""
        return True

    def process(self, batch: list[dict[str, Any]], text_field: str) -> list[Any]:
        """The bulk writes that process ``batch`` (documents in idx order): each document's
        :meth:`apply`, set."""
        return set_each([(d["_id"], f) for d in batch if (f := self.apply(d, text_field))])

    def check(self, conn: Connection, names: Sequence[str]) -> None:
        """Refuse the run before any work (e.g. documents a run trained on would change)."""

    def start(self, conn: Connection, name: str) -> Step:
        """The step as it runs on ``name`` (an index built first, settings read from its meta_info)."""
        return self

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> Any:
        """``name``'s entry of the report, once this run processed ``done`` of its documents (and where
        a step records in meta_info that it ran)."""
        return Processed(name, done)

    def report(self, parts: list[Any]) -> Report:
        """The run's report from the collections' entries."""
        return StepReport(parts, verb=self.verb)

    def conclude(self, conn: Connection, names: Sequence[str], report: Any, split: Split) -> None:
        """The work over every collection at once, once each is processed (dedup's grouping and
        marking): run by the driver after the per-document work."""

    # ---------------------------------------------------------------- at ingest

    def opened(self, conn: Connection, collection: str) -> Step:
        """The step as an ingest into ``collection`` runs it (indexes it asks of built first)."""
        return self

    def admit(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Of a batch about to be stored, those to store: the others are skipped and counted under
        :attr:`skip_reason` (asked only of a step that has one)."""
        return docs

    def stored(self, collection: str, docs: list[dict[str, Any]]) -> int:
        """Work on a batch once numbered, before it is stored: documents it marked."""
        return 0


# Every step, by name, in the order the commands, the ingest switches and the report list them.
# A step's marks are declared on the document schema as it registers: a FILTER may name them at once.
STEPS: Registry[type[Step]] = Registry(
    "curation step",
    "step",
    declare=lambda name, step: declare_marks(name, step.marks),
    forget=forget_marks,
)


def commands() -> dict[str, list[type[Step]]]:
    """The registered steps by the command that runs them, in registration order."""
    out: dict[str, list[type[Step]]] = {}
    for _, step in STEPS.items():
        if step.command is not None:
            out.setdefault(step.command, []).append(step)
    return out


def reasons() -> list[Reason]:
    """What the registered steps leave out of training, in their order."""
    return [r for _, step in STEPS.items() for r in step.reasons]


def ingest_switches() -> list[type[Step]]:
    """The registered steps ``dsgpt2 ingest`` can run, in their order."""
    return [step for _, step in STEPS.items() if step.at_ingest is not None]
