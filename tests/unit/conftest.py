"""Unit-tier fixtures: every log record of the product names the operation id once (in its fields, not again in
its message), checked in every unit test at DEBUG (:func:`operation_id_named_once`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from streams import logs


class OperationIdRecords(logging.Handler):
    """Keeps, of the records it handles, ``named`` (those with an ``operation_id`` field, bound or ``extra=``) and
    ``doubled`` (those of them whose line names the id again: in its template, or as one of its arguments), as
    text lines. An error's own text that names the operation (streams.errors: errors say for which operation)
    is not the line naming it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.named: list[str] = []
        self.doubled: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        operation_id = logs.record_fields(record).get("operation_id")  # the bound context is the caller's, here
        if operation_id is None:
            return
        line = f"{record.name}: {record.getMessage()} [operation_id={operation_id}]"
        self.named.append(line)
        args = record.args if isinstance(record.args, tuple) else ()
        if str(operation_id) in str(record.msg) or any(str(a) == str(operation_id) for a in args):
            self.doubled.append(line)


@pytest.fixture(autouse=True)
def operation_id_named_once() -> Iterator[OperationIdRecords]:
    """Collect the product's records (logger ``streams``, every level) while the test runs; fail the test when one
    carries the operation id both as a field and in its message text (:data:`streams.logs.FIELDS`)."""
    records = OperationIdRecords()
    logger = logging.getLogger("streams")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert records.doubled == [], "log lines naming the operation id twice (in the message and as a field)"
