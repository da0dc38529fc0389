"""The runtime's waits (tenacity): what is retried, what is not, the waits between attempts, the deadlines,
what is counted and logged. The waits are recorded by replacing ``asyncio.sleep`` (what tenacity sleeps with)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

import aiokafka.errors
import fakeredis
import httpx
import pytest
from prometheus_client import Counter

from streams import metrics
from streams.config import Settings
from streams.errors import DeadLetterError, InvalidEventError, LedgerDataError, LedgerUnavailableError
from streams.ledger import waiting
from streams.worker.runtime import RawMessage, Runtime
from tests.fakes import fake_leases, fake_runtime

CAP_S = 0.5


@pytest.fixture
def settings(base_settings: Settings) -> Settings:
    return base_settings.replace(coordination_retry_cap_s=CAP_S)


@pytest.fixture
def redis_server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def rt(settings: Settings, redis_server: fakeredis.FakeServer) -> Runtime:
    return fake_runtime(settings, lambda request: httpx.Response(500), leases=fake_leases(settings, redis_server))


class Sleeps:
    """The waits asked of ``asyncio.sleep`` (each then yields once); ``on_sleep`` runs after each is recorded."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.on_sleep: Callable[[int], None] = lambda n: None

    def __len__(self) -> int:
        return len(self.waits)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sleeps]:
    real_sleep = asyncio.sleep
    recorded = Sleeps()

    async def sleep(delay: float, result: object = None) -> object:
        recorded.waits.append(delay)
        recorded.on_sleep(len(recorded.waits))
        return await real_sleep(0, result)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    yield recorded


def count(counter: Counter, *labels: str) -> float:
    return float(counter.labels(*labels)._value.get())


