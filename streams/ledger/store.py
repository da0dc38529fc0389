"""The PostgreSQL ledger: operations, fenced transitions, outputs, outbox and remote-call accounting.

Every method is one statement (atomic), except the relay's batch. Writes of observations are *fenced*: they name
the fencing value the worker got when it claimed the operation and touch zero rows if a newer claim happened since
(seed: "Fence durable state changes separately"). The state order is enforced twice: by the ``WHERE`` clause of
each query (``states.can_transition``) and by the ``operations_guard`` trigger; the ``operations_log_transition``
trigger writes the transition log and its outbox event.

Batching (group commit, :mod:`streams.coalesce`; README "How it keeps its promises"): the statements every
operation makes on the hot path (accept, the dispatcher's claim and job-id save, the observer's claim, save and
reschedule, the accounting of remote calls) are coalesced across this worker's concurrent tasks: the requests made
while the previous batch of the same kind is on the wire go out as one statement over parallel arrays
(``streams/ledger/queries/ledger.sql``). Each caller still gets exactly the result its own statement would have given:

* an operation appears at most once per statement; a second request for it (two tasks handling one
  operation) goes in a later statement, in the order the requests were made;
* the rows are locked in ``operation_id`` order before they are changed, so two batches (two workers) never
  wait on each other in a cycle; a deadlock or serialization failure all the same (a statement of another
  kind) rolls the statement back, which is then run again (:data:`CONFLICT_ATTEMPTS`; counted in
  ``streams_ledger_conflicts_total``): nothing is written twice, nothing is lost, nothing is raised to the
  caller unless it keeps failing (then :class:`LedgerUnavailableError`, which callers wait out);
* a batch PostgreSQL refuses for one request's values (:class:`LedgerDataError`, e.g. a NUL in an output) is
  run again one statement per request, so only that request fails (``streams_ledger_batch_fallbacks_total``);
* a batch waits at most :data:`BATCH_LOCK_TIMEOUT` for a lock another transaction holds (an operator's
  command, a test holding a row): past it, nothing is written and each of its callers runs its request alone,
  waiting as long as it takes, so one held row never holds up the other operations (nor this kind's next
  batches);
* PostgreSQL unavailable fails the requests of that statement (and of its later statements) with
  :class:`LedgerUnavailableError`; the callers wait it out and send them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import asyncpg

from streams import metrics
from streams.coalesce import LINGER_UNDER_LOAD_S, Coalescer
from streams.errors import (
    DatabaseConfigError,
    LedgerDataError,
    LedgerUnavailableError,
    OperatorActionRefusedError,
    UnknownOperationError,
)
from streams.ledger.sql import ACCOUNTING, RECONCILE
from streams.ledger.sql import LEDGER as Q
from streams.ledger.sql import OPERATORS as OPS
from streams.model.answers import JOB_ID, JobSnapshot, LookupJob, clean_text
from streams.model.codes import ReasonCode, RemoteCallOutcome
from streams.model.states import POLLABLE, OperationState, can_transition, is_terminal
from streams.outages import is_outage
from streams.wire import exactjson

log = logging.getLogger(__name__)

#: Most requests in one batched statement.
BATCH_MAX = 256

#: Batched statements of one kind on the wire at once per worker; the requests made meanwhile form the next one.
#: One: measured against two with ``streams bench`` (fewer, larger batches: less CPU and fewer round trips per
#: operation, README "Benchmark"), and seven kinds then need at most seven pooled connections.
BATCH_IN_FLIGHT = 1

#: Attempts at one statement that PostgreSQL rolled back as a deadlock victim or a serialization failure
#: (SQLSTATE class 40: nothing was written; running it again is safe). Past them: LedgerUnavailableError.
CONFLICT_ATTEMPTS = 8

#: How long a batched statement waits for a lock held by another transaction (PostgreSQL ``lock_timeout``, set
#: for that statement only) before its requests are run one by one, each waiting as long as it takes (``"0"``).
BATCH_LOCK_TIMEOUT = "100ms"
WAIT_FOR_LOCKS = "0"

#: One request of a batched statement: its parameters, the operation id first.
Request = tuple[Any, ...]

#: Runs one batched statement for distinct operations: (requests, lock_timeout) -> one result per request, in the
#: same order.
Statement = Callable[[list[Request], str], Awaitable[list[Any]]]


class _RunAlone:
    """A batch's answer to a request whose statement waited too long for a lock: its caller runs it alone."""


RUN_ALONE = _RunAlone()


#: What PostgreSQL answers when it refuses a statement for the values it was given (nothing written; the same
#: values always fail): class 22 (data exception: a NUL in a text, a number out of range), class 23 (integrity
#: constraint violation) and class 54 (program limit exceeded: a value too large for an index row, e.g. an output
#: id of a few kB, or for a jsonb). :class:`LedgerDataError`; a batch holding one is run again request by request.
REFUSED_VALUES = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError, asyncpg.ProgramLimitExceededError)


