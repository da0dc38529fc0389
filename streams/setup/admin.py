"""Set-up tasks: apply migrations (yoyo-migrations), Kafka admin calls (topics, consumer groups).

Migrations are the plain SQL files in ``migrations/`` (installed as the package ``streams.migrations``); yoyo
applies them in order and records each in its ``_yoyo_migration`` table, under a lock, so concurrent callers
are safe.

Every Kafka admin call goes through :class:`KafkaAdmin`, which retries the broker's retriable errors (tenacity)
within a deadline. A broker that has just started answers on its port before it can coordinate a consumer
group: its internal ``__consumer_offsets`` topic is created on the first coordinator look-up, and until its
partitions are loaded, look-ups and describes answer "coordinator not available" or "load in progress". aiokafka's
admin client raises those at once, and reports per-topic errors of create/delete in the response without
raising; both are handled here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    CoordinatorLoadInProgressError,
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.structs import TopicPartition
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    retry_if_result,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
    wait_random,
)
from yoyo import get_backend, read_migrations
from yoyo.migrations import MigrationList

from streams.config import Settings, mask_url
from streams.errors import (
    KafkaAdminError,
    LedgerUnavailableError,
    MissingResourceError,
    SharedResourceRefusedError,
    StreamsError,
    TopicLayoutError,
)
from streams.kafka_security import client_kwargs, raise_for_security
from streams.ledger.pool import connect_config_error, database_address, diagnose_connect, privilege_error
from streams.outages import is_outage

log = logging.getLogger(__name__)

#: The package that holds the migrations (``migrations/`` of the repository, see ``pyproject.toml``).
MIGRATIONS_PACKAGE = "streams.migrations"


def yoyo_url(database_url: str) -> str:
    """The yoyo backend URL (psycopg 3 driver) for a ``postgresql://`` URL."""
    scheme, sep, rest = database_url.partition("://")
    if not sep or not scheme.startswith("postgres"):
        raise ValueError(f"not a PostgreSQL URL: {mask_url(database_url)!r}")
    return f"postgresql+psycopg://{rest}"


def sql_migrations(directory: Path) -> MigrationList:
    """The SQL migrations (``*.sql``, rollbacks paired by yoyo) of ``directory``.

    Raises:
        MissingResourceError: the directory holds none; an installation without its migrations must not
            report a database as up to date.
    """
    found = read_migrations(str(directory))
    migrations = MigrationList([m for m in found if m.path.endswith(".sql")], found.post_apply)
    if not migrations:
        raise MissingResourceError(
            f"no migration (*.sql) found in {directory}: the installed package {MIGRATIONS_PACKAGE} is incomplete; "
            "reinstall generation-streams. Nothing was applied."
        )
    return migrations


def migrate(database_url: str) -> list[str]:
    """Apply pending migrations of :data:`MIGRATIONS_PACKAGE`; returns the ids applied (empty when up to date).

    Raises:
        MissingResourceError: the package is not installed or holds no migration (nothing is applied).
        DatabaseConfigError: PostgreSQL refused the login, has no such database, or the URL does not parse.
        LedgerUnavailableError: PostgreSQL did not accept the connection for another reason (nothing applied).
        DatabasePrivilegeError: the role may not take the migrations' lock or run one (not the database's owner).
    """
    try:
        package = resources.files(MIGRATIONS_PACKAGE)
    except ModuleNotFoundError as exc:
        raise MissingResourceError(
            f"package {MIGRATIONS_PACKAGE} is not installed: reinstall generation-streams. Nothing was applied."
        ) from exc
    with resources.as_file(package) as directory:
        migrations = sql_migrations(directory)
        try:
            backend = get_backend(yoyo_url(database_url))
        except psycopg.OperationalError as exc:
            raise _connect_failure(database_url, exc) from exc
        except ValueError as exc:  # the URL does not parse (a port that is not a number, another scheme)
            raise connect_config_error(database_url, exc) from exc
        try:
            with backend.lock():
                pending = backend.to_apply(migrations)
                backend.apply_migrations(pending)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise privilege_error(
                database_url,
                "apply the migrations",
                exc,
                "the ones applied before stay; each is one transaction, but one that builds indexes CONCURRENTLY may "
                "have built some of them and is run whole again by the next streams migrate",
            ) from exc
    return [m.id for m in pending]


