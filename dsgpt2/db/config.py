"""The MongoDB connection config: JSON file → validated :class:`MongoConfig`.

The file keeps the original toolkit's keys::

    {"MONGO_CONNECTION_STRING": "mongodb://...", "MONGO_CONNECTION_DB": "corpus",
     "COLLECTIONS": ["news", "wiki"]}

The environment variable ``MONGO_CONNECTION_STRING`` overrides the file's
connection string, so that a password never has to be written into a file.
"""

from __future__ import annotations

import json
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dsgpt2.documents import TEXT, utf8_encodable
from dsgpt2.errors import ConfigError
from dsgpt2.files import not_a_file
from dsgpt2.settings.options import NON_NEGATIVE_INT, POSITIVE_INT, Checked, Range, option
from dsgpt2.settings.shipped import shipped_if_absent

ENV_URI = "MONGO_CONNECTION_STRING"
SCHEMES = ("mongodb://", "mongodb+srv://", "local://")
REDACTED = "***"
# The collection evaluation results are recorded in, beside the corpus (:func:`dsgpt2.db.meta.record_eval`):
# one of the toolkit's own collections, which :func:`dsgpt2.db.client.require_collections` does not name
# as corpus.
EVAL_RESULTS = "eval_results"

# JSON key → (dataclass field, expected type(s), description for errors and docs).
_KEYS: dict[str, tuple[str, tuple[type, ...], str]] = {
    "MONGO_CONNECTION_STRING": ("uri", (str,), "connection string"),
    "MONGO_CONNECTION_DB": ("db", (str,), "database name"),
    "COLLECTIONS": (
        "collections",
        (list,),
        'list of collection names, in index order (or {"name": ..., "weight": ...} objects: token shares)',
    ),
    "TEXT_FIELD": ("text_field", (str,), "document field holding the text"),
    "META_COLLECTION": ("meta_collection", (str,), "collection holding per-collection counts"),
    "SERVER_SELECTION_TIMEOUT_MS": ("server_selection_timeout_ms", (int,), "how long to look for a server"),
    "SOCKET_TIMEOUT_MS": ("socket_timeout_ms", (int,), "one query's limit (index builds, counts: none)"),
    "RETRIES": ("retries", (int,), "attempts after a transient error"),
    "RETRY_BACKOFF_S": ("retry_backoff_s", (int, float), "first backoff, doubled per retry"),
    "MAX_TEXT_CHARS": ("max_text_chars", (int,), "longer documents are skipped as bad"),
    "STRICT": ("strict", (bool,), "fail on the first bad document instead of skipping it"),
    "READ_PREFERENCE": ("read_preference", (str,), "which replica set members answer training reads"),
    "READ_PREFERENCE_TAGS": ("read_preference_tags", (list,), "tag sets of the members to read from"),
    "FILTER": (
        "filter",
        (dict,),
        "a MongoDB query over document fields: only the documents it matches are read "
        '(e.g. {"dup_of": {"$exists": false}, "passes.gopher": true})',
    ),
}
# Server-side JavaScript: slow, often disabled, and no business of a data filter.
_FILTER_REFUSED = ("$where", "$function", "$accumulator")
READ_PREFERENCES = ("primary", "primaryPreferred", "secondary", "secondaryPreferred", "nearest")
_REQUIRED = ("MONGO_CONNECTION_DB", "COLLECTIONS")
# The keys that decide which documents a run reads and how it reads them: alike on every node of a run. The
# others say where a node finds the database and how patiently it asks, which may differ between nodes.
_CORPUS_KEYS = ("MONGO_CONNECTION_DB", "COLLECTIONS", "TEXT_FIELD", "META_COLLECTION", "MAX_TEXT_CHARS",
                "STRICT", "FILTER")  # fmt: skip

# The scheme may be missing (a mistyped string): its password is kept back all the same.
_USERINFO = re.compile(r"^(?P<scheme>[a-z+]+://)?(?P<user>[^:@/]*)(?::(?P<pw>[^@/]*))?@")
# authMechanismProperties may carry AWS_SESSION_TOKEN:...: its whole value is kept back.
_SECRET_OPTIONS = re.compile(
    r"(?i)((?:password|tlsCertificateKeyFilePassword|secret|authMechanismProperties)[^=&]*=)([^&]*)"
)


