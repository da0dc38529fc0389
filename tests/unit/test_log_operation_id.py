"""The operation id is named once per log line: as the record's field (bound by the stage, or ``extra=``), not
again in the message (``tests/unit/conftest.py`` checks every unit test's records; this pins that the check sees
records and catches a doubled one)."""

from __future__ import annotations

import logging

from streams import logs
from tests.unit.conftest import OperationIdRecords


def test_a_record_naming_its_bound_operation_id_in_the_message_is_doubled() -> None:
    records = OperationIdRecords()
    log = logging.getLogger("tests.log_operation_id")
    log.addHandler(records)
    try:
        logs.bind(operation_id="op-7")
        log.warning("operation %s: POST %s", "op-7", "unknown_outcome")
        log.warning("POST %s", "unknown_outcome")
        logs.clear()
        log.warning("operation %s not bound: named in the message only", "op-8")
        log.warning("GET %s", "transient", extra={"operation_id": "op-9"})
        log.warning("GET of %s: %s", "op-9", "transient", extra={"operation_id": "op-9"})
        log.warning("GET of op-9: %s", "transient", extra={"operation_id": "op-9"})
        log.warning("refused: %s", "submission op-9: another request", extra={"operation_id": "op-9"})
    finally:
        log.removeHandler(records)
        logs.clear()
    assert records.named == [
        "tests.log_operation_id: operation op-7: POST unknown_outcome [operation_id=op-7]",
        "tests.log_operation_id: POST unknown_outcome [operation_id=op-7]",
        "tests.log_operation_id: GET transient [operation_id=op-9]",
        "tests.log_operation_id: GET of op-9: transient [operation_id=op-9]",
        "tests.log_operation_id: GET of op-9: transient [operation_id=op-9]",
        "tests.log_operation_id: refused: submission op-9: another request [operation_id=op-9]",
    ]
    assert records.doubled == records.named[0:1] + records.named[3:5]  # an error's own text is not the line's
