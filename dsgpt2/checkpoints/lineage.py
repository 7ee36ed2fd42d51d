"""Which steps of a run trained on a document: its reading replayed from the run's own record.

A checkpoint holds everything that decided what each rank read: the chunk table and the growth taken
in (when, how much), the launches (from which step, how many ranks, micro-batch and accumulation,
mixture stages, whether growth was dealt at once) and the micro-batches skipped as non-finite. With
the data fingerprint's settings, :class:`Replay` drives the trainer's own :class:`BlockStream` on
every rank, from step 0 to the checkpoint's step, through the same redeals and growth; only the
shape of each chunk's blocks is needed, so chunks are tokenized once and no model is built. The
replay ends where the checkpoint's saved data position is, or the answer is refused (the corpus no
longer reads as it did). A document's chunk in an epoch comes from the run's reading order
(:meth:`ReadOrder.chunk_of`), its blocks from that chunk's packing (:meth:`StreamingChunks.layout`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsgpt2.checkpoints.format import (
    CheckpointError,
    complete_tags,
    has_checkpoints,
    read_client_state,
    read_marker,
    resolve,
)
from dsgpt2.checkpoints.weights import check_tokenizer, run_info
from dsgpt2.data.dealing import ChunkOrders, ReadState, redeal_states, take_in
from dsgpt2.data.loader import BlockStream
from dsgpt2.data.mixture import Stage
from dsgpt2.data.packing import tokens_in_spans
from dsgpt2.data.ramp import BatchRamp
from dsgpt2.data.sources import Chunk, DataSpec, Key, StreamingChunks, order_of, spec_of
from dsgpt2.data.split import split_mask
from dsgpt2.data.table import ChunkTable
from dsgpt2.db.config import MongoConfig
from dsgpt2.errors import ConfigError, LineageError
from dsgpt2.tokenizer.stored import local_tokenizer

log = logging.getLogger(__name__)

BlockId = tuple[int, int, int]  # (epoch, chunk, block in chunk)


class _Shapes:
    """Chunks as a replay needs them: how many blocks, the real tokens of the last one, the order
    they go out and each collection's tokens in them; and where each document lies in them. Each
    (epoch, chunk) is read and tokenized once (under the ranges order, each chunk once)."""

    def __init__(self, source: StreamingChunks) -> None:
        self.source = source
        self.layouts: dict[Any, dict[tuple[int, int], tuple[int, int]]] = {}
        self._row = np.zeros(source.spec.context, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.source)

    def _key(self, key: Key) -> Any:
        return key if self.source.chunks.spread(key) else self.source.chunks.chunk_id(key)

    def layout(self, key: Key) -> dict[tuple[int, int], tuple[int, int]]:
        """(collection, idx) → (first token, end) of each document packed into ``key``'s chunk (see
        StreamingChunks.layout)."""
        k = self._key(key)
        if k not in self.layouts:
            self.layouts[k] = self.source.layout(key)
        return self.layouts[k]

    def __getitem__(self, key: Key) -> Chunk:
        spans = self.layout(key)
        tokens = max((end for _, end in spans.values()), default=0)
        context = len(self._row)
        n = -(-tokens // context)
        item = Chunk(self.source.chunks.chunk_id(key), np.broadcast_to(self._row, (n, context)),
                     tokens - (n - 1) * context if n else 0)  # fmt: skip
        lengths = [end - first for first, end in spans.values()]
        colls = np.array([c for c, _ in spans], dtype=np.int64)
        if not self.source.chunks.aligned:
            return self.source.chunks.finish(key, item, lengths, colls)
        # BOS-aligned blocks: the real tokens of each block and its shares, from where each document lies.
        placed = np.array(list(spans.values()), dtype=np.int64).reshape(-1, 2)
        item.real = tokens_in_spans(placed, np.zeros(len(placed), dtype=np.int64), context, n, 1)[:, 0]
        return self.source.chunks.finish(key, item, lengths, colls, placed)


@dataclass
class Replay:
    """The reading of a run as its checkpoint ``data`` (its data state) records it; see the module
    docstring. ``shapes``: the training split's chunks of the checkpoint's table."""

    data: dict[str, Any]
    seed: int
    shapes: Any
    states: list[ReadState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.final = ChunkTable.from_dict(self.data["table"])
        self.streams = [tuple(s) for s in self.data["streams"]]
        first = tuple(s for s in self.final.segments if s.generation == 0)
        self.schedule = ChunkOrders(
            ChunkTable(self.final.names, self.final.chunk_docs, first), self.streams, self.seed
        )
        self.skipped = set(self.data.get("skipped_micro", []))
        self.micro = 0

    def steps(self, end: int) -> Iterator[tuple[int, list[list[BlockId]]]]:
        """(step, the block ids each rank trained on in it), for steps 1..``end``; afterwards
        :meth:`check` says whether the replay reached the checkpoint's position."""
        launches = self.data["launches"]
        for i, launch in enumerate(launches):
            stop = launches[i + 1]["step"] if i + 1 < len(launches) else end
            yield from self._launch(launch, min(stop, end))

    def _launch(self, launch: dict[str, Any], stop: int) -> Iterator[tuple[int, list[list[BlockId]]]]:
        start, world = int(launch["step"]), int(launch["world"])
        if self.micro != int(launch["micro"]):
            raise self._diverged(f"the launch at step {start} began at micro-batch {launch['micro']}")
        if not self.states:
            self.states = [ReadState.start(len(self.streams)) for _ in range(world)]
        elif len(self.states) != world:
            self.states = redeal_states(self.schedule, self.states, world)
        for record in self._growth(start, "resume"):
            dealt = self._take_in(record, deal=int(launch["follow"]) > 0)
            for state, mine in zip(self.states, dealt, strict=True):
                for s, items in mine.items():
                    state.streams[s].queue.extend(items)
        stages = [Stage(int(s), tuple(w)) for s, w in launch["stages"]]
        mb = int(launch["micro_batch"])
        ramp = BatchRamp(int(launch["grad_accum"]), int(launch.get("batch_ramp", 0))).at(start, self.micro)
        readers = [
            BlockStream(self.shapes, self.schedule, r, world, mb, state=self.states[r], workers=0,
                        stages=stages, ramp=ramp)
            for r in range(world)
        ]  # fmt: skip
        batches = [iter(b) for b in readers]
        try:
            for step in range(start + 1, stop + 1):
                ids: list[list[BlockId]] = [[] for _ in range(world)]
                trained = 0
                while trained < ramp.accum(step - 1):
                    self.micro += 1
                    drawn = [next(b) for b in batches]
                    if self.micro in self.skipped:
                        continue  # read, never trained on: no backward, no step
                    trained += 1
                    for r, batch in enumerate(drawn):
                        ids[r].extend(tuple(int(x) for x in b) for b in batch.block_ids)
                self.states = [b.state for b in readers]
                yield step, ids
                for record in self._growth(step, "follow"):
                    dealt = self._take_in(record, deal=True)
                    for reader, mine in zip(readers, dealt, strict=True):
                        reader.regrow(self.shapes, self.schedule, mine)
                    batches = [iter(b) for b in readers]
        finally:
            for reader in readers:
                reader.close()
        self.states = [b.state.copy() for b in readers]

    def _growth(self, step: int, at: str) -> list[dict[str, Any]]:
        return [g for g in self.data.get("growth", []) if int(g["step"]) == step and g["at"] == at]

    def _take_in(self, record: dict[str, Any], deal: bool) -> list[dict[int, list[tuple[int, int, int]]]]:
        table = self.schedule.table
        marks = table.marks
        added = [
            (c, marks[c], marks[c] + int(record["added"][name]))
            for c, name in enumerate(table.names)
            if record["added"].get(name)
        ]
        grown, dealt = take_in(self.schedule, self.states, added, deal)
        self.schedule = ChunkOrders(grown, self.streams, self.seed)
        return dealt

    def check(self, tag: str) -> None:
        """Raise unless the replay ended at the checkpoint's table and every rank's position."""
        if self.schedule.table != self.final:
            raise self._diverged(f"the table grew otherwise than {tag}'s")
        if [s.to_dict() for s in self.states] != self.data["ranks"]:
            raise self._diverged(f"the ranks' positions differ from those {tag} saved")

    def _diverged(self, what: str) -> LineageError:
        return LineageError(
            f"replaying the run's reading went astray ({what}): the corpus no longer reads as it did "
            "when the run trained (documents edited or removed, a FILTER's marks changed since)"
        )


