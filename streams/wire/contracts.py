"""JSON Schema contracts of every topic's value (``schemas/<topic>.json``, installed as the package
``streams.schemas``) and the dead-letter envelope.

:func:`decode` turns raw Kafka bytes into a validated dict or raises :class:`InvalidEventError` with a reason
code; :func:`dead_letter` builds the envelope that carries the reason and the original bytes to the
dead-letter topic.

Values are read with :mod:`streams.wire.exactjson` (every number exact: ``int`` or ``Decimal``); an integral
``Decimal`` such as ``5.0`` is an ``integer`` for the schemas, as JSON Schema says (2020-12, validation 6.1.1).
Every ``format`` keyword is enforced (jsonschema checks ``format`` only when given a FormatChecker, and some
formats only with extra packages: ``date-time`` needs ``rfc3339-validator``): a schema that uses a format the
installed checker cannot enforce is refused when it is loaded (:func:`compile_schema`).

Two engines read the same schema files. jsonschema (Python) is the reference: it checks the schemas, and it
names the failing field of a refused value. jsonschema-rs (Rust) answers the question every consumed event
asks, valid or not, in about 1 µs where jsonschema takes 30-50 µs. Only a value it refuses, or holds a number
with a fraction or an exponent, goes to jsonschema, which then gives the reason; when the two disagree on a
value, jsonschema's verdict stands
(tests/unit/test_contracts_engines.py compares them on valid and invalid values of every topic).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import jsonschema
import jsonschema_rs

from streams.errors import ConfigError, InvalidEventError, JsonValueError, MissingResourceError
from streams.wire import exactjson, iri

#: The package that holds the schema files (``schemas/`` of the repository, see ``pyproject.toml``).
SCHEMA_PACKAGE = "streams.schemas"

#: Topic (without prefix) -> schema file name.
SCHEMA_FILES = {
    "generation.submissions": "generation.submissions.json",
    "generation.polls": "generation.polls.json",
    "generation.outputs.delivered": "generation.outputs.delivered.json",
    "generation.transitions": "generation.transitions.json",
    "generation.dead-letter": "generation.dead-letter.json",
    "generation.cancellations": "generation.cancellations.json",
}

_BASE = jsonschema.Draft202012Validator


#: Formats whose checks match a pattern up to ``$``, which also matches before a final newline: jsonschema took
#: ``"https://example.org/\n"`` for a ``uri``. No value of these formats holds a line break.
NO_FINAL_NEWLINE_FORMATS = ("date-time", "time", "hostname", "uri", "uri-reference")


def _without_final_newline(check: Callable[[object], bool]) -> Callable[[object], bool]:
    def checked(instance: object) -> bool:
        return not (isinstance(instance, str) and instance.endswith("\n")) and check(instance)

    return checked


def _format_checker() -> jsonschema.FormatChecker:
    """Draft 2020-12's format checks with the installed packages, plus ``iri`` and ``iri-reference``
    (:mod:`streams.wire.iri`: jsonschema checks them only with ``rfc3987-syntax``, not installed), and a final
    newline refused where jsonschema's check lets it through (:data:`NO_FINAL_NEWLINE_FORMATS`); a copy, so
    jsonschema's own checker stays as it is for other users in the process."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(_BASE.FORMAT_CHECKER.checkers)
    for fmt in NO_FINAL_NEWLINE_FORMATS:
        if fmt in checker.checkers:  # missing without its package: compile_schema refuses a schema that uses it
            check, raises = checker.checkers[fmt]
            checker.checkers[fmt] = (_without_final_newline(check), raises)
    checker.checks("iri")(iri.is_iri)
    checker.checks("iri-reference")(iri.is_iri_reference)
    return checker


#: The format checker of every schema: each format of JSON Schema 2020-12 (``format_conforms`` refuses to answer
#: for one it cannot check).
FORMAT_CHECKER: jsonschema.FormatChecker = _format_checker()


def _is_integer(checker: Any, instance: Any) -> bool:
    if isinstance(instance, Decimal):
        return instance.is_finite() and instance == instance.to_integral_value()
    return bool(_BASE.TYPE_CHECKER.is_type(instance, "integer"))


#: Draft 2020-12 with integral Decimals counted as integers.
_Validator = jsonschema.validators.extend(
    _BASE, type_checker=_BASE.TYPE_CHECKER.redefine("integer", _is_integer), format_checker=FORMAT_CHECKER
)


