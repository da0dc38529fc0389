"""What the people who run the system read: operations by state, one operation in full, the on-call overview.

Read-only queries of ``queries/inspect.sql`` and the Redis lease keys, plus the text formatting shared by the
command line (``streams operations ...``) and the worker's live view (:mod:`streams.oncall.liveview`). The operators'
decisions themselves (adopt, abandon, repoll, fail) are fenced ledger statements (:class:`streams.ledger.store.Ledger`);
nothing here writes, and nothing here calls the remote API.

Ages are seconds since the operation entered its current state (``operations.state_entered_at``), on the
database's clock.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import getpass
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client import REGISTRY

from streams.bounded import close_within
from streams.config import Settings, lease_key
from streams.coordination.lease import REDIS_POOL_EXHAUSTED, REDIS_UNAVAILABLE
from streams.errors import error_summary
from streams.kafka_security import client_kwargs
from streams.ledger.pool import guard as ledger_guard  # PostgreSQL errors -> LedgerUnavailableError/LedgerDataError
from streams.ledger.records import OperatorMove
from streams.ledger.sql import INSPECT
from streams.model.codes import RemoteCallOutcome
from streams.model.states import OperationState, is_terminal
from streams.wire import exactjson

#: Lease actions whose keys :func:`lease_holders` reads (``streams.config.lease_key``).
LEASE_ACTIONS = ("submit", "observe")

#: States in which work waits for the reconciler or a person (``stalled`` once the ledger has it).
DECISION_STATES = ("uncertain", "stalled")

#: POST outcomes that tell no job was created: the provider refused, or nothing reached it.
NOTHING_CREATED = (RemoteCallOutcome.REFUSED, RemoteCallOutcome.RATE_LIMITED, RemoteCallOutcome.NOT_SENT)

#: Prometheus counters the live view shows, by section (this worker's values since it started).
CONTENTION_METRICS = (
    "streams_lease_busy_total",
    "streams_lease_lost_total",
    "streams_coordination_unavailable_total",
    "streams_fencing_refusals_total",
    "streams_order_refusals_total",
    "streams_stale_polls_total",
)
DEAD_LETTER_METRICS = ("streams_dead_letters_total",)

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")  # ASCII digits: int() would take any script's
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


#: The longest duration an operator's command takes (s): 100 years, which every age of the ledger is within (a
#: longer one put the start of its window before PostgreSQL's earliest timestamp: a traceback, not an answer).
MAX_DURATION_S = 100 * 365 * 86400.0


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30s``, ``5m``, ``2h``, ``1d``, ``1.5h`` or ``1h30m`` (units s, m, h, d,
    largest first, each at most once; ``S``, ``H``, ``D`` too, never ``M``, which could mean months; ASCII digits).

    Raises:
        ValueError: the text is not such a duration, it is zero, or it is longer than :data:`MAX_DURATION_S`.
    """
    if "M" in text:
        raise ValueError(
            f"{text!r} is not a duration: M could mean months or minutes; write m for minutes, days for months (180d)"
        )
    raw = text.strip().lower()
    pos, total, units = 0, 0.0, []
    for match in _DURATION.finditer(raw):
        if match.start() != pos:
            break
        units.append(match.group(2))
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    order = "dhms"
    if not units or pos != len(raw) or units != sorted(set(units), key=order.index):
        raise ValueError(f"{text!r} is not a duration: write a number and a unit (s, m, h, d), e.g. 30s, 5m, 1h30m")
    if total <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    if total > MAX_DURATION_S:
        raise ValueError(f"{text!r} is longer than {MAX_DURATION_S // 86400:.0f}d, the longest duration taken")
    return total