@dataclass
class Sighting:
    """A step that trained on the document: on which rank, in which epoch and chunk, which of its blocks."""

    step: int
    rank: int
    epoch: int
    chunk: int
    blocks: list[int]


@dataclass
class DocLineage:
    """Where one document went in a run."""

    doc: str
    status: str  # trained, not-yet (read in no step so far), validation, left-out, beyond
    # Its chunk and blocks when first trained on (before: in the first epoch; not trained: its chunk
    # as it lies, which validation reads); under the spread order they change with the epoch.
    chunk: int | None = None
    blocks: list[int] = field(default_factory=list)
    tokens: tuple[int, int] | None = None  # its tokens in the chunk's blocks laid end to end
    where: tuple[int, int] | None = None  # (collection, idx)
    sightings: list[Sighting] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    note: str = ""  # "beyond": what the run's table holds of the collection

    @property
    def steps(self) -> list[int]:
        return sorted({s.step for s in self.sightings})

    def to_dict(self) -> dict[str, Any]:
        out = {
            "doc": self.doc,
            "status": self.status,
            "chunk": self.chunk,
            "blocks": self.blocks,
            "tokens": list(self.tokens) if self.tokens else None,
            "steps": self.steps,
            "sightings": [vars(s) for s in self.sightings],
            "checkpoints": self.checkpoints,
        }
        return out