def collection_name_problem(name: object) -> str | None:
    """Why MongoDB would refuse ``name`` as a collection name, or None."""
    if not isinstance(name, str) or not name:
        return "it must be a non-empty string"
    if not utf8_encodable(name):
        return "it is not UTF-8 text (bytes the shell could not decode, or a lone surrogate)"
    if "$" in name or "\x00" in name:
        return "it may not contain '$' or NUL"
    if name.startswith("system."):
        return "names starting with 'system.' are MongoDB's own"
    if name.startswith(".") or name.endswith("."):
        return "it may not start or end with '.'"
    if len(name.encode("utf-8")) > 200:
        return "it is longer than 200 bytes"
    return None


def db_name_problem(name: object) -> str | None:
    """Why MongoDB would refuse ``name`` as a database name, or None."""
    if not isinstance(name, str) or not name:
        return "it must be a non-empty string"
    if not utf8_encodable(name):
        return "it is not UTF-8 text (bytes the shell could not decode, or a lone surrogate)"
    bad = sorted(set(name) & set('/\\. "$*<>:|?\x00'))
    if bad:
        return f"it may not contain {' '.join(repr(c) for c in bad)}"
    if len(name.encode("utf-8")) > 63:
        return "it is longer than 63 bytes"
    return None


@dataclass(frozen=True)
class MongoConfig(Checked):
    """Where the corpus lives and how to read it.

    Attributes:
        uri: ``mongodb://``/``mongodb+srv://`` for a server (a deployment), ``local://DIR`` for the
            embedded database on the directory DIR (see :mod:`dsgpt2.db.embedded`).
        db: database holding the collections and ``meta_collection``.
        collections: pretraining collections; their documents are indexed in this order.
        text_field: the field read as a document's text.
        meta_collection: per-collection counts and ingest progress.
        server_selection_timeout_ms: how long opening waits for a server before failing.
        socket_timeout_ms: how long one query may run before it counts as a network error (not the
            commands whose time grows with the collection: :func:`dsgpt2.db.client.patiently`).
        retries: attempts after a transient error before giving up.
        retry_backoff_s: first backoff; doubled after each failed attempt.
        max_text_chars: documents longer than this are skipped as bad.
        strict: raise on the first bad document instead of skipping and counting it.
        read_preference: the replica set members that answer the training reads (MongoDB's modes;
            ``secondaryPreferred`` keeps them off the primary). Writes always go to the primary.
        read_preference_tags: tag sets narrowing those members, tried in order
            (``[{"dc": "east"}, {}]``); not with ``primary``.
        filter: the FILTER query as canonical JSON ("" for none): documents it does not match are
            skipped (counted as ``filtered``) by training, validation, vocabulary download,
            evaluation and info; see :attr:`filter_query`.
        weights: mixture weights, one per collection (token shares; see
            :mod:`dsgpt2.data.mixture`), from ``{"name": ..., "weight": ...}`` entries of
            COLLECTIONS; empty: collections are read in proportion to their sizes.
    """

    uri: str = field(repr=False)
    db: str
    collections: tuple[str, ...]
    text_field: str = TEXT
    meta_collection: str = "meta_info"
    server_selection_timeout_ms: int = option(5000, flag="SERVER_SELECTION_TIMEOUT_MS", check=POSITIVE_INT)
    socket_timeout_ms: int = option(60000, flag="SOCKET_TIMEOUT_MS", check=POSITIVE_INT)
    retries: int = option(5, flag="RETRIES", check=NON_NEGATIVE_INT)
    retry_backoff_s: float = option(0.5, flag="RETRY_BACKOFF_S", check=Range(float, 0))
    max_text_chars: int = option(2_000_000, flag="MAX_TEXT_CHARS", check=POSITIVE_INT)
    strict: bool = False
    read_preference: str = "primary"
    read_preference_tags: tuple[dict[str, str], ...] = ()
    filter: str = ""
    weights: tuple[float, ...] = ()
    # The file the config was read from ("" when made in code): messages name it as the user's --config.
    source: str = field(default="", compare=False, repr=False)

    # Each key named as the config file spells it.
    flag_prefix = ""

    def check(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.startswith(SCHEMES):
            raise ConfigError(
                f"MONGO_CONNECTION_STRING must start with one of {', '.join(SCHEMES)}; got "
                f"{redact_uri(str(self.uri))!r}: write local://{_local_suggestion(self.uri)}"
                " for the embedded "
                "database (a directory, started by dsgpt2) or mongodb://HOST for a server"
            )
        problem = db_name_problem(self.db)
        if problem:
            raise ConfigError(f"MONGO_CONNECTION_DB {self.db!r} is not a database name: {problem}")
        names = list(self.collections)
        if not names:
            raise ConfigError("COLLECTIONS must list at least one collection")
        for name in names:
            problem = collection_name_problem(name)
            if problem:
                raise ConfigError(f"COLLECTIONS holds {name!r}, not a collection name: {problem}")
        if len(set(names)) != len(names):
            raise ConfigError(f"COLLECTIONS names a collection twice: {names}")
        if self.meta_collection in names:
            raise ConfigError(
                f"META_COLLECTION {self.meta_collection!r} is also listed in COLLECTIONS; "
                "give the meta collection its own name"
            )
        infinite = [w for w in self.weights if not math.isfinite(w)]  # JSON's Infinity and NaN
        if self.weights and (
            len(self.weights) != len(names) or infinite or min(self.weights) < 0 or not sum(self.weights) > 0
        ):
            said = f"{infinite[0]} is not a finite number; " if infinite else ""
            raise ConfigError(
                f"COLLECTIONS weights {list(self.weights)}: {said}need one weight >= 0 per collection, "
                "not all 0"
            )
        if self.read_preference not in READ_PREFERENCES:
            raise ConfigError(
                f"READ_PREFERENCE {self.read_preference!r} is not a read preference; use one of "
                f"{', '.join(READ_PREFERENCES)}"
            )
        for tags in self.read_preference_tags:
            if not isinstance(tags, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in tags.items()
            ):
                raise ConfigError(
                    f"READ_PREFERENCE_TAGS must be a list of objects of strings such as "
                    f'[{{"dc": "east"}}, {{}}]; got {tags!r}'
                )
        if self.read_preference_tags and self.read_preference == "primary":
            raise ConfigError(
                "READ_PREFERENCE_TAGS do not apply to READ_PREFERENCE primary; pick another mode"
            )
        problem = filter_problem(self.filter_query if self.filter else {})
        if problem:
            raise ConfigError(f"FILTER {self.filter}: {problem}")

    def __repr__(self) -> str:
        return (
            f"MongoConfig(uri={self.display_uri!r}, db={self.db!r}, collections={list(self.collections)!r})"
        )

    @property
    def display_uri(self) -> str:
        """The connection string with its password replaced by ``***``."""
        return redact_uri(self.uri)

    @property
    def hosts(self) -> str:
        """The host part of the connection string, without credentials."""
        return uri_hosts(self.uri)

    @property
    def filter_query(self) -> dict[str, Any] | None:
        """FILTER as a query document, None when the config has none (or an empty one)."""
        return json.loads(self.filter) if self.filter else None

    @property
    def is_local(self) -> bool:
        """Whether this is the embedded database (``local://DIR``) that dsgpt2 starts itself."""
        return self.uri.startswith("local://")

    def records_problem(self, name: str) -> str | None:
        """Why ``name`` is no corpus collection but the toolkit's own records (the meta collection,
        evaluation records, stored files), or None."""
        if name in (self.meta_collection, EVAL_RESULTS) or name.endswith((".files", ".chunks")):
            return "the toolkit's own records, not a corpus collection"
        return None

    def scrub(self, text: str) -> str:
        """Remove every secret of this config from ``text`` (an error message, a log line)."""
        return scrub(text, self.uri)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON keys, with the password redacted: safe to log or to send to wandb."""
        values = asdict(self)
        values["uri"] = self.display_uri
        values["collections"] = list(self.collections)
        if self.weights:
            values["collections"] = [
                {"name": n, "weight": w} for n, w in zip(self.collections, self.weights, strict=True)
            ]
        values["read_preference_tags"] = list(self.read_preference_tags)
        values["filter"] = self.filter_query or {}
        return {key: values[name] for key, (name, _, _) in _KEYS.items()}

    def corpus_keys(self) -> dict[str, Any]:
        """The keys (as the file spells them) that decide what a run reads, not where a node reaches it."""
        values = self.to_dict()
        return {key: values[key] for key in _CORPUS_KEYS}

    def with_collections(self, collections: list[str] | tuple[str, ...]) -> MongoConfig:
        """A copy of this config that reads only ``collections``."""
        return _replace(self, collections=tuple(collections))


def _local_suggestion(uri: object) -> str:
    """A directory for ``local://`` from a URI of another scheme (a store's file path becomes a directory)."""
    if isinstance(uri, str) and "://" in uri:
        path = uri.split("://", 1)[1]
        if path and not set(path) & set("@:,?"):
            return os.path.splitext(path)[0]
    return "runs/db"


def _replace(config: MongoConfig, **changes: Any) -> MongoConfig:
    values = {name: getattr(config, name) for name, _, _ in _KEYS.values()}
    if tuple(changes.get("collections", config.collections)) == config.collections:
        values["weights"] = config.weights
    values.update(changes)
    return MongoConfig(**values)


def _collection_entries(source: str, entries: list[Any]) -> tuple[tuple[Any, ...], tuple[float, ...]]:
    """COLLECTIONS as (names, weights): each entry a name, or {"name": ..., "weight": ...}."""
    names, weights = [], []
    for entry in entries:
        if isinstance(entry, Mapping):
            extra = sorted(set(entry) - {"name", "weight"})
            weight = entry.get("weight")
            if (
                extra
                or "name" not in entry
                or isinstance(weight, bool)
                or not isinstance(weight, (int, float))
            ):
                raise ConfigError(
                    f'{source}: COLLECTIONS entry {entry!r}: write {{"name": "...", "weight": 0.5}} '
                    "(a weight >= 0: the collection's share of the training tokens)"
                )
            names.append(entry["name"])
            weights.append(float(weight))
        else:
            names.append(entry)
    if weights and len(weights) != len(names):
        raise ConfigError(
            f"{source}: COLLECTIONS gives some collections a weight and not others; give all or none"
        )
    return tuple(names), tuple(weights)


def canonical_filter(query: Mapping[str, Any]) -> str:
    """FILTER as stored and fingerprinted: compact JSON, keys in the order given (an equality match on
    a subdocument depends on it); an empty query is no filter."""
    return json.dumps(query, separators=(",", ":"), ensure_ascii=False) if query else ""


def filter_problem(query: Any, where: str = "") -> str | None:
    """Why ``query`` cannot be a FILTER, or None."""
    if not isinstance(query, Mapping):
        return f"{where or 'it'} must be a JSON object (a MongoDB query), got {type(query).__name__}"
    for key, value in query.items():
        if key in _FILTER_REFUSED:
            return f"{key} runs JavaScript on the server; write the condition with query operators"
        nested = value if isinstance(value, list) else [value]
        for item in nested:
            if isinstance(item, Mapping):
                problem = filter_problem(item, key)
                if problem:
                    return problem
    return None


def config_from_dict(
    data: Mapping[str, Any], env: Mapping[str, str] | None = None, source: str = "config"
) -> MongoConfig:
    """Build a :class:`MongoConfig` from JSON keys, applying the environment override.

    Raises:
        ConfigError: unknown or missing keys, wrong types, invalid values.
    """
    env = os.environ if env is None else env
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a JSON object with keys {', '.join(_KEYS)}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; valid keys are {', '.join(_KEYS)}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name, types, _ = _KEYS[key]
        if not utf8_encodable(json.dumps(value, ensure_ascii=False, default=str)):  # a "\udcff" escape, say
            raise ConfigError(
                f"{source}: {key} holds text that is not UTF-8 (a lone surrogate such as \\udcff)"
            )
        # bool is an int in Python; a JSON true is no timeout.
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            expected = " or ".join(t.__name__ for t in types)
            raise ConfigError(
                f"{source}: {key} must be {expected}; got {type(value).__name__} {_safe_value(key, value)!r}"
            )
        values[name] = tuple(value) if key == "READ_PREFERENCE_TAGS" else value
        if key == "FILTER":
            values["filter"] = canonical_filter(value)
        if key == "COLLECTIONS":
            values["collections"], values["weights"] = _collection_entries(source, value)
    override = env.get(ENV_URI, "").strip()
    if override:
        values["uri"] = override
    for key in _REQUIRED:
        if _KEYS[key][0] not in values:
            raise ConfigError(f"{source}: missing required key {key} ({_KEYS[key][2]})")
    if "uri" not in values:
        raise ConfigError(
            f"{source}: no connection string; set MONGO_CONNECTION_STRING in the file "
            f"or in the environment variable {ENV_URI}"
        )
    try:
        return MongoConfig(**values)
    except ConfigError as exc:
        if override and str(exc).startswith("MONGO_CONNECTION_STRING"):  # not the file's: the environment's
            source = f"{source}, with {ENV_URI} from the environment"
        raise ConfigError(f"{source}: {exc}") from None


def _safe_value(key: str, value: Any) -> Any:
    return redact_uri(value) if key == "MONGO_CONNECTION_STRING" and isinstance(value, str) else value


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> MongoConfig:
    """Read and validate a connection config file.

    Raises:
        ConfigError: the file is missing, not JSON, or not a valid config.
    """
    p = shipped_if_absent(Path(path))
    why = not_a_file(p) if p.exists() else None  # a named pipe would wait for a writer
    if why is not None:
        raise ConfigError(f"config file {str(p)!r}: {why}; pass a JSON file")
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} not found; pass an existing file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        hint = ""
        if p.suffix.lower() in (".yaml", ".yml", ".toml"):
            hint = (
                f"; a connection config is a JSON file (as configs/sample.json), and {p.name} looks like an "
                "experiment file: give that to `dsgpt2 train --config` itself"
            )
        where = f"line {exc.lineno} column {exc.colno}"
        raise ConfigError(f"config file {str(p)!r} is not valid JSON: {exc.msg} at {where}{hint}") from None
    return replace(config_from_dict(data, env=env, source=str(p)), source=str(p))