def format_age(seconds: float | None) -> str:
    """A short age: ``42.0s``, ``3m15s``, ``2h03m``, ``1d04h``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{max(seconds, 0.0):.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_time(value: dt.datetime | None) -> str:
    """UTC, ISO 8601 to the millisecond (``2026-05-02T10:00:00.123Z``); ``-`` for None."""
    if value is None:
        return "-"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def format_epoch_ms(value: int | None) -> str:
    """An epoch time in milliseconds as :func:`format_time` shows it; the number itself when out of range."""
    if value is None:
        return "-"
    try:
        return format_time(dt.datetime.fromtimestamp(value / 1000, dt.UTC))
    except (OverflowError, OSError, ValueError):
        return f"{value} ms since the epoch"


#: Longest actor text a person may give (``--actor``, ``STREAMS_ACTOR``); longer is cut.
MAX_GIVEN_ACTOR_CHARS = 200


def os_user(environ: Mapping[str, str] | None = None) -> str:
    """The operating-system user running the command: ``USER``, else ``LOGNAME``, else the login name, else
    ``unknown``."""
    env = os.environ if environ is None else environ
    for var in ("USER", "LOGNAME"):
        if env.get(var, "").strip():
            return env[var].strip()
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def given_actor(option: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """What the person says they are: ``--actor`` (``option``), else ``STREAMS_ACTOR``; None when neither is
    given or both are blank."""
    env = os.environ if environ is None else environ
    for value in (option, env.get("STREAMS_ACTOR")):
        if value is not None and value.strip():
            return value.strip()
    return None


def actor(database_role: str, user: str, given: str | None = None) -> str:
    """Who takes an operator's decision, as the ledger records it: the database role the command logged in as
    and the OS user, ``<role>@postgres-role/<user>@os`` (e.g. ``streams@postgres-role/alice@os``), with a given
    actor beside them, never instead: ``streams@postgres-role/alice@os (given: alice.smith)``. Control characters
    of the given text become spaces; it is cut at :data:`MAX_GIVEN_ACTOR_CHARS`."""
    base = f"{database_role}@postgres-role/{user}@os"
    if given is None or not given.strip():
        return base
    text = "".join(c if c.isprintable() else " " for c in given.strip())[:MAX_GIVEN_ACTOR_CHARS]
    return f"{base} (given: {text})"


def to_json(value: Any) -> str:
    """Compact JSON text of query results: numbers exact (:mod:`streams.wire.exactjson`, as the ledger stores them),
    datetimes as RFC 3339.

    Raises:
        TypeError: a value JSON cannot hold.
    """
    return exactjson.dumps(value).decode()


# --- queries ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperationList:
    """Rows of ``list_operations`` (dicts: operation_id, state, state_age_s, reason, remote_job_id,
    fencing_token) and how many matched before the limit."""

    rows: list[dict[str, Any]]
    matched: int


async def list_operations(
    pool: asyncpg.Pool, *, states: Sequence[str] | None, older_than_s: float | None, limit: int
) -> OperationList:
    """Operations in ``states`` (None: all) for longer than ``older_than_s`` (None: any), oldest first, at most
    ``limit`` (>= 1).

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with ledger_guard("list operations"):
        rows = await INSPECT.list_operations.fetch(
            pool, states=list(states) if states else None, older_than_s=older_than_s, limit=limit
        )
    matched = rows[0]["matched"] if rows else 0
    return OperationList([{k: v for k, v in dict(r).items() if k != "matched"} for r in rows], matched)


async def lease_holders(redis: aioredis.Redis, settings: Settings, operation_id: str) -> list[dict[str, Any]]:
    """The Redis leases held on the operation now: ``[{action, key, owner_token, ttl_ms}]`` (empty when none).

    The owner token is random per acquisition (it names no worker). Raises the redis-py error when Redis does
    not answer (see :data:`streams.coordination.lease.REDIS_UNAVAILABLE`).
    """
    held = []
    for action in LEASE_ACTIONS:
        key = lease_key(settings, action, operation_id)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.get(key)
            pipe.pttl(key)
            token, ttl_ms = await pipe.execute()
        if token is not None and ttl_ms >= 0:
            owner = token.decode(errors="replace") if isinstance(token, bytes) else str(token)
            held.append({"action": action, "key": key, "owner_token": owner, "ttl_ms": int(ttl_ms)})
    return held


