"""What the harness's runs share: the main job (:mod:`streams_harness.mainjob`) and the soak
(:mod:`streams_harness.soak`) run the same steps around their own processes and faults, and the benchmark gathers
its report the same way.

* a run's isolation on the shared services (:func:`isolated_run`): its own ledger database, topics, consumer
  group and provider account, removed afterwards;
* its simulator's and workers' settings (:func:`simulator_env`, :func:`worker_settings`);
* the replay of the trace with progress until every operation is final and the outbox drained
  (:func:`replay_until_final`);
* the report from independent records (:func:`collect_report`) and its output (:func:`write_report`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import asyncpg
import httpx
import orjson

from streams.clients.follow import read_topic_to_end
from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams.errors import StreamsError, error_summary
from streams.ledger.store import Ledger
from streams.outages import is_outage
from streams.setup.admin import create_topics, database_name, delete_topics, migrate, migrations_line
from streams.setup.teardown import Selection, run_names, teardown_command
from streams_harness.cancels import PlannedCancel, callback_refusals, cancellation_plan, publish_cancellations
from streams_harness.checkout import checkout_dir
from streams_harness.replay import operation_id, replay_trace
from streams_harness.report import (
    FINAL_STATES,
    REPORT,
    LedgerAccounting,
    LedgerOperation,
    build_report,
    callback_counts,
    render_table,
)
from streams_harness.services import create_run_database, drop_run_database
from streams_harness.trace import TraceRow

#: Fault rates of the simulator when a run has its faults on (the main job's default, the soak's always).
DEFAULT_FAULTS: dict[str, float] = {
    "fault_429": 0.01,
    "fault_502_job_id": 0.01,
    "fault_5xx": 0.005,
    "fault_drop_after_create": 0.005,
    "fault_slow": 0.002,
    "fault_job_failed": 0.01,
    "fault_not_found": 0.005,
    "fault_unknown_status": 0.002,
    "fault_never_finishes": 0.002,
    "fault_status_regression": 0.01,
}

#: The simulator's completion-callback fault rates when a run has callbacks on (the main job's and the soak's
#: default): lost, duplicated, reordered and badly signed deliveries (docs/callbacks.md).
DEFAULT_CALLBACK_FAULTS: dict[str, float] = {
    "callback_loss": 0.05,
    "callback_duplicates": 0.05,
    "callback_reorder": 0.1,
    "callback_bad_signature": 0.03,
}

#: Least delay between two polls of a running job in a run with callbacks on (s): the product's 60 s would hold a
#: job whose callback was lost far longer than the run's compressed jobs last.
RUN_CALLBACK_FALLBACK_POLL_S = 5.0

#: Maximum observation age of a harness run's workers (s): a job that never finishes stalls this long after its
#: id was saved (the product's default, 24 h, would outlast the run); far beyond any job of the traces.
RUN_MAX_OBSERVATION_AGE_S = 30.0

#: The simulator's lookup consistency lag in a run with lookup on (s); the workers wait one more second.
RUN_LOOKUP_LAG_S = 1.0


class RunStoppedError(StreamsError):
    """An error stopped a harness run in ``step`` (:class:`RunSteps`); ``cause`` is the error (also chained).

    ``streams run``, ``soak`` and ``bench`` end with it as one message naming the step: a service that did not
    answer exits 5, a wrong setting 6, any other project error 1; anything else is a bug and keeps its traceback
    (:func:`streams_harness.cli._run_job`)."""

    def __init__(self, step: str, cause: Exception) -> None:
        super().__init__(f"in step {step!r}: {error_summary(cause)}")
        self.step = step
        self.cause = cause


class RunSteps:
    """The step a harness run is in, said by :meth:`enter` as the run goes: set-up, start, replay, report. An error
    the run does not handle leaves the run as :class:`RunStoppedError` naming the step (:meth:`stopped`)."""

    def __init__(self) -> None:
        self.step = "set-up: read the trace"

    def enter(self, step: str) -> None:
        """The run is now in ``step`` (a few words: what it does)."""
        self.step = step

    def stopped(self, exc: Exception) -> RunStoppedError:
        """``exc`` as the error that stopped the run in the current step (a :class:`RunStoppedError` as it is)."""
        return exc if isinstance(exc, RunStoppedError) else RunStoppedError(self.step, exc)


@dataclass
class RunOptions:
    """Options every harness run has; :class:`~streams_harness.mainjob.MainJobOptions` and
    :class:`~streams_harness.soak.SoakOptions` add their own (and their defaults)."""

    trace: str = "conv"
    start: int = 0
    rows: int = 2000
    compression: float = 15.0
    workers: int = 2
    #: Seed of the simulator's fault decisions (and of the soak's fault plan).
    seed: int = 7
    report_path: Path | None = None
    timeout_s: float = 900.0
    #: Keep the run's database and topics after the report (isolated runs).
    keep: bool = False
    #: Reconcile uncertain operations by lookup of the client reference (the simulator offers it for the run).
    lookup: bool = False
    #: The provider dialect the simulator serves and the workers speak (``STREAMS_PROVIDER_DIALECT``).
    dialect: str = "seed-generations"
    #: Share (0..1) of the operations canceled during the run on its ``generation.cancellations`` topic
    #: (:func:`streams_harness.cancels.cancellation_plan`); 0: none.
    cancel_fraction: float = 0.05
    #: Workers serve completion callbacks (a generated test secret) and the simulator sends them to one worker.
    callbacks: bool = True
    #: The simulator's callback fault rates with ``callbacks`` on (``callback_loss``, ...).
    callback_faults: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_CALLBACK_FAULTS))

    @property
    def trace_name(self) -> str:
        """The trace's short name (``conv``, ``code`` or a CSV file's stem), part of every operation id."""
        return Path(self.trace).stem

    def report_file(self, run_id: str) -> Path:
        """Where the JSON report goes: ``report_path``, else ``reports/<run id>/report.json`` of the clone."""
        return self.report_path or run_dir(run_id) / "report.json"


def run_dir(run_id: str) -> Path:
    """``reports/<run id>`` of the clone: the run's logs and report."""
    return checkout_dir() / "reports" / run_id