def migrations_line(applied: list[str]) -> str:
    """``migrations applied: <n> (<first> .. <last>)``, or ``none (up to date)``: one line for ``applied`` (the ids
    :func:`migrate` returns), as ``streams migrate`` and the harness's runs print it."""
    if not applied:
        return "migrations applied: none (up to date)"
    span = applied[0] if len(applied) == 1 else f"{applied[0]} .. {applied[-1]}"
    return f"migrations applied: {len(applied)} ({span})"


def _connect_failure(database_url: str, exc: psycopg.OperationalError) -> StreamsError:
    """What psycopg's failure to connect means: psycopg gives no SQLSTATE for a refused login, so one asyncpg login
    (:func:`streams.ledger.pool.diagnose_connect`, on a thread of its own: a caller may be running an event loop) tells
    wrong settings (:class:`DatabaseConfigError`) from an outage (:class:`LedgerUnavailableError`)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        config_error = pool.submit(asyncio.run, diagnose_connect(database_url)).result()
    if config_error is not None:
        return config_error
    return LedgerUnavailableError(
        f"PostgreSQL at {database_address(database_url)} did not accept the connection for the migrations: "
        f"{' '.join(str(exc).split())}; check that it is up (streams ready --service postgres) "
        "and run again. Nothing was applied."
    )


T = TypeVar("T")

#: Backoff between attempts of a Kafka admin call: exponential from 0.1 s up to 2 s, plus up to 0.1 s of jitter.
ADMIN_RETRY_INITIAL_S = 0.1
ADMIN_RETRY_MAX_S = 2.0
ADMIN_RETRY_JITTER_S = 0.1


def _raise_for_code(error_code: int, message: str) -> None:
    """Raise the aiokafka error of a non-zero Kafka protocol ``error_code`` (responses carry them unraised)."""
    if error_code:
        raise for_code(error_code)(message)


async def _nothing(client: AIOKafkaAdminClient) -> None:
    """An admin request that only needs the client connected (used to connect with retries)."""


@dataclass(frozen=True)
class GroupDescription:
    """A consumer group as its coordinator describes it: ``state`` (``Stable``, ``PreparingRebalance``,
    ``CompletingRebalance``, ``Empty``, ``Dead`` for an unknown group) and the number of ``members``."""

    group_id: str
    state: str
    members: int


class KafkaAdmin:
    """A Kafka admin client whose every call retries the broker's retriable errors within a deadline.

    Use ``async with KafkaAdmin(settings) as admin``. Each call may take up to ``deadline_s`` seconds (default
    ``settings.kafka_admin_deadline_s``), including connecting; :func:`streams.outages.is_outage` decides what is
    retried (exponential backoff with jitter, 0.1 s up to 2 s). A connection error drops the client, so the next
    attempt bootstraps afresh.

    Raises:
        KafkaAdminError: from any call, when the broker answers with a definite error, or still answers with a
            retriable one at the deadline; the message names the call and the broker.
    """

    def __init__(self, settings: Settings, deadline_s: float | None = None) -> None:
        self.bootstrap = settings.kafka_bootstrap
        self.settings = settings
        self._client_kwargs = client_kwargs(settings)
        self.deadline_s = settings.kafka_admin_deadline_s if deadline_s is None else deadline_s
        self._client: AIOKafkaAdminClient | None = None

    async def __aenter__(self) -> KafkaAdmin:
        await self.call("connect", _nothing)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._drop_client()

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _connected(self) -> AIOKafkaAdminClient:
        if self._client is None:
            client = AIOKafkaAdminClient(**self._client_kwargs)
            try:
                await client.start()
            except BaseException as exc:
                await client.close()
                await raise_for_security(self.settings, exc)  # a wrong security setting: not waited out
                raise
            self._client = client
        return self._client

    async def call(
        self,
        what: str,
        request: Callable[[AIOKafkaAdminClient], Awaitable[T]],
        deadline_s: float | None = None,
    ) -> T:
        """Run ``request(client)`` until it succeeds, a definite error, or ``deadline_s`` (default: the admin's).

        Each attempt is bounded by the time left (at least 1 s). Raises :class:`KafkaAdminError` naming ``what``.
        """
        budget_s = self.deadline_s if deadline_s is None else deadline_s
        started = time.monotonic()
        attempts = 0

        async def attempt() -> T:
            nonlocal attempts
            attempts += 1
            left_s = max(1.0, budget_s - (time.monotonic() - started))
            try:
                async with asyncio.timeout(left_s):
                    return await request(await self._connected())
            except (KafkaConnectionError, OSError, TimeoutError):
                await self._drop_client()
                raise

        retrying = AsyncRetrying(
            retry=retry_if_exception(is_outage),
            stop=stop_after_delay(budget_s),
            wait=wait_exponential(multiplier=ADMIN_RETRY_INITIAL_S, max=ADMIN_RETRY_MAX_S)
            + wait_random(0, ADMIN_RETRY_JITTER_S),
            before_sleep=lambda state: log.debug(
                "Kafka admin call %r on %s: attempt %d failed (%r), retrying",
                what,
                self.bootstrap,
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
            reraise=True,
        )
        try:
            return await retrying(attempt)
        except (KafkaError, OSError, TimeoutError) as exc:
            raise KafkaAdminError(
                what, self.bootstrap, attempts=attempts, elapsed_s=time.monotonic() - started, cause=exc
            ) from exc

    async def create_topics(
        self,
        names: list[str],
        partitions: int,
        replication_factor: int = -1,
        min_insync_replicas: int = 0,
        topic_configs: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Create ``names`` with ``partitions`` partitions each, ``replication_factor`` replicas (-1: the broker's
        ``default.replication.factor``), ``min.insync.replicas`` (0: the broker's) and ``topic_configs`` (more topic
        configs, Kafka's names); returns those created.

        Topics that already exist are left as they are (see :meth:`topic_layouts`). Raises
        :class:`KafkaAdminError` for any other per-topic error the broker reports (e.g. an invalid name, more
        replicas than brokers, a config it does not know).
        """
        configs = dict(topic_configs or {})
        if min_insync_replicas:
            configs["min.insync.replicas"] = str(min_insync_replicas)

        async def request(client: AIOKafkaAdminClient) -> list[str]:
            existing = set(await client.list_topics())
            wanted = [name for name in names if name not in existing]
            if not wanted:
                return []
            replicas = replication_factor
            if replicas < 1:  # aiokafka's CreateTopics (v0-v3) cannot say "the broker's default" (v4+): read it
                replicas = int((await _broker_configs(client)).get("default.replication.factor") or 1)
            response: Any = await client.create_topics(
                [
                    NewTopic(
                        name,
                        num_partitions=partitions,
                        replication_factor=replicas,
                        topic_configs=configs,
                    )
                    for name in wanted
                ]
            )
            created = []
            for topic, error_code, *rest in response.topic_errors:
                if error_code == TopicAlreadyExistsError.errno:
                    continue
                _raise_for_code(error_code, f"creating topic {topic!r}" + (f": {rest[0]}" if rest and rest[0] else ""))
                created.append(topic)
            return created

        return await self.call(f"create topics {names}", request)

    async def topic_layouts(self, names: list[str]) -> dict[str, TopicLayout]:
        """Partitions, replication factor and ``min.insync.replicas`` of those of ``names`` that exist, and the
        broker's defaults for the last two (``default.replication.factor``, ``min.insync.replicas``)."""

        async def request(client: AIOKafkaAdminClient) -> dict[str, TopicLayout]:
            existing = set(await client.list_topics())
            present = [name for name in names if name in existing]
            if not present:
                return {}
            described = await client.describe_topics(present)
            cluster = await client.describe_cluster()
            broker_id = str(cluster["brokers"][0]["node_id"])
            resources = [
                ConfigResource(ConfigResourceType.TOPIC, name, {"min.insync.replicas": None}) for name in present
            ]
            resources.append(
                ConfigResource(
                    ConfigResourceType.BROKER,
                    broker_id,
                    {"default.replication.factor": None, "min.insync.replicas": None},
                )
            )
            values: dict[tuple[int, str], dict[str, str]] = {}
            for response in await client.describe_configs(resources):
                for error_code, error_message, resource_type, resource_name, entries, *_ in response.resources:
                    _raise_for_code(error_code, f"describing the configuration of {resource_name!r}: {error_message}")
                    values[(resource_type, resource_name)] = {entry[0]: entry[1] for entry in entries}
            broker = values.get((int(ConfigResourceType.BROKER), broker_id), {})
            layouts = {}
            for topic in described:
                _raise_for_code(topic["error_code"], f"describing topic {topic['topic']!r}")
                replicas = {len(p["replicas"]) for p in topic["partitions"]}
                isr = min((len(p["isr"]) for p in topic["partitions"]), default=0)
                topic_config = values.get((int(ConfigResourceType.TOPIC), topic["topic"]), {})
                layouts[topic["topic"]] = TopicLayout(
                    name=topic["topic"],
                    partitions=len(topic["partitions"]),
                    replication_factor=max(replicas, default=0),
                    min_insync_replicas=int(topic_config.get("min.insync.replicas") or 1),
                    in_sync_replicas=isr,
                    broker_replication_factor=int(broker.get("default.replication.factor") or 1),
                    broker_min_insync_replicas=int(broker.get("min.insync.replicas") or 1),
                )
            return layouts

        return await self.call(f"describe topics {names}", request)

    async def delete_topics(self, names: list[str]) -> list[str]:
        """Delete those of ``names`` that exist; returns the names deleted (a topic already gone is no error)."""

        async def request(client: AIOKafkaAdminClient) -> list[str]:
            existing = set(await client.list_topics())
            doomed = [name for name in names if name in existing]
            if not doomed:
                return []
            response: Any = await client.delete_topics(doomed)
            deleted = []
            for topic, error_code, *_ in response.topic_error_codes:
                if error_code == UnknownTopicOrPartitionError.errno:
                    continue
                _raise_for_code(error_code, f"deleting topic {topic!r}")
                deleted.append(topic)
            return deleted

        return await self.call(f"delete topics {names}", request)

    async def alter_topic_configs(self, name: str, configs: dict[str, str]) -> None:
        """Set the dynamic ``configs`` of topic ``name`` (an AlterConfigs request: Kafka replaces the topic's
        dynamic configs by these; the others fall back to the broker's defaults).

        Raises :class:`KafkaAdminError` when the broker refuses (e.g. no such topic, an invalid value).
        """

        async def request(client: AIOKafkaAdminClient) -> None:
            responses: Any = await client.alter_configs([ConfigResource(ConfigResourceType.TOPIC, name, configs)])
            for response in responses:
                for error_code, error_message, *_ in response.resources:
                    _raise_for_code(error_code, f"setting {sorted(configs)} of topic {name!r}: {error_message}")

        await self.call(f"alter the configs of topic {name!r}", request)

    async def describe_topic_configs(self, name: str, keys: list[str]) -> dict[str, str | None]:
        """The values of the configs ``keys`` of topic ``name`` as the broker has them (a DescribeConfigs
        request; a key the broker does not report is missing from the result)."""

        async def request(client: AIOKafkaAdminClient) -> dict[str, str | None]:
            responses: Any = await client.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name, dict.fromkeys(keys))]
            )
            values: dict[str, str | None] = {}
            for response in responses:
                for error_code, error_message, _, _, entries, *_ in response.resources:
                    _raise_for_code(error_code, f"describing the configs of topic {name!r}: {error_message}")
                    for entry in entries:
                        values[entry[0]] = entry[1]
            return values

        return await self.call(f"describe the configs of topic {name!r}", request)

    async def find_coordinator(self, group_id: str, deadline_s: float | None = None) -> int:
        """The broker id coordinating consumer group ``group_id`` (a FindCoordinator request)."""

        async def request(client: AIOKafkaAdminClient) -> int:
            coordinator: int = await client.find_coordinator(group_id)
            return coordinator

        return await self.call(f"find the coordinator of consumer group {group_id!r}", request, deadline_s)

    async def describe_group(self, group_id: str, deadline_s: float | None = None) -> GroupDescription:
        """Consumer group ``group_id`` as its coordinator describes it (``Dead`` with 0 members when unknown)."""

        async def request(client: AIOKafkaAdminClient) -> GroupDescription:
            [response] = await client.describe_consumer_groups([group_id])
            error_code, _, state, _, _, members, *_ = response.groups[0]
            _raise_for_code(error_code, f"describing consumer group {group_id!r}")
            return GroupDescription(group_id, state, len(members))

        return await self.call(f"describe consumer group {group_id!r}", request, deadline_s)


