"""Language identification: accuracy on real text in many languages, found offline, and texts/s, of the
model ``dsgpt2 langid`` uses (py3langid's, :mod:`dsgpt2.curation.language`) against the runner-up,
lingua-language-detector, on the same texts.

The texts: the message catalogues under /usr/share/locale (``LANG/LC_MESSAGES/*.mo``: every msgstr is
in the directory's language), read here as ``msgunfmt`` would, but decoded with each catalogue's own
charset (some are not UTF-8), their format directives and accelerator marks removed, joined into
paragraph-sized texts; English from the stdlib docstrings (the ``en`` catalogues are only quote
variants). Directory names are the truth: ``pt_BR`` is ``pt``, ``zh_CN`` and ``zh_TW`` are ``zh``,
``nb`` (Bokmål) is ``no`` as py3langid names it. Accuracy is counted on the languages both models know
(the fair ratio) and, for ours, on every language it knows.

Run alone: ``python -m bench.bench_langid [TEXTS_PER_LANGUAGE]``; ``python -m bench langid`` in the suite.
"""

from __future__ import annotations

import re
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import Metric

LOCALES = Path("/usr/share/locale")
# A directory name that is a language (with a region only where the region picks a script or variant
# the base name has no catalogue of its own for).
_DIRECTORY = re.compile(r"[a-z]{2,3}|zh_CN|zh_TW|pt_BR")
SAME = {"nb": "no", "zh_CN": "zh", "zh_TW": "zh", "pt_BR": "pt"}
_DIRECTIVE = re.compile(r"%[-+ #0-9.*]*[a-zA-Z$]+|\{[\w.]*\}|[_&]")


def mo_strings(path: Path) -> list[str]:
    """The translations (msgstr, each plural form) of a compiled catalogue of two words or more."""
    data = path.read_bytes()
    if len(data) < 28:
        return []
    order = "<" if struct.unpack("<I", data[:4])[0] == 0x950412DE else ">"
    count, _, strings = struct.unpack(order + "3I", data[8:20])
    raw = []
    for i in range(count):
        length, offset = struct.unpack(order + "2I", data[strings + 8 * i : strings + 8 * i + 8])
        raw.append(data[offset : offset + length])
    header = raw[0].decode("ascii", "replace") if raw else ""
    charset = re.search(r"charset=([\w-]+)", header)
    encoding = charset.group(1) if charset and charset.group(1).upper() != "CHARSET" else "utf-8"
    out = []
    for blob in raw[1:]:
        for form in blob.split(b"\0"):
            try:
                text = form.decode(encoding)
            except (UnicodeDecodeError, LookupError):
                continue
            text = " ".join(_DIRECTIVE.sub("", text).split())
            if len(text.split()) >= 2:
                out.append(text)
    return out