def outage_lines(caplog: pytest.LogCaptureFixture, service: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{service} unavailable, waiting")]


# --- acquire_waiting: Redis down is waited out without a deadline -------------------------------------------------


async def test_redis_down_is_waited_out_with_doubling_waits_up_to_the_cap(
    rt: Runtime, redis_server: fakeredis.FakeServer, sleeps: Sleeps, caplog: pytest.LogCaptureFixture
) -> None:
    redis_server.connected = False
    sleeps.on_sleep = lambda n: setattr(redis_server, "connected", n >= 6)  # answers again after the 6th wait
    before = count(metrics.COORDINATION_UNAVAILABLE, "test-acquire")
    with caplog.at_level(logging.WARNING):
        lease = await rt.acquire_waiting("app:observe:op-down", "test-acquire")
    assert lease is not None and lease.key == "app:observe:op-down"
    assert sleeps.waits == [0.1, 0.2, 0.4, CAP_S, CAP_S, CAP_S]
    assert count(metrics.COORDINATION_UNAVAILABLE, "test-acquire") == before + 6  # every failed attempt
    assert len(outage_lines(caplog, "Redis")) == 1  # an outage is logged at most every 5 s


async def test_a_lease_held_by_another_is_none_at_once(rt: Runtime, sleeps: Sleeps) -> None:
    assert await rt.acquire_waiting("app:observe:op-held", "test-held") is not None
    assert await rt.acquire_waiting("app:observe:op-held", "test-held") is None
    assert sleeps.waits == []


async def test_acquire_waiting_does_not_retry_other_errors(
    rt: Runtime, sleeps: Sleeps, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    async def broken(key: str) -> None:
        calls.append(key)
        raise TypeError("a bug in the lease path")

    monkeypatch.setattr(rt.leases, "acquire", broken)
    with pytest.raises(TypeError, match="a bug"):
        await rt.acquire_waiting("app:observe:op-bug", "test-bug")
    assert (calls, sleeps.waits) == (["app:observe:op-bug"], [])


# --- dead_letter: outages without a limit, other failures bounded -------------------------------------------------

MESSAGE = RawMessage("generation.submissions", 3, 41, b"op-dl", b"{not json")
ERROR = InvalidEventError("not_json", "not JSON")


def failing_send(failures: list[BaseException | None]) -> tuple[Callable[..., Awaitable[None]], list[bytes]]:
    """A send that raises ``failures`` in turn (None: the record is acknowledged); returns (send, acknowledged)."""
    acknowledged: list[bytes] = []

    async def send(topic: str, key: bytes, value: bytes) -> None:
        failure = failures.pop(0)
        if failure is not None:
            raise failure
        acknowledged.append(key)

    return send, acknowledged


async def test_a_dead_letter_kafka_refuses_ends_after_three_attempts(rt: Runtime, sleeps: Sleeps) -> None:
    refusals: list[BaseException | None] = [aiokafka.errors.MessageSizeTooLargeError() for _ in range(5)]
    rt.send, acknowledged = failing_send(refusals)
    before = count(metrics.UNEXPECTED_ERRORS, "dead letter")
    with pytest.raises(DeadLetterError, match=r"generation.submissions\[3\]@41 not published after 3 attempts") as e:
        await rt.dead_letter(MESSAGE, ERROR)
    assert isinstance(e.value.__cause__, aiokafka.errors.MessageSizeTooLargeError)
    assert (len(refusals), acknowledged) == (2, [])  # three attempts made
    assert sleeps.waits == [0.2, 0.4]  # none after the last
    assert count(metrics.UNEXPECTED_ERRORS, "dead letter") == before + 3


async def test_a_kafka_outage_is_waited_out_for_a_dead_letter(
    rt: Runtime, sleeps: Sleeps, caplog: pytest.LogCaptureFixture
) -> None:
    outage: list[BaseException | None] = [aiokafka.errors.KafkaConnectionError() for _ in range(5)]
    rt.send, acknowledged = failing_send([*outage, None])
    before = count(metrics.OUTAGE_WAITS, "Kafka", "dead letter")
    with caplog.at_level(logging.WARNING):
        await rt.dead_letter(MESSAGE, ERROR)
    assert acknowledged == [b"op-dl"]
    assert sleeps.waits == [0.2, 0.4, CAP_S, CAP_S, CAP_S]
    assert count(metrics.OUTAGE_WAITS, "Kafka", "dead letter") == before + 5
    assert len(outage_lines(caplog, "Kafka")) == 1


async def test_outages_do_not_count_towards_the_dead_letter_attempts(rt: Runtime, sleeps: Sleeps) -> None:
    def refused() -> BaseException:
        error: BaseException = aiokafka.errors.MessageSizeTooLargeError()  # aiokafka is untyped
        return error

    def outage() -> BaseException:
        error: BaseException = aiokafka.errors.KafkaConnectionError()
        return error

    failures: list[BaseException | None] = [refused(), outage(), refused(), outage(), outage(), refused(), None]
    rt.send, acknowledged = failing_send(failures)
    with pytest.raises(DeadLetterError, match="after 3 attempts"):
        await rt.dead_letter(MESSAGE, ERROR)
    assert (failures, acknowledged) == ([None], [])  # six attempts: the third refusal ended it
    assert len(sleeps) == 5


# --- the ledger's outage wait as the runtime sets it: PostgreSQL outages waited out for 10 minutes ---------------


def outage_wait(rt: Runtime) -> waiting.OutageWait:
    """The wait the runtime gave its ledger."""
    wait = rt.ledger.outage_wait
    assert wait is not None
    return wait


def flaky(failures: list[BaseException]) -> tuple[Callable[[], Awaitable[str]], list[int]]:
    """A ledger call that raises ``failures`` in turn, then answers ``"done"``; returns (call, attempts)."""
    attempts: list[int] = []

    async def call() -> str:
        attempts.append(len(attempts) + 1)
        if failures:
            raise failures.pop(0)
        return "done"

    return call, attempts


def unavailable(n: int) -> list[BaseException]:
    return [LedgerUnavailableError(f"PostgreSQL unavailable during save: attempt {i + 1}") for i in range(n)]


async def test_a_ledger_outage_is_retried_at_once_then_with_backoff(
    rt: Runtime, sleeps: Sleeps, caplog: pytest.LogCaptureFixture
) -> None:
    call, attempts = flaky(unavailable(4))
    before = count(metrics.LEDGER_UNAVAILABLE, "test save")
    with caplog.at_level(logging.WARNING):
        assert await outage_wait(rt).run("test save", call) == "done"
    assert attempts == [1, 2, 3, 4, 5]
    # the second attempt follows the first at once; then 0.1 s doubling plus up to 1 s of jitter, capped
    assert len(sleeps) == 3
    assert 0.1 <= sleeps.waits[0] <= 1.1 and all(0.2 <= w <= CAP_S for w in sleeps.waits[1:]), sleeps.waits
    assert count(metrics.LEDGER_UNAVAILABLE, "test save") == before + 4
    assert len(outage_lines(caplog, "PostgreSQL")) == 1


async def test_the_fast_path_makes_no_wait(rt: Runtime, sleeps: Sleeps) -> None:
    call, attempts = flaky([])
    assert await outage_wait(rt).run("test read", call) == "done"
    assert (attempts, sleeps.waits) == ([1], [])


async def test_a_refusal_by_postgresql_is_not_retried(rt: Runtime, sleeps: Sleeps) -> None:
    call, attempts = flaky([LedgerDataError("PostgreSQL refused the value: invalid input")])
    before = count(metrics.LEDGER_UNAVAILABLE, "test refused")
    with pytest.raises(LedgerDataError, match="refused the value"):
        await outage_wait(rt).run("test refused", call)
    assert (attempts, sleeps.waits) == ([1], [])
    assert count(metrics.LEDGER_UNAVAILABLE, "test refused") == before


async def test_a_ledger_outage_past_the_deadline_raises_the_last_error(
    rt: Runtime, sleeps: Sleeps, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(waiting, "LEDGER_OUTAGE_DEADLINE_S", 0.0)
    call, attempts = flaky(unavailable(10))
    with pytest.raises(LedgerUnavailableError, match=r"attempt 2$"):
        await outage_wait(rt).run("test give up", call)
    assert (attempts, sleeps.waits) == ([1, 2], [])


def test_an_outage_of_a_closing_runtime_is_not_logged_as_one(rt: Runtime, caplog: pytest.LogCaptureFixture) -> None:
    """A timer still running while the worker stops meets its own closed pool ("pool is closed"): no warning."""
    caplog.set_level(logging.DEBUG, logger="streams.worker.runtime")
    rt.log_outage("PostgreSQL", LedgerUnavailableError("PostgreSQL unavailable during fetch: pool is closed"))
    assert len(outage_lines(caplog, "PostgreSQL")) == 1
    rt._last_outage_log.clear()
    caplog.clear()
    rt.closing = True
    rt.log_outage("PostgreSQL", LedgerUnavailableError("PostgreSQL unavailable during fetch: pool is closed"))
    assert outage_lines(caplog, "PostgreSQL") == []
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records] == [
        (logging.DEBUG, "PostgreSQL closed while this worker stops")
    ]