def worker_settings(
    settings: Settings,
    *,
    lookup: bool,
    max_observation_age_s: float = RUN_MAX_OBSERVATION_AGE_S,
    callback_secret: str | None = None,
) -> Settings:
    """``settings`` for a run's workers: jobs stall ``max_observation_age_s`` after their id was saved,
    uncertain operations are looked up (``lookup``) one second after the simulator lists a job, and with
    ``callback_secret`` (``whsec_<base64>``) the workers serve completion callbacks signed with it and poll a
    running job at least every :data:`RUN_CALLBACK_FALLBACK_POLL_S`."""
    run = settings.replace(
        max_observation_age_s=max_observation_age_s, lookup_enabled=lookup, lookup_lag_s=RUN_LOOKUP_LAG_S + 1.0
    )
    if callback_secret is None:
        return run
    return run.replace(
        callbacks_enabled=True,
        callback_secrets=callback_secret,
        callback_fallback_poll_interval_s=RUN_CALLBACK_FALLBACK_POLL_S,
        web_enabled=True,
    )


def simulator_env(
    opts: RunOptions,
    settings: Settings,
    faults: Mapping[str, float],
    *,
    callback_url: str = "",
    callback_secret: str = "",
) -> dict[str, str]:
    """``SIM_*`` variables of a run's simulator: the seed, the compression, a slow POST answered 2 s after the
    workers' read timeout, the fault rates ``faults`` (``fault_429``, ...), the lookup (``opts.lookup``,
    :data:`RUN_LOOKUP_LAG_S`), the dialect served (``opts.dialect``) and, with ``callback_url``, completion
    callbacks to it signed with ``callback_secret`` under the faults ``opts.callback_faults``."""
    env = {
        "SIM_SEED": str(opts.seed),
        "SIM_COMPRESSION": str(opts.compression),
        "SIM_SLOW_RESPONSE_S": str(settings.http_read_timeout_s + 2),
        "SIM_LOOKUP_ENABLED": "true" if opts.lookup else "false",
        "SIM_LOOKUP_LAG_S": str(RUN_LOOKUP_LAG_S),
        "SIM_DIALECT": opts.dialect,
    }
    env.update({f"SIM_{name.upper()}": str(rate) for name, rate in faults.items()})
    if callback_url:
        env |= {"SIM_CALLBACK_URL": callback_url, "SIM_CALLBACK_SECRET": callback_secret}
        env.update({f"SIM_{name.upper()}": str(rate) for name, rate in opts.callback_faults.items()})
    return env


def isolate(settings: Settings, run_id: str, database_url: str) -> Settings:
    """``settings`` of the run ``run_id``: the ledger ``database_url``, topics ``<prefix><run id>.generation.*``,
    consumer group ``<app id>-<run id>`` and provider account ``run_id`` (the run's simulator is an account of its
    own: its own rate budget)."""
    names = run_names(settings, run_id)  # the names `streams teardown --run-id` resolves too
    return settings.replace(
        database_url=database_url,
        topic_prefix=names.topic_prefix,
        app_id=names.groups[0],
        remote_account=run_id,
    )


