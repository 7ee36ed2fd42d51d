"""The checks of a config's FILTER that need no server: the language codes it may compare ``lang`` with,
and the wording of the server's refusal (the key it names, the operator most like a typo); and
:func:`conjoin`, which joins FILTER (or any condition) to an idx bound in the shape an index serves.

:func:`dsgpt2.db.client.check_filter` asks the server to parse FILTER and uses both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dsgpt2.documents import LANGUAGE, known_fields
from dsgpt2.errors import ConfigError

# Every code the language model of `dsgpt2 langid` (py3langid 0.4) can put in a document's LANGUAGE; a test
# of dsgpt2/curation/language.py keeps the list equal to the model's. The list is curation's, but it lives
# here, in db/: FILTER is checked where the query is made, below curation, before anything is read.
_CODES = """ace af am an ar ary arz as az ba bcl be bg bn br bs ca crh cs cy da de dz el en eo es et eu ext fa
fi fo fr fuv fy ga gcf gcr gd gl gom grc gu gug guw ha hbo he hi hr ht hu hy id ig is it ja jv ka
kab kik kk km kn ko ku ky la lb lg lij ln lo lt ltg lv mg mk ml mn mr ms mt my ne nl nn no nso oc om
or pa pcm pl ps pt qu ro ru rw sa sdh se si sk sl sn so sq sr st sv sw ta te tg th tk tl tr tt ug uk
ur uz uzs vec vi vo wa wuu xh yo yue zh zu zxx"""
LANGUAGE_CODES = frozenset(_CODES.split())


def check_filter_languages(query: Any, shown: str) -> None:
    """Refuse a FILTER that compares ``lang`` with a code the language model never emits (it would
    select nothing, or everything): ``{"lang": "xx"}``, ``{"lang": {"$in": ["en", "zz"]}}``, also
    inside ``$and``, ``$or``, ``$nor`` and ``$not``.

    Raises:
        ConfigError: naming the code.
    """
    for code in _language_values(query):
        if code not in LANGUAGE_CODES:
            raise ConfigError(
                f"FILTER {shown}: {LANGUAGE!r} {code!r} is not a language code `dsgpt2 langid` "
                f"labels (ISO 639, e.g. en, de, zh; {len(LANGUAGE_CODES)} codes); fix FILTER in the config"
            )


def _language_values(query: Any) -> Iterator[str]:
    if isinstance(query, list):
        for item in query:
            yield from _language_values(item)
    elif isinstance(query, dict):
        for key, value in query.items():
            if key in ("$and", "$or", "$nor"):
                yield from _language_values(value)
            elif key == LANGUAGE:
                yield from _compared_codes(value)


def _compared_codes(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for op, operand in value.items():
            if op in ("$eq", "$ne") and isinstance(operand, str):
                yield operand
            elif op in ("$in", "$nin") and isinstance(operand, list):
                yield from (v for v in operand if isinstance(v, str))
            elif op == "$not":
                yield from _compared_codes(operand)


# Comparisons with a value that no missing field equals: a field they bound exists.
_BOUNDS = ("$eq", "$gt", "$gte", "$lt", "$lte")
_LOWER, _UPPER = ("$gt", "$gte"), ("$lt", "$lte")


def conjoin(*queries: Mapping[str, Any]) -> dict[str, Any]:
    """The query matching what every one of ``queries`` matches, as one document of field conditions
    where it can be: ``{"idx": {"$gte": 0, "$lt": 10}, "lang": "en"}``, not ``{"$and": [...]}``.

    The same query to mongod, but not to the embedded engine, which plans an index only for a query
    without top-level operators: there, ``{"$and": [{"idx": <range>}, q]}`` reads every document of
    the collection (each window of a windowed pass, each chunk a FILTER reads, the whole collection
    again). Fields keep the order of their first appearance, so an index on the first query's field is
    the one picked. ``$and`` lists are flattened; conditions on one field are merged when their
    operators differ (``$exists: true`` is dropped beside a bound that implies it); only what cannot
    be merged stays in an ``$and`` (an ``$or`` of one condition is that condition; two bounds of one
    kind, ``$gte`` and ``$gte``, are the tighter).
    """
    fields: dict[str, Any] = {}
    rest: list[dict[str, Any]] = []

    def add(query: Mapping[str, Any]) -> None:
        for key, value in query.items():
            one_of = key == "$or" and isinstance(value, list) and len(value) == 1
            if (
                (key == "$and" or one_of)
                and isinstance(value, list)
                and all(isinstance(q, Mapping) for q in value)
            ):
                for q in value:
                    add(q)
            elif key not in fields:
                fields[key] = value
            elif key.startswith("$") or (merged := _merged(fields[key], value)) is None:
                rest.append({key: value})
            else:
                fields[key] = merged

    for query in queries:
        add(query)
    if rest:
        fields["$and"] = rest
    return fields


def _operators(condition: Any) -> dict[str, Any] | None:
    """``condition`` as its operators (None: an equality, or a document of fields)."""
    if isinstance(condition, Mapping) and condition and all(str(k).startswith("$") for k in condition):
        return dict(condition)
    return None


def _implies_exists(ops: Mapping[str, Any]) -> bool:
    listed = ops.get("$in")
    return any(ops.get(op) is not None for op in _BOUNDS) or (
        isinstance(listed, list) and all(v is not None for v in listed)
    )


def _merged(a: Any, b: Any) -> dict[str, Any] | None:
    """One field's two conditions as one, or None where they cannot be written as one."""
    ops_a, ops_b = _operators(a), _operators(b)
    if ops_a is None or ops_b is None:
        return None
    for ops, other in ((ops_a, ops_b), (ops_b, ops_a)):
        if ops == {"$exists": True} and _implies_exists(other):
            return other
    both = ops_a.keys() & ops_b.keys()
    if not both <= {*_LOWER, *_UPPER} or not all(_number(ops_a[op]) and _number(ops_b[op]) for op in both):
        return None
    merged = {**ops_a, **ops_b}
    for op in both:  # two bounds of one kind: the tighter
        merged[op] = (max if op in _LOWER else min)(ops_a[op], ops_b[op])
    return merged


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def filter_fields(query: Any) -> list[str]:
    """The field paths a FILTER names, in order, once each (inside ``$and``, ``$or`` and ``$nor`` too)."""
    out: list[str] = []
    if isinstance(query, list):
        for item in query:
            out += [f for f in filter_fields(item) if f not in out]
    elif isinstance(query, Mapping):
        for key, value in query.items():
            if key in ("$and", "$or", "$nor"):
                out += [f for f in filter_fields(value) if f not in out]
            elif not str(key).startswith("$") and key not in out:
                out.append(str(key))
    return out