async def _broker_configs(client: AIOKafkaAdminClient) -> dict[str, str]:
    """``default.replication.factor`` and ``min.insync.replicas`` of the cluster's first broker (absent: unset)."""
    cluster = await client.describe_cluster()
    broker_id = str(cluster["brokers"][0]["node_id"])
    resource = ConfigResource(
        ConfigResourceType.BROKER, broker_id, {"default.replication.factor": None, "min.insync.replicas": None}
    )
    values: dict[str, str] = {}
    for response in await client.describe_configs([resource]):
        for error_code, error_message, _, resource_name, entries, *_ in response.resources:
            _raise_for_code(error_code, f"describing the configuration of broker {resource_name!r}: {error_message}")
            values.update({entry[0]: entry[1] for entry in entries if entry[1] is not None})
    return values


@dataclass(frozen=True)
class TopicLayout:
    """A topic as the cluster holds it: ``partitions``, ``replication_factor`` (replicas of its partitions),
    ``min_insync_replicas`` (its ``min.insync.replicas``), ``in_sync_replicas`` (the fewest of any partition), and
    the broker's ``default.replication.factor`` and ``min.insync.replicas``."""

    name: str
    partitions: int
    replication_factor: int
    min_insync_replicas: int
    in_sync_replicas: int
    broker_replication_factor: int
    broker_min_insync_replicas: int


