"""``streams.errors.error_summary``: how every error message and log line names an exception it reports."""

from __future__ import annotations

import pytest
from aiokafka.errors import KafkaConnectionError

from streams.errors import error_summary


class _NamesItself(Exception):
    def __str__(self) -> str:
        return "_NamesItself: broker 3 unreachable"


@pytest.mark.parametrize(
    ("exc", "summary"),
    [
        (ValueError("bad port"), "ValueError: bad port"),
        (TimeoutError(), "TimeoutError"),  # an empty message: the name alone, no dangling colon
        (_NamesItself(), "_NamesItself: broker 3 unreachable"),  # the name once, as aiokafka's messages give it
        (
            KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1, 0)]"),
            "KafkaConnectionError: Unable to bootstrap from [('127.0.0.1', 1, 0)]",
        ),
    ],
)
def test_error_summary_names_the_type_once_and_keeps_the_message(exc: BaseException, summary: str) -> None:
    assert error_summary(exc) == summary
