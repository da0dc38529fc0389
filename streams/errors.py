"""The project's exception tree: every error raised on purpose derives from :class:`StreamsError`.

::

    StreamsError
    ├── ConfigError                  a setting is missing or malformed (fix the environment and restart)
    │   ├── DatabaseConfigError            PostgreSQL refused the login, has no such database, its URL does
    │   │                                  not parse, or it refused the URL's TLS settings: not an outage
    │   ├── KafkaSecurityError             Kafka refused the SASL login or the TLS handshake failed
    │   └── TopicLayoutError               ``migrate --strict-topics``: a topic differs from the settings
    ├── MissingResourceError         a file the package ships (schema, migration, query) is not installed
    ├── QueryParametersError         a named query called without one of its parameters, or with one it does not
    │                                take: a bug at the call site, nothing was sent
    ├── InvalidEventError            a Kafka value failed its JSON Schema or is not JSON (goes to the DLQ)
    ├── JsonValueError               JSON text that is not JSON or whose numbers cannot be carried exactly
    ├── DeadLetterError              a dead letter could not be published for a reason that is not an outage
    ├── CoordinationError            Redis leases
    │   ├── CoordinationUnavailableError   Redis did not answer: make no claim, make no remote call
    │   ├── CoordinationBusyError          no pooled Redis connection came free in time: this worker's own
    │   │                                  load, not an outage; try again shortly
    │   ├── LeaseLostError                 renewal/ownership check found another token (or none)
    │   └── RateBudgetDeadlineError        the account's rate budget had no slot before the caller's deadline:
    │                                      nothing was sent
    ├── LedgerError                  PostgreSQL ledger
    │   ├── LedgerUnavailableError         PostgreSQL did not answer: wait and retry, never skip the write
    │   ├── LedgerDataError                PostgreSQL refused a value (class 22/23/54): retrying cannot help
    │   ├── UnknownOperationError          an event or a command names an operation the ledger does not hold
    │   └── OperatorActionRefusedError     an operator's command does not apply (wrong state, bad job id)
    ├── KafkaAdminError              a Kafka admin call (topics, consumer groups) failed, or kept failing past its
    │                                deadline with errors the broker calls retriable
    ├── SharedResourceRefusedError   a removal would touch unprefixed (shared) topics or the ledger the
    │                                settings name, without the explicit flag: nothing removed
    ├── ServiceNotReadyError         a backing service did not answer real commands within the deadline
    ├── CallbackRefusedError         a completion callback refused (bad or stale signature, malformed, oversized,
    │                                unknown job); carries a bounded ``reason`` and the HTTP status answered
    └── RemoteError                  the remote generation API (always carries ``operation_id``)
        ├── RemoteRefusedError             definite refusal, nothing created (4xx such as 400/422)
        │   └── RemoteRateLimitedError     429: nothing created, retry after ``retry_after_s``
        ├── RemoteNotSentError             connection refused/not established: no byte of the request sent
        ├── RemoteUnknownOutcomeError      sent, outcome unknown (timeout/connection lost after send,
        │                                  5xx without ``error.job_id``): the operation becomes ``uncertain``
        ├── RemoteJobNotFoundError         GET answered 404 for a saved remote job id
        ├── RemoteUnknownStatusError       GET answered 200 with a status the client does not know
        ├── RemoteContractError            a GET answer that breaks the API contract (e.g. output ids)
        └── RemoteTransientError           a GET failed in a way worth retrying later (5xx, not sent, ...)
            └── RemoteAbandonedError       a GET cut off after its request was sent (deadline, timeout,
                                           connection lost): the provider may still be serving it

A POST is retried only on :class:`RemoteNotSentError` and :class:`RemoteRateLimitedError`; everything else that
was sent is never re-sent (docs/guarantees.md).
"""

from __future__ import annotations

import re
from typing import ClassVar

from streams.model.codes import CallbackRefusal, RemoteCallOutcome