def layout_differences(settings: Settings, layout: TopicLayout) -> list[str]:
    """How ``layout`` differs from what ``settings`` ask (``partitions``, ``kafka_replication_factor``,
    ``kafka_min_insync_replicas``; -1/0 stand for the broker's defaults), one phrase each; empty when it does not.
    A partition with fewer in-sync replicas than ``min.insync.replicas`` is reported too (it refuses writes)."""
    wanted_rf = settings.kafka_replication_factor
    if wanted_rf == -1:
        wanted_rf = layout.broker_replication_factor
    wanted_isr = settings.kafka_min_insync_replicas or layout.broker_min_insync_replicas
    out = []
    if layout.partitions != settings.partitions:
        out.append(f"{layout.partitions} partitions, STREAMS_PARTITIONS={settings.partitions}")
    if layout.replication_factor != wanted_rf:
        out.append(f"replication factor {layout.replication_factor}, wanted {wanted_rf}")
    if layout.min_insync_replicas != wanted_isr:
        out.append(f"min.insync.replicas {layout.min_insync_replicas}, wanted {wanted_isr}")
    if layout.in_sync_replicas < layout.min_insync_replicas:
        out.append(
            f"a partition has {layout.in_sync_replicas} in-sync replicas, below min.insync.replicas "
            f"{layout.min_insync_replicas}: writes to it are refused"
        )
    return out


