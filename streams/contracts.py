"""JSON Schema contracts of every topic's value (``schemas/<topic>.json``, installed as the package
``streams.schemas``) and the dead-letter envelope.

:func:`decode` turns raw Kafka bytes into a validated dict or raises :class:`InvalidEventError` with a reason
code; :func:`dead_letter` builds the envelope that carries the reason and the original bytes to the
dead-letter topic.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import time
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import jsonschema
import orjson

from streams.errors import ConfigError, InvalidEventError, MissingResourceError

#: The package that holds the schema files (``schemas/`` of the repository, see ``pyproject.toml``).
SCHEMA_PACKAGE = "streams.schemas"

#: Topic (without prefix) -> schema file name.
SCHEMA_FILES = {
    "generation.submissions": "generation.submissions.json",
    "generation.polls": "generation.polls.json",
    "generation.outputs.delivered": "generation.outputs.delivered.json",
    "generation.transitions": "generation.transitions.json",
    "generation.dead-letter": "generation.dead-letter.json",
}


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
    """The compiled Draft 2020-12 validator for ``topic`` (unprefixed name).

    Raises:
        ConfigError: no schema file for the topic, or the schema itself is invalid.
        MissingResourceError: the topic's schema file is not installed.
    """
    try:
        name = SCHEMA_FILES[topic]
    except KeyError:
        raise ConfigError(f"no JSON Schema registered for topic {topic!r}") from None
    try:
        schema = orjson.loads(schema_dir().joinpath(name).read_bytes())
    except FileNotFoundError as exc:
        raise MissingResourceError(
            f"JSON Schema {name} of topic {topic} is missing from package {SCHEMA_PACKAGE}: "
            "reinstall generation-streams"
        ) from exc
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    v: jsonschema.protocols.Validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return v


def decode(topic: str, raw: bytes | None, max_value_bytes: int) -> dict[str, Any]:
    """Parse and validate one Kafka value for ``topic``.

    Returns the value as a dict. Raises :class:`InvalidEventError` with ``reason`` ``oversized`` (more than
    ``max_value_bytes`` bytes), ``not_json`` (not UTF-8 JSON, or a tombstone) or ``schema`` (the message
    names the first failing field).
    """
    if raw is None:
        raise InvalidEventError("not_json", "value is empty (tombstone)")
    if len(raw) > max_value_bytes:
        raise InvalidEventError("oversized", f"value is {len(raw)} bytes, over the {max_value_bytes}-byte limit")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidEventError("not_json", f"value is not JSON: {exc}") from exc
    errors = sorted(validator(topic).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "(root)"
        raise InvalidEventError("schema", f"{topic} schema: at {where}: {first.message}")
    assert isinstance(value, dict)  # the schemas all require an object
    return value


def validate(topic: str, value: dict[str, Any]) -> None:
    """Check an outgoing value against its topic's schema.

    Raises:
        InvalidEventError: reason ``schema``; a bug in the producer, never sent.
    """
    error = jsonschema.exceptions.best_match(validator(topic).iter_errors(value))
    if error is not None:
        raise InvalidEventError("schema", f"{topic} schema: {error.message}")


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
