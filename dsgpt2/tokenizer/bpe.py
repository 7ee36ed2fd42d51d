"""The byte-level BPE tokenizer: special tokens, training, the tokenizer directory.

``train_vocab`` streams texts (from shards or from MongoDB, see :mod:`dsgpt2.tokenizer.texts`)
into ``ByteLevelBPETokenizer.train_from_iterator``: nothing holds the whole corpus in memory. The
output directory loads with ``transformers.AutoTokenizer``. Special tokens take the first ids, in
a fixed order, whatever the corpus: ``<|endoftext|>`` 0, ``<|pad|>`` 1, one ``<|SPEAKER|>`` per
conversation speaker, then ``<unused0>``... reserved for later use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsgpt2.documents import SkipTally
from dsgpt2.errors import ConfigError, first_line
from dsgpt2.files import (
    RECORDED_FILES,
    atomic_write_text,
    check_writable_dir,
    file_digest,
    is_occupied,
    read_regular,
    staged_dir,
    unlisted,
)
from dsgpt2.settings.argtypes import comma_list
from dsgpt2.settings.options import POSITIVE_INT, Checked, Range, option
from dsgpt2.tokenizer.texts import TextStream

log = logging.getLogger(__name__)
EOT = "<|endoftext|>"
PAD = "<|pad|>"
DEFAULT_SPEAKERS = ("user", "bot")
VOCAB_META = "dsgpt2_vocab.json"
MAX_VOCAB = 1 << 20
_SPEAKER_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def load_tokenizer(tokenizer_dir: Path) -> Any:
    """The fast tokenizer of ``tokenizer_dir``, reading special-token text as plain text.

    Raises:
        ConfigError: its tokenizer.json is missing or damaged.
    """
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library's own error of a file it cannot parse
        said = "not found" if not (tokenizer_dir / "tokenizer.json").is_file() else first_line(exc)
        raise ConfigError(
            f"tokenizer {tokenizer_dir}: tokenizer.json cannot be read ({said}); give a whole tokenizer "
            "directory (--vocab_dir), or train one again with `dsgpt2 vocab train`"
        ) from None
    # A document that contains the text "<|endoftext|>" must not inject the real token.
    tok.encode_special_tokens = True
    return tok


def speaker_token(name: str) -> str:
    """The special token that opens a turn of speaker ``name``."""
    return f"<|{name}|>"


def special_tokens(speakers: Iterable[str] = DEFAULT_SPEAKERS, reserved: int = 0) -> list[str]:
    """The special tokens in id order: end-of-text, pad, speakers, reserved."""
    return [EOT, PAD, *(speaker_token(s) for s in speakers), *(f"<unused{i}>" for i in range(reserved))]


@dataclass(frozen=True)
class VocabSettings(Checked):
    """How to train the tokenizer.

    Attributes:
        vocab_size: the largest vocabulary to learn, special tokens included.
        min_frequency: a pair must occur this often to be merged.
        speakers: conversation speakers, each with a ``<|name|>`` token.
        reserved: how many ``<unusedN>`` tokens to reserve.
        lowercase: lowercase texts before learning (off: GPT-2 keeps case).
        context_length: the model's context, recorded as ``model_max_length``.
    """

    # Above a million tokens no corpus has the merges, and the trainer allocates for the size asked.
    vocab_size: int = option(
        50257, "vocabulary size, special tokens included", check=Range(int, 1, MAX_VOCAB)
    )
    min_frequency: int = option(2, "minimum pair count", check=POSITIVE_INT)
    speakers: tuple[str, ...] = option(
        DEFAULT_SPEAKERS, "conversation speakers, comma-separated", type=comma_list, metavar="A,B"
    )
    reserved: int = option(0, "number of <unusedN> tokens to reserve", check=Range(int, 0, MAX_VOCAB))
    lowercase: bool = option(False, "lowercase texts first (default: keep case)")
    context_length: int = option(1024, "model context length", check=POSITIVE_INT)

    def check(self) -> None:
        floor = 256 + len(self.specials)
        if self.vocab_size < floor:
            raise ConfigError(
                f"--vocab_size must be at least {floor} (256 bytes + {len(self.specials)} special tokens); "
                f"got {self.vocab_size}"
            )
        for s in self.speakers:
            if not _SPEAKER_NAME.match(s):
                raise ConfigError(f"--speakers: {s!r} is not a name of letters, digits and underscores")
        if len(set(self.speakers)) != len(self.speakers):
            raise ConfigError(f"--speakers names a speaker twice: {list(self.speakers)}")
        taken = [s for s in self.speakers if speaker_token(s) in (EOT, PAD)]
        if taken:  # one token for two roles: the recorded ids would name the wrong one
            raise ConfigError(
                f"--speakers: {taken[0]!r} is the token {speaker_token(taken[0])}, the tokenizer's own "
                "end-of-text or padding; name the speaker otherwise"
            )

    @property
    def specials(self) -> list[str]:
        return special_tokens(self.speakers, self.reserved)


@dataclass
class VocabReport:
    """What ``train_vocab`` learnt from what."""

    out: Path
    source: str
    documents: int
    bytes: int
    vocab_size: int
    requested: int
    skipped: SkipTally
    seconds: float

    def lines(self) -> list[str]:
        short = (
            f" (asked for {self.requested}: the corpus has no more merges)"
            if self.vocab_size < self.requested
            else ""
        )
        return [
            f"tokenizer: {self.out}",
            f"from {self.source}: {self.documents} documents, {self.bytes / 1e6:.2f} MB, "
            f"{self.skipped.summary()}",
            f"vocabulary: {self.vocab_size} tokens{short}, trained in {self.seconds:.1f}s",
        ]


@contextlib.contextmanager
def _native_stdout_closed() -> Iterator[None]:
    """The trainer of ``tokenizers`` prints an empty line to the process's stdout after each of its
    stages, progress shown or not (three blank lines in a command's output): its stdout is /dev/null
    while it trains (its progress bars draw on stderr; Python's own writes are flushed first)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def tokenizer_digest(tokenizer_dir: Path) -> str:
    """A hash of the tokenizer (its tokenizer.json): part of the data fingerprint."""
    return file_digest(tokenizer_dir / "tokenizer.json")


def check_vocab_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that holds something: a tokenizer (runs may have trained with it) unless
    ``overwrite``, anything else always.

    Raises:
        ConfigError: ``out`` is a file, a directory of other files, or a tokenizer and not ``overwrite``.
    """
    if not is_occupied(out):
        check_writable_dir(out, "--out")
        return
    if not out.is_dir() or not (out / "tokenizer.json").is_file():
        raise ConfigError(f"--out {out} holds files that are not a tokenizer; give an empty or new directory")
    others = unlisted(out, _recorded_files(out), VOCAB_META, ("latest", "dsgpt2_run.json"))
    if others:  # the tokenizer replaces the whole directory: they would go with it
        raise ConfigError(
            f"--out {out} holds a tokenizer and other files ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}); give an empty or new directory"
        )
    if not overwrite:
        raise ConfigError(
            f"--out {out} holds a tokenizer (hash {tokenizer_digest(out)}), which runs and "
            "exports may have trained with and are checked against; pass --overwrite to replace it, or "
            "give another --out"
        )


def _recorded_files(out: Path) -> object:
    """The file names a tokenizer's record lists (None where it lists none, or cannot be read)."""
    try:
        return json.loads(read_regular(out / VOCAB_META)).get(RECORDED_FILES)
    except (OSError, ValueError, AttributeError):
        return None


def train_vocab(
    texts: Iterable[str],
    out: Path,
    settings: VocabSettings,
    source: str,
    skipped: SkipTally | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
) -> VocabReport:
    """Train a byte-level BPE on ``texts`` (streamed) and save a ``transformers``-loadable directory.

    ``out`` is written whole or not at all (a staging directory renamed into place).

    Raises:
        ConfigError: ``out`` holds something (see :func:`check_vocab_out`), before and after training.
    """
    from tokenizers import ByteLevelBPETokenizer

    check_vocab_out(out, overwrite)
    started = time.monotonic()
    stream = TextStream(texts)
    bpe = ByteLevelBPETokenizer(add_prefix_space=False, lowercase=settings.lowercase)
    with _native_stdout_closed():
        bpe.train_from_iterator(
            stream,
            vocab_size=settings.vocab_size,
            min_frequency=settings.min_frequency,
            special_tokens=settings.specials,
            show_progress=progress,
        )
    if stream.documents == 0:
        raise ConfigError(f"no usable text in {source}; nothing to learn a vocabulary from")
    report = VocabReport(
        out=out,
        source=source,
        documents=stream.documents,
        bytes=stream.bytes,
        vocab_size=bpe.get_vocab_size(),
        requested=settings.vocab_size,
        skipped=skipped if skipped is not None else SkipTally(),
        seconds=time.monotonic() - started,
    )
    meta = {
        "settings": {**asdict(settings), "speakers": list(settings.speakers)},
        "special_tokens": {tok: i for i, tok in enumerate(settings.specials)},
        "source": source,
        "documents": report.documents,
        "bytes": report.bytes,
        "vocab_size": report.vocab_size,
        "skipped": dict(report.skipped),
    }
    with staged_dir(out, check=lambda: check_vocab_out(out, overwrite)) as staging:
        _save(bpe, settings, staging)
        meta[RECORDED_FILES] = sorted([*os.listdir(staging), VOCAB_META])
        atomic_write_text(staging / VOCAB_META, json.dumps(meta, indent=1) + "\n")
    return report


def _save(bpe: Any, settings: VocabSettings, out: Path) -> None:
    """The trained tokenizer as transformers saves it, plus GPT-2's vocab.json and merges.txt."""
    from tokenizers import Tokenizer
    from transformers import GPT2TokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "tokenizer.json"
        bpe.save(str(raw))
        hf = GPT2TokenizerFast(
            tokenizer_object=Tokenizer.from_file(str(raw)),
            eos_token=EOT,
            bos_token=EOT,
            unk_token=EOT,
            pad_token=PAD,
            additional_special_tokens=settings.specials[2:],
            model_max_length=settings.context_length,
            add_prefix_space=False,
        )
        hf.save_pretrained(str(out))
    bpe.save_model(str(out))  # vocab.json and merges.txt, for tools that read the GPT-2 files


def load_vocab_size(directory: Path) -> int:
    """The vocabulary size of a tokenizer directory (special tokens included)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