async def operation_detail(
    pool: asyncpg.Pool, redis: aioredis.Redis | None, settings: Settings, operation_id: str
) -> dict[str, Any] | None:
    """Everything about one operation, or None when the ledger does not hold it.

    Returns ``{operation, transitions, outputs, remote_calls, remote_jobs, leases, leases_error}``: the
    operation's row (with ``state_age_s``), its transition log, its outputs with their outbox rows, its remote
    calls, the accounting records of its remote jobs (with their refunds), and the Redis leases held on it now
    (``leases_error`` says why they could not be read, else None).

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer (Redis not answering is reported in ``leases_error``).
    """
    async with ledger_guard(f"read {operation_id}"):
        row = await INSPECT.operation_row.fetchrow(pool, operation_id=operation_id)
        if row is None:
            return None
        transitions = await INSPECT.operation_transitions.fetch(pool, operation_id=operation_id)
        outputs = await INSPECT.operation_outputs.fetch(pool, operation_id=operation_id)
        calls = await INSPECT.operation_remote_calls.fetch(pool, operation_id=operation_id)
        jobs = await INSPECT.operation_remote_jobs.fetch(pool, operation_id=operation_id)
    leases: list[dict[str, Any]] = []
    leases_error = None
    if redis is None:
        leases_error = "Redis not consulted"
    else:
        try:
            leases = await lease_holders(redis, settings, operation_id)
        except REDIS_UNAVAILABLE as exc:
            leases_error = f"Redis unavailable: {error_summary(exc)}"
        except REDIS_POOL_EXHAUSTED as exc:
            leases_error = f"no Redis connection free in this process's pool: {exc}"
    return {
        "operation": dict(row),
        "transitions": [dict(r) for r in transitions],
        "outputs": [dict(r) for r in outputs],
        "remote_calls": [dict(r) for r in calls],
        "remote_jobs": [dict(r) for r in jobs],
        "leases": leases,
        "leases_error": leases_error,
    }


