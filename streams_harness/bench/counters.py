"""What a benchmark run cost, read from the services' own counters (never from the program measured):

* Redis: ``INFO stats`` ``total_reads_processed`` (read events: one per request a client sends and waits for,
  however many commands it pipelines into it) and ``INFO commandstats`` (calls per command, the commands Lua
  scripts run included), on a Redis server of the benchmark's own
  (:class:`streams_harness.redis_server.PrivateRedis`) so that no other client is counted;
* PostgreSQL: ``pg_stat_database`` transactions of the run's own database (one per statement run outside an
  explicit transaction and one per statement prepared: a round trip each; an explicit transaction counts once);
* Kafka: the end offsets of the run's own topics (created empty for the run).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import asyncpg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from streams.config import Settings
from streams.ledger.sql import Queries

#: The benchmark's named queries (``streams_harness/queries/bench.sql``).
BENCH = Queries("bench.sql", package="streams_harness")


@dataclass(frozen=True)
class Counters:
    """One reading of the counters (see the module docstring)."""

    redis_reads: int
    redis_calls: dict[str, int]
    postgres_transactions: int
    kafka_messages: dict[str, int] = field(default_factory=dict)

    def minus(self, before: Counters, reading: Counters | None = None) -> Counters:
        """The increase since ``before``, less ``reading`` (what one reading itself adds to the next one, see
        :func:`redis_reading_cost`)."""
        extra_calls = reading.redis_calls if reading is not None else {}
        calls = {k: v - before.redis_calls.get(k, 0) - extra_calls.get(k, 0) for k, v in self.redis_calls.items()}
        return Counters(
            redis_reads=self.redis_reads - before.redis_reads - (reading.redis_reads if reading is not None else 0),
            redis_calls={k: v for k, v in calls.items() if v > 0},
            postgres_transactions=self.postgres_transactions - before.postgres_transactions,
            kafka_messages={
                k: v - before.kafka_messages.get(k, 0)
                for k, v in self.kafka_messages.items()
                if v - before.kafka_messages.get(k, 0)
            },
        )


async def redis_counters(url: str) -> tuple[int, dict[str, int]]:
    """``(total_reads_processed, {command: calls})`` of the Redis server at ``url`` (see
    :data:`READING_REDIS_READS` for what the reading itself adds)."""
    client = aioredis.Redis.from_url(url, lib_name=None, lib_version=None)
    try:
        stats = await client.info("stats")
        commands = await client.info("commandstats")
    finally:
        await client.aclose()
    calls = {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in commands.items()}
    return int(stats["total_reads_processed"]), calls


async def redis_reading_cost(url: str) -> Counters:
    """What one :func:`redis_counters` reading adds to the next (its connection's requests and close), measured
    on the idle server: the difference of two readings with nothing in between."""
    readings = [await redis_counters(url) for _ in range(3)]
    (reads_1, calls_1), (reads_2, calls_2) = readings[1], readings[2]
    return Counters(reads_2 - reads_1, {k: v - calls_1.get(k, 0) for k, v in calls_2.items()}, 0)


async def postgres_transactions(admin_url: str, database: str) -> int:
    """Transactions committed and rolled back in ``database``, read over a connection to ``admin_url`` (another
    database, so the reading adds none)."""
    conn = await asyncpg.connect(admin_url)
    try:
        value = await BENCH.database_transactions.fetchval(conn, database=database)
    finally:
        await conn.close()
    return int(value or 0)


async def settled_postgres_transactions(admin_url: str, database: str, timeout_s: float = 5.0) -> int:
    """:func:`postgres_transactions` once two readings 0.5 s apart agree (PostgreSQL publishes a backend's
    counts when it ends or at most every second), or after ``timeout_s``."""
    last = await postgres_transactions(admin_url, database)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.5)
        value = await postgres_transactions(admin_url, database)
        if value == last:
            break
        last = value
    return last


async def kafka_messages(settings: Settings) -> dict[str, int]:
    """Messages in each topic of ``settings`` (role -> sum of the partitions' end offsets)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
    await admin.start()
    await consumer.start()
    try:
        roles = {topic: role for role, topic in settings.topics.items()}
        described = await admin.describe_topics(list(roles))
        tps = [
            TopicPartition(t["topic"], p["partition"])
            for t in described
            if not t["error_code"]
            for p in t["partitions"]
        ]
        ends = await consumer.end_offsets(tps) if tps else {}
        counts = dict.fromkeys(settings.topics, 0)
        for tp, offset in ends.items():
            counts[roles[tp.topic]] += offset
        return counts
    finally:
        await consumer.stop()
        await admin.close()
