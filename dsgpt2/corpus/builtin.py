"""A real English corpus with no download: the documentation of Python's standard library.

Documents, in a fixed order (sorted file paths, then source order):
- every module, class and function docstring of at least 40 characters,
- every block of three or more comment lines that reads as prose,
- every topic of the language reference shipped in ``pydoc_data.topics``.

Read from the stdlib's source files with :mod:`ast` (nothing is imported), so
the corpus is identical for a given Python version: about 2.7 MB of text in
9,200 documents on CPython 3.11. Test suites are left out (mostly code).

The conversation sample (``stdlib-chat``) asks about each public function and
class of the same files and answers with the first paragraph of its
docstring; when the docstring goes on, the user asks for more and the second
paragraph answers.
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import sys
import sysconfig
from collections import deque
from collections.abc import Iterator
from pathlib import Path

SAMPLES = ("stdlib", "stdlib-chat")
_MIN_DOC_CHARS = 40
_MIN_COMMENT_LINES = 3
_MIN_COMMENT_CHARS = 120
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_COMMENT = re.compile(r"^\s*#(?![!#])\s?(.*)$")
_LETTERS = re.compile(r"[A-Za-z ]")


def sample_version() -> str:
    """What the sample corpus depends on: the Python version it was read from."""
    return "stdlib-" + ".".join(map(str, sys.version_info[:3]))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(limit: int | None = None) -> Iterator[str]:
    """Yield the sample documents in their fixed order (at most ``limit``)."""
    return itertools.islice(_all_documents(), limit)


def _all_documents() -> Iterator[str]:
    for path in _source_files(stdlib_root()):
        try:
            source = path.read_bytes()
            tree = ast.parse(source)
        except (OSError, SyntaxError, ValueError):
            continue  # the stdlib ships deliberately broken files as test data
        yield from _docstrings(tree)
        yield from _comment_blocks(source.decode("utf-8", errors="replace"))
    yield from _pydoc_topics()


def _source_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _docstrings(tree: ast.AST) -> Iterator[str]:
    for node in _statement_walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= _MIN_DOC_CHARS:
                yield doc


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


def _statement_walk(tree: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk``'s breadth-first order over the statements only (and the handlers and cases that hold
    them): a docstring belongs to a module, class or function, never inside an expression, and leaving
    the expressions out makes the walk several times faster while keeping its order."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, _BLOCKS))
        yield node


def _comment_blocks(source: str) -> Iterator[str]:
    block: list[str] = []
    for line in [*source.splitlines(), ""]:
        m = _COMMENT.match(line)
        if m:
            block.append(m[1].strip())
            continue
        if len(block) >= _MIN_COMMENT_LINES:
            text = " ".join(part for part in block if part)
            # Commented-out code and ASCII art are not prose.
            if len(text) >= _MIN_COMMENT_CHARS and len(_LETTERS.findall(text)) >= 0.8 * len(text):
                yield text
        block = []


def _pydoc_topics() -> Iterator[str]:
    path = stdlib_root() / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            items = [
                (k.value, v.value)
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str)
            ]
            for _, text in sorted(items):
                yield text
            return


_QUESTIONS = ("What does {} do?", "What is {} for?", "Can you explain {}?", "How does {} work?")
_FOLLOW_UP = "Tell me more."
_MAX_REPLY_CHARS = 600


def stdlib_conversations(limit: int | None = None) -> Iterator[dict[str, object]]:
    """Yield question/answer conversations about the stdlib's API, ``{"turns": [...]}`` each."""
    return itertools.islice(_all_conversations(), limit)


def _all_conversations() -> Iterator[dict[str, object]]:
    root = stdlib_root()
    for path in _source_files(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        if any(part.startswith("_") for part in module.split(".")):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        for name, doc in _public_docstrings(tree, module):
            paragraphs = _prose_paragraphs(doc)
            if not paragraphs:
                continue
            # The question's wording varies with the name, not at random: the sample stays fixed.
            question = _QUESTIONS[sum(map(ord, name)) % len(_QUESTIONS)].format(f"`{name}`")
            turns = [{"speaker": "user", "text": question}, {"speaker": "bot", "text": paragraphs[0]}]
            if len(paragraphs) > 1:
                turns += [{"speaker": "user", "text": _FOLLOW_UP}, {"speaker": "bot", "text": paragraphs[1]}]
            yield {"turns": turns}


def _public_docstrings(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    for node in tree.body:
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= _MIN_DOC_CHARS:
            yield f"{module}.{node.name}", doc


def _prose_paragraphs(doc: str) -> list[str]:
    """The docstring's paragraphs that read as sentences (not signatures, examples or tables)."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        text = " ".join(line.strip() for line in block.splitlines()).strip()
        if len(text) < 20 or text.startswith((">>>", "..", "|", "-", "*", "+")):
            continue
        if len(_LETTERS.findall(text)) < 0.8 * len(text):
            continue
        if len(text) > _MAX_REPLY_CHARS:
            cut = text.rfind(". ", 0, _MAX_REPLY_CHARS)
            text = text[: cut + 1] if cut > 0 else text[:_MAX_REPLY_CHARS]
        out.append(text)
    return out
