"""``streams.errors.error_summary``: how every error message and log line names an exception it reports."""

from __future__ import annotations

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaError, RequestTimedOutError

from streams.errors import error_summary


class _NamesItself(Exception):
    def __str__(self) -> str:
        return "_NamesItself: broker 3 unreachable"


class Error(Exception):
    pass


class _StrRaises(Exception):
    def __str__(self) -> str:
        raise IndexError("tuple index out of range")  # as asyncpg's PostgresError() without arguments


@pytest.mark.parametrize(
    ("exc", "summary"),
    [
        (ValueError("bad port"), "ValueError: bad port"),
        (TimeoutError(), "TimeoutError"),  # an empty message: the name alone, no dangling colon
        (OSError("  \n"), "OSError"),  # a blank one too
        (ValueError("\nport 0 refused\n"), "ValueError: port 0 refused"),
        (_NamesItself(), "_NamesItself: broker 3 unreachable"),  # the name once
        (KafkaConnectionError("Unable to bootstrap"), "KafkaConnectionError: Unable to bootstrap"),
        (RequestTimedOutError(), "[Error 7] RequestTimedOutError"),  # a broker's error names itself after its code
        (RequestTimedOutError("in fetch"), "[Error 7] RequestTimedOutError: in fetch"),
        (Error("Errors occurred"), "Error: Errors occurred"),  # a message that only begins like the name
        (Error("Error occurred"), "Error: Error occurred"),
        (KafkaError(""), "KafkaError"),  # aiokafka's "KafkaError: " of an empty argument: no dangling colon
        (RequestTimedOutError(""), "[Error 7] RequestTimedOutError"),
        (_StrRaises(), "_StrRaises: <exception str() failed>"),
    ],
)
def test_error_summary_names_the_type_once_and_keeps_the_message(exc: BaseException, summary: str) -> None:
    assert error_summary(exc) == summary
