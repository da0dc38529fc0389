"""The provider's API shape, declared (docs/provider-dialects.md): routes, auth header, where each field of an
answer sits, which status words mean which state, the cancel route and the lookup by client reference (or none).

Every declared field is read by the product; a key it would not act on is refused as unknown.

A declaration is a JSON file: a shipped one by name (``streams/remote/dialects/<name>.json``; the default,
``seed-generations``, is the seed's API) or any file by path (``STREAMS_PROVIDER_DIALECT``). :func:`load_dialect`
validates it once (unknown or missing keys, bad paths, status words mapping to no state: :class:`ConfigError`
naming the file and the key) and precomputes every field path into a tuple of keys, so reading an answer walks
dicts and never looks at the declaration's text again.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from streams.errors import ConfigError
from streams.model.states import OperationState

#: The package holding the shipped declarations (``<name>.json``).
DIALECTS_PACKAGE = "streams.remote.dialects"

#: The declaration used when none is named (the seed's API).
DEFAULT_DIALECT = "seed-generations"

#: How the outputs of an answer are shaped: ``objects`` (each a JSON object with a string ``id``) or ``values``
#: (any JSON value, or one value: each becomes ``{"id": "output_<i>", "value": <it>}``).
OUTPUT_SHAPES = frozenset({"objects", "values"})

#: Largest declaration file read (bytes): a declaration is a few kB; a bigger file is not one (a log named by
#: mistake) and is refused before it is read whole.
MAX_DECLARATION_BYTES = 1024 * 1024

#: What a bare ``Prefer: wait`` asks of a provider of the Replicate kind (its documented longest hold, s).
PREFER_WAIT_DEFAULT_S = 60.0

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait(?:=(\d+(?:\.\d+)?))?(?:$|[,;\s])")
_METHODS = frozenset({"POST", "PUT", "PATCH", "GET", "DELETE"})
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_SLASH_ESCAPE = re.compile(r"%(?:2f|5c)", re.IGNORECASE)
_BROKEN_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_HEADER_VALUE = re.compile(r"[\x20-\x7e\t]*")
#: Headers of a create call the client sets itself, never a declaration (lower case): the body is JSON, its framing
#: the sender's, the host the base URL's.
CLIENT_HEADERS = frozenset({"content-type", "content-length", "transfer-encoding", "host", "connection"})

#: A field path: the keys from the answer's top object down to the value; ``()`` = not in this API's answers.
FieldPath = tuple[str, ...]

_ANSWER_KEYS = (
    "job_id",
    "status",
    "outputs",
    "outputs_shape",
    "error",
    "error_code",
    "error_message",
    "error_job_id",
    "poll_after_ms",
    "completed_at",
    "created_at",
    "expires_at",
    "charge",
    "refund",
)
#: Answer fields every declaration must locate (the rest may be ``""``: absent from this API).
_REQUIRED_ANSWER = frozenset({"job_id", "status", "outputs"})
_TOP_KEYS = frozenset(
    {"name", "description", "create", "get", "cancel", "lookup", "auth", "request", "answer", "statuses"}
)
_LOOKUP_KEYS = frozenset({"path", "reference_param", "jobs"})


def read_path(body: Any, path: FieldPath) -> Any:
    """The value at ``path`` in ``body`` (nested JSON objects), None when a step is missing or not an object
    (and for the empty path)."""
    if not path:
        return None
    value = body
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


@dataclass(frozen=True, slots=True)
class AnswerFields:
    """Where each field sits in the provider's answers (:data:`FieldPath` each; ``()``: absent from this API)."""

    job_id: FieldPath
    status: FieldPath
    outputs: FieldPath
    outputs_shape: str
    error: FieldPath
    error_code: FieldPath
    error_message: FieldPath
    error_job_id: FieldPath
    poll_after_ms: FieldPath
    completed_at: FieldPath
    created_at: FieldPath
    expires_at: FieldPath
    charge: FieldPath
    refund: FieldPath


@dataclass(frozen=True, slots=True)
class LookupRoute:
    """The provider's list of jobs by client reference: ``GET <path>?<reference_param>=<operation id>``, the jobs
    at ``jobs`` in its answer, each read with the declaration's ``answer.job_id``, ``status`` and ``created_at``."""

    path: str
    reference_param: str
    jobs: FieldPath


