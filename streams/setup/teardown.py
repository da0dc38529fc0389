"""Removing what a run or a prefix left behind: its ledger database, its Kafka topics and its consumer groups
(``streams teardown``, docs/operating-data.md "Leftovers").

A run's names are derived once, here (:func:`run_names`), from the settings it was started with and its run id:
database ``<database>_<run id>``, topics ``<topic prefix><run id>.*``, consumer group ``<app id>-<run id>``; the
harness (``streams run``, ``streams soak``, ``streams bench``) isolates its runs with them and prints the teardown
command (:func:`teardown_command`) when ``--keep`` keeps them.

Nothing shared is removed without asking: a topic selection without a prefix (every ``generation.*`` topic on the
broker), or the database the settings themselves name, is refused (:class:`SharedResourceRefusedError`) unless
``include_shared`` is set.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupIdNotFound
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Int16, Int32, Schema, String

from streams.config import Settings
from streams.errors import SharedResourceRefusedError
from streams.ledger.databases import drop_database
from streams.setup.admin import KafkaAdmin, _raise_for_code, database_name


@dataclass(frozen=True)
class Selection:
    """What a teardown removes: the database named ``database`` (None: none) on the server of the settings'
    URL, every topic whose name starts with ``topic_prefix`` (None: none), and the consumer groups ``groups``."""

    database: str | None
    topic_prefix: str | None
    groups: tuple[str, ...] = ()


@dataclass
class Removed:
    """What a teardown found and removed (or, on a dry run, would remove): names, in the order removed."""

    database: str | None = None
    topics: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)


def run_database_name(database_url: str, run_id: str) -> str:
    """The name of run ``run_id``'s database next to ``database_url``'s: ``<name>_<run id>``, lower case."""
    return f"{database_name(database_url)}_{run_id}".lower()


def run_names(settings: Settings, run_id: str) -> Selection:
    """Run ``run_id``'s database, topic prefix and consumer group on the services of ``settings``."""
    return Selection(
        database=run_database_name(settings.database_url.get_secret_value(), run_id),
        topic_prefix=f"{settings.topic_prefix}{run_id}.",
        groups=(f"{settings.app_id}-{run_id}",),
    )


def teardown_command(selection: Selection) -> str:
    """The ``streams teardown`` command that removes exactly ``selection`` (printed by the harness after a
    ``--keep`` run; it names everything, so it works whatever the environment it is run in)."""
    words = ["streams", "teardown"]
    if selection.database is not None:
        words += ["--database", selection.database]
    if selection.topic_prefix is not None:
        words += ["--topic-prefix", selection.topic_prefix]
    for group in selection.groups:
        words += ["--group", group]
    return shlex.join(words)


def check_selection(settings: Settings, selection: Selection, *, include_shared: bool) -> None:
    """Refuse a selection that reaches the shared names unless ``include_shared``.

    Raises:
        SharedResourceRefusedError: the topic prefix is empty or starts like an unprefixed topic
            (``generation.``), or the database is the one ``settings.database_url`` names.
    """
    if include_shared:
        return
    ledger = database_name(settings.database_url.get_secret_value())
    if selection.topic_prefix is not None and (
        not selection.topic_prefix or selection.topic_prefix.startswith("generation.")
    ):
        raise SharedResourceRefusedError(
            f"teardown of topics {selection.topic_prefix!r}*: refused, that reaches the unprefixed, shared "
            "generation.* topics; give a run id or a prefix, or --include-shared to remove them. Nothing was removed"
        )
    if selection.database is not None and selection.database == ledger:
        raise SharedResourceRefusedError(
            f"teardown of database {selection.database!r}: refused, it is the ledger STREAMS_DATABASE_URL names; "
            "pass --include-shared to drop it. Nothing was removed"
        )


class _DeleteGroupsResponse_v0(Response):  # type: ignore[misc]  # aiokafka ships no type information
    API_KEY = 42
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("results", Array(("group_id", String("utf-8")), ("error_code", Int16))),
    )


class _DeleteGroupsResponse_v1(Response):  # type: ignore[misc]
    API_KEY = 42
    API_VERSION = 1
    SCHEMA = _DeleteGroupsResponse_v0.SCHEMA