def redact_uri(uri: str) -> str:
    """``mongodb://user:pw@host/?password=x`` → ``mongodb://user:***@host/?password=***``."""
    out = _USERINFO.sub(
        lambda m: f"{m['scheme'] or ''}{m['user']}:{REDACTED}@" if m["pw"] is not None else m[0], uri
    )
    return _SECRET_OPTIONS.sub(lambda m: m[1] + REDACTED, out)


def uri_shape(uri: str) -> str:
    """The connection string with its password and every option's value replaced by ``***``: what an
    error about the string itself shows (a misspelt secret option is not known to be a secret)."""
    head, sep, query = redact_uri(uri).partition("?")
    return head + sep + re.sub(r"=[^&;]*", "=" + REDACTED, query)


def uri_hosts(uri: str) -> str:
    """The host list of a connection string: ``mongodb://u:p@h1,h2/db`` → ``h1,h2``."""
    if uri.startswith("local://"):
        return uri
    rest = uri.split("://", 1)[-1]
    rest = rest.rsplit("@", 1)[-1] if "@" in rest.split("/", 1)[0] else rest
    return rest.split("/", 1)[0].split("?", 1)[0] or "(in-process)"


def uri_secrets(uri: str) -> list[str]:
    """Every form in which the connection string's secrets could be echoed."""
    found: list[str] = []
    m = _USERINFO.match(uri)
    if m and m["pw"]:
        found += [m["pw"], urllib.parse.unquote(m["pw"])]
    found += [v for _, v in _SECRET_OPTIONS.findall(uri) if v]
    # Longest first, so that a secret containing another one is replaced whole.
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrub(text: str, uri: str) -> str:
    """Replace the secrets of ``uri`` anywhere in ``text``."""
    for secret in uri_secrets(uri):
        text = text.replace(secret, REDACTED)
    return text