async def create_topics(
    settings: Settings, *, strict: bool = False, topic_configs: Mapping[str, str] | None = None
) -> list[str]:
    """Create the five topics with ``settings.partitions`` partitions, ``kafka_replication_factor`` replicas,
    ``kafka_min_insync_replicas`` and ``topic_configs`` (more topic configs, Kafka's names: none for ``streams
    migrate``); returns those created. Then check every topic (:func:`layout_differences`): each difference is
    logged as a warning, or with ``strict`` refused.

    Existing topics are left as they are (their partition count is not changed).

    Raises:
        KafkaAdminError: see :class:`KafkaAdmin`.
        TopicLayoutError: ``strict`` and a topic differs from the settings (the message names each difference).
    """
    names = list(settings.topics.values())
    async with KafkaAdmin(settings) as admin:
        created = await admin.create_topics(
            names,
            settings.partitions,
            settings.kafka_replication_factor,
            settings.kafka_min_insync_replicas,
            topic_configs,
        )
        layouts = await admin.topic_layouts(names)
    differences = [
        f"{name}: {difference}"
        for name in names
        if name in layouts
        for difference in layout_differences(settings, layouts[name])
    ]
    for difference in differences:
        log.warning("topic differs from the settings: %s", difference)
    if differences and strict:
        raise TopicLayoutError(differences)
    return created