async def overview(pool: asyncpg.Pool, *, window_min: int, queue_limit: int) -> dict[str, Any]:
    """The on-call overview from the ledger.

    Returns ``{now, states, throughput, queues, outbox}``:

    * ``states``: {state: operations} for every state (0 when none);
    * ``throughput``: ``{window_min, minutes: [{minute, accepted, finished, by_state}], finished,
      finished_per_s}`` over the last ``window_min`` minutes (the current minute included; ``finished`` counts
      transitions into terminal states);
    * ``queues``: {state: {matched, oldest_age_s, rows}} for :data:`DECISION_STATES`, at most ``queue_limit``
      rows each, oldest first;
    * ``outbox``: ``{unpublished, oldest_age_s, by_topic_role: {role: {unpublished, oldest_age_s}}}``;
    * ``late_jobs``: ``{matched, rows: [{operation_id, remote_job_id, state, learned_age_s}]}``: jobs created
      after an operator's decision and not observed, oldest first, at most ``queue_limit`` rows
      (docs/decisions.md).

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with ledger_guard("read the overview"):
        return await _overview(pool, window_min, queue_limit)


async def _overview(pool: asyncpg.Pool, window_min: int, queue_limit: int) -> dict[str, Any]:
    now: dt.datetime = await INSPECT.database_now.fetchval(pool)
    counts = {r["state"]: r["operations"] for r in await INSPECT.state_counts.fetch(pool)}
    states = {s.value: counts.pop(s.value, 0) for s in OperationState}
    states.update(counts)  # a state the database has and this code does not (a newer migration)
    per_minute = await INSPECT.transitions_per_minute.fetch(pool, window_min=window_min)
    queues = {}
    for state in DECISION_STATES:
        rows = [dict(r) for r in await INSPECT.state_queue.fetch(pool, state=state, limit=queue_limit)]
        queues[state] = {
            "matched": rows[0]["matched"] if rows else 0,
            "oldest_age_s": rows[0]["state_age_s"] if rows else None,
            "rows": [{k: v for k, v in r.items() if k != "matched"} for r in rows],
        }
    backlog = {
        r["topic_role"]: {"unpublished": r["unpublished"], "oldest_age_s": r["oldest_age_s"]}
        for r in await INSPECT.outbox_backlog.fetch(pool)
    }
    ages = [b["oldest_age_s"] for b in backlog.values()]
    late = [dict(r) for r in await INSPECT.late_jobs.fetch(pool, limit=queue_limit)]
    return {
        "now": now,
        "states": states,
        "throughput": _throughput(now, window_min, per_minute),
        "queues": queues,
        "outbox": {
            "unpublished": sum(b["unpublished"] for b in backlog.values()),
            "oldest_age_s": max(ages) if ages else None,
            "by_topic_role": backlog,
        },
        "late_jobs": {
            "matched": late[0]["matched"] if late else 0,
            "rows": [{k: v for k, v in r.items() if k != "matched"} for r in late],
        },
    }


def _throughput(now: dt.datetime, window_min: int, rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    start = now.replace(second=0, microsecond=0) - dt.timedelta(minutes=window_min - 1)
    minutes: dict[dt.datetime, dict[str, Any]] = {
        start + dt.timedelta(minutes=i): {"accepted": 0, "finished": 0, "by_state": {}} for i in range(window_min)
    }
    for r in rows:
        slot = minutes.setdefault(r["minute"], {"accepted": 0, "finished": 0, "by_state": {}})
        slot["by_state"][r["to_state"]] = r["transitions"]
        if r["to_state"] == OperationState.ACCEPTED.value:
            slot["accepted"] += r["transitions"]
        elif _is_terminal(r["to_state"]):
            slot["finished"] += r["transitions"]
    finished = sum(m["finished"] for m in minutes.values())
    elapsed_s = (now - start).total_seconds()
    return {
        "window_min": window_min,
        "minutes": [{"minute": k, **v} for k, v in sorted(minutes.items())],
        "finished": finished,
        "finished_per_s": finished / elapsed_s if elapsed_s > 0 else 0.0,
    }


def _is_terminal(state: str) -> bool:
    try:
        return is_terminal(OperationState(state))
    except ValueError:
        return False


async def dead_letter_topic(settings: Settings, *, timeout_s: float = 3.0) -> dict[str, Any]:
    """What the dead-letter topic holds now, from Kafka's offsets (every worker's dead letters, retained ones):
    ``{topic, retained, by_partition: {partition (text): records}, error}``; ``error`` says why Kafka could not be
    read
    within ``timeout_s`` (then ``retained`` is None). Never raises for an unreachable broker."""
    topic = settings.topic("dead_letter")
    admin = AIOKafkaAdminClient(**client_kwargs(settings), request_timeout_ms=int(timeout_s * 1000))
    consumer = AIOKafkaConsumer(
        **client_kwargs(settings), enable_auto_commit=False, request_timeout_ms=int(timeout_s * 1000)
    )

    async def read() -> dict[str, int]:
        await admin.start()
        if topic not in await admin.list_topics():
            return {}  # asked first: a metadata request naming a missing topic may have the broker create it
        (described,) = await admin.describe_topics([topic])
        tps = [
            TopicPartition(topic, p["partition"]) for p in sorted(described["partitions"], key=lambda p: p["partition"])
        ]
        await consumer.start()
        first = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        return {str(tp.partition): end[tp] - first[tp] for tp in tps}  # JSON keys are text

    try:
        async with asyncio.timeout(timeout_s):
            by_partition = await read()
    except (KafkaError, OSError, TimeoutError) as exc:
        return {"topic": topic, "retained": None, "by_partition": {}, "error": error_summary(exc)}
    finally:
        await close_within(consumer.stop(), timeout_s, "the dead-letter count's Kafka consumer")
        await close_within(admin.close(), timeout_s, "the dead-letter count's Kafka admin client")
    return {"topic": topic, "retained": sum(by_partition.values()), "by_partition": by_partition, "error": None}


def worker_counters(names: Iterable[str]) -> list[dict[str, Any]]:
    """This process's Prometheus counter samples named ``names`` (``<name>`` or ``<name>_total``):
    ``[{name, labels, value}]``, in registry order."""
    wanted = set(names)
    samples = []
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in wanted:
                samples.append({"name": sample.name, "labels": dict(sample.labels), "value": sample.value})
    return samples


async def accounting(
    pool: asyncpg.Pool, ledger_summary: Mapping[str, Any], operation_pattern: str, operation_prefix: str
) -> dict[str, Any]:
    """The accounting report of the operations whose id starts with ``operation_prefix`` (``operation_pattern``,
    its SQL ``LIKE`` pattern): ``ledger_summary`` (:meth:`streams.ledger.store.Ledger.accounting_summary`), plus
    ``post_attempts`` (query ``posts_per_operation``: every attempt, and ``max_sent``, the most POSTs that may
    have created a job for one operation, i.e. with an outcome not in :data:`NOTHING_CREATED`; it must be at
    most 1), ``operation_prefix`` and the database clock ``now``.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with ledger_guard("read the POSTs per operation"):
        row = await INSPECT.posts_per_operation.fetchrow(
            pool, operation_pattern=operation_pattern, nothing_created_outcomes=list(NOTHING_CREATED)
        )
        now = await INSPECT.database_now.fetchval(pool)
    assert row is not None  # aggregates only: always one row
    return {"now": now, "operation_prefix": operation_prefix, **ledger_summary, "post_attempts": dict(row)}