@contextlib.asynccontextmanager
async def _guard(what: str) -> AsyncIterator[None]:
    try:
        yield
    except REFUSED_VALUES as exc:
        raise LedgerDataError(f"PostgreSQL refused the values of {what}: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        if is_outage(exc):  # streams.outages: connection errors, shutdown, too many connections, timeouts
            raise LedgerUnavailableError(f"PostgreSQL unavailable during {what}: {type(exc).__name__}: {exc}") from exc
        raise


def _encode_json(value: Any) -> str:
    return exactjson.dumps(value).decode()


async def _init_connection(conn: asyncpg.Connection) -> None:
    """json/jsonb codecs with every number exact (:mod:`streams.wire.exactjson`): jsonb stores numbers as
    ``numeric``, so a 2**64 written here is read back as the same int (orjson would round it to a double)."""
    for typename in ("json", "jsonb"):
        await conn.set_type_codec(typename, encoder=_encode_json, decoder=exactjson.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool reset hook: asyncpg already rolled back any open transaction; the ledger keeps no session state
    (no SET, LISTEN, cursors or session advisory locks), so the default reset round trip is skipped."""


async def create_pool(database_url: str, *, min_size: int = 2, max_size: int = 10) -> asyncpg.Pool:
    """An asyncpg pool whose connections encode/decode json and jsonb with every number exact.

    Raises:
        LedgerUnavailableError: PostgreSQL did not accept the connection.
        DatabaseConfigError: it refused the login, has no such database, or ``database_url`` does not parse.
    """
    try:
        async with _guard("connect"):
            pool: asyncpg.Pool = await asyncpg.create_pool(
                database_url,
                min_size=min_size,
                max_size=max_size,
                init=_init_connection,
                reset=_keep_session,
                command_timeout=30,
            )
    except CONNECT_CONFIG_ERRORS as exc:
        raise connect_config_error(database_url, exc) from exc
    return pool


async def connect(database_url: str) -> asyncpg.Connection:
    """One plain connection to ``database_url`` (no json codecs: for administration, not the ledger's rows).

    Raises:
        LedgerUnavailableError: PostgreSQL did not accept the connection.
        DatabaseConfigError: it refused the login, has no such database, or ``database_url`` does not parse.
    """
    try:
        async with _guard("connect"):
            conn: asyncpg.Connection = await asyncpg.connect(database_url)
    except CONNECT_CONFIG_ERRORS as exc:
        raise connect_config_error(database_url, exc) from exc
    return conn


#: What a connection attempt raises when its settings are wrong, not when the server is down: SQLSTATE class 28
#: (invalid authorization: a wrong password, an unknown role), 3D000 (no such database), and ValueError (asyncpg
#: could not parse the URL, e.g. a port that is not a number, or refused one of its parameters with
#: ``ClientConfigurationError``, e.g. ``sslmode=bogus``; :mod:`streams.outages` never counts those as outages), and
#: OverflowError (a port above 65535: asyncpg parses it, the socket's connect refuses it).
CONNECT_CONFIG_ERRORS = (
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
    ValueError,
    OverflowError,
)

#: Seconds :func:`diagnose_connect` waits for PostgreSQL to answer a login.
DIAGNOSE_TIMEOUT_S = 5.0


def database_address(database_url: str) -> str:
    """``host:port/database`` of a PostgreSQL URL as written, without user, password or query parameters (which
    may hold a password); parses nothing, so it works on a URL that does not parse."""
    rest = database_url.partition("://")[2] or database_url
    return rest.rpartition("@")[2].partition("?")[0]


#: Characters that end the user info of a URL early when written unencoded in a password: the URL parser then
#: reads a piece of the password as the port or the path, and a client's error may quote that piece.
URL_DELIMITERS = "/?#"


def _password(database_url: str) -> str:
    """The password of a PostgreSQL URL as written (user info up to its last ``@``); empty when none."""
    userinfo = (database_url.partition("://")[2] or database_url).rpartition("@")[0]
    return userinfo.partition(":")[2]


def _without_password(text: str, database_url: str) -> str:
    """``text`` with the URL's password (user info, as written or decoded) replaced by ``***``."""
    password = _password(database_url)
    for secret in {password, unquote(password)} - {""}:
        text = text.replace(secret, "***")
    return text


def connect_config_error(database_url: str, exc: BaseException) -> DatabaseConfigError:
    """The :class:`DatabaseConfigError` for ``exc``, one of :data:`CONNECT_CONFIG_ERRORS` raised by a connection
    attempt to ``database_url``: what failed, where (host, port, database; never the password) and what to fix."""
    address = database_address(database_url)
    detail = _without_password(str(exc), database_url)
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        message = (
            f"PostgreSQL at {address} refused the login: {detail}; fix the user and password in STREAMS_DATABASE_URL"
        )
    elif isinstance(exc, asyncpg.InvalidCatalogNameError):
        message = (
            f"PostgreSQL at {address}: {detail}; create it (as the database owner) or fix the database name in "
            "STREAMS_DATABASE_URL, then run streams migrate"
        )
    elif any(char in _password(database_url) for char in URL_DELIMITERS):
        # The client's error would quote a piece of the password (the part before the delimiter, read as the
        # port): name the cause instead of echoing it.
        message = (
            f"STREAMS_DATABASE_URL ({address}) does not parse: its password holds an unencoded '/', '?' or '#'; "
            "percent-encode them (%2F, %3F, %23)"
        )
    elif isinstance(exc, asyncpg.ClientConfigurationError):
        message = (
            f"STREAMS_DATABASE_URL ({address}) is refused by the PostgreSQL client: {detail}; "
            "write it as postgresql://USER:PASSWORD@HOST:PORT/DATABASE?PARAMETER=VALUE"
        )
    else:
        message = (
            f"STREAMS_DATABASE_URL ({address}) does not parse: {detail}; "
            "write it as postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
        )
    return DatabaseConfigError(address, message)


async def diagnose_connect(database_url: str) -> DatabaseConfigError | None:
    """Log in to ``database_url`` once (at most :data:`DIAGNOSE_TIMEOUT_S`) to tell wrong settings from an outage
    after a client that does not say which (psycopg, under yoyo's migrations) failed to connect.

    Returns:
        the :class:`DatabaseConfigError` when the settings are wrong; None when the login works or failed for
        another reason (an outage: the caller reports its own error).
    """
    try:
        conn = await asyncpg.connect(database_url, timeout=DIAGNOSE_TIMEOUT_S)
    except CONNECT_CONFIG_ERRORS as exc:
        return connect_config_error(database_url, exc)
    except Exception:  # an outage or anything else: not the settings' fault as far as a login can tell
        return None
    await conn.close()
    return None


class SaveOutcome(enum.StrEnum):
    """What happened to a fenced save."""

    SAVED = "saved"  # written (a transition, or a refresh of the same state)
    REFUSED_FENCING = "refused_fencing"  # a newer claim exists: the caller drops its result
    REFUSED_ORDER = "refused_order"  # the row is already at or past this state (e.g. late running)


@dataclass(frozen=True)
class ClaimBound:
    """The scheduler's back-pressure on poll claims (:mod:`streams.worker.stages.scheduler`): the polls claimed and not
    yet taken
    by an observer stay at most ``max(least, taken * take_target_s / pace_window_s)``, where ``taken`` is the number
    of polls the observers of every worker took in the last ``pace_window_s`` seconds (read from the ledger)."""

    #: The bound when the observers took few or none lately (polls).
    least: int
    #: How far back the observers' pace is read (s, > 0).
    pace_window_s: float
    #: How long the claimed polls may wait for an observer at that pace (s).
    take_target_s: float


@dataclass(frozen=True)
class DuePoll:
    """One poll claimed by the scheduler."""

    operation_id: str
    remote_job_id: str
    poll_claim_id: int


@dataclass(frozen=True)
class ObserveClaim:
    """The observer's claim: the fencing value every save must name; ``observed_for_s`` is how long the job has
    been observed (since its id was saved or an operator repolled it), by the database's clock."""

    fencing_token: int
    remote_job_id: str
    state: OperationState
    poll_count: int
    observed_for_s: float = 0.0


@dataclass(frozen=True)
class LookupClaim:
    """The reconciler's claim of one ``uncertain`` operation for a lookup: the fencing value its save must name,
    how long the operation has been uncertain (s), and the lookups claimed so far (this one included)."""

    operation_id: str
    fencing_token: int
    uncertain_for_s: float
    lookup_count: int


def sources_for(new: OperationState) -> list[str]:
    """States over which an observation of ``new`` may be saved: its legal predecessors among the pollable
    states, plus ``new`` itself when not terminal (a refresh). Never over ``stalled``: only an operator moves
    work out of it."""
    allowed = [s.value for s in OperationState if s in POLLABLE and can_transition(s, new)]
    if not is_terminal(new) and new in POLLABLE:
        allowed.append(new.value)
    return allowed


def _rounds(requests: Sequence[Request], distinct: bool) -> list[list[int]]:
    """Split a batch into statements: positions of ``requests``, each list holding an operation at most once
    (``distinct``; the n-th request for an operation goes in the n-th statement, keeping the order they were
    made), sorted by operation id."""
    if not distinct:
        return [sorted(range(len(requests)), key=lambda i: requests[i][0])]
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}
    for i, request in enumerate(requests):
        n = seen.get(request[0], 0)
        seen[request[0]] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    for positions in rounds:
        positions.sort(key=lambda i: requests[i][0])
    return rounds


def _by_position(rows: Sequence[asyncpg.Record], n: int) -> list[asyncpg.Record | None]:
    """The rows of a batched statement (column ``i``, from 1) placed at their request's position; None where a
    request returned no row."""
    placed: list[asyncpg.Record | None] = [None] * n
    for row in rows:
        placed[row["i"] - 1] = row
    return placed


def _columns(requests: Sequence[Request], width: int) -> list[list[Any]]:
    """The parallel arrays of a batched statement: column ``k`` of every request."""
    return [[request[k] for request in requests] for k in range(width)]


def _json_text(value: Any) -> str:
    return exactjson.dumps(value).decode()


@dataclass(frozen=True)
class OperatorMove:
    """The result of an operator's decision: the transition written.

    ``transition_seq`` is the operation's transition sequence number (the event id is
    ``transition:<operation_id>:<transition_seq>:<to_state>``); ``fencing_token`` the value the decision took.
    """

    operation_id: str
    action: str
    from_state: OperationState
    to_state: OperationState
    transition_seq: int
    fencing_token: int


class Ledger:
    """Typed access to the ledger's named queries (``streams/ledger/queries/ledger.sql``).

    Args:
        pool: from :func:`create_pool`.
        worker: this worker's name, written into the transition log and accounting.

        batching: coalesce the hot path's statements across concurrent tasks (module docstring); False sends
            one statement per call (the same statements, one row each), as a reference for tests and
            measurements.

    Every method raises :class:`LedgerUnavailableError` when PostgreSQL does not answer and
    :class:`LedgerDataError` when it refuses the values; nothing is then written (each method is atomic).
    """

    def __init__(self, pool: asyncpg.Pool, worker: str, *, batching: bool = True) -> None:
        self.pool = pool
        self.worker = worker
        self.batching = batching
        self._stages: dict[str, tuple[Statement, bool, Coalescer[Request, Any]]] = {}
        self._stage("accept", self._accept_many)
        self._stage("claim_submit", self._claim_submit_many)
        self._stage("save_submitted", self._save_submitted_many)
        self._stage("claim_observe", self._claim_observe_many)
        self._stage("reschedule_poll", self._reschedule_many)
        self._stage("save_observation", self._save_observation_many)
        self._stage("record_remote_call", self._record_calls_many, distinct=False)

    def _stage(self, name: str, statement: Statement, *, distinct: bool = True) -> None:
        async def flush(requests: list[Request]) -> list[Any]:
            return await self._flush(name, statement, distinct, requests, BATCH_LOCK_TIMEOUT)

        coalescer: Coalescer[Request, Any] = Coalescer(
            f"ledger_{name}", flush, max_batch=BATCH_MAX, max_in_flight=BATCH_IN_FLIGHT, linger_s=LINGER_UNDER_LOAD_S
        )
        self._stages[name] = (statement, distinct, coalescer)

    async def _submit(self, name: str, request: Request) -> Any:
        """One request of the stage ``name``: batched with the other tasks' (or alone without batching, or when
        its batch waited too long for a lock).

        Raises:
            LedgerDataError, LedgerUnavailableError: as the request's own statement would.
        """
        statement, distinct, coalescer = self._stages[name]
        if self.batching:
            result = await coalescer.submit(request)
            if result is not RUN_ALONE:
                return result
        (result,) = await self._flush(name, statement, distinct, [request], WAIT_FOR_LOCKS)
        if isinstance(result, BaseException):
            raise result
        return result

    async def _flush(
        self, name: str, statement: Statement, distinct: bool, requests: list[Request], lock_timeout: str
    ) -> list[Any]:
        """Run ``requests`` as few statements as the rules allow (module docstring); one result, exception or
        :data:`RUN_ALONE` per request, in order."""
        results: list[Any] = [None] * len(requests)
        rounds = _rounds(requests, distinct)
        for n, positions in enumerate(rounds):
            batch = [requests[i] for i in positions]
            try:
                out = await self._run(name, statement, batch, lock_timeout)
            except LedgerDataError as exc:
                out = await self._one_by_one(name, statement, batch, lock_timeout) if len(batch) > 1 else [exc]
            except (LedgerUnavailableError, asyncpg.LockNotAvailableError) as exc:  # not sent: this one and later
                if isinstance(exc, asyncpg.LockNotAvailableError):
                    metrics.LEDGER_BATCH_FALLBACKS.labels(name, "lock_wait").inc()
                    log.info("%s: a batch waited more than %s for a lock; its requests run alone", name, lock_timeout)
                for later in rounds[n:]:
                    for i in later:
                        results[i] = exc if isinstance(exc, LedgerUnavailableError) else RUN_ALONE
                return results
            for i, result in zip(positions, out, strict=True):
                results[i] = result
        return results

    async def _one_by_one(self, name: str, statement: Statement, batch: list[Request], lock_timeout: str) -> list[Any]:
        """PostgreSQL refused a batch for some request's values: each request alone, so only it fails."""
        metrics.LEDGER_BATCH_FALLBACKS.labels(name, "refused_value").inc()
        out: list[Any] = []
        for k, request in enumerate(batch):
            try:
                out.extend(await self._run(name, statement, [request], lock_timeout))
            except LedgerDataError as exc:
                out.append(exc)
            except asyncpg.LockNotAvailableError:
                out.append(RUN_ALONE)
            except LedgerUnavailableError as exc:
                out.extend([exc] * (len(batch) - k))
                break
        return out

    async def _run(self, name: str, statement: Statement, batch: list[Request], lock_timeout: str) -> list[Any]:
        """One statement; run again when PostgreSQL rolled it back as a deadlock victim or serialization failure.

        Raises:
            LedgerDataError: PostgreSQL refused a value. LedgerUnavailableError: it did not answer, or the
                statement kept being rolled back (:data:`CONFLICT_ATTEMPTS`). asyncpg.LockNotAvailableError: it
                waited ``lock_timeout`` for a lock (nothing written).
        """
        what = f"{name} of {batch[0][0]}" if len(batch) == 1 else f"{name} of {len(batch)} operations"
        for attempt in range(1, CONFLICT_ATTEMPTS + 1):
            try:
                async with _guard(what):
                    return await statement(batch, lock_timeout)
            except asyncpg.TransactionRollbackError as exc:  # class 40: rolled back, nothing written
                metrics.LEDGER_CONFLICTS.labels(name, exc.sqlstate).inc()
                if attempt == CONFLICT_ATTEMPTS:
                    raise LedgerUnavailableError(
                        f"{what} rolled back {attempt} times in a row ({type(exc).__name__}: {exc}); nothing was "
                        "written; retrying later"
                    ) from exc
                log.warning("%s rolled back (%s: %s); running it again", what, type(exc).__name__, exc)
                await asyncio.sleep(random.uniform(0, 0.005 * 2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        """Finish the batches on the wire or queued, then close the pool."""
        for _, _, coalescer in self._stages.values():
            await coalescer.drain()
        await self.pool.close()

    async def accept(
        self, operation_id: str, request_text: str, *, submitted_at_ms: int, source_text: str | None = None
    ) -> bool:
        """Insert the operation as ``accepted``; False when it already existed (a replay).

        ``request_text`` (the provider's request) and ``source_text`` are JSON texts, stored as they are
        (``json``: no number or escape rewritten); ``submitted_at_ms`` is the application's epoch ms.
        """
        inserted: bool = await self._submit("accept", (operation_id, request_text, submitted_at_ms, source_text))
        return inserted

    async def _accept_many(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        operation_ids, requests, submitted_at_ms, sources = _columns(batch, 4)
        rows = await Q.accept_operation.fetch(
            self.pool,
            operation_ids=operation_ids,
            requests=requests,
            submitted_at_ms=submitted_at_ms,
            sources=sources,
            worker=self.worker,
            lock_timeout=lock_timeout,
        )
        inserted = {row["operation_id"] for row in rows}
        return [request[0] in inserted for request in batch]

    async def claim_for_submit(self, operation_id: str, claim_id: uuid.UUID | None = None) -> int | None:
        """``accepted -> submitting`` with a new fencing value, written before the POST.

        ``claim_id`` names this claim (default: a new one). A caller that sends its claim again after
        :class:`LedgerUnavailableError` passes the same id: if the first one was committed (only its reply was
        lost), the repeat returns the fencing value it wrote.

        Returns the fencing value, or None when the operation is past ``accepted`` by another claim (never
        resubmit).

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer; the claim may have been committed.
        """
        fencing: int | None = await self._submit("claim_submit", (operation_id, claim_id or uuid.uuid4()))
        return fencing

    async def _claim_submit_many(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        operation_ids, claim_ids = _columns(batch, 2)
        rows = await Q.claim_for_submit.fetch(
            self.pool, operation_ids=operation_ids, claim_ids=claim_ids, worker=self.worker, lock_timeout=lock_timeout
        )
        return [None if row is None else row["fencing_token"] for row in _by_position(rows, len(batch))]

    async def save_submitted(
        self, operation_id: str, fencing_token: int, remote_job_id: str, first_poll_delay_s: float, reason: str | None
    ) -> bool:
        """Fenced: save the job id (``submitting|uncertain -> submitted``); False when refused."""
        saved: bool = await self._submit(
            "save_submitted", (operation_id, fencing_token, remote_job_id, first_poll_delay_s, reason)
        )
        return saved

    async def _save_submitted_many(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        operation_ids, fencing_tokens, remote_job_ids, first_poll_delays_s, reasons = _columns(batch, 5)
        rows = await Q.save_submitted.fetch(
            self.pool,
            operation_ids=operation_ids,
            fencing_tokens=fencing_tokens,
            remote_job_ids=remote_job_ids,
            first_poll_delays_s=first_poll_delays_s,
            reasons=reasons,
            worker=self.worker,
            lock_timeout=lock_timeout,
        )
        return [row is not None for row in _by_position(rows, len(batch))]

    async def save_submission_without_job(
        self, operation_id: str, fencing_token: int, state: OperationState, reason: str, reason_code: ReasonCode
    ) -> bool:
        """Fenced: ``submitting -> rejected|uncertain`` with ``reason`` and its ``reason_code``; False when
        refused. The same end sent again after :class:`LedgerUnavailableError` (committed, only its reply lost)
        finds it on the row at its fencing value and returns True, writing nothing."""
        if state not in (OperationState.REJECTED, OperationState.UNCERTAIN):
            raise ValueError(f"a submission without a job ends rejected or uncertain, not {state}")
        async with _guard(f"save {state} for {operation_id}"):
            saved = await Q.save_submission_without_job.fetchval(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                state=state.value,
                reason=clean_text(reason),
                reason_code=reason_code,
                worker=self.worker,
            )
        return saved is not None

    async def reconcile_stale_submitting(self, stale_after_s: float, batch_size: int) -> list[str]:
        """Mark operations stuck in ``submitting`` as ``uncertain`` (with a reason); returns their ids."""
        async with _guard("reconcile submitting"):
            rows = await Q.reconcile_stale_submitting.fetch(
                self.pool, stale_after_s=stale_after_s, batch_size=batch_size, worker=self.worker
            )
        return [row["operation_id"] for row in rows]

    async def stale_accepted(self, stale_after_s: float, batch_size: int) -> list[tuple[str, str]]:
        """Operations still ``accepted`` ``stale_after_s`` seconds after their last change, oldest first, as
        ``(operation_id, request JSON text)``; at most ``batch_size``. Reading claims nothing (see
        ``claim_for_submit``)."""
        async with _guard("find stale accepted"):
            rows = await Q.stale_accepted.fetch(self.pool, stale_after_s=stale_after_s, batch_size=batch_size)
        return [(row["operation_id"], row["request"]) for row in rows]

    async def claim_due_polls(
        self, batch_size: int, visibility_timeout_s: float, bound: ClaimBound | None = None
    ) -> list[DuePoll]:
        """Claim at most ``batch_size`` due polls, oldest due first, skipping rows other transactions hold; each
        comes back by itself after ``visibility_timeout_s`` unless an observer takes it sooner. With ``bound``,
        fewer (or none) so the polls claimed and not yet taken stay within it (:class:`ClaimBound`)."""
        async with _guard("claim due polls"):
            rows = await Q.claim_due_polls.fetch(
                self.pool,
                batch_size=batch_size,
                visibility_timeout_s=visibility_timeout_s,
                least_in_flight=bound.least if bound else None,
                pace_window_s=bound.pace_window_s if bound else 1.0,
                take_target_s=bound.take_target_s if bound else 0.0,
            )
        return [DuePoll(r["operation_id"], r["remote_job_id"], r["poll_claim_id"]) for r in rows]

    async def get_operation(self, operation_id: str) -> dict[str, Any] | None:
        """The operation's row as a dict, or None when the ledger does not hold it."""
        async with _guard(f"read {operation_id}"):
            row = await Q.get_operation.fetchrow(self.pool, operation_id=operation_id)
        return dict(row) if row is not None else None

    async def claim_for_observe(
        self, operation_id: str, poll_claim_id: int, claim_id: uuid.UUID | None = None
    ) -> ObserveClaim | None:
        """A new fencing value for observing, if the poll is the newest claim, not taken yet, and the job still
        pollable. ``claim_id`` names this claim (default: a new one); a caller that sends it again after
        :class:`LedgerUnavailableError` passes the same id and gets the claim the first one committed.

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer; the claim may have been committed.
        """
        claim: ObserveClaim | None = await self._submit(
            "claim_observe", (operation_id, poll_claim_id, claim_id or uuid.uuid4())
        )
        return claim

    async def _claim_observe_many(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        operation_ids, poll_claim_ids, claim_ids = _columns(batch, 3)
        rows = await Q.claim_for_observe.fetch(
            self.pool,
            operation_ids=operation_ids,
            poll_claim_ids=poll_claim_ids,
            claim_ids=claim_ids,
            worker=self.worker,
            lock_timeout=lock_timeout,
        )
        return [
            None
            if row is None
            else ObserveClaim(
                row["fencing_token"],
                row["remote_job_id"],
                OperationState(row["state"]),
                row["poll_count"],
                row["observed_for_s"],
            )
            for row in _by_position(rows, len(batch))
        ]

    async def reschedule_poll(self, operation_id: str, poll_claim_id: int, delay_s: float) -> bool:
        """Move the claimed poll to now + ``delay_s``; False when the claim is stale or the job not pollable."""
        rescheduled: bool = await self._submit("reschedule_poll", (operation_id, poll_claim_id, delay_s))
        return rescheduled

    async def _reschedule_many(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        operation_ids, poll_claim_ids, delays_s = _columns(batch, 3)
        rows = await Q.reschedule_poll.fetch(
            self.pool,
            operation_ids=operation_ids,
            poll_claim_ids=poll_claim_ids,
            delays_s=delays_s,
            lock_timeout=lock_timeout,
        )
        return [row is not None for row in _by_position(rows, len(batch))]

    async def save_observation(
        self, operation_id: str, fencing_token: int, snapshot: JobSnapshot, next_poll_delay_s: float | None
    ) -> SaveOutcome:
        """Fenced, conditional save of one GET snapshot (one statement).

        A terminal ``succeeded`` writes the outputs and one outbox row per ``(operation_id, output_id)`` in
        the same statement. Returns :class:`SaveOutcome`; a refusal writes nothing.
        """
        new = snapshot.state
        terminal = is_terminal(new)
        reason = None
        if new is OperationState.FAILED and snapshot.error:
            reason = clean_text(f"remote job failed: {exactjson.dumps(snapshot.error).decode()}")
        outputs = [{"output_id": str(o["id"]), "position": i, "payload": o} for i, o in enumerate(snapshot.outputs)]
        request = (
            operation_id,
            fencing_token,
            new.value,
            _json_text(snapshot.as_observation()),
            None if terminal else next_poll_delay_s,
            snapshot.completed_at_ms if terminal else None,
            reason,
            "{" + ",".join(sources_for(new)) + "}",
            _json_text(outputs),
        )
        outcome: SaveOutcome = await self._submit("save_observation", request)
        return outcome

    async def _save_observation_many(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        (
            operation_ids,
            fencing_tokens,
            states,
            observations,
            next_poll_delays_s,
            remote_completed_at_ms,
            reasons,
            source_states,
            outputs,
        ) = _columns(batch, 9)
        rows = await Q.save_observation.fetch(
            self.pool,
            operation_ids=operation_ids,
            fencing_tokens=fencing_tokens,
            states=states,
            observations=observations,
            next_poll_delays_s=next_poll_delays_s,
            remote_completed_at_ms=remote_completed_at_ms,
            reasons=reasons,
            source_states=source_states,
            outputs=outputs,
            worker=self.worker,
            lock_timeout=lock_timeout,
        )
        outcomes: list[Any] = []
        for request, row in zip(batch, _by_position(rows, len(batch)), strict=True):
            assert row is not None  # one row per request
            if row["saved"]:
                outcomes.append(SaveOutcome.SAVED)
            elif row["fencing_token"] is not None and row["fencing_token"] != request[1]:
                outcomes.append(SaveOutcome.REFUSED_FENCING)
            else:  # the state order refused it, or the operation does not exist
                outcomes.append(SaveOutcome.REFUSED_ORDER)
        return outcomes

    async def save_stalled(
        self, operation_id: str, fencing_token: int, reason: str, last_answer: dict[str, Any]
    ) -> bool:
        """Fenced: a pollable operation -> ``stalled`` with ``reason`` and the raw ``last_answer`` (kept as
        ``last_observation``); nothing polls it until an operator acts. False when refused."""
        async with _guard(f"save stalled for {operation_id}"):
            saved = await Q.save_stalled.fetchval(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                reason=clean_text(reason),
                last_answer=last_answer,
                worker=self.worker,
            )
        return saved is not None

    async def note_not_found(
        self,
        operation_id: str,
        fencing_token: int,
        grace_s: float,
        next_poll_delay_s: float,
        reason: str,
        answer: dict[str, Any],
    ) -> OperationState | None:
        """Fenced: the job's GET answered 404. Within ``grace_s`` of saving the job id the poll is rescheduled
        ``next_poll_delay_s`` out; past it the operation becomes ``stalled`` with ``reason`` and ``answer``.

        Returns the state afterwards (``stalled``, or the unchanged pollable state), None when refused.
        """
        async with _guard(f"note 404 for {operation_id}"):
            state = await Q.note_not_found.fetchval(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                grace_s=grace_s,
                next_poll_delay_s=next_poll_delay_s,
                reason=clean_text(reason),
                answer=answer,
                worker=self.worker,
            )
        return None if state is None else OperationState(state)

    async def note_unknown_status(
        self,
        operation_id: str,
        fencing_token: int,
        limit: int,
        next_poll_delay_s: float,
        reason: str,
        answer: dict[str, Any],
    ) -> tuple[OperationState, int] | None:
        """Fenced: the job's GET answered a status the client does not know. The ``limit``-th in a row makes the
        operation ``stalled`` with ``reason`` and ``answer``; before that the poll is rescheduled.

        Returns (state afterwards, unknown statuses in a row), None when refused.
        """
        async with _guard(f"note unknown status for {operation_id}"):
            row = await Q.note_unknown_status.fetchrow(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                unknown_status_limit=limit,
                next_poll_delay_s=next_poll_delay_s,
                reason=clean_text(reason),
                answer=answer,
                worker=self.worker,
            )
        return None if row is None else (OperationState(row["state"]), row["unknown_status_count"])

    async def note_failed_poll(
        self,
        operation_id: str,
        fencing_token: int,
        limit: int,
        next_poll_delay_s: float,
        reason: str,
        last_answer: dict[str, Any],
    ) -> tuple[OperationState, int] | None:
        """Fenced: the job's GET failed (counted as a poll, so the backoff grows). The ``limit``-th failure in a
        row makes the operation ``stalled`` with ``reason`` and ``last_answer``; before that the poll is
        rescheduled ``next_poll_delay_s`` out.

        Returns (state afterwards, failed polls in a row), None when refused.
        """
        async with _guard(f"note failed poll for {operation_id}"):
            row = await Q.note_failed_poll.fetchrow(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                failed_poll_limit=limit,
                next_poll_delay_s=next_poll_delay_s,
                reason=clean_text(reason),
                last_answer=last_answer,
                worker=self.worker,
            )
        return None if row is None else (OperationState(row["state"]), row["failed_poll_count"])

    # --- reconciliation by lookup -----------------------------------------------------------------------------

    async def claim_due_lookups(self, batch_size: int, lag_s: float, visibility_timeout_s: float) -> list[LookupClaim]:
        """Claim ``uncertain`` operations due for a lookup (first one ``lag_s`` after becoming uncertain); each
        claim takes a new fencing value and comes back by itself after ``visibility_timeout_s``."""
        async with _guard("claim due lookups"):
            rows = await RECONCILE.claim_due_lookups.fetch(
                self.pool,
                batch_size=batch_size,
                lag_s=lag_s,
                visibility_timeout_s=visibility_timeout_s,
                worker=self.worker,
            )
        return [
            LookupClaim(r["operation_id"], r["fencing_token"], r["uncertain_for_s"], r["lookup_count"]) for r in rows
        ]

    async def adopt_found_job(
        self, claim: LookupClaim, found: list[LookupJob], reason: str, first_poll_delay_s: float
    ) -> bool:
        """Fenced: adopt ``found[0]`` (oldest first) for the claimed operation (``uncertain -> submitted``) and
        give every job found its accounting record (``lookup``, the others ``duplicate``), in one statement.

        Returns True when the transition was written (False: a newer claim or an operator decided meanwhile;
        the accounting records are written all the same).
        """
        if not found:
            raise ValueError("adopt_found_job needs at least one job")
        jobs = [{"job_id": j.job_id, "status": j.status} for j in found]
        async with _guard(f"adopt found job for {claim.operation_id}"):
            adopted: bool = await RECONCILE.adopt_found_job.fetchval(
                self.pool,
                operation_id=claim.operation_id,
                fencing_token=claim.fencing_token,
                remote_job_id=found[0].job_id,
                reason=clean_text(reason),
                first_poll_delay_s=first_poll_delay_s,
                jobs_found=jobs,
                worker=self.worker,
            )
        return adopted

    async def give_up_lookup(self, claim: LookupClaim, reason: str) -> bool:
        """Fenced: nothing found after the lag; the operation stays ``uncertain`` for a person, ``reason`` first
        in its reason. False when refused."""
        async with _guard(f"give up lookup for {claim.operation_id}"):
            row = await RECONCILE.give_up_lookup.fetchval(
                self.pool,
                operation_id=claim.operation_id,
                fencing_token=claim.fencing_token,
                reason=clean_text(reason),
                worker=self.worker,
            )
        return row is not None

    async def reschedule_lookup(self, claim: LookupClaim, delay_s: float) -> bool:
        """Fenced: try the lookup again ``delay_s`` from now. False when refused."""
        async with _guard(f"reschedule lookup for {claim.operation_id}"):
            row = await RECONCILE.reschedule_lookup.fetchval(
                self.pool, operation_id=claim.operation_id, fencing_token=claim.fencing_token, delay_s=delay_s
            )
        return row is not None

    async def record_remote_call(
        self,
        operation_id: str,
        method: str,
        status_code: int | None,
        outcome: RemoteCallOutcome,
        remote_job_id: str | None,
        duration_ms: float,
        fencing_token: int | None,
        call_id: uuid.UUID | None = None,
    ) -> None:
        """Accounting: append one remote call attempt with its classified outcome. ``call_id`` names the row
        (default: a new one); a caller that sends it again after :class:`LedgerUnavailableError` passes the same
        id, and a row already committed is not written twice.

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer; the row may have been written.
        """
        await self._submit(
            "record_remote_call",
            (
                operation_id,
                call_id or uuid.uuid4(),
                method,
                status_code,
                str(outcome),
                remote_job_id,
                duration_ms,
                fencing_token,
            ),
        )

    async def _record_calls_many(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        operation_ids, call_ids, methods, status_codes, outcomes, remote_job_ids, durations_ms, fencing_tokens = (
            _columns(batch, 8)
        )
        await Q.record_remote_call.execute(
            self.pool,
            operation_ids=operation_ids,
            call_ids=call_ids,
            methods=methods,
            status_codes=status_codes,
            outcomes=outcomes,
            remote_job_ids=remote_job_ids,
            durations_ms=durations_ms,
            fencing_tokens=fencing_tokens,
            worker=self.worker,
            lock_timeout=lock_timeout,
        )
        return [None] * len(batch)

    async def relay_outbox(self, batch_size: int, publish: Callable[[list[dict[str, Any]]], Awaitable[None]]) -> int:
        """Publish one batch of unpublished outbox rows with ``publish`` and mark them published.

        Only one relay runs at a time (a transaction-scoped advisory lock), which keeps each operation's
        events in order. ``publish`` must raise unless every row was acknowledged by Kafka; then nothing is
        marked. A crash between publish and mark repeats rows with the same ``event_id``.
        Returns the number of rows published (0 when another relay holds the lock).
        """
        async with _guard("relay outbox"), self.pool.acquire() as conn, conn.transaction():
            if not await Q.try_relay_lock.fetchval(conn):
                return 0
            rows = await Q.lock_unpublished_outbox.fetch(conn, batch_size=batch_size)
            if not rows:
                return 0
            await publish([dict(r) for r in rows])
            await Q.mark_outbox_published.execute(conn, outbox_ids=[r["id"] for r in rows])
            return len(rows)

    # --- operators' decisions -----------------------------------------------------------------------------

    async def adopt(self, operation_id: str, remote_job_id: str, reason: str, actor: str) -> OperatorMove:
        """An operator adopts the job found at the provider for an ``uncertain`` operation: ``uncertain ->
        submitted`` with that job id, observed from now on; the job gets an accounting record ``adopted``.

        Args:
            operation_id: the operation.
            remote_job_id: the provider's job id (``[A-Za-z0-9][A-Za-z0-9._:-]{0,255}``).
            reason: why (recorded in the transition log), non-empty.
            actor: who decided (recorded as the transition's worker), non-empty.

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``uncertain``, the job id is malformed or already
                saved for another operation, or reason/actor is empty. Nothing is written.
        """
        action = "adopt"
        if not JOB_ID.fullmatch(remote_job_id):
            raise OperatorActionRefusedError(
                operation_id, action, f"{clean_text(repr(remote_job_id), 80)} is not a usable remote job id"
            )
        why = self._decision_text(operation_id, action, reason, actor, f"adopted job {remote_job_id}")
        try:
            return await self._decide(
                action,
                operation_id,
                OperationState.UNCERTAIN,
                OperationState.SUBMITTED,
                OPS.adopt.fetchrow(
                    self.pool, operation_id=operation_id, remote_job_id=remote_job_id, reason=why, actor=actor
                ),
            )
        except LedgerDataError:
            async with _guard(f"read holder of job {remote_job_id}"):
                holder = await OPS.operation_holding_job.fetchval(self.pool, remote_job_id=remote_job_id)
            if holder is not None and holder != operation_id:
                raise OperatorActionRefusedError(
                    operation_id,
                    action,
                    f"remote job {remote_job_id} is already saved for operation {holder!r}; a job belongs to one "
                    "operation",
                    state=OperationState.UNCERTAIN.value,
                ) from None
            raise

    async def abandon(self, operation_id: str, reason: str, actor: str) -> OperatorMove:
        """An operator checked that the provider created no job for an ``uncertain`` operation: ``uncertain ->
        rejected`` ("not created, checked by an operator").

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``uncertain``, or reason/actor is empty.
        """
        action = "abandon"
        why = self._decision_text(operation_id, action, reason, actor, "not created, checked by an operator")
        return await self._decide(
            action,
            operation_id,
            OperationState.UNCERTAIN,
            OperationState.REJECTED,
            OPS.abandon.fetchrow(self.pool, operation_id=operation_id, reason=why, actor=actor),
        )

    async def repoll(self, operation_id: str, actor: str, reason: str = "observe again") -> OperatorMove:
        """An operator has a ``stalled`` operation observed again: ``stalled -> submitted``, due now, with a fresh
        observation window (maximum age and unknown-status count start over).

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``stalled``, or actor is empty.
        """
        action = "repoll"
        why = self._decision_text(operation_id, action, reason, actor, "repolled by an operator")
        return await self._decide(
            action,
            operation_id,
            OperationState.STALLED,
            OperationState.SUBMITTED,
            OPS.repoll.fetchrow(self.pool, operation_id=operation_id, reason=why, actor=actor),
        )

    async def fail(self, operation_id: str, reason: str, actor: str) -> OperatorMove:
        """An operator ends a ``stalled`` operation: ``stalled -> failed`` with the reason.

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``stalled``, or reason/actor is empty.
        """
        action = "fail"
        why = self._decision_text(operation_id, action, reason, actor, "failed by an operator")
        return await self._decide(
            action,
            operation_id,
            OperationState.STALLED,
            OperationState.FAILED,
            OPS.fail_stalled.fetchrow(self.pool, operation_id=operation_id, reason=why, actor=actor),
        )

    @staticmethod
    def _decision_text(operation_id: str, action: str, reason: str, actor: str, what: str) -> str:
        if not actor.strip():
            raise OperatorActionRefusedError(operation_id, action, "name who decides (actor)")
        if not reason.strip():
            raise OperatorActionRefusedError(operation_id, action, "give a reason; it is recorded")
        return clean_text(f"{what} ({actor.strip()}): {reason.strip()}")

    async def _decide(
        self,
        action: str,
        operation_id: str,
        from_state: OperationState,
        to_state: OperationState,
        decision: Awaitable[asyncpg.Record | None],
    ) -> OperatorMove:
        """Await ``decision`` (the decision's fenced statement, one row or none); when it wrote nothing, read the
        operation to say why."""
        async with _guard(f"{action} {operation_id}"):
            row = await decision
            if row is not None:
                return OperatorMove(
                    operation_id, action, from_state, to_state, row["transition_seq"], row["fencing_token"]
                )
            current = await Q.get_operation.fetchrow(self.pool, operation_id=operation_id)
        if current is None:
            raise UnknownOperationError(operation_id)
        raise OperatorActionRefusedError(
            operation_id,
            action,
            f"it is {current['state']}; {action} applies only to {from_state.value} operations",
            state=current["state"],
        )

    # --- accounting ------------------------------------------------------------------------------------------

    async def record_refund(self, remote_job_id: str, refund: dict[str, Any]) -> bool:
        """Record a refund the provider reported for a job, once per (refund id, job id); ``refund`` is the
        provider's object (a string ``id``; ``amount`` and ``currency`` as sent). A terminal observation records
        its refund by itself; this is for refunds learned otherwise. Never used to decide whether a job was
        created.

        Returns True when recorded now, False when it already was (or the job has no accounting record, or the
        refund carries no string id).
        """
        async with _guard(f"record refund for job {remote_job_id}"):
            row = await ACCOUNTING.record_refund.fetchval(self.pool, remote_job_id=remote_job_id, refund=refund)
        return row is not None

    async def accounting_summary(self, operation_pattern: str = "%") -> dict[str, Any]:
        """The accounting summary of the operations whose id matches ``operation_pattern`` (SQL ``LIKE``).

        Returns a dict: ``jobs_by_outcome`` ({outcome or ``not_terminal``: n}), ``jobs_by_learned_via``
        ({``post_2xx``/``post_502``/``adopted``/``lookup``/``duplicate``: n}), ``learned_only_via_502``,
        ``duplicate_creations``, ``charges`` ([{currency, amount (decimal text), jobs}]), ``refunds_settled``
        ([{currency, amount, refunds}]), ``refunds_pending`` (failed/canceled jobs with a charge and no refund
        recorded), ``needs_decision`` ({``uncertain``/``stalled``: {operations, oldest_age_s}}),
        ``posts_per_operation`` and ``gets_per_completed_operation`` ({operations, mean, max}).
        """
        async with _guard("accounting summary"):
            row = await ACCOUNTING.accounting_summary.fetchrow(self.pool, operation_pattern=operation_pattern)
        assert row is not None  # aggregates only: always one row
        return dict(row)
