"""``dsgpt2 curate report``: what each curation step marks, per collection, with examples, printed and
plotted. Read from the marks the steps left on the documents (``dup_of``, ``near_dup_of``,
``passes.<rule>``: each registered step's :class:`~dsgpt2.curation.steps.Reason`), counted by the
database, one aggregation per collection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsgpt2.curation.decontaminate import contaminated_counts
from dsgpt2.curation.pii import KINDS, PII_FACET, pii_totals
from dsgpt2.curation.steps import CollectionPart, Reason, reasons
from dsgpt2.db.client import Connection, require_collections
from dsgpt2.db.meta import read_meta
from dsgpt2.db.summaries import aggregate_summary, first_in_order
from dsgpt2.documents import IDX, TURNS, document_text
from dsgpt2.files import output_writer


def checked(meta: dict[str, Any], reason: Reason) -> bool:
    """Whether the step that marks ``reason`` ran to its end on the collection of ``meta`` (its meta_info
    entry): the marks of a step never run are absent, so a count of 0 there is "not checked", not
    "clean"."""
    node: Any = meta
    for key in reason.recorded:
        if isinstance(node, list):
            return key in node
        if not isinstance(node, dict) or not node.get(key):
            return False
        node = node[key]
    return True


@dataclass
class CollectionSummary(CollectionPart):
    judged: int = 0  # documents with quality verdicts
    removed: dict[str, int] = field(default_factory=dict)  # reason → documents it selects
    kept: int = 0  # documents no reason selects
    examples: dict[str, list[str]] = field(default_factory=dict)
    contaminated_by: dict[str, int] = field(default_factory=dict)  # evaluation set → documents marked
    languages: dict[str, int] = field(default_factory=dict)  # `dsgpt2 langid`'s code → documents
    pii: dict[str, int] = field(default_factory=dict)  # redacted documents, items replaced per kind
    unchecked: list[str] = field(default_factory=list)  # reasons whose pass never ran to its end here


def summarize(
    conn: Connection, names: Sequence[str], examples: int = 2, chars: int = 80
) -> list[CollectionSummary]:
    """Per collection: documents, each reason's count, the documents no reason selects, examples."""
    require_collections(conn, names)
    cfg = conn.config
    listed = reasons()
    facets = {r.label: [{"$match": r.query}, {"$count": "n"}] for r in listed}
    facets["documents"] = [{"$count": "n"}]
    facets["judged"] = [{"$match": {"passes.key": {"$exists": True}}}, {"$count": "n"}]
    facets["kept"] = [{"$match": {"$nor": [dict(r.query) for r in listed]}}, {"$count": "n"}]
    facets["languages"] = [{"$match": {"lang_key": {"$exists": True}}},
                           {"$group": {"_id": {"$ifNull": ["$lang", "none"]}, "n": {"$sum": 1}}}]  # fmt: skip
    facets["pii"] = PII_FACET
    shown = {IDX: 1, cfg.text_field: 1, TURNS: 1, **{r.of: 1 for r in listed if r.of}}
    out = []
    metas = read_meta(conn, list(names))
    for name in names:
        pipeline = [{"$match": {"idx": {"$exists": True}}}, {"$facet": facets}]
        (row,) = aggregate_summary(conn, name, pipeline, f"curate report: counting {name}")
        languages = {str(r["_id"]): int(r["n"]) for r in row.pop("languages")}
        redacted = pii_totals(row.pop("pii"))
        count = {k: (v[0]["n"] if v else 0) for k, v in row.items()}
        part = CollectionSummary(name, count["documents"], count["judged"], kept=count["kept"])
        part.removed = {r.label: count[r.label] for r in listed}
        part.unchecked = [r.label for r in listed if not checked(metas.get(name, {}), r)]
        part.contaminated_by = contaminated_counts(conn, name)
        part.languages = dict(sorted(languages.items(), key=lambda kv: (-kv[1], kv[0])))
        part.pii = redacted
        for r in listed:
            if not part.removed[r.label] or examples <= 0:
                continue
            what = f"curate report: examples of {name}"
            docs = first_in_order(conn, name, dict(r.query), shown, what, n=examples)
            part.examples[r.label] = [_example(name, d, cfg.text_field, chars, listed) for d in docs]
        out.append(part)
    return out


def _example(name: str, doc: dict[str, Any], text_field: str, chars: int, listed: Sequence[Reason]) -> str:
    text = " ".join((document_text(doc, text_field) or "").split())
    text = text if len(text) <= chars else text[: chars - 1] + "…"
    of = next((doc[r.of] for r in listed if r.of and doc.get(r.of)), None)
    return f"{name}:{doc['idx']}" + (f" (of {of})" if of else "") + f": {text!r}"


def report_lines(parts: Sequence[CollectionSummary]) -> list[str]:
    runs = {r.label: r.run for r in reasons()}
    lines = []
    for p in parts:
        total = max(p.documents, 1)
        lines.append(f"{p.name}: {p.documents} documents ({p.judged} with quality verdicts)")
        for reason, n in p.removed.items():
            if reason in p.unchecked and not n:
                lines.append(f"  {reason:<16} {'—':>9}  not checked (run {runs[reason]})")
                continue
            unfinished = f"  (unfinished: re-run {runs[reason]})" if reason in p.unchecked else ""
            lines.append(f"  {reason:<16} {n:>9}  {n / total:6.1%}{unfinished}")
            lines.extend(f"      e.g. {e}" for e in p.examples.get(reason, []))
            if reason == "contaminated":
                lines.extend(f"      by {s}: {k}" for s, k in p.contaminated_by.items())
        lines.append(f"  {'kept by all':<16} {p.kept:>9}  {p.kept / total:6.1%}")
        if p.languages:
            shown = ", ".join(f"{code} {n}" for code, n in list(p.languages.items())[:10])
            more = f", {len(p.languages) - 10} more" if len(p.languages) > 10 else ""
            lines.append(f"  languages ({sum(p.languages.values())} labelled): {shown}{more}")
        if p.pii:
            n, kinds = p.pii["changed"], ", ".join(f"{k} {p.pii[k]}" for k in KINDS)
            checked = p.pii["documents"]
            lines.append(
                f"  {'pii redacted':<16} {n:>9}  {n / total:6.1%}  (of {checked} checked; replaced: {kinds})"
            )
    return lines


def plot(parts: Sequence[CollectionSummary], out: Path) -> Path:
    """One horizontal bar per reason and collection: the share of its documents each selects."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    listed = [r.label for r in reasons()]
    never = [r for r in listed if all(r in p.unchecked for p in parts)]
    labels = [f"{r} (not checked)" if r in never else r for r in listed] + ["kept by all"]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(labels) * max(len(parts), 1) ** 0.5))
    height = 0.8 / max(len(parts), 1)
    for k, p in enumerate(parts):
        shares = [p.removed.get(r, 0) / max(p.documents, 1) for r in listed] + [p.kept / max(p.documents, 1)]
        ys = [i + k * height for i in range(len(labels))]
        ax.barh(ys, shares, height=height, label=f"{p.name} ({p.documents} documents)")
    ax.set_yticks([i + height * (len(parts) - 1) / 2 for i in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xlabel("share of the collection's documents")
    ax.set_xlim(0, 1)
    ax.legend(loc="lower right")
    ax.set_title("what each curation pass marks")
    fig.tight_layout()
    try:
        with output_writer(out, "wb", prefix=".plot-") as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out