@contextlib.asynccontextmanager
async def isolated_run(
    settings: Settings, run_id: str, *, keep: bool, out: TextIO, steps: RunSteps | None = None
) -> AsyncIterator[Settings]:
    """The run ``run_id`` isolated on the services of ``settings`` (:func:`isolate`): its ledger database created
    and migrated (one line to ``out``), its topics created (``settings.partitions``); yields the run's settings.
    Afterwards its topics (Faust's internal one included) and its database are removed unless ``keep``
    (:func:`remove_run`); a removal that fails is printed to ``out``, never raised over the run's own outcome.

    Raises:
        asyncpg.PostgresError: the role may not create databases.
    """
    steps = steps or RunSteps()
    database_url = settings.database_url.get_secret_value()
    steps.enter("set-up: create the run's database")
    run = isolate(settings, run_id, await create_run_database(database_url, run_id))
    try:
        steps.enter("set-up: migrate the run's database")
        applied = migrate_quietly(run.database_url.get_secret_value())
        print(
            f"run database {database_name(run.database_url.get_secret_value())}: {migrations_line(applied)}", file=out
        )
        steps.enter("set-up: create the run's topics")
        await create_topics(run)
        yield run
    finally:
        if keep:
            print_kept(run, out)
        else:
            await remove_run(run, database_url, out)


def print_kept(run: Settings, out: TextIO) -> None:
    """Say what ``--keep`` kept of the run on ``run`` (its database, topics and consumer group) and the command
    that removes exactly that (:func:`streams.setup.teardown.teardown_command`)."""
    kept = Selection(
        database=database_name(run.database_url.get_secret_value()), topic_prefix=run.topic_prefix, groups=(run.app_id,)
    )
    print(
        f"kept (--keep): database {kept.database}, topics {kept.topic_prefix}*, consumer group {run.app_id}; "
        f"remove them with: {teardown_command(kept)}",
        file=out,
    )


def migrate_quietly(database_url: str) -> list[str]:
    """:func:`streams.setup.admin.migrate` ``database_url`` with yoyo's step-by-step INFO log held back (a run's
    database is new: every migration would log its lines); its warnings and errors still show, and a failure
    raises as ever. Returns the ids applied."""
    yoyo_log = logging.getLogger("yoyo")
    level = yoyo_log.level
    yoyo_log.setLevel(max(logging.WARNING, yoyo_log.getEffectiveLevel()))
    try:
        return migrate(database_url)
    finally:
        yoyo_log.setLevel(level)


async def remove_run(run: Settings, admin_database_url: str, out: TextIO) -> None:
    """Remove the run ``run``'s topics (:func:`streams.setup.admin.delete_topics`) and its database (dropped
    through ``admin_database_url``), its processes being stopped. A removal that fails is printed to ``out`` with
    what to remove by hand (the services may just have been restarted), never raised over the run's own outcome;
    the other removal still runs."""
    await _remove(f"topics {run.topic_prefix}*", lambda: delete_topics(run), out)
    await _remove(
        f"database {run.database_url}",
        lambda: drop_run_database(admin_database_url, run.database_url.get_secret_value()),
        out,
    )


async def _remove(what: str, remove: Callable[[], Awaitable[Any]], out: TextIO) -> None:
    try:
        await remove()
    except Exception as exc:
        print(f"warning: the run's {what} not removed ({error_summary(exc)}); remove it by hand", file=out)


async def progress(db: asyncpg.Pool | asyncpg.Connection, pattern: str) -> dict[str, int]:
    """Operation counts by state (plus ``outbox_pending`` and ``lookup_pending``) of the operations whose id
    matches ``pattern`` (SQL ``LIKE``), read through ``db`` (a pool or a connection)."""
    rows = await REPORT.run_progress.fetch(db, operation_pattern=pattern)
    return {r["state"]: r["n"] for r in rows}


async def publication_times_ms(db: asyncpg.Pool | asyncpg.Connection, pattern: str) -> list[int]:
    """When the relay published each outbox row of the operations whose id matches ``pattern`` (SQL ``LIKE``),
    in ms since the epoch, in order, read through ``db``; rows not yet published are left out."""
    rows = await REPORT.run_publications.fetch(db, operation_pattern=pattern)
    return [r["published_at_ms"] for r in rows]


async def states(db: asyncpg.Pool | asyncpg.Connection, operation_ids: list[str]) -> dict[str, str]:
    """The ledger state of each of ``operation_ids`` it holds, read through ``db``."""
    rows = await REPORT.operation_states.fetch(db, operation_ids=operation_ids)
    return {r["operation_id"]: r["state"] for r in rows}