def error_summary(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` for an error message or a log line: its type's name once (a message that is the
    name or starts with it and a colon, as aiokafka's ``KafkaConnectionError: ...`` and a broker error's ``[Error 7]
    RequestTimedOutError`` do, is kept as it is) and the name alone when the message is empty or blank. The message
    is stripped of surrounding whitespace (and of a colon with nothing after it); it is otherwise the exception's
    own (what it may say is the raiser's concern). An exception whose ``str()`` raises is named with a note saying
    so, as :mod:`traceback` does."""
    name = type(exc).__name__
    try:
        text = str(exc).strip()
    except Exception:
        return f"{name}: <exception str() failed>"
    itself = _NAMES_ITSELF.match(text)
    if itself is not None and itself.group("name") == name:
        return text[:-1] if text[itself.end() :] == "" and text.endswith(":") else text
    return f"{name}: {text}" if text else name


#: A message that begins with its exception's name: ``Name``, ``Name: ...``, or aiokafka's broker errors
#: ``[Error 7] Name...`` (``aiokafka/errors.py``, ``BrokerResponseError.__str__``).
_NAMES_ITSELF = re.compile(r"(?:\[Error -?\d+\] )?(?P<name>\w+)(?::|$)")


class StreamsError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(StreamsError):
    """A setting is missing or malformed; the message names the variable and what to set it to."""


#: Exit status of a command (and of the worker) stopped by a :class:`ConfigError`: a supervisor restarting the
#: process cannot fix it (docs/operations.md).
EXIT_CONFIG = 6
#: Exit status of a command (and of the worker) stopped because a service (PostgreSQL, Redis, Kafka) did not
#: answer or broke the connection: running it again once the service is back can succeed (docs/operations.md).
EXIT_UNAVAILABLE = 5


class DatabaseConfigError(ConfigError):
    """The PostgreSQL connection settings are wrong, not the server down: it refused the user or password
    (SQLSTATE class 28), the database does not exist (3D000), or ``STREAMS_DATABASE_URL`` does not parse (a port
    that is not a number). The message names host, port and database (never the password) and what to fix;
    retrying cannot help (:func:`streams.ledger.pool.connect_config_error`)."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(message)
        self.address = address


class DatabasePrivilegeError(ConfigError):
    """PostgreSQL refused a statement because the login role lacks the privilege (SQLSTATE 42501): the command
    needs another role, e.g. ``streams migrate`` and dropping a database need the database's owner, which the
    group roles of migration 0008 are not (docs/operating-data.md, "Roles"). The message names the role, where,
    and what to do; retrying as the same role cannot help (exit 6)."""


class MissingResourceError(StreamsError):
    """A file the package ships (a JSON Schema, a migration, a named query) is missing from the installation;
    the message names it. Reinstall the package; nothing was done."""


class QueryParametersError(StreamsError):
    """A named query (``streams.ledger.sql``) was called with parameter names other than its own: ``missing`` (not
    given) and ``unknown`` (given, but the query does not take them). A bug at the call site; nothing was sent
    to PostgreSQL. Fix the call to name exactly the parameters the query's ``.sql`` file documents."""

    def __init__(self, source: str, query: str, missing: list[str], unknown: list[str]) -> None:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(unknown)}")
        super().__init__(
            f"query {query!r} of {source} called with the wrong parameters ({'; '.join(parts)}); nothing was sent: "
            f"pass exactly the parameters its .sql file documents"
        )
        self.source = source
        self.query = query
        self.missing = missing
        self.unknown = unknown


class InvalidEventError(StreamsError):
    """A Kafka value is not JSON, is too large, or fails its topic's JSON Schema.

    ``reason`` is a short machine-readable code (``not_json``, ``number_out_of_range``, ``too_deep``, ``schema``,
    ``oversized``, ``unknown_operation``, ``key_mismatch``, ``conflicting_duplicate``, ``processing_error``,
    ``unpublishable``: an outbox row Kafka refused for good) and the message says what was wrong; the original
    bytes go to the dead-letter topic with both.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class JsonValueError(StreamsError):
    """JSON text that is not JSON, or holds a value that cannot be carried exactly (``NaN``, a number too long).

    ``reason`` is ``not_json``, ``number_out_of_range`` or ``too_deep`` (nested more than
    :data:`streams.wire.exactjson.MAX_DEPTH` levels); ``path`` names the field (``outputs/0/seed``,
    ``(root)``) when the text parsed; the message says what was wrong (:mod:`streams.wire.exactjson`).
    """

    def __init__(self, reason: str, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.path = path


class CoordinationError(StreamsError):
    """A Redis lease operation failed."""


class CoordinationUnavailableError(CoordinationError):
    """Redis did not answer (refused, timed out, reset). Workers make no new claims and no remote calls."""


class CoordinationBusyError(CoordinationError):
    """No connection of this worker's Redis pool came free within ``redis_pool_timeout_s``.

    The worker's own load, not a Redis outage: the command was not sent; try again shortly. If it recurs, the
    pool is smaller than the work sharing it (see ``Settings.redis_max_connections``).
    """


class DeadLetterError(StreamsError):
    """A dead letter could not be published, and not because Kafka is down (e.g. the broker refused the record
    as too large). Raised after a bounded number of attempts so the failure surfaces instead of looping: the
    event is neither processed nor recorded; fix the cause and let the event be consumed again."""


class RecordNotHandedOverError(StreamsError):
    """A record of a Kafka send round was not handed to the producer within the round's wait: an earlier record's
    hand-over waited on a full batch of a partition that does not acknowledge. Nothing of it was sent; the caller
    sends it again in a later round (its own partition is not at fault)."""


class LeaseLostError(CoordinationError):
    """The lease key no longer holds our owner token (expired, or taken by a newer holder).

    Raised by renewal; the holder must stop: no further remote call and no save for that operation.
    """

    def __init__(self, key: str) -> None:
        super().__init__(
            f"lease {key!r} is no longer ours (expired or taken by another owner token); "
            "stop work on this operation: the ledger's fencing value decides who may save"
        )
        self.key = key


class RateBudgetDeadlineError(CoordinationError):
    """The provider account's rate budget (:mod:`streams.coordination.ratebudget`) had no slot for this call before the
    caller's deadline (budget spent, or a 429's pause lasting past it). Nothing was sent."""

    def __init__(self, kind: str, account: str, detail: str) -> None:
        super().__init__(f"no {kind} slot of the rate budget of account {account!r} before the deadline ({detail})")
        self.kind = kind


class LedgerError(StreamsError):
    """A PostgreSQL ledger operation failed in a way the caller must handle."""


class LedgerUnavailableError(LedgerError):
    """PostgreSQL is unreachable or the connection broke; the write did not happen (or was rolled back)."""


class LedgerDataError(LedgerError):
    """PostgreSQL refused the values of a write (data exception, integrity violation, or a value past a program
    limit such as an index row); nothing was written and retrying the same write cannot succeed. The caller
    records the operation's outcome another way."""


class KafkaAdminError(StreamsError):
    """A Kafka admin call (create/delete/list topics, find a group coordinator, describe a consumer group) failed.

    Either the broker answered with a definite error (an invalid topic name, a policy refusal), or it kept
    answering with errors it calls retriable (no group coordinator yet, coordinator loading, not the controller,
    connection refused) until the deadline. ``call`` names the call, ``attempts`` and ``elapsed_s`` say how hard it
    was tried; the message says what to check.
    """

    def __init__(self, call: str, bootstrap: str, *, attempts: int, elapsed_s: float, cause: BaseException) -> None:
        retried = f" after {attempts} attempts over {elapsed_s:.1f} s" if attempts > 1 else ""
        said = error_summary(cause)
        #: What failed, without what to do: ``Kafka admin call 'connect' on HOST:PORT failed ...: ERROR``.
        self.failure = f"Kafka admin call {call!r} on {bootstrap} failed{retried}: {said}"
        super().__init__(
            f"{self.failure}. "
            "Check that the broker is up and can coordinate consumer groups (`scripts/services up` waits for that; "
            "`streams ready --service kafka` checks it), then run again"
        )
        self.call = call
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.cause = cause


class SharedResourceRefusedError(StreamsError):
    """A removal (``streams teardown``, :func:`streams.setup.admin.delete_topics`) would touch the shared names:
    topics without a prefix (``generation.*``, every deployment's on this broker) or the database the settings
    name. Nothing was removed; give a prefix or a run id, or pass the explicit flag the message names."""


class TopicLayoutError(ConfigError):
    """``streams migrate --strict-topics``: an existing topic's partitions, replication factor or
    ``min.insync.replicas`` differ from the settings (``differences``: one ``topic: what`` phrase each)."""

    def __init__(self, differences: list[str]) -> None:
        super().__init__(
            "topics differ from the settings: " + "; ".join(differences) + ". Change the topics (kafka-topics "
            "--alter, kafka-reassign-partitions, kafka-configs) or the settings, then run streams migrate again"
        )
        self.differences = differences


class KafkaSecurityError(ConfigError):
    """A Kafka client could not connect with its security settings: the broker refused the SASL login, the
    broker's certificate is not trusted or does not name its host, or TLS met a plaintext port (or the reverse).
    Waiting cannot fix it: exit 6."""

    def __init__(self, bootstrap: str, cause: str) -> None:
        super().__init__(f"Kafka at {bootstrap}: {cause}; fix the STREAMS_KAFKA_* security settings")
        self.bootstrap = bootstrap


class ServiceNotReadyError(StreamsError):
    """A backing service (``kafka``, ``postgres``, ``redis``) did not answer real commands within the deadline,
    or its process exited while we waited; the message names the service, its address and the last error."""

    def __init__(self, service: str, message: str) -> None:
        super().__init__(f"{service}: {message}")
        self.service = service


class CallbackRefusedError(StreamsError):
    """A completion callback refused before it changed anything (docs/callbacks.md).

    ``reason`` is the bounded label of ``streams_callbacks_refused_total``, ``status`` the HTTP status answered.
    The message never quotes the body or a signature.
    """

    def __init__(self, reason: CallbackRefusal, status: int, message: str) -> None:
        super().__init__(f"completion callback refused ({reason}): {message}")
        self.reason = reason
        self.status = status


class UnknownOperationError(LedgerError):
    """A command names an operation id that the ledger does not hold."""

    def __init__(self, operation_id: str) -> None:
        super().__init__(f"operation {operation_id!r} is not in the ledger; check the operation id")
        self.operation_id = operation_id


class OperatorActionRefusedError(LedgerError):
    """An operator's command (``adopt``, ``abandon``, ``repoll``, ``fail``) does not apply to the operation as the
    ledger holds it; nothing was written. ``state`` is the operation's current state (None when the command's
    input was refused before reading it); the message says what the command needs."""

    def __init__(self, operation_id: str, action: str, message: str, *, state: str | None = None) -> None:
        super().__init__(f"{action} operation {operation_id!r} refused: {message}")
        self.operation_id = operation_id
        self.action = action
        self.state = state


class DeadLetterReadError(StreamsError):
    """The dead-letter topic could not be read or written by an operator's command (Kafka did not answer in time,
    or the topic is missing): the message names the topic and what to do."""


class RedriveRefusedError(StreamsError):
    """A re-drive of dead letters was refused before anything was published (no reason or actor given, or a fixed
    value for more than one dead letter)."""


class RemoteError(StreamsError):
    """A call to the remote generation API failed; ``operation_id`` and ``status_code`` (if any) say where,
    ``outcome`` (a class attribute) is what the ledger's accounting records for it."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.TRANSIENT

    def __init__(self, operation_id: str, message: str, *, status_code: int | None = None) -> None:
        super().__init__(f"operation {operation_id}: {message}")
        self.operation_id = operation_id
        self.status_code = status_code


class RemoteRefusedError(RemoteError):
    """The API refused with a definite answer that no job was created (4xx). The operation ends ``rejected``."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.REFUSED

    def __init__(self, operation_id: str, message: str, *, status_code: int | None, code: str) -> None:
        super().__init__(operation_id, message, status_code=status_code)
        self.code = code


class RemoteRateLimitedError(RemoteRefusedError):
    """HTTP 429, or a 4xx whose ``error.code`` is one of ``remote_throttled_codes`` (a provider's "throttled"):
    nothing was created; retry after ``retry_after_s`` seconds."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.RATE_LIMITED

    def __init__(
        self, operation_id: str, retry_after_s: float, *, status_code: int = 429, code: str = "rate_limited"
    ) -> None:
        what = "rate limited" if status_code == 429 else f"throttled (HTTP {status_code} {code})"
        super().__init__(operation_id, f"{what}, retry after {retry_after_s:.3f} s", status_code=status_code, code=code)
        self.retry_after_s = retry_after_s


class RemoteNotSentError(RemoteError):
    """The connection was refused or never established: no byte of the request left this process."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.NOT_SENT


class RemoteUnknownOutcomeError(RemoteError):
    """The request was sent and its outcome is unknown; a job may exist. Never re-send: mark ``uncertain``."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.UNKNOWN_OUTCOME


class RemoteJobNotFoundError(RemoteError):
    """A GET for a saved remote job id answered 404; ``answer`` is the raw answer (status code and body text),
    kept if the operation stalls. Providers commonly answer 404 for a few seconds after creating a job."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.JOB_NOT_FOUND

    def __init__(self, operation_id: str, message: str, *, answer: dict[str, object]) -> None:
        super().__init__(operation_id, message, status_code=404)
        self.answer = answer


class RemoteUnknownStatusError(RemoteError):
    """A GET answered 200 with a ``status`` this client does not know (``aborted``, ``paused``, ``null``, ...);
    ``answer`` is the raw answer, kept if the operation stalls."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.UNKNOWN_STATUS

    def __init__(self, operation_id: str, message: str, *, answer: dict[str, object]) -> None:
        super().__init__(operation_id, message, status_code=200)
        self.answer = answer


class RemoteContractError(RemoteError):
    """A response that breaks the API's contract (outputs without distinct string ids); the job ends ``failed``
    with this reason rather than delivering outputs that cannot be told apart."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.CONTRACT_VIOLATION


class RemoteTransientError(RemoteError):
    """An observation (GET) failed in a retryable way; the poll is rescheduled with backoff."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.TRANSIENT


class RemoteAbandonedError(RemoteTransientError):
    """A GET was cut off after its request was sent: the overall deadline, a read/write timeout, or the
    connection lost before the whole answer arrived. The provider may still be serving it, so the job's next
    GET must wait until it cannot be (the observer leaves the lease to expire and polls after it)."""

    outcome: ClassVar[RemoteCallOutcome] = RemoteCallOutcome.ABANDONED