@dataclass(frozen=True, slots=True)
class ProviderDialect:
    """One provider API shape, validated (:func:`load_dialect`).

    Paths are relative to ``STREAMS_REMOTE_BASE_URL``; ``get_path`` and ``cancel_path`` hold ``{job_id}`` where
    the percent-encoded job id goes. ``create_headers`` are sent with every create call (e.g. ``Prefer: wait``).
    ``model_field`` is the top-level key a default model goes into, ``reference_path`` where the operation id is
    added (one or two keys); the application's request is otherwise sent as written. ``lookup`` is the list of
    jobs by client reference, None when the API offers none (then ``lookup_enabled`` is refused and an
    ``uncertain`` operation waits for an operator's decision). ``statuses`` maps each status word (lower case) to
    the operation state; a word not in it is an unknown status.
    """

    name: str
    description: str
    create_method: str
    create_path: str
    create_headers: tuple[tuple[str, str], ...]
    get_path: str
    cancel_method: str
    cancel_path: str
    auth_header: str
    auth_scheme: str
    model_field: str
    reference_path: FieldPath
    lookup: LookupRoute | None
    answer: AnswerFields
    statuses: dict[str, OperationState]
    source: str

    def state_for(self, word: str) -> OperationState | None:
        """The operation state of status ``word`` (compared stripped, lower case), None when unknown."""
        return self.statuses.get(word.strip().lower())

    def prefer_wait_s(self) -> float | None:
        """Seconds a create call asks the provider to hold its answer (``Prefer: wait=<s>``, RFC 7240), None
        without that preference; a bare ``wait`` counts as :data:`PREFER_WAIT_DEFAULT_S`."""
        for name, value in self.create_headers:
            if name.lower() == "prefer":
                match = _PREFER_WAIT.search(value)
                if match is not None:
                    return float(match.group(1)) if match.group(1) else PREFER_WAIT_DEFAULT_S
        return None


def shipped_dialects() -> list[str]:
    """Names of the declarations shipped with the package, sorted."""
    folder = resources.files(DIALECTS_PACKAGE)
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def _refuse(source: str, message: str) -> ConfigError:
    return ConfigError(f"STREAMS_PROVIDER_DIALECT: declaration {source}: {message}")