def final_count(counts: Mapping[str, int]) -> int:
    """Operations in a final state (:data:`~streams_harness.report.FINAL_STATES`) among ``counts``."""
    return sum(n for state, n in counts.items() if state in FINAL_STATES)


def settled(counts: Mapping[str, int], total: int, *, lookup: bool, outbox: bool = True) -> bool:
    """True when ``total`` operations are final, no lookup is pending (``lookup``) and the outbox is drained
    (``outbox``: a program without one has nothing to drain)."""
    return (
        final_count(counts) >= total
        and not (lookup and counts.get("lookup_pending", 0))
        and not (outbox and counts.get("outbox_pending", 0))
    )


def progress_line(counts: Mapping[str, int], sent: int, total: int, elapsed_s: float, lookup: bool) -> str:
    """One progress line: elapsed time, submissions sent, final operations and their rate, outbox backlog and the
    operations by state."""
    final = final_count(counts)
    states = " ".join(
        f"{s}={n}" for s, n in sorted(counts.items()) if s not in ("outbox_pending", "lookup_pending") and n
    )
    if lookup and counts.get("lookup_pending"):
        states += f" (lookups pending {counts['lookup_pending']})"
    return (
        f"[{elapsed_s:6.1f}s] submitted {sent}/{total}  final {final}/{total}  "
        f"({final / max(0.001, elapsed_s):.0f} ops/s)  outbox pending {counts.get('outbox_pending', 0)}  | {states}"
    )


def run_cancellations(rows: Sequence[TraceRow], opts: RunOptions, run_id: str) -> list[PlannedCancel]:
    """The run's cancellations (:func:`streams_harness.cancels.cancellation_plan`): ``opts.cancel_fraction`` of
    ``rows``, seeded by ``opts.seed``, timed by ``opts.compression``."""
    return cancellation_plan(
        rows,
        [operation_id(run_id, opts.trace_name, row) for row in rows],
        fraction=opts.cancel_fraction,
        compression=opts.compression,
        seed=opts.seed,
    )


def _nothing() -> None:
    return None


async def replay_until_final(
    settings: Settings,
    pool: asyncpg.Pool,
    rows: list[TraceRow],
    opts: RunOptions,
    run_id: str,
    *,
    out: TextIO,
    interval_s: float,
    check: Callable[[], None] = _nothing,
    busy: Callable[[], bool] = lambda: False,
    extra: Callable[[], str] = lambda: "",
    cancels: Sequence[PlannedCancel] = (),
) -> tuple[list[str], float]:
    """Publish ``rows`` as submissions at their arrival times divided by ``opts.compression`` (operation ids
    ``<run id>-<trace>-<row>``) and print a progress line (:func:`progress_line`, then ``extra()``) every
    ``interval_s`` until the replay is done, every operation :func:`settled` and ``busy()`` false (the soak's
    faults still running), or ``opts.timeout_s`` has passed (said so; what is there gets reported).

    A progress read that fails with an outage (PostgreSQL restarting under the soak) is said and skipped.

    Returns:
        The submitted operation ids, and the seconds from the start of the replay to the end of the wait.

    Raises:
        Whatever ``check()`` raises (it checks the run's processes), a failed replay's or cancellations' error, and
        a progress read's error that is not an outage.
    """
    pattern = f"{run_id}-%"
    started = time.monotonic()
    sent = [0]
    async with SubmissionProducer(settings) as producer:
        replay = asyncio.create_task(
            replay_trace(
                producer,
                rows,
                trace=opts.trace_name,
                run_id=run_id,
                compression=opts.compression,
                model=settings.remote_model,
                on_sent=lambda n: sent.__setitem__(0, n),
            )
        )
        canceling = asyncio.create_task(publish_cancellations(settings, cancels, started, partial(states, pool)))
        try:
            while True:
                await asyncio.sleep(interval_s)
                elapsed_s = time.monotonic() - started
                ids = replay.result() if replay.done() else None  # a failed replay raises here
                if canceling.done():
                    canceling.result()  # failed cancellations raise here
                try:
                    counts = await progress(pool, pattern)
                except Exception as exc:
                    if not is_outage(exc):
                        raise
                    print(f"[{elapsed_s:6.1f}s] progress not read: {error_summary(exc)}", file=out, flush=True)
                else:
                    line = progress_line(counts, sent[0], len(rows), elapsed_s, opts.lookup)
                    print(f"{line}{extra()}", file=out, flush=True)
                    if (
                        ids is not None
                        and canceling.done()
                        and not busy()
                        and settled(counts, len(rows), lookup=opts.lookup)
                    ):
                        break
                check()
                if elapsed_s > opts.timeout_s:
                    print(f"timeout after {opts.timeout_s:.0f} s: reporting what is there", file=out)
                    break
            ids = await replay
        finally:
            replay.cancel()  # when the wait failed: the producer closes next
            canceling.cancel()
    return ids, time.monotonic() - started