#: The Kafka topic config that bounds how long a topic keeps its records (ms).
RETENTION_MS = "retention.ms"


async def set_dead_letter_retention(settings: Settings) -> int:
    """Set ``retention.ms`` of the dead-letter topic to :attr:`Settings.dead_letter_retention_ms` (the topic must
    exist: :func:`create_topics` first); returns the value set. Dead letters hold the original submissions, user
    prompts included: they are kept at least that long, and deleted with their segment (up to ``segment.ms``
    later: docs/operating-data.md "Retention and erasure").

    Raises :class:`~streams.errors.KafkaAdminError` (see :class:`KafkaAdmin`).
    """
    async with KafkaAdmin(settings) as admin:
        await admin.alter_topic_configs(
            settings.topic("dead_letter"), {RETENTION_MS: str(settings.dead_letter_retention_ms)}
        )
    return settings.dead_letter_retention_ms


#: The topics whose records can bring an operation id back: the submissions topic (a consumer group set back to an
#: earlier offset), the dead-letter topic (a re-drive) and the cancellations topic (a cancel of an unknown id is
#: recorded, and cancels the next operation of the id before its POST). Deleting a purged id is safe only once they
#: can hold no record of it (``streams purge --ids-older-than``).
REPLAY_ROLES = ("submissions", "dead_letter", "cancellations")
CLEANUP_POLICY = "cleanup.policy"
SEGMENT_MS = "segment.ms"

#: What a horizon must exceed beyond a topic's longest record life (``retention.ms`` + ``segment.ms``): the broker's
#: retention check runs every ``log.retention.check.interval.ms`` (5 minutes by default), and a record's timestamp is
#: its producer's clock (``CreateTime``), which may run ahead.
REPLAY_MARGIN_S = 86_400.0


@dataclass(frozen=True)
class ReplayWindow:
    """How long a topic of :data:`REPLAY_ROLES` may keep a record: ``longest_ms``, its ``retention.ms`` plus its
    ``segment.ms`` (Kafka deletes whole segments, once the newest record of one is older than ``retention.ms``: a
    record can outlive it by a segment's span); None when it keeps records without a time limit (``retention.ms`` -1,
    a ``cleanup.policy`` without ``delete``: compaction keeps a key's latest record for good, or a config the broker
    did not report) or does not exist (``exists`` False: the settings may name the wrong topics)."""

    topic: str
    longest_ms: int | None
    exists: bool = True


