"""PII redaction: precision and recall on planted items and their lookalikes, and texts/s, of ``dsgpt2
redact``'s rules (:func:`dsgpt2.curation.pii.redact`) against datatrove's ``PIIFormatter`` on the same
texts.

The texts: paragraphs of the stdlib documentation, each with one item planted in a sentence of its
kind. Positives, drawn from a seeded generator: e-mail addresses (names, dots, plus tags, subdomains),
public IPv4 addresses (in prose and in URLs), public IPv6 addresses (full and compressed) and phone
numbers (North American, international, national with a leading 0). Negatives, the lookalikes:
version and section numbers with four parts (``version 1.2.3.4``, ``v2.0.1.3``, ``section 4.1.2.7``),
private and loopback addresses, dates, decimals, ordinary numbers, ISBNs, times, MAC addresses,
e-mail-like code (``A@B.T``, ``x = a@b``) and documentation domains (``user@example.com``). An item
counts as found when it is no longer in the output; a lookalike as a false positive when it is not.

datatrove looks for e-mail addresses and public IPv4 addresses only: the ratios on the kinds both look
for are the fair comparison; the line on every kind shows what it does not cover. datatrove is not a
dependency of the project: ``make bench`` installs it beside the environment at a fixed version
(``BENCH_ANCHORS`` in the Makefile); run without it, ours alone are printed.

Run alone: ``python -m bench.bench_pii [ITEMS_PER_KIND]``; ``python -m bench pii`` in the suite.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from functools import partial

from bench.common import Metric

Redactor = Callable[[str], str]
BOTH = ("email", "ipv4")  # the kinds datatrove looks for


def _email(rng: random.Random) -> str:
    first = rng.choice(["john", "maria", "li", "ahmed", "sophie", "k", "olga", "james"])
    last = rng.choice(["doe", "garcia", "wang", "khan", "martin", "smith", "ivanova", "o-neil"])
    local = rng.choice([f"{first}.{last}", f"{first}{rng.randint(1, 99)}", f"{first}_{last}+news", first])
    domain = rng.choice(["gmail.com", "mail.uni-heidelberg.de", "company.io", "example-corp.co.uk",
                         "yahoo.fr", "posteo.net", "dept.state.gov"])  # fmt: skip
    return f"{local}@{domain}"


def _ipv4(rng: random.Random) -> str:
    while True:
        first = rng.choice([8, 23, 45, 66, 93, 104, 151, 172, 185, 198, 212])
        if first in (172, 198):
            continue  # 172.16/12 and 198.18/15 hold private and benchmarking ranges: kept simple
        return f"{first}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"


def _ipv6(rng: random.Random) -> str:
    groups = [f"{rng.choice([0x2001, 0x2A00, 0x2A03, 0x2604, 0x2607]):x}", f"{rng.randint(0x100, 0xFFFF):x}"]
    groups += [f"{rng.randint(0, 0xFFFF):x}" for _ in range(6)]
    if groups[1] == "db8":
        groups[1] = "db9"
    if rng.random() < 0.5:
        return ":".join(groups[:3]) + "::" + groups[7]
    return ":".join(groups)


def _phone(rng: random.Random) -> str:
    a, b, c = rng.randint(201, 989), rng.randint(200, 999), rng.randint(1000, 9999)
    return rng.choice([
        f"({a}) {b}-{c}", f"{a}-{b}-{c}", f"{a}.{b}.{c}", f"+1 {a} {b} {c}", f"1-{a}-{b}-{c}",
        f"+44 20 {rng.randint(7000, 8999)} {c}", f"+49 30 {rng.randint(1000000, 99999999)}",
        f"+33 1 {rng.randint(10, 99)} {rng.randint(10, 99)} {rng.randint(10, 99)} {rng.randint(10, 99)}",
        f"020 {rng.randint(7000, 8999)} {c}",
    ])  # fmt: skip


POSITIVE = {
    "email": (_email, ["Write to {} for the slides.", "Questions go to {}.", "(contact: {})"]),
    "ipv4": (_ipv4, ["The server at {} answered.", "Blocked {} after the scan.", "See http://{}/index.html"]),
    "ipv6": (_ipv6, ["The host {} is online.", "Ping {} twice."]),
    "phone": (_phone, ["Call {} before noon.", "Phone: {}", "Ring us on {} today."]),
}


def _lookalike(rng: random.Random) -> str:
    n = lambda: rng.randint(0, 20)  # noqa: E731
    return rng.choice([
        f"version {n()}.{n()}.{n()}.{n()}", f"v{n()}.{n()}.{n()}.{n()}", f"section {n()}.{n()}.{n()}.{n()}",
        f"release {rng.randint(1, 9)}.{n()}.{n()}.{rng.randint(100, 255)}",
        f"192.168.{n()}.{rng.randint(1, 254)}", f"10.{n()}.{n()}.{n()}", "127.0.0.1",
        f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        f"{rng.randint(1, 28):02d}/{rng.randint(1, 12):02d}/{rng.randint(1990, 2030)}",
        f"{rng.randint(0, 99)}.{rng.randint(10000, 99999)}", f"{rng.randint(10**9, 10**10 - 1)}",
        f"ISBN 978-{rng.randint(0, 9)}-{rng.randint(10, 99)}-{rng.randint(10**5, 10**6 - 1)}-{n() % 10}",
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}",
        ":".join(f"{rng.randint(0, 255):02X}" for _ in range(6)),
        "y = A@B.T", "x = a@b", "out = self.w@self.x.data(0)", f"user{n()}@example.com",
        f"{rng.randint(100, 999)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}",
    ])  # fmt: skip


def cases(per_kind: int, seed: int = 0) -> tuple[dict[str, list[tuple[str, str]]], list[tuple[str, str]]]:
    """(kind → [(text, item)]), [(text, lookalike)]: each item planted in a stdlib paragraph."""
    from dsgpt2.corpus.builtin import stdlib_documents
    from dsgpt2.corpus.cleaning import clean_text

    rng = random.Random(seed)
    paragraphs = [p for p in (clean_text(t)[:300] for t in stdlib_documents()) if p and "@" not in p]
    positives = {}
    for kind, (make, sentences) in POSITIVE.items():
        items = [make(rng) for _ in range(per_kind)]
        positives[kind] = [(f"{rng.choice(paragraphs)} {rng.choice(sentences).format(item)}", item)
                           for item in items]  # fmt: skip
    negatives = []
    for _ in range(per_kind * 2):
        item = _lookalike(rng)
        negatives.append((f"{rng.choice(paragraphs)} It says {item} here.", item))
    return positives, negatives


def score(redact: Redactor, positives: list[tuple[str, str]], negatives: list[tuple[str, str]]) -> tuple:
    """(precision, recall): an item found when the output no longer holds it; a lookalike wrongly
    taken when it does not."""
    found = sum(item not in redact(text) for text, item in positives)
    wrong = sum(item not in redact(text) for text, item in negatives)
    return found / max(found + wrong, 1), found / max(len(positives), 1)


def speed(redact: Redactor, texts: list[str], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for t in texts:
            redact(t)
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def ours() -> Redactor:
    from dsgpt2.curation.pii import redact

    return lambda text: redact(text)[0]


def datatrove() -> Redactor:
    from datatrove.pipeline.formatters import PIIFormatter

    return PIIFormatter().format


def pii(per_kind: int = 200) -> list[Metric]:
    """Precision and recall on the kinds both look for and on all, and texts/s, ours against datatrove."""
    positives, negatives = cases(per_kind)
    common = [c for kind in BOTH for c in positives[kind]]
    every = [c for cs in positives.values() for c in cs]
    texts = [t for t, _ in every + negatives]
    mine = ours()
    p, r = score(mine, common, negatives)
    p_all, r_all = score(mine, every, negatives)
    rate = speed(mine, texts)
    note = f"{len(common)} items, {len(negatives)} lookalikes"
    note_all = f"{len(every)} items of 4 kinds, {len(negatives)} lookalikes"
    try:
        anchor = datatrove()
    except ImportError:  # datatrove is not installed beside the project: our figures alone
        alone = "(datatrove not installed)"
        return [
            Metric(f"pii precision {alone}", p_all, 1.0, "share", ">= 0.95", p_all >= 0.95, note_all),
            Metric(f"pii recall {alone}", r_all, 1.0, "share", ">= 0.95", r_all >= 0.95, note_all),
            Metric(f"pii texts/s {alone}", rate, 1.0, "texts/s", "-", True, f"{len(texts)} texts"),
        ]
    ap, ar = score(anchor, common, negatives)
    ap_all, ar_all = score(anchor, every, negatives)
    anchor_rate = speed(anchor, texts)
    share = partial(Metric, unit="share", target=">= 0.95")
    return [
        share("pii precision, e-mail+IPv4 (÷ datatrove)", p, ap, passed=p >= 0.95, note=note),
        share("pii recall, e-mail+IPv4 (÷ datatrove)", r, ar, passed=r >= 0.95, note=note),
        share("pii precision, all kinds (÷ datatrove)", p_all, ap_all, passed=p_all >= 0.95, note=note_all),
        share("pii recall, all kinds (÷ datatrove)", r_all, ar_all, passed=r_all >= 0.95, note=note_all),
        Metric("pii texts/s (÷ datatrove)", rate, anchor_rate, "texts/s", "-", True, f"{len(texts)} texts"),
    ]


def main() -> int:
    per_kind = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    metrics = pii(per_kind)
    for m in metrics:
        print(m.line(), flush=True)
    return 0 if all(m.passed for m in metrics) else 1


if __name__ == "__main__":
    sys.exit(main())