# --- text ------------------------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain text table: columns left-aligned, two spaces apart, values shown as ``str`` (None as ``-``)."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def compact_json(value: Any) -> str:
    """One-line JSON of ``value``; ``-`` for None."""
    return "-" if value is None else to_json(value)


def _short(value: Any, limit: int = 100) -> str:
    text = value if isinstance(value, str) else compact_json(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_list(result: OperationList) -> str:
    """``streams operations list`` as text: one line per operation, and how many more matched."""
    if not result.rows:
        return "no operations match"
    body = table(
        ["OPERATION", "STATE", "AGE", "JOB ID", "FENCING", "CODE", "REASON"],
        (
            [
                r["operation_id"],
                r["state"],
                format_age(r["state_age_s"]),
                r["remote_job_id"],
                r["fencing_token"],
                r["reason_code"],
                _short(r["reason"], 80) if r["reason"] else None,
            ]
            for r in result.rows
        ),
    )
    more = result.matched - len(result.rows)
    return body + (f"\n... {more} more (raise --limit)" if more > 0 else "")


def _section(title: str, headers: Sequence[str], rows: list[list[Any]]) -> list[str]:
    lines = ["", f"{title} ({len(rows)})"]
    if rows:
        lines.append(_indent(table(headers, rows)))
    return lines


def format_detail(detail: Mapping[str, Any]) -> str:
    """``streams operations show`` as text."""
    op = detail["operation"]
    observed = format_time(op["last_observed_at"])
    if op["last_observation"] is not None:
        observed += f": {_short(op['last_observation'], 200)}"
    lines = [
        f"operation        {op['operation_id']}",
        f"state            {op['state']} (for {format_age(op['state_age_s'])}, transition {op['transition_seq']})",
        f"reason           {op['reason'] or '-'}" + (f" [{op['reason_code']}]" if op["reason_code"] else ""),
        f"remote job id    {op['remote_job_id'] or '-'}",
        f"fencing value    {op['fencing_token']}",
        f"accepted at      {format_time(op['accepted_at'])}",
        f"last change      {format_time(op['updated_at'])} by {op['updated_by']}",
        f"polls            {op['poll_count']} (next due {format_time(op['next_poll_at'])}; observing since "
        f"{format_time(op['observing_since'])}; unknown statuses in a row {op['unknown_status_count']})",
        f"lookups          {op['lookup_count']} (next due {format_time(op['next_lookup_at'])}; gave up "
        f"{format_time(op['lookup_gave_up_at'])})",
        f"last observed    {observed}",
        f"remote completed {format_time(op['remote_completed_at'])}",
        f"request          {_short(op['request'], 200)}",
        f"submitted at     {format_epoch_ms(op['submitted_at_ms'])} (the application's clock)",
        f"source           {_short(op['source'], 120) if op['source'] is not None else '-'}",
    ]
    lines += _section(
        "transitions",
        ["#", "AT", "FROM", "TO", "FENCING", "BY", "REASON"],
        [
            [
                t["seq"],
                format_time(t["at"]),
                t["from_state"],
                t["to_state"],
                t["fencing_token"],
                t["worker"],
                _short(t["reason"]) if t["reason"] else None,
            ]
            for t in detail["transitions"]
        ],
    )
    lines += _section(
        "outputs",
        ["POSITION", "OUTPUT ID", "RECORDED", "OUTBOX EVENT", "PUBLISHED"],
        [
            [
                o["position"],
                o["output_id"],
                format_time(o["recorded_at"]),
                o["event_id"],
                format_time(o["published_at"]) if o["event_id"] else "no outbox row",
            ]
            for o in detail["outputs"]
        ],
    )
    lines += _section(
        "remote calls",
        ["AT", "METHOD", "STATUS", "OUTCOME", "JOB ID", "FENCING", "MS", "WORKER"],
        [
            [
                format_time(c["at"]),
                c["method"],
                c["status_code"],
                c["outcome"],
                c["remote_job_id"],
                c["fencing_token"],
                f"{c['duration_ms']:.1f}",
                c["worker"],
            ]
            for c in detail["remote_calls"]
        ],
    )
    lines += _section(
        "remote jobs (accounting)",
        ["JOB ID", "LEARNED VIA", "BY", "AT", "LAST STATUS", "OUTCOME", "CHARGE", "REFUNDS"],
        [
            [
                j["remote_job_id"],
                j["learned_via"],
                j["learned_by"],
                format_time(j["learned_at"]),
                j["last_status"],
                j["outcome"],
                compact_json(j["charge"]),
                compact_json(j["refunds"]) if j["refunds"] else None,
            ]
            for j in detail["remote_jobs"]
        ],
    )
    lines += ["", "leases"]
    if detail["leases_error"]:
        lines.append(f"  {detail['leases_error']}")
    elif not detail["leases"]:
        lines.append("  none held")
    else:
        lines.append(
            _indent(
                table(
                    ["ACTION", "KEY", "OWNER TOKEN", "TTL LEFT"],
                    ([x["action"], x["key"], x["owner_token"], f"{x['ttl_ms']} ms"] for x in detail["leases"]),
                )
            )
        )
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _counts(mapping: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(mapping.items())) or "none"


def _amounts(items: Sequence[Mapping[str, Any]], what: str) -> str:
    return "; ".join(f"{i['currency']} {i['amount']} ({i[what]} {what})" for i in items) or "none"


def _stats(figures: Mapping[str, Any]) -> str:
    if not figures["operations"]:
        return "no operations"
    return f"mean {float(figures['mean']):.3f}, max {figures['max']} over {figures['operations']} operations"


def _scope(prefix: str) -> str:
    return f"operations {prefix}*" if prefix else "all operations"


def format_accounting(report: Mapping[str, Any]) -> str:
    """``streams accounting report`` as text."""
    jobs = report["jobs_by_outcome"]
    posts, attempts = report["posts_per_operation"], report["post_attempts"]
    gets = report["gets_per_completed_operation"]
    waiting = ", ".join(
        f"{state} {d['operations']}" + (f" (oldest {format_age(d['oldest_age_s'])})" if d["operations"] else "")
        for state, d in report["needs_decision"].items()
    )
    sent_ok = attempts["max_sent"] <= 1
    lines = [
        f"accounting of {_scope(report['operation_prefix'])} at {format_time(report['now'])}",
        f"remote jobs learned of             {sum(jobs.values())}",
        f"  by outcome                       {_counts(jobs)}",
        f"  by how they were learned         {_counts(report['jobs_by_learned_via'])}",
        f"  learned only through a 502       {report['learned_only_via_502']}",
        f"  duplicate creations              {report['duplicate_creations']}",
        f"charges                            {_amounts(report['charges'], 'jobs')}",
        f"refunds settled                    {_amounts(report['refunds_settled'], 'refunds')}",
        f"refunds pending                    {report['refunds_pending']} (failed or canceled jobs charged, no refund)",
        f"waiting for a decision             {waiting}",
        f"POSTs per operation                {_stats(posts)} (every attempt, 429 and never-sent retries included)",
        f"  that may have created a job      max {attempts['max_sent']} (must be 1"
        + ("" if sent_ok else f"; BROKEN for {attempts['operations_sent_twice']} operations")
        + ")"
        + (
            f"; POSTs of {attempts['former_ids']} freed ids' former operations not counted"
            if attempts.get("former_ids")
            else ""
        ),
        f"GETs per completed operation       {_stats(gets)}",
    ]
    late = report.get("created_after_decision") or {"jobs": 0, "unobserved": 0, "first": []}
    lines.append(
        f"created after a decision           {late['jobs']} ({late['unobserved']} not observed"
        + ("" if not late["unobserved"] else ": adopt or cancel each, docs/decisions.md")
        + ")"
    )
    lines += [
        f"  {j['operation_id']} ({j['state']}): job {j['remote_job_id']}"
        + (
            f"  -> streams operations adopt {j['operation_id']} {j['remote_job_id']} --reason ..."
            if j["state"] == "rejected"
            else "  -> cancel it at the provider"
        )
        for j in late["first"]
    ]
    return "\n".join(lines)


def format_move(move: OperatorMove) -> str:
    """One line for an operator's decision written (:class:`streams.ledger.store.OperatorMove`)."""
    return (
        f"{move.action}: operation {move.operation_id} {move.from_state} -> {move.to_state} "
        f"(transition {move.transition_seq}, fencing value {move.fencing_token})"
    )