async def replay_windows(settings: Settings) -> list[ReplayWindow]:
    """The :class:`ReplayWindow` of each topic of :data:`REPLAY_ROLES`, as the broker has them (its defaults
    included).

    Raises :class:`~streams.errors.KafkaAdminError` (see :class:`KafkaAdmin`).
    """

    async def topic_names(client: AIOKafkaAdminClient) -> set[str]:
        return set(await client.list_topics())

    windows = []
    async with KafkaAdmin(settings) as admin:
        existing = await admin.call("list the topics", topic_names)
        for role in REPLAY_ROLES:
            name = settings.topic(role)
            configs = None
            if name in existing:
                configs = await admin.describe_topic_configs(name, [RETENTION_MS, SEGMENT_MS, CLEANUP_POLICY])
            windows.append(replay_window(name, configs))
    return windows


def replay_window(topic: str, configs: Mapping[str, str | None] | None) -> ReplayWindow:
    """The :class:`ReplayWindow` of ``topic`` from its configs as the broker describes them (None: no such topic).
    A config missing or not a number counts as no time limit."""
    if configs is None:
        return ReplayWindow(topic, None, exists=False)
    try:
        retention_ms, segment_ms = int(configs.get(RETENTION_MS) or -1), int(configs.get(SEGMENT_MS) or -1)
    except ValueError:
        return ReplayWindow(topic, None)
    policies = [p.strip() for p in (configs.get(CLEANUP_POLICY) or "").strip("[]").split(",")]
    if retention_ms < 0 or segment_ms < 0 or "delete" not in policies:
        return ReplayWindow(topic, None)
    return ReplayWindow(topic, retention_ms + segment_ms)


def replay_refusals(
    windows: list[ReplayWindow], horizon_s: float, age: Callable[[float], str] = lambda s: f"{s:g} s"
) -> list[str]:
    """One phrase per window that may still hold a record older than ``horizon_s`` seconds (its longest record
    life plus :data:`REPLAY_MARGIN_S` is not shorter, or it could not be read), saying why (durations written by
    ``age``, seconds -> text); empty when every window is shorter than the horizon."""
    phrases = []
    for window in windows:
        if not window.exists:
            phrases.append(f"topic {window.topic} does not exist (check STREAMS_TOPIC_PREFIX)")
        elif window.longest_ms is None:
            phrases.append(f"{window.topic} keeps its records without a time limit")
        elif window.longest_ms / 1000 + REPLAY_MARGIN_S >= horizon_s:
            phrases.append(
                f"{window.topic} may keep a record {age(window.longest_ms / 1000)} (retention.ms + segment.ms; "
                f"a horizon must exceed it by {age(REPLAY_MARGIN_S)})"
            )
    return phrases


#: How long ``streams purge --ids-older-than`` waits for the workers' consumer group to consume the submissions
#: written before it started (and how often it looks).
CATCH_UP_TIMEOUT_S = 60.0
CATCH_UP_LOOK_INTERVAL_S = 1.0