def formats_used(schema: Any) -> Iterator[tuple[str, str]]:
    """Each ``format`` keyword in ``schema`` as ``(location, format name)``; location like ``properties/at``."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("format"), str):
                yield where or "(root)", node["format"]
            for key, value in node.items():
                if key in ("enum", "const", "default", "examples") or (key == "format" and isinstance(value, str)):
                    continue  # data, or the keyword itself
                stack.append((f"{where}/{key}" if where else key, value))
        elif isinstance(node, list):
            stack.extend((f"{where}/{i}", item) for i, item in enumerate(node))


def compile_schema(schema: dict[str, Any], name: str) -> jsonschema.protocols.Validator:
    """A validator for ``schema`` that enforces every ``format`` it uses.

    Raises:
        ConfigError: the schema is invalid, or uses a format the installed checker does not enforce (install
            the project's dependencies, which include jsonschema's format packages; an unknown format name is a
            typo in the schema).
    """
    try:
        _Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConfigError(f"JSON Schema {name} is invalid: {exc.message}") from exc
    for where, fmt in formats_used(schema):
        if fmt not in FORMAT_CHECKER.checkers:
            raise ConfigError(
                f"JSON Schema {name} uses format {fmt!r} at {where}, which is not enforced: jsonschema checks it "
                "only with its format packages (dependencies of this project: reinstall it), or the name is unknown"
            )
    v: jsonschema.protocols.Validator = _Validator(schema, format_checker=FORMAT_CHECKER)
    return v


def schema_dir() -> Traversable:
    """The installed schema files (an :mod:`importlib.resources` traversable).

    Raises:
        MissingResourceError: the package :data:`SCHEMA_PACKAGE` is not installed.
    """
    try:
        return resources.files(SCHEMA_PACKAGE)
    except ModuleNotFoundError as exc:
        raise MissingResourceError(
            f"package {SCHEMA_PACKAGE} (the topics' JSON Schemas) is not installed: reinstall generation-streams"
        ) from exc


@functools.cache
def validator(topic: str) -> jsonschema.protocols.Validator:
    """The compiled Draft 2020-12 validator for ``topic`` (unprefixed name), every format enforced.

    Raises:
        ConfigError: no schema file for the topic, or the schema itself is invalid or not enforceable.
        MissingResourceError: the topic's schema file is not installed.
    """
    try:
        name = SCHEMA_FILES[topic]
    except KeyError:
        raise ConfigError(f"no JSON Schema registered for topic {topic!r}") from None
    try:
        schema = exactjson.loads(schema_dir().joinpath(name).read_bytes())
    except FileNotFoundError as exc:
        raise MissingResourceError(
            f"JSON Schema {name} of topic {topic} is missing from package {SCHEMA_PACKAGE}: "
            "reinstall generation-streams"
        ) from exc
    return compile_schema(schema, name)


@functools.cache
def fast_validator(topic: str) -> jsonschema_rs.Validator:
    """jsonschema-rs's validator of ``topic``'s schema (the same file as :func:`validator`), formats enforced.

    Raises:
        ConfigError, MissingResourceError: as :func:`validator`, which checks the schema first.
    """
    validator(topic)  # the reference engine checks the schema and its formats first
    schema = exactjson.loads(schema_dir().joinpath(SCHEMA_FILES[topic]).read_bytes())
    return jsonschema_rs.validator_for(schema, validate_formats=True)


def schema_error(topic: str, value: Any) -> str | None:
    """Why ``value`` breaks ``topic``'s schema (``at <field path>: <message>``, the first failing field), or None
    when it conforms. jsonschema-rs decides conformance; a value it refuses is explained by jsonschema, whose
    verdict stands when the two disagree, and it alone decides a value holding a fraction or an exponent
    (jsonschema-rs refuses :class:`~streams.wire.exactjson.JsonDecimal`, a ``Decimal`` subclass, as a type)."""
    try:
        if fast_validator(topic).is_valid(value):
            return None
    except ValueError:  # a type jsonschema-rs does not take (a JsonDecimal: a fraction or an exponent)
        pass
    errors = sorted(validator(topic).iter_errors(value), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    first = errors[0]
    where = "/".join(str(p) for p in first.absolute_path) or "(root)"
    return f"at {where}: {explain(first)}"


#: Top-level members whose values are the applications' or the provider's payload (prompts, outputs): a schema
#: error inside them describes a refused value by its kind and size, never by its text.
PAYLOAD_MEMBERS = frozenset({"request", "source", "output", "outputs"})

#: Most characters of a refused value's text that a schema error shows (outside :data:`PAYLOAD_MEMBERS`, and
#: only scalars), and most characters of the whole explanation.
MAX_SHOWN_VALUE_CHARS = 80
MAX_EXPLANATION_CHARS = 300


def described(value: Any) -> str:
    """What ``value`` is without its content: ``a string of 12 characters``, ``an object of 3 members``,
    ``an array of 2 items``, ``a number of 40 digits``, or ``true``/``false``/``null``."""
    if isinstance(value, str):
        return f"a string of {len(value)} character{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        return f"an object of {len(value)} member{'s' * (len(value) != 1)}"
    if isinstance(value, list | tuple):
        return f"an array of {len(value)} item{'s' * (len(value) != 1)}"
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return f"a number of {len(str(value))} characters"


def _shown(value: Any, in_payload: bool) -> str | None:
    """The text jsonschema writes for ``value`` when a message may show it, else None: a scalar outside the
    payload (a string only outside it) whose text is at most :data:`MAX_SHOWN_VALUE_CHARS` characters."""
    if isinstance(value, dict | list | tuple) or (in_payload and isinstance(value, str)):
        return None
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_VALUE_CHARS else None


def explain(error: jsonschema.exceptions.ValidationError) -> str:
    """``error``'s message for a person, with no payload in it and at most :data:`MAX_EXPLANATION_CHARS`
    characters: the refused value is named by jsonschema's text only when :func:`_shown` allows it, else by
    :func:`described` (its kind and size; a prompt never reaches a log line or a dead letter's ``error``). A field
    the schema forbids (``{"not": {}}``: nothing is valid there) is explained by that field's ``description``
    (which says why it may not be given) instead of jsonschema's ``... should not be valid under {}``."""
    if error.validator == "not" and error.validator_value == {}:
        description = error.schema.get("description") if isinstance(error.schema, dict) else None
        return str(description) if description else "this field may not be given"
    path = list(error.absolute_path)
    in_payload = bool(path) and path[0] in PAYLOAD_MEMBERS
    message = str(error.message)
    instance_text = repr(error.instance)
    if _shown(error.instance, in_payload) is None:
        if message.startswith(instance_text):
            message = described(error.instance) + message[len(instance_text) :]
        elif in_payload and error.validator in ("additionalProperties", "unevaluatedProperties", "propertyNames"):
            message = f"{described(error.instance)} with members the schema does not allow"
        elif instance_text in message:
            message = message.replace(instance_text, described(error.instance))
    if len(message) > MAX_EXPLANATION_CHARS:
        message = message[: MAX_EXPLANATION_CHARS - 3] + "..."
    return message


def format_conforms(value: Any, fmt: str) -> bool:
    """True when ``value`` satisfies JSON Schema format ``fmt`` (e.g. ``date-time``: RFC 3339, offset required).

    Raises:
        ConfigError: the installed packages cannot check ``fmt`` (jsonschema would accept anything).
    """
    if fmt not in FORMAT_CHECKER.checkers:
        raise ConfigError(
            f"format {fmt!r} cannot be checked: jsonschema's format packages are missing (dependencies of this "
            "project: reinstall it)"
        )
    return bool(FORMAT_CHECKER.conforms(value, fmt))


def decode(topic: str, raw: bytes | None, max_value_bytes: int) -> dict[str, Any]:
    """Parse and validate one Kafka value for ``topic``, every number exact (:mod:`streams.wire.exactjson`).

    Returns the value as a dict. Raises :class:`InvalidEventError` with ``reason`` ``oversized`` (more than
    ``max_value_bytes`` bytes), ``not_json`` (not UTF-8 JSON, a tombstone, ``NaN``/``Infinity`` or a key
    repeated in one object, naming the field), ``number_out_of_range`` (a number too long to carry exactly,
    naming the field), ``too_deep`` (nested more than :data:`~streams.wire.exactjson.MAX_DEPTH` levels) or
    ``schema`` (the message names the first failing field).
    """
    if raw is None:
        raise InvalidEventError("not_json", "value is empty (tombstone)")
    if len(raw) > max_value_bytes:
        raise InvalidEventError("oversized", f"value is {len(raw)} bytes, over the {max_value_bytes}-byte limit")
    try:
        value = exactjson.loads(raw, unique_keys=True)
    except JsonValueError as exc:
        raise InvalidEventError(exc.reason, f"{topic} value: {exc}") from exc
    error = schema_error(topic, value)
    if error is not None:
        raise InvalidEventError("schema", f"{topic} schema: {error}")
    assert isinstance(value, dict)  # the schemas all require an object
    return value


def validate(topic: str, value: dict[str, Any]) -> None:
    """Check an outgoing value against its topic's schema.

    Raises:
        InvalidEventError: reason ``schema``; a bug in the producer, never sent.
    """
    error = jsonschema.exceptions.best_match(validator(topic).iter_errors(value))
    if error is not None:
        raise InvalidEventError("schema", f"{topic} schema: {explain(error)}")


def dead_letter(
    *,
    source_topic: str,
    partition: int | None,
    offset: int | None,
    key: bytes | None,
    original: bytes | None,
    error: InvalidEventError,
    worker: str,
    max_original_bytes: int = 512 * 1024,
) -> dict[str, Any]:
    """The dead-letter envelope (``schemas/generation.dead-letter.json``) for one rejected input.

    The original bytes travel base64-encoded, cut at ``max_original_bytes`` so the envelope always fits in a
    Kafka record (``original_size`` and ``original_sha256`` describe the whole value, ``original_truncated``
    says whether it was cut).
    """
    data = original or b""
    return {
        "source_topic": source_topic,
        "partition": partition,
        "offset": offset,
        "key_base64": base64.b64encode(key).decode() if key is not None else None,
        "reason": error.reason,
        "error": str(error),
        "original_base64": base64.b64encode(data[:max_original_bytes]).decode(),
        "original_size": len(data),
        "original_truncated": len(data) > max_original_bytes,
        "original_sha256": hashlib.sha256(data).hexdigest(),
        "failed_at_ms": int(time.time() * 1000),
        "worker": worker,
    }