def locale_texts(per_language: int = 20, chars: int = 250) -> dict[str, list[str]]:
    """Up to ``per_language`` texts of about ``chars`` characters per language code (those with at least
    half that many), each the next distinct msgstr strings of the language's catalogues, in file order."""
    out: dict[str, list[str]] = {}
    for directory in sorted(LOCALES.iterdir()) if LOCALES.is_dir() else []:
        if not _DIRECTORY.fullmatch(directory.name) or directory.name == "en":
            continue
        code = SAME.get(directory.name, directory.name)
        seen: set[str] = set()
        texts = out.setdefault(code, [])
        current: list[str] = []
        for catalogue in sorted((directory / "LC_MESSAGES").glob("*.mo")):
            for s in mo_strings(catalogue):
                if s in seen or len(texts) >= per_language:
                    continue
                seen.add(s)
                current.append(s)
                if sum(map(len, current)) >= chars:
                    texts.append(" ".join(current))
                    current = []
    return {code: texts for code, texts in out.items() if len(texts) >= max(per_language // 2, 1)}


def english_texts(count: int, chars: int = 250) -> list[str]:
    """``count`` stdlib docstrings, each its first paragraph-sized piece."""
    from dsgpt2.corpus.builtin import stdlib_documents
    from dsgpt2.corpus.cleaning import clean_text

    out = []
    for doc in stdlib_documents():
        text = " ".join(clean_text(doc).split())
        if len(text) >= chars:
            out.append(text[: text.rfind(" ", 0, chars * 2) if len(text) > chars * 2 else len(text)])
        if len(out) == count:
            break
    return out


def ours() -> tuple[Callable[[str], str | None], frozenset[str]]:
    from dsgpt2.curation.language import identify, model_codes

    return (lambda text: identify(text)[0]), model_codes()


def lingua() -> tuple[Callable[[str], str | None], frozenset[str]]:
    from lingua import Language, LanguageDetectorBuilder

    detector = LanguageDetectorBuilder.from_all_languages().with_preloaded_language_models().build()

    def detect(text: str) -> str | None:
        found = detector.detect_language_of(text)
        return (
            None
            if found is None
            else SAME.get(found.iso_code_639_1.name.lower(), found.iso_code_639_1.name.lower())
        )

    codes = frozenset(SAME.get(c, c) for c in (lang.iso_code_639_1.name.lower() for lang in Language.all()))
    return detect, codes


def accuracy(
    detect: Callable[[str], str | None], data: dict[str, list[str]], codes: set[str]
) -> tuple[float, int]:
    """The share of the texts of ``codes`` labelled with their language, and how many texts."""
    texts = [(code, t) for code in sorted(codes) for t in data[code]]
    right = sum(detect(t) == code for code, t in texts)
    return right / max(len(texts), 1), len(texts)


def speed(detect: Callable[[str], str | None], texts: list[str], repeats: int = 3) -> float:
    """Texts per second, the best of ``repeats`` passes over ``texts`` (after a warm-up)."""
    for t in texts[:20]:
        detect(t)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for t in texts:
            detect(t)
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def langid(per_language: int = 20) -> list[Metric]:
    """Accuracy on the languages both know, and texts/s, ours against lingua; ours on all it knows."""
    data = locale_texts(per_language)
    data["en"] = english_texts(per_language)
    mine, my_codes = ours()
    try:
        anchor, anchor_codes = lingua()
    except ImportError:  # the bench extra is not installed: our figures alone
        anchor, anchor_codes = None, frozenset()
    both = set(data) & my_codes & (anchor_codes or my_codes)
    acc, n = accuracy(mine, data, both)
    wide, wide_n = accuracy(mine, data, set(data) & my_codes)
    texts = [t for code in sorted(both) for t in data[code]]
    rate = speed(mine, texts)
    note = f"{n} texts, {len(both)} languages"
    if anchor is None:
        return [
            Metric("langid accuracy (lingua not installed)", acc, 1.0, "share", ">= 0.95", acc >= 0.95, note),
            Metric("langid texts/s (lingua not installed)", rate, 1.0, "texts/s", "-", True, note),
        ]
    anchor_acc, _ = accuracy(anchor, data, both)
    anchor_rate = speed(anchor, texts, repeats=1)
    return [
        Metric("langid accuracy, common languages (÷ lingua)", acc, anchor_acc, "share", ">= 0.98x",
               acc >= 0.98 * anchor_acc, note),
        Metric("langid accuracy, all ours knows (÷ lingua common)", wide, anchor_acc, "share", ">= 0.95x",
               wide >= 0.95 * anchor_acc, f"{wide_n} texts, {len(set(data) & my_codes)} languages"),
        Metric("langid texts/s (÷ lingua)", rate, anchor_rate, "texts/s", ">= 1x", rate >= anchor_rate, note),
    ]  # fmt: skip


def main() -> int:
    per_language = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    metrics = langid(per_language)
    for m in metrics:
        print(m.line(), flush=True)
    return 0 if all(m.passed for m in metrics) else 1


if __name__ == "__main__":
    sys.exit(main())