async def submissions_behind(settings: Settings, timeout_s: float = CATCH_UP_TIMEOUT_S) -> list[str]:
    """Wait until the workers' consumer group (``settings.app_id``) has committed, on every partition of the
    submissions and cancellations topics, at least the end offset the partition had when this was called: every
    record written before now consumed (a replay among them has met its id, and an erased id's ``replayed_at`` is
    recorded; a cancel has been recorded, so the purge that follows deletes it with the id), looking
    every :data:`CATCH_UP_LOOK_INTERVAL_S` (tenacity) for ``timeout_s`` at most. Returns one phrase per partition
    still behind then (``topic[p]: consumed up to C of E``); empty when caught up.

    Raises :class:`~streams.errors.KafkaAdminError` (see :class:`KafkaAdmin`).
    """
    topics, group = [settings.topic("submissions"), settings.topic("cancellations")], settings.app_id
    async with KafkaAdmin(settings) as admin:

        async def partition_counts(client: AIOKafkaAdminClient) -> dict[str, int]:
            existing = set(await client.list_topics())
            described = await client.describe_topics([t for t in topics if t in existing]) if existing else []
            for topic in described:
                _raise_for_code(topic["error_code"], f"describing topic {topic['topic']!r}")
            return {topic["topic"]: len(topic["partitions"]) for topic in described}

        counts = await admin.call(f"describe topics {topics}", partition_counts)
        missing = [
            f"topic {topic} does not exist (check STREAMS_TOPIC_PREFIX)" for topic in topics if topic not in counts
        ]
        if missing:
            return missing
        partitions = [TopicPartition(t, p) for t in topics for p in range(counts[t])]

        async def log_offsets(_: AIOKafkaAdminClient) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
            reader = AIOKafkaConsumer(**client_kwargs(settings), enable_auto_commit=False)
            try:
                await reader.start()
            except Exception as exc:
                await reader.stop()
                await raise_for_security(settings, exc)
                raise
            try:
                return await reader.beginning_offsets(partitions), await reader.end_offsets(partitions)
            finally:
                await reader.stop()

        starts, ends = await admin.call(f"read the offsets of topics {topics}", log_offsets)

        async def committed(client: AIOKafkaAdminClient) -> dict[TopicPartition, int]:
            answer = await client.list_consumer_group_offsets(group, partitions=partitions)
            if any(tp not in answer for tp in partitions):  # aiokafka drops a group-level error (coordinator loading)
                raise CoordinatorLoadInProgressError(f"no committed offsets of group {group!r} in the answer")
            return {tp: meta.offset for tp, meta in answer.items()}

        async def behind() -> list[str]:
            offsets = await admin.call(f"read the offsets of consumer group {group!r}", committed)
            return behind_phrases(partitions, starts, ends, offsets)

        retrying = AsyncRetrying(
            retry=retry_if_result(bool),
            wait=wait_fixed(CATCH_UP_LOOK_INTERVAL_S),
            stop=stop_after_delay(timeout_s),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome is not None else [],
        )
        result: list[str] = await retrying(behind)
        return result


def behind_phrases(
    partitions: list[TopicPartition],
    starts: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
    committed: Mapping[TopicPartition, int],
) -> list[str]:
    """``topic[p]: consumed up to C of E`` for each partition whose committed offset (-1 or missing: none committed,
    read from the first record still kept, ``starts``) is below its end offset (``ends``, taken before)."""
    phrases = []
    for tp in partitions:
        position = max(committed.get(tp, -1), starts[tp])
        if position < ends[tp]:
            phrases.append(f"{tp.topic}[{tp.partition}]: consumed up to {position} of {ends[tp]}")
    return phrases


def run_topics(settings: Settings) -> list[str]:
    """Every topic of a run on ``settings``: its five (:attr:`Settings.topics`), by exact name. Faust adds none:
    the app keeps no tables and its leader topic is disabled (:func:`streams.worker.app.create_app`)."""
    return list(settings.topics.values())


async def delete_topics(settings: Settings, *, include_unprefixed: bool = False) -> list[str]:
    """Delete a run's topics (:func:`run_topics`) that exist; returns the names deleted.

    Meant for isolated runs (the main job, the soak, the benchmark, test sessions) whose topics carry their own
    prefix and whose consumer group its own app id; their workers must have stopped.

    Raises:
        SharedResourceRefusedError: ``settings.topic_prefix`` is empty (the names are the shared ``generation.*``
            topics) and ``include_unprefixed`` is not set; nothing was deleted.
        KafkaAdminError: see :class:`KafkaAdmin`.
    """
    if not settings.topic_prefix and not include_unprefixed:
        raise SharedResourceRefusedError(
            f"delete topics {run_topics(settings)}: refused, STREAMS_TOPIC_PREFIX is empty, so these are the shared, "
            "unprefixed topics; set the run's prefix, or pass include_unprefixed=True to delete them. "
            "Nothing was deleted"
        )
    async with KafkaAdmin(settings) as admin:
        return await admin.delete_topics(run_topics(settings))


def database_name(database_url: str) -> str:
    """The database name of a ``postgresql://`` URL (no credentials)."""
    return database_url.rpartition("/")[2].partition("?")[0]