class _DeleteGroupsRequest_v0(RequestStruct):  # type: ignore[misc]
    API_KEY = 42
    API_VERSION = 0
    RESPONSE_TYPE = _DeleteGroupsResponse_v0
    SCHEMA = Schema(("groups_names", Array(String("utf-8"))))


class _DeleteGroupsRequest_v1(RequestStruct):  # type: ignore[misc]
    API_KEY = 42
    API_VERSION = 1
    RESPONSE_TYPE = _DeleteGroupsResponse_v1
    SCHEMA = _DeleteGroupsRequest_v0.SCHEMA


_DeleteGroupsStruct: TypeAlias = _DeleteGroupsRequest_v0 | _DeleteGroupsRequest_v1


class DeleteGroupsRequest(Request[_DeleteGroupsStruct]):  # type: ignore[misc]
    """Kafka's DeleteGroups (API key 42, versions 0-1), which aiokafka's admin client does not offer."""

    API_KEY = 42

    def __init__(self, group_ids: list[str]) -> None:
        self._group_ids = group_ids

    def build(self, request_struct_class: type[_DeleteGroupsStruct]) -> _DeleteGroupsStruct:
        return request_struct_class(self._group_ids)


async def _topics_with_prefix(admin: KafkaAdmin, prefix: str) -> list[str]:
    async def request(client: AIOKafkaAdminClient) -> list[str]:
        return sorted(t for t in await client.list_topics() if t.startswith(prefix))

    return await admin.call(f"list topics {prefix}*", request)


async def _existing_groups(admin: KafkaAdmin, wanted: tuple[str, ...]) -> list[str]:
    async def request(client: AIOKafkaAdminClient) -> list[str]:
        known = {g[0] for g in await client.list_consumer_groups()}
        return [g for g in wanted if g in known]

    return await admin.call(f"list consumer groups {list(wanted)}", request)


async def _delete_group(admin: KafkaAdmin, group_id: str) -> bool:
    """Delete consumer group ``group_id`` at its coordinator; False when the broker no longer knows it."""

    async def request(client: AIOKafkaAdminClient) -> bool:
        node = await client.find_coordinator(group_id)
        response: Any = await client._send_request(DeleteGroupsRequest([group_id]), node)
        for name, error_code in response.results:
            if error_code == GroupIdNotFound.errno:
                return False
            _raise_for_code(error_code, f"deleting consumer group {name!r}")
        return True

    return await admin.call(f"delete consumer group {group_id!r}", request)


async def teardown(
    settings: Settings,
    selection: Selection,
    *,
    include_shared: bool = False,
    dry_run: bool = False,
    report: Callable[[str], None] = lambda line: None,
) -> Removed:
    """Remove ``selection``'s consumer groups, topics and database, in that order, calling ``report`` with one
    line per name (``topic <name>``, ``consumer group <name>``, ``database <name>``) as each goes; on
    ``dry_run`` only find them. What does not exist is skipped. The run's workers must have stopped (a group
    with members is refused by the broker: NON_EMPTY_GROUP).

    Raises:
        SharedResourceRefusedError: as :func:`check_selection` (checked before anything is removed).
        KafkaAdminError: a Kafka admin call failed (names removed so far were reported).
        DatabaseConfigError, DatabasePrivilegeError, LedgerUnavailableError: as
            :func:`streams.ledger.databases.drop_database`.
    """
    check_selection(settings, selection, include_shared=include_shared)
    removed = Removed()
    verb = "would remove" if dry_run else "removed"
    async with KafkaAdmin(settings) as admin:
        for group in await _existing_groups(admin, selection.groups):
            if dry_run or await _delete_group(admin, group):
                removed.groups.append(group)
                report(f"{verb} consumer group {group}")
        if selection.topic_prefix is not None:
            topics = await _topics_with_prefix(admin, selection.topic_prefix)
            deleted = topics if dry_run else await admin.delete_topics(topics) if topics else []
            for topic in deleted:
                removed.topics.append(topic)
                report(f"{verb} topic {topic}")
    if selection.database is not None and await drop_database(
        settings.database_url.get_secret_value(), selection.database, dry_run=dry_run
    ):
        removed.database = selection.database
        report(f"{verb} database {selection.database}")
    return removed