def unknown_fields(query: Any, present: set[str], extra: Sequence[str] = ()) -> list[tuple[str, str | None]]:
    """The fields ``query`` names whose first part is no field of the documents seen (``present``), of
    dsgpt2's (a FILTER may name one no document has yet: a corpus without duplicates has no ``dup_of``),
    or of ``extra`` (the config's TEXT_FIELD): each with the known name most like it."""
    import difflib

    known = {*present, *known_fields(), *extra}
    out = []
    for path in filter_fields(query):
        head = path.split(".")[0]
        if head not in known:
            close = difflib.get_close_matches(head, sorted(known), n=1, cutoff=0.6)
            out.append((path, close[0] if close else None))
    return out


# Query operators, to suggest one for a typo the server refuses.
QUERY_OPERATORS = [
    "$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$and", "$or", "$nor", "$not",
    "$exists", "$type", "$expr", "$jsonSchema", "$mod", "$regex", "$options", "$text", "$all",
    "$elemMatch", "$size", "$bitsAllClear", "$bitsAllSet", "$bitsAnyClear", "$bitsAnySet", "$comment",
]  # fmt: skip


def filter_refusal(query: Any, reason: str) -> str:
    """The server's ``reason`` for refusing ``query``, with the key of the operator it names and, for an
    unknown one, the operator most like it."""
    import difflib
    import re

    named = re.search(r"\$[A-Za-z]\w*", reason)
    if named is None:
        return f"the server refuses it ({reason})"
    operator = named.group(0)
    key = _key_of(query, operator)
    where = f"key {key!r}, operator {operator}" if key else f"operator {operator}"
    text = f"the server refuses {where} ({reason})"
    if "unknown" in reason:
        close = difflib.get_close_matches(operator, QUERY_OPERATORS, n=1)
        if close:
            text += f"; did you mean {close[0]}?"
    return text


def _key_of(query: Any, operator: str, key: str | None = None) -> str | None:
    """The field whose condition holds ``operator`` (None: a top-level one or not found)."""
    if isinstance(query, list):
        return next((k for item in query if (k := _key_of(item, operator, key)) is not None), None)
    if not isinstance(query, Mapping):
        return None
    for name, value in query.items():
        if name == operator:
            return key
        found = _key_of(value, operator, key if name.startswith("$") else name)
        if found is not None:
            return found
    return None