def run_meta(
    opts: RunOptions, run_id: str, *, partitions: int, rows: int, faults: Mapping[str, float], elapsed_s: float
) -> dict[str, Any]:
    """The report's fields that describe the run (docs/harness.md)."""
    return {
        "run_id": run_id,
        "workers": opts.workers,
        "partitions": partitions,
        "trace": opts.trace_name,
        "rows": rows,
        "start_row": opts.start,
        "compression": opts.compression,
        "seed": opts.seed,
        "faults": dict(faults),
        "lookup": opts.lookup,
        "dialect": opts.dialect,
        "cancel_fraction": opts.cancel_fraction,
        "callbacks_enabled": opts.callbacks,
        "wall_clock_s": round(elapsed_s, 1),
    }


async def collect_report(
    settings: Settings,
    pool: asyncpg.Pool,
    pattern: str,
    ids: list[str],
    meta: dict[str, Any],
    *,
    cancels: Sequence[PlannedCancel] = (),
    worker_urls: Sequence[str] = (),
) -> dict[str, Any]:
    """Gather the independent records (ledger, simulator, Kafka read-back) of the operations matching ``pattern``
    and build the report (:func:`streams_harness.report.build_report`) with ``meta``: the run canceled the
    operations of ``cancels``, and the workers at ``worker_urls`` (``http://host:port``) give their callback
    refusals by reason. ``gets_per_completed_operation_by_job_length`` counts a job's length in the simulator's
    longest poll hint (its ``poll_max_ms``)."""
    rows = await REPORT.run_operations.fetch(pool, operation_pattern=pattern)
    ledger = [
        LedgerOperation(
            r["operation_id"],
            r["state"],
            r["reason_code"],
            r["accepted_at_ms"],
            r["final_at_ms"],
            r["outputs"],
            r["remote_job_id"],
        )
        for r in rows
    ]
    async with httpx.AsyncClient(timeout=30.0) as client:
        sim = (await client.get(f"{settings.remote_base_url.get_secret_value()}/_sim/jobs")).json()["jobs"]
        summary = (await client.get(f"{settings.remote_base_url.get_secret_value()}/_sim/summary")).json()
        # an empty change answers the simulator's whole config: its longest poll hint is the report's poll interval
        sim_config = (await client.post(f"{settings.remote_base_url.get_secret_value()}/_sim/config", json={})).json()
    delivered = await read_topic_to_end(settings, "outputs_delivered")
    transitions = [
        (r["operation_id"], r["from_state"], r["to_state"])
        for r in await REPORT.run_transitions.fetch(pool, operation_pattern=pattern)
    ]
    accounting = await Ledger(pool, "report").accounting_summary(pattern)
    reconciled = await REPORT.run_reconciled.fetchrow(pool, operation_pattern=pattern)
    meta = dict(meta)
    meta["faults_injected"] = summary.get("faults_injected", {})
    asked_when = await REPORT.run_cancellations.fetch(pool, operation_pattern=pattern)
    recorded = await REPORT.run_callbacks.fetchrow(pool, operation_pattern=pattern)
    assert recorded is not None  # aggregates only: always one row
    callbacks = callback_counts(
        summary.get("callbacks"), recorded["received"], recorded["made_due"], await callback_refusals(worker_urls)
    )
    if callbacks is not None:
        meta["callbacks"] = callbacks
    return build_report(
        submitted_ids=ids,
        ledger=ledger,
        sim_jobs=sim,
        delivered=[(d.value, d.timestamp_ms) for d in delivered],
        meta=meta,
        transitions=transitions,
        cancel_asked=[c.operation_id for c in cancels],
        cancel_asked_when={r["state"]: r["n"] for r in asked_when},
        accounting=LedgerAccounting(
            reconciled=dict(reconciled) if reconciled is not None else {},
            duplicate_creations=accounting["duplicate_creations"],
            charges=accounting["charges"],
            refunds_settled=accounting["refunds_settled"],
            refunds_pending=accounting["refunds_pending"],
        ),
        poll_interval_s=int(sim_config["poll_max_ms"]) / 1000.0,
    )


def write_report(report: Mapping[str, Any], path: Path, out: TextIO) -> None:
    """Print ``report`` as a table to ``out`` and write it as JSON to ``path``."""
    print(render_table(report), file=out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"report written to {path}", file=out)