def _object(source: str, data: Any, where: str, keys: frozenset[str], required: frozenset[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _refuse(source, f"{where} must be a JSON object")
    unknown = sorted(set(data) - keys)
    if unknown:
        raise _refuse(source, f"unknown key(s) {unknown} in {where} (known: {sorted(keys)})")
    missing = sorted(required - set(data))
    if missing:
        raise _refuse(source, f"missing key(s) {missing} in {where}")
    return data


def _text(source: str, data: dict[str, Any], key: str, where: str, pattern: re.Pattern[str] | None = None) -> str:
    value = data[key]
    if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
        raise _refuse(
            source,
            f"{where}.{key} is {value!r}: expected text" + (" of the form " + pattern.pattern if pattern else ""),
        )
    return value


def _path(source: str, text: str, where: str) -> FieldPath:
    if text == "":
        return ()
    keys = tuple(text.split("."))
    if not all(_KEY.fullmatch(k) for k in keys) or len(keys) > 4:
        raise _refuse(source, f'{where} is {text!r}: expected up to 4 dot-separated keys, or "" for none')
    return keys


def route_problem(path: str) -> str | None:
    """What makes route template ``path`` unusable, None when nothing does: a placeholder other than
    ``{job_id}``, a ``.`` or ``..`` segment (plain or percent-encoded: httpx resolves it, so the call would leave
    ``STREAMS_REMOTE_BASE_URL``'s path), an empty segment (``//`` at the start names a host, which httpx drops), a
    fragment, a space or control character, a ``\\`` or an encoded ``/`` or ``\\`` (``%2F``, ``%5C``: servers that
    read them as ``/`` resolve the dot segments they make), or a ``%`` that starts no escape."""
    route, _, query = path.partition("?")
    if "{" in path.replace("{job_id}", "") or "}" in path.replace("{job_id}", ""):
        return "the only placeholder a route may hold is {job_id}"
    if "{job_id}" in query:
        return "{job_id} must be in the path, not the query"
    segments = route.split("/")[1:]
    if any(seg.lower().replace("%2e", ".") in (".", "..") for seg in segments):
        return "a '.' or '..' segment would leave STREAMS_REMOTE_BASE_URL's path"
    if "" in segments[:-1]:
        return "an empty segment ('//') is not a route"
    if "#" in path or any(c.isspace() or not c.isprintable() for c in path):
        return "a route holds no fragment ('#'), space or control character"
    if "\\" in path or _SLASH_ESCAPE.search(route):
        return "a '\\', '%2F' or '%5C' in a route is read as '/' by some servers: write the segments with '/'"
    if _BROKEN_ESCAPE.search(path):
        return "a '%' in a route starts an escape of two hex digits"
    return None


def _route(source: str, data: Any, where: str, *, method: bool, job_id: bool) -> tuple[str, str]:
    keys = {"path"} | ({"method"} if method else set())
    route = _object(
        source, data, where, frozenset(keys | ({"headers"} if where == "create" else set())), frozenset(keys)
    )
    path = _text(source, route, "path", where)
    if not path.startswith("/") or path.count("{job_id}") != (1 if job_id else 0):
        need = "with {job_id} once" if job_id else "without {job_id}"
        raise _refuse(source, f"{where}.path is {path!r}: expected an absolute path {need}")
    problem = route_problem(path)
    if problem is not None:
        raise _refuse(source, f"{where}.path is {path!r}: {problem}")
    verb = _text(source, route, "method", where).upper() if method else "GET"
    if verb not in _METHODS:
        raise _refuse(source, f"{where}.method is {verb!r}: expected one of {sorted(_METHODS)}")
    return verb, path


def parse_dialect(data: Any, source: str) -> ProviderDialect:
    """A declaration's parsed JSON made a :class:`ProviderDialect` (``source`` names it in errors).

    Raises:
        ConfigError: an unknown or missing key, a value of the wrong kind, a route without (or, for create, with)
            ``{job_id}`` or with it twice, a route with another placeholder, a ``.``/``..``/empty segment, a
            fragment or a space, a status mapping to no operation state or a status word declared twice (after
            stripping and lower-casing), an unknown output shape, a create header the client sets itself or cannot
            send (:func:`_create_headers`), a ``lookup`` neither ``null`` nor a route without ``{job_id}`` with a
            query parameter name and a jobs path.
    """
    top = _object(source, data, "the declaration", _TOP_KEYS, _TOP_KEYS - {"description"})
    name = _text(source, top, "name", "the declaration", _NAME)
    create_method, create_path = _route(source, top["create"], "create", method=True, job_id=False)
    _, get_path = _route(source, top["get"], "get", method=False, job_id=True)
    cancel_method, cancel_path = _route(source, top["cancel"], "cancel", method=True, job_id=True)
    auth = _object(source, top["auth"], "auth", frozenset({"header", "scheme"}), frozenset({"header", "scheme"}))
    auth_header = _text(source, auth, "header", "auth", _HEADER)
    if auth_header.lower() in CLIENT_HEADERS:
        raise _refuse(source, f"auth.header is {auth_header!r}: set by the client itself, it cannot carry the API key")
    headers = _create_headers(source, top["create"].get("headers", {}), auth_header)
    auth_scheme = _text(source, auth, "scheme", "auth", re.compile(r"[A-Za-z0-9._~+/-]*"))
    request_keys = frozenset({"model_field", "reference_field"})
    request = _object(source, top["request"], "request", request_keys, request_keys)
    model_field = _text(source, request, "model_field", "request", _KEY)
    reference_path = _path(source, _text(source, request, "reference_field", "request"), "request.reference_field")
    if not 1 <= len(reference_path) <= 2:
        raise _refuse(source, "request.reference_field must be one key or two (object.key)")
    answer = _object(source, top["answer"], "answer", frozenset(_ANSWER_KEYS), frozenset(_ANSWER_KEYS))
    shape = _text(source, answer, "outputs_shape", "answer")
    if shape not in OUTPUT_SHAPES:
        raise _refuse(source, f"answer.outputs_shape is {shape!r}: expected one of {sorted(OUTPUT_SHAPES)}")
    paths = {
        k: _path(source, _text(source, answer, k, "answer"), f"answer.{k}")
        for k in _ANSWER_KEYS
        if k != "outputs_shape"
    }
    empty = sorted(k for k in _REQUIRED_ANSWER if not paths[k])
    if empty:
        raise _refuse(source, f'answer.{empty[0]} must name where it sits (it cannot be "")')
    statuses_data = top["statuses"]
    if not isinstance(statuses_data, dict) or not statuses_data:
        raise _refuse(source, "statuses must be a non-empty object of status word -> operation state")
    known_states = {s.value: s for s in OperationState}
    statuses: dict[str, OperationState] = {}
    for word, state in statuses_data.items():
        if state not in ("queued", "running", "succeeded", "failed", "canceled"):
            raise _refuse(
                source, f"statuses.{word} is {state!r}: expected queued, running, succeeded, failed or canceled"
            )
        key = word.strip().lower()  # answers' words are compared so (ProviderDialect.state_for)
        if not key:
            raise _refuse(source, f"statuses holds an empty status word ({word!r})")
        if key in statuses:
            raise _refuse(
                source,
                f"statuses.{word} is the word {key!r} again (words are compared stripped and in lower case): "
                "declare each status word once",
            )
        statuses[key] = known_states[state]
    lookup = _lookup(source, top["lookup"])
    description = _text(source, top, "description", "the declaration") if "description" in top else ""
    return ProviderDialect(
        name=name,
        description=description,
        create_method=create_method,
        create_path=create_path,
        create_headers=tuple(headers.items()),
        get_path=get_path,
        cancel_method=cancel_method,
        cancel_path=cancel_path,
        auth_header=auth_header,
        auth_scheme=auth_scheme,
        model_field=model_field,
        reference_path=reference_path,
        lookup=lookup,
        answer=AnswerFields(outputs_shape=shape, **paths),
        statuses=statuses,
        source=source,
    )


def _create_headers(source: str, data: Any, auth_header: str) -> dict[str, str]:
    """The ``create.headers`` declaration: header names (RFC 9110 tokens) to values of printable ASCII, space and
    tab (what httpx can send); never one the client sets itself (:data:`CLIENT_HEADERS`, the auth header)."""
    if not isinstance(data, dict):
        raise _refuse(source, "create.headers must be an object of header names to text values")
    for name, value in data.items():
        if not _HEADER.fullmatch(name) or not isinstance(value, str) or not _HEADER_VALUE.fullmatch(value):
            raise _refuse(
                source,
                f"create.headers.{name}: expected a header name (RFC 9110 token) and a text value of printable "
                "ASCII, space or tab",
            )
        if name.lower() in CLIENT_HEADERS or name.lower() == auth_header.lower():
            raise _refuse(
                source,
                f"create.headers.{name}: set by the client itself (the body's type and framing, the host, the "
                "auth header): remove it",
            )
    return data


def _lookup(source: str, data: Any) -> LookupRoute | None:
    """The ``lookup`` declaration: ``null`` (the API offers none) or ``{"path", "reference_param", "jobs"}``."""
    if data is None:
        return None
    lookup = _object(source, data, "lookup", _LOOKUP_KEYS, _LOOKUP_KEYS)
    _, path = _route(source, {"path": lookup["path"]}, "lookup", method=False, job_id=False)
    if "?" in path:
        raise _refuse(source, f"lookup.path is {path!r}: the query is built from lookup.reference_param")
    param = _text(source, lookup, "reference_param", "lookup", _KEY)
    jobs = _path(source, _text(source, lookup, "jobs", "lookup"), "lookup.jobs")
    if not jobs:
        raise _refuse(source, 'lookup.jobs must name where the list of jobs sits (it cannot be "")')
    return LookupRoute(path=path, reference_param=param, jobs=jobs)


@functools.lru_cache(maxsize=16)
def load_dialect(name_or_path: str = DEFAULT_DIALECT) -> ProviderDialect:
    """The declaration ``name_or_path`` names: a shipped one (:func:`shipped_dialects`) or a JSON file (a value
    with ``/`` or ending ``.json``), validated by :func:`parse_dialect`; loaded once per value.

    Raises:
        ConfigError: neither a shipped name nor a readable JSON file (larger than :data:`MAX_DECLARATION_BYTES`, not
            UTF-8, not JSON, nested too deep), or the declaration is invalid.
    """
    if "/" in name_or_path or name_or_path.endswith(".json"):
        source = name_or_path
        try:
            with Path(name_or_path).open("rb") as file:
                raw = file.read(MAX_DECLARATION_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"STREAMS_PROVIDER_DIALECT: cannot read the declaration {name_or_path} ({exc.strerror}); "
                f"set it to a readable JSON file or one of {shipped_dialects()}"
            ) from None
        if len(raw) > MAX_DECLARATION_BYTES:
            raise _refuse(source, f"larger than {MAX_DECLARATION_BYTES} bytes: not a declaration")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _refuse(source, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    else:
        if name_or_path not in shipped_dialects():
            raise ConfigError(
                f"STREAMS_PROVIDER_DIALECT is {name_or_path!r}: no such declaration; set it to one of "
                f"{shipped_dialects()} or to the path of a JSON file"
            )
        text = resources.files(DIALECTS_PACKAGE).joinpath(f"{name_or_path}.json").read_text(encoding="utf-8")
        source = f"{name_or_path} (shipped)"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _refuse(source, f"not JSON ({exc})") from None
    except RecursionError:  # the parser's recursion limit: no declaration nests more than a few levels
        raise _refuse(source, "not a declaration: JSON nested deeper than the parser's recursion limit") from None
    return parse_dialect(data, source)
