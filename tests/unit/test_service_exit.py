"""A service that did not answer ends a command, and a harness run in the step it was in, with one message and exit
5 (:func:`streams.cli.service_exit`, :func:`streams_harness.cli._run_job`); a refusal keeps exit 1, a bug its
traceback."""

from __future__ import annotations

import asyncio

import aiokafka.errors
import click
import pytest
import redis.exceptions

from streams.cli import CommandExit, service_exit
from streams.errors import EXIT_UNAVAILABLE, KafkaAdminError, LedgerUnavailableError
from streams_harness.cli import _run_job
from streams_harness.mainjob import MainJobError
from streams_harness.run import RunSteps


def test_a_kafka_connection_error_is_kafka_not_answering_with_what_to_do() -> None:
    failed = service_exit(aiokafka.errors.KafkaConnectionError("Unable to bootstrap from [('h', 1)]"), "streams x")
    assert isinstance(failed, CommandExit)
    assert failed.exit_code == EXIT_UNAVAILABLE == 5
    assert failed.message == (
        "streams x stopped: Kafka did not answer: KafkaConnectionError: Unable to bootstrap from [('h', 1)]. "
        "What to do: check that the brokers of STREAMS_KAFKA_BOOTSTRAP are up (`streams ready --service kafka`), "
        "then run it again"
    )


def test_an_admin_error_is_classified_by_its_cause_and_said_without_its_own_advice() -> None:
    cause = aiokafka.errors.KafkaConnectionError("refused")
    exc = KafkaAdminError("connect", "h:1", attempts=3, elapsed_s=2.0, cause=cause)
    failed = service_exit(exc, "streams migrate")
    assert failed is not None and failed.exit_code == 5
    assert failed.message.startswith(
        "streams migrate stopped: Kafka did not answer: Kafka admin call 'connect' on h:1 failed after 3 attempts "
        "over 2.0 s: KafkaConnectionError: refused. What to do:"
    )
    assert failed.message.count("then run") == 1


@pytest.mark.parametrize(
    ("exc", "service"),
    [
        (LedgerUnavailableError("PostgreSQL unavailable during connect"), "PostgreSQL"),
        (redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:1"), "Redis"),
        (RuntimeError("wrapped"), "Redis"),
    ],
)
def test_each_service_is_named(exc: Exception, service: str) -> None:
    if isinstance(exc, RuntimeError):
        exc.__cause__ = redis.exceptions.ConnectionError("reset")
    failed = service_exit(exc, "streams y")
    assert failed is not None and failed.exit_code == 5
    assert f"stopped: {service} did not answer: " in failed.message
    assert "\n" not in failed.message


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("a bug"),
        aiokafka.errors.TopicAuthorizationFailedError(),
        KafkaAdminError("create topics", "h:1", attempts=1, elapsed_s=0.1, cause=aiokafka.errors.InvalidTopicError()),
    ],
)
def test_a_refusal_or_a_bug_is_not_a_service_outage(exc: Exception) -> None:
    assert service_exit(exc, "streams z") is None


async def _stopped_in_replay(exc: Exception) -> None:
    steps = RunSteps()
    try:
        steps.enter("replay: submit")
        await asyncio.sleep(0)
        raise exc
    except Exception as caught:
        raise steps.stopped(caught) from caught


def test_a_run_stopped_by_kafka_exits_5_naming_its_step() -> None:
    with pytest.raises(CommandExit) as e:
        _run_job(_stopped_in_replay(aiokafka.errors.KafkaConnectionError("gone")), "streams run")
    assert e.value.exit_code == 5
    assert e.value.message.startswith(
        "streams run in step 'replay: submit' stopped: Kafka did not answer: KafkaConnectionError: gone."
    )


def test_a_run_stopped_by_its_own_error_exits_1_naming_its_step() -> None:
    with pytest.raises(click.ClickException) as e:
        _run_job(_stopped_in_replay(MainJobError("worker processes exited")), "streams run")
    assert e.value.exit_code == 1 and not isinstance(e.value, CommandExit)
    assert e.value.message == "streams run in step 'replay: submit': worker processes exited"


def test_a_bug_in_a_run_keeps_its_traceback() -> None:
    with pytest.raises(TypeError, match="a bug"):
        _run_job(_stopped_in_replay(TypeError("a bug")), "streams run")