def parse_doc(text: str, names: Sequence[str]) -> tuple[int, int]:
    """``news:1234`` → (place of news in the collections, 1234)."""
    name, sep, idx = text.rpartition(":")
    if not sep or not idx.strip().isdigit():
        raise ConfigError(f"--doc {text!r}: write COLLECTION:IDX, e.g. {names[0]}:1234")
    if name not in names:
        raise ConfigError(
            f"--doc {text!r}: {name!r} is not one of the run's collections ({', '.join(names)})"
        )
    return names.index(name), int(idx)


@dataclass
class RunLineage:
    """A run's lineage answer: the checkpoint replayed to, and each document's."""

    ckpt_dir: Path | str  # as the user named it (a stored run's location, not this machine's copy)
    tag: str
    step: int
    world: list[int]
    docs: list[DocLineage]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ckpt_dir": str(self.ckpt_dir),
            "checkpoint": self.tag,
            "step": self.step,
            "ranks": self.world,
            "docs": [d.to_dict() for d in self.docs],
        }


def lineage(
    ckpt_dir: Path,
    docs: Sequence[str],
    mongo: MongoConfig | None = None,
    ckpt_id: str | None = None,
    vocab_dir: Path | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> RunLineage:
    """The steps and checkpoints of the run in ``ckpt_dir`` (up to ``ckpt_id``, default the latest)
    that trained on each of ``docs`` (``COLLECTION:IDX``).

    Args:
        mongo: the corpus's connection config (default: the run's --config_train).
        vocab_dir: the run's tokenizer (default: the one it recorded).
        progress: called with (step, last step) as the replay goes.

    Raises:
        ConfigError: a bad --doc, a config or tokenizer of other data than the run's.
        CheckpointError: no checkpoint, or one without the record a replay needs.
        LineageError: the replay does not reach the checkpoint's data position.
    """
    if not has_checkpoints(ckpt_dir):
        raise CheckpointError(
            f"--ckpt_dir {ckpt_dir}: no checkpoint there (no `latest` file, no complete one)"
        )
    tag = resolve(ckpt_dir, ckpt_id)
    saved = read_client_state(ckpt_dir, tag)
    data, fp = saved["data"], saved["fingerprint"]
    if "launches" not in data:
        raise CheckpointError(
            f"{ckpt_dir / tag} holds no record of the run's launches (saved by an older dsgpt2): its "
            "reading cannot be replayed"
        )
    mongo = mongo or _run_config(saved)
    _check_same_data(mongo, fp)

    vocab = local_tokenizer(
        vocab_dir or saved["vocab_dir"], mongo, None if vocab_dir else saved.get("vocab_copy")
    )
    check_tokenizer(vocab, run_info(saved, ckpt_dir / tag), str(ckpt_dir / tag))
    _check_prefix(mongo, data.get("prefix") or {})
    spec = spec_of(fp)
    if order_of(fp) is None:
        raise CheckpointError(
            f"{ckpt_dir / tag} reads its chunks under layout {fp.get('layout')}, which this version "
            "does not replay"
        )
    table = ChunkTable.from_dict(data["table"])
    source = StreamingChunks(mongo, table, vocab, spec, "train", streams=data["streams"])
    step = int(saved["step"])
    shapes = _Shapes(source)
    try:
        where = [parse_doc(d, list(table.names)) for d in docs]
        _check_exist(mongo, docs, where, table)
        wanted = [_place(d, w, table, shapes, spec) for d, w in zip(docs, where, strict=True)]
        _replay(data, shapes, wanted, step, tag, progress=progress)
    finally:
        source.close()
    tags = {t: (read_marker(ckpt_dir, t) or {}).get("step", -1) for t in complete_tags(ckpt_dir)}
    for d in wanted:
        if d.sightings:
            first = d.steps[0]
            d.checkpoints = [t for t, n in tags.items() if first <= n <= step]
        elif d.status == "trained":
            d.status = "not-yet"
    return RunLineage(ckpt_dir, tag, step, [int(launch["world"]) for launch in data["launches"]], wanted)


def _replay(
    data: dict[str, Any],
    shapes: _Shapes,
    wanted: list[DocLineage],
    step: int,
    tag: str,
    *,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Replay the run's reading to ``step``, noting where it trained on each wanted document."""
    watch = _Watch([d for d in wanted if d.status == "trained"], shapes)
    replay = Replay(data, shapes.source.spec.seed, shapes)
    for s, ids in replay.steps(step):
        for rank, blocks in enumerate(ids):
            for e, c, b in blocks:
                for d, chunk in watch.at(e, c, b):
                    _sighted(d, s, rank, (e, chunk, b))
        if progress:
            progress(s, step)
    replay.check(tag)
    for d in wanted:
        if d.sightings:
            d.chunk, d.blocks, d.tokens = watch.placed[(d.doc, d.sightings[0].epoch)]


class _Watch:
    """The blocks that hold the watched documents, epoch by epoch, found as the replay reaches them."""

    def __init__(self, docs: list[DocLineage], shapes: _Shapes) -> None:
        self.docs, self.shapes = docs, shapes
        self.placed: dict[tuple[str, int], tuple[int, list[int], tuple[int, int]]] = {}
        self._blocks: dict[tuple[int, int, int], list[tuple[DocLineage, int]]] = {}
        self._epochs: set[int] = set()

    def at(self, epoch: int, chunk: int, block: int) -> list[tuple[DocLineage, int]]:
        if epoch not in self._epochs:
            self._epochs.add(epoch)
            for d in self.docs:
                c, b, span = _blocks_in(d.where, epoch, self.shapes)  # type: ignore[arg-type]
                self.placed[(d.doc, epoch)] = (c, b, span)
                for x in b:
                    self._blocks.setdefault((epoch, c, x), []).append((d, c))
        return self._blocks.get((epoch, chunk, block), [])


def _blocks_in(where: tuple[int, int], epoch: int, shapes: _Shapes) -> tuple[int, list[int], tuple[int, int]]:
    """A training document's chunk in ``epoch``, its blocks there, and its tokens in them."""
    chunks = shapes.source.chunks
    chunk = chunks.reading.chunk_of(epoch, *where)
    first, end = shapes.layout((epoch, chunk))[where]  # type: ignore[arg-type]
    context = shapes.source.spec.context
    return chunk, list(range(first // context, (end - 1) // context + 1)), (first, end)  # type: ignore[return-value]


def _sighted(d: DocLineage, step: int, rank: int, block_id: BlockId) -> None:
    epoch, chunk, block = block_id
    last = d.sightings[-1] if d.sightings else None
    if last and (last.step, last.rank, last.epoch) == (step, rank, epoch):
        last.blocks.append(block)
    else:
        d.sightings.append(Sighting(step, rank, epoch, chunk, [block]))


def _check_exist(
    mongo: MongoConfig, docs: Sequence[str], where: Sequence[tuple[int, int]], table: Any
) -> None:
    """Refuse a document past the run's reading that its collection does not hold either (a typo in
    an audit: a clean "never trained on" would answer it).

    Raises:
        ConfigError: naming the collection's range of idx.
    """
    past = [(d, c, idx) for d, (c, idx) in zip(docs, where, strict=True) if table.chunk_of(c, idx) is None]
    if not past:
        return
    from dsgpt2.db.client import Connection
    from dsgpt2.db.idx import idx_bounds

    conn = Connection(mongo)
    try:
        conn.ping()  # a server that does not answer: one line now, not a read's retries
        for doc, c, idx in past:
            name = table.names[c]
            bounds = idx_bounds(conn, name)
            if bounds is None or idx > bounds[1]:
                held = "no numbered document" if bounds is None else f"idx {bounds[0]} to {bounds[1]}"
                raise ConfigError(f"--doc {doc}: no such document; {name} holds {held}")
    finally:
        conn.close()


def _place(
    doc: str,
    where: tuple[int, int],
    table: ChunkTable,
    shapes: _Shapes,
    spec: DataSpec,
) -> DocLineage:
    """The document's status, and where it lies in the first epoch (its chunk as it lies where it
    never trains)."""
    c, idx = where
    chunk = table.chunk_of(c, idx)
    if chunk is None:
        return DocLineage(doc, "beyond", note=f"{table.marks[c]} documents of {table.names[c]}")
    name = table.names[c]
    if not split_mask(np.array([idx]), spec.tr_ratio, spec.seed, name)[0]:
        return DocLineage(doc, "validation", chunk, where=where)
    if where not in shapes.layout(chunk):
        return DocLineage(doc, "left-out", chunk, where=where)
    first, blocks, span = _blocks_in(where, 0, shapes)
    return DocLineage(doc, "trained", first, blocks, span, where=where)


def _run_config(saved: dict[str, Any]) -> MongoConfig:
    from dsgpt2.db.config import load_config

    path = saved.get("args", {}).get("config_train")
    if not path or not Path(path).is_file():
        raise ConfigError(
            f"the run's connection config ({path or 'not recorded'}) is not there; pass --config with it"
        )
    return load_config(path)


def _check_prefix(mongo: MongoConfig, record: dict[str, Any]) -> None:
    """The run's trained prefix still holds (the check a resume makes), or no replay is the run's."""
    from dsgpt2.corpus.marks import prefix_problems, read_marks
    from dsgpt2.db.client import Connection

    conn = Connection(mongo)
    try:
        conn.ping()  # a server that does not answer: one line now, not a read's retries
        problems = prefix_problems(conn, record, read_marks(conn))
    finally:
        conn.close()
    if problems:
        raise LineageError(
            f"the corpus no longer holds what the run trained on ({'; '.join(problems)}): its reading "
            "cannot be replayed; restore those documents first"
        )


def _check_same_data(mongo: MongoConfig, fp: dict[str, Any]) -> None:
    mine = {"db": mongo.db, "collections": list(mongo.collections), "filter": mongo.filter or None}
    theirs = {"db": fp["db"], "collections": fp["collections"], "filter": fp.get("filter")}
    changed = [k for k in mine if mine[k] != theirs[k]]
    if changed:
        raise ConfigError(
            f"the config reads other data than the run ({', '.join(changed)} differ: the run read "
            f"{theirs['db']} {', '.join(theirs['collections'])}); pass the run's --config"
        )


STATUS = {
    "validation": "in the validation split: never trained on",
    "left-out": "left out of its chunk when read (FILTER, missing or without usable text): never trained on",
    "beyond": "not among the {note} the run has read: never trained on",
    "not-yet": "in the training split, not yet read by this step",
}


def lineage_lines(result: RunLineage) -> list[str]:
    """What ``dsgpt2 lineage`` prints."""
    out = []
    for d in result.docs:
        if d.status != "trained":
            where = f" (chunk {d.chunk})" if d.chunk is not None else ""
            out.append(f"{d.doc}{where}: {STATUS[d.status].format(note=d.note)}")
            continue
        blocks = f"block {d.blocks[0]}" if len(d.blocks) == 1 else f"blocks {d.blocks[0]}-{d.blocks[-1]}"
        out.append(f"{d.doc}: chunk {d.chunk}, {blocks}; trained on at {len(d.steps)} step(s)")
        for s in d.sightings:
            out.append(
                f"  step {s.step}: rank {s.rank}, epoch {s.epoch}, chunk {s.chunk}, "
                f"block(s) {', '.join(map(str, s.blocks))}"
            )
        first = d.steps[0]
        saw = ", ".join(d.checkpoints) if d.checkpoints else "none kept"
        out.append(f"  checkpoints that saw it (step >= {first}): {saw}")
    ranks = "/".join(str(w) for w in dict.fromkeys(result.world))
    replayed = f"{str(result.ckpt_dir).rstrip('/')}/{result.tag}"
    out.append(
        f"replayed {result.step} step(s) on {ranks} rank(s) to {replayed}: its saved data position matches"
    )
    return out
