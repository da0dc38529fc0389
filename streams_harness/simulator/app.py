"""aiohttp application of the provider simulator and its in-memory job registry.

Everything the simulator records (see :class:`JobRegistry`) is the independent
source of truth for tests and reports: it is kept in memory, per process, and
exposed read-only under ``/_sim/*``.

Job status is never advanced by background tasks: each job stores its
schedule (``created_at``, ``started_at``, ``completed_at``, unix seconds) and
every read computes the status from the wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from importlib import resources
from typing import Any

import jsonschema
import orjson
from aiohttp import web

from streams_harness.simulator.callbacks import CallbackSender
from streams_harness.simulator.config import SimulatorConfig
from streams_harness.simulator.faults import FAULT_KINDS, JOB_FAILED, FaultDecider, JobFault, PostFault
from streams_harness.simulator.model import (
    JobStatus,
    TerminalStatus,
    job_schedule,
    poll_after_ms,
    read_request,
    status_at,
)
from streams_harness.simulator.ratelimit import AccountLimiter, dated_retry_after, retry_after_header

logger = logging.getLogger("streams_harness.simulator")

_JSON = "application/json"


@dataclass(slots=True)
class JobRecord:
    """The simulator's record of one created job.

    Times are unix seconds (float).  ``started_at`` / ``completed_at`` are the
    scheduled times, always set; the public API only reveals them once reached.

    Attributes:
        job_id: ``job_<16 hex>``.
        client_reference: ``metadata.client_reference`` of the creating POST (the product's operation id),
            ``None`` if absent.
        model: the requested model name.
        context_tokens: tokens of ``input.prompt`` (>= 0).
        generated_tokens: ``input.max_tokens`` (>= 1), reported per output.
        created_at: creation time.
        started_at: time the job leaves ``queued``.
        completed_at: time the job reaches ``final_status``.
        final_status: ``succeeded`` or ``failed`` (decided at creation).
        outputs: number of outputs once succeeded (1 or 2).
        create_post_seq: 1-based sequence number (among all POSTs) of the POST that created it.
        create_fault: fault injected on that POST (``PostFault`` value) or ``None``.
        create_http_status: HTTP status answered to that POST (0 = connection dropped).
        gets: number of ``GET /v1/generations/{id}`` received for it.
        gets_in_flight: GETs currently inside the handler.
        max_gets_in_flight: maximum of ``gets_in_flight`` ever observed.
        terminal_gets: GETs that answered a terminal status.
        first_terminal_get_at: time of the first GET answering a terminal status, or ``None``.
        faults: the job's GET-side faults (``JobFault`` values).
        unknown_status: the undocumented status answered when ``unknown_status`` is among ``faults``.
        charge_amount: what the job costs (decimal text, in ``currency``), reported once it is terminal; a
            failed job's charge is refunded in full (refund id ``rf_<job hex>``).
        currency: the currency of charge and refund.
        gets_not_found: GETs answered 404 (inside the not-found window).
        regressed_gets: GETs answered ``queued`` while the job was running.
        account: the account (bearer token) that created it: its concurrency limit counts it until it is terminal.
        canceled_at: time the provider's cancel route canceled the job (``None``: not canceled); from then on its
            status is ``canceled`` (no outputs, nothing charged).
        cancels: calls of the cancel route for it (whatever they answered).
    """

    job_id: str
    client_reference: str | None
    model: str
    context_tokens: int
    generated_tokens: int
    created_at: float
    started_at: float
    completed_at: float
    final_status: TerminalStatus
    outputs: int
    create_post_seq: int
    create_fault: str | None
    create_http_status: int
    gets: int = 0
    gets_in_flight: int = 0
    max_gets_in_flight: int = 0
    terminal_gets: int = 0
    first_terminal_get_at: float | None = None
    faults: tuple[str, ...] = ()
    unknown_status: str | None = None
    charge_amount: str = "0"
    currency: str = "USD"
    gets_not_found: int = 0
    regressed_gets: int = 0
    account: str = ""
    canceled_at: float | None = None
    cancels: int = 0

    def status(self, now: float) -> JobStatus:
        """Status at unix time ``now`` (a ``never_finishes`` job stays ``running``; a canceled one is ``canceled``
        from ``canceled_at`` on)."""
        if self.canceled_at is not None and now >= self.canceled_at:
            return "canceled"
        if JobFault.NEVER_FINISHES in self.faults and now >= self.started_at:
            return "running"
        return status_at(now, self.started_at, self.completed_at, self.final_status)

    @property
    def refund_id(self) -> str | None:
        """The refund id of a failed job (``None`` otherwise)."""
        return "rf_" + self.job_id.removeprefix("job_") if self.final_status == "failed" else None

    def charge(self) -> dict[str, str]:
        """The charge object of the GET answer once terminal."""
        return {"id": "ch_" + self.job_id.removeprefix("job_"), "amount": self.charge_amount, "currency": self.currency}

    def to_record(self, now: float) -> dict[str, Any]:
        """JSON-ready record (one element of ``GET /_sim/jobs``); ``status`` is the status at ``now``."""
        return {
            "job_id": self.job_id,
            "client_reference": self.client_reference,
            "model": self.model,
            "context_tokens": self.context_tokens,
            "generated_tokens": self.generated_tokens,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "completed_at": self.completed_at,
            "status": self.status(now),
            "final_status": self.final_status,
            "outputs": self.outputs,
            "create_post_seq": self.create_post_seq,
            "create_fault": self.create_fault,
            "create_http_status": self.create_http_status,
            "gets": self.gets,
            "gets_in_flight": self.gets_in_flight,
            "max_gets_in_flight": self.max_gets_in_flight,
            "terminal_gets": self.terminal_gets,
            "first_terminal_get_at": self.first_terminal_get_at,
            "faults": list(self.faults),
            "unknown_status": self.unknown_status,
            "charge_amount": self.charge_amount,
            "currency": self.currency,
            "refund_id": self.refund_id,
            "gets_not_found": self.gets_not_found,
            "regressed_gets": self.regressed_gets,
            "canceled_at": self.canceled_at,
            "cancels": self.cancels,
        }


@dataclass(slots=True)
class OperationRecord:
    """Everything seen for one ``metadata.client_reference`` (for the product: one operation id).

    Attributes:
        posts: number of POSTs naming this client reference (including refused ones: 400/401/429/5xx).
        post_statuses: HTTP status of each of those POSTs in arrival order (0 = dropped connection).
        jobs: ids of the jobs created for it, in creation order.
        bodies: each POST body as received (UTF-8 text), only while ``record_bodies`` is on.
    """

    posts: int = 0
    post_statuses: list[int] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)


class JobRegistry:
    """In-memory record of all POSTs, GETs and jobs since start (or the last reset)."""

    def __init__(self) -> None:
        """Create an empty registry."""
        self._init_fields()

    def _init_fields(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.operations: dict[str, OperationRecord] = {}
        self.posts = 0
        self.gets = 0
        self.gets_not_found = 0
        self.orphan_jobs = 0
        self.faults_injected: Counter[str] = Counter()
        self.posts_by_status: Counter[int] = Counter()
        self.lookups = 0
        self.active: set[str] = set()  # ids of the jobs not terminal when last counted
        self.concurrency_throttled = 0
        self.max_active_jobs = 0
        self.cancels = 0

    def clear(self) -> None:
        """Forget everything (``POST /_sim/reset``)."""
        self._init_fields()

    def next_post_seq(self) -> int:
        """Count a new POST and return its 1-based sequence number."""
        self.posts += 1
        return self.posts

    def note_post_outcome(self, client_reference: str | None, status: int, body: bytes | None = None) -> None:
        """Record the HTTP status answered to a POST (0 = dropped) under its client reference, if any, with its
        ``body`` when given (kept as UTF-8 text, undecodable bytes replaced)."""
        self.posts_by_status[status] += 1
        if client_reference is not None:
            op = self.operations.get(client_reference)
            if op is None:
                op = self.operations[client_reference] = OperationRecord()
            op.posts += 1
            op.post_statuses.append(status)
            if body is not None:
                op.bodies.append(body.decode("utf-8", "replace"))

    def active_jobs(self, account: str, model: str, now: float) -> tuple[int, int]:
        """Jobs of ``account`` queued or running at ``now``, and of those the ones of ``model`` (terminal jobs are
        dropped from the count for good)."""
        for job_id in [j for j in self.active if self.jobs[j].status(now) in ("succeeded", "failed")]:
            self.active.discard(job_id)
        mine = [self.jobs[j] for j in self.active if self.jobs[j].account == account]
        return len(mine), sum(1 for j in mine if j.model == model)

    def add_job(self, job: JobRecord) -> None:
        """Store a newly created job and link it to its operation."""
        self.jobs[job.job_id] = job
        self.active.add(job.job_id)
        self.max_active_jobs = max(
            self.max_active_jobs, sum(1 for j in self.active if self.jobs[j].account == job.account)
        )
        if job.client_reference is None:
            self.orphan_jobs += 1
        else:
            op = self.operations.get(job.client_reference)
            if op is None:
                op = self.operations[job.client_reference] = OperationRecord()
            op.jobs.append(job.job_id)
        if job.final_status == "failed":
            self.faults_injected[JOB_FAILED] += 1
        for kind in job.faults:
            self.faults_injected[kind] += 1

    def summary(self, now: float) -> dict[str, Any]:
        """Aggregates (the body of ``GET /_sim/summary``)."""
        by_status: Counter[str] = Counter()
        max_in_flight = 0
        for job in self.jobs.values():
            by_status[job.status(now)] += 1
            max_in_flight = max(max_in_flight, job.max_gets_in_flight)
        return {
            "jobs_created": len(self.jobs),
            "posts": self.posts,
            "gets": self.gets,
            "gets_not_found": self.gets_not_found,
            "lookups": self.lookups,
            "cancels": self.cancels,
            "max_jobs_per_operation": max((len(op.jobs) for op in self.operations.values()), default=0),
            "max_gets_in_flight_per_job": max_in_flight,
            "operations_seen": len(self.operations),
            "operations_with_jobs": sum(1 for op in self.operations.values() if op.jobs),
            "orphan_jobs_without_operation": self.orphan_jobs,
            "faults_injected": {kind: self.faults_injected[kind] for kind in FAULT_KINDS},
            "posts_by_status": {str(k): v for k, v in sorted(self.posts_by_status.items())},
            "jobs_by_status": {s: by_status[s] for s in ("queued", "running", "succeeded", "failed", "canceled")},
            "concurrency_throttled": self.concurrency_throttled,
            "max_active_jobs": self.max_active_jobs,
        }


class Simulator:
    """Mutable state behind one application: current config, seeded RNG, registry."""

    def __init__(self, config: SimulatorConfig) -> None:
        """Create the state for ``config`` (RNG seeded with ``config.seed``)."""
        self.config = config
        self.decider = FaultDecider(config.seed)
        self.registry = JobRegistry()
        self.limiter = AccountLimiter()
        self.stopping = asyncio.Event()
        self.callbacks = CallbackSender(config.seed)

    def reset(self) -> None:
        """Clear all records (and the per-account limit's buckets) and restart the RNG from ``config.seed``."""
        self.registry.clear()
        self.limiter.clear()
        self.decider.reseed(self.config.seed)
        self.callbacks.clear(self.config.seed)


SIMULATOR_KEY: web.AppKey[Simulator] = web.AppKey("simulator", Simulator)


def get_simulator(app: web.Application) -> Simulator:
    """The :class:`Simulator` state of an app built by :func:`make_app`."""
    return app[SIMULATOR_KEY]


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type=_JSON, headers=headers)


def _error(status: int, code: str, message: str, **extra: Any) -> web.Response:
    return _json({"error": {"code": code, "message": message, **extra}}, status=status)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_body(raw: bytes) -> tuple[Any, str | None]:
    """Parse the POST body with every number exact (a provider does not round what it is sent); returns
    ``(parsed, error_message)``."""
    try:
        return json.loads(raw.decode("utf-8"), parse_float=Decimal, parse_constant=_refuse_constant), None
    except (ValueError, RecursionError):
        return None, "body is not valid JSON"


def _client_reference_of(body: Any) -> str | None:
    if isinstance(body, dict):
        meta = body.get("metadata")
        if isinstance(meta, dict):
            reference = meta.get("client_reference")
            if isinstance(reference, str):
                return reference
    return None


@functools.cache
def _request_validator() -> jsonschema.protocols.Validator:
    """The validator of ``request.schema.json`` (package data beside this module)."""
    schema = orjson.loads(resources.files(__package__).joinpath("request.schema.json").read_bytes())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


def _validate(body: Any) -> str | None:
    """Return an error message for a body ``request.schema.json`` refuses, ``None`` if valid."""
    error = jsonschema.exceptions.best_match(_request_validator().iter_errors(body))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"at {where}: {error.message}"


def _authorized(request: web.Request) -> bool:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip())


def _account(request: web.Request) -> str:
    """The account a request is counted against: its bearer token ("" without one)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _over_limit(sim: Simulator, request: web.Request, method: str) -> web.Response | None:
    """The 429 for a request over its account's limit of ``method`` requests (counted), or None (under it, or
    no limit set)."""
    cfg = sim.config
    rate = cfg.rate_limit_post_per_s if method == "POST" else cfg.rate_limit_get_per_s
    wait_s = sim.limiter.check(_account(request), method, rate, cfg.rate_limit_burst, time.monotonic())
    if wait_s is None:
        return None
    return _json(
        {"error": {"code": "rate_limited", "message": f"account limit of {rate:g} {method} requests/s exceeded"}},
        status=429,
        headers=dated_retry_after(time.time(), wait_s)
        if cfg.retry_after_dates
        else {"Retry-After": retry_after_header(wait_s)},
    )


def _over_concurrency(sim: Simulator, request: web.Request, model: str) -> web.Response | None:
    """The throttled answer (``throttled_status`` with ``error.code`` ``throttled_code`` and ``Retry-After``) for
    a POST whose account, or whose account's ``model``, has as many jobs queued or running as its concurrency
    limit allows (counted), or None (room, or no limit set)."""
    cfg = sim.config
    if not (cfg.concurrency_limit_per_account or cfg.concurrency_limit_per_model):
        return None
    in_account, in_model = sim.registry.active_jobs(_account(request), model, time.time())
    account_full = 0 < cfg.concurrency_limit_per_account <= in_account
    model_full = 0 < cfg.concurrency_limit_per_model <= in_model
    if not (account_full or model_full):
        return None
    sim.registry.concurrency_throttled += 1
    what = "account" if account_full else f"model {model}"
    return _json(
        {"error": {"code": cfg.throttled_code, "message": f"concurrency limit of the {what} reached"}},
        status=cfg.throttled_status,
        headers={"Retry-After": cfg.retry_after_header or str(cfg.retry_after_s)},
    )


def _outputs(job: JobRecord, extra_json: str = "", output_ttl_s: float = 0.0) -> list[Any]:
    """The job's outputs; ``extra_json`` (raw object text) is spliced into each one verbatim, so an answer can
    carry numbers no Python float or orjson int holds (``2**64``, ``NaN``) exactly as written."""
    outputs: list[Any] = [
        {
            "id": f"out_{i}",
            "index": i,
            "tokens": job.generated_tokens,
            "text": f"simulated output {i} of {job.job_id} ({job.generated_tokens} tokens)",
            **({"expires_at": job.completed_at + output_ttl_s} if output_ttl_s > 0 else {}),
        }
        for i in range(job.outputs)
    ]
    members = extra_json.strip()[1:-1].strip().encode()
    if members:
        outputs = [orjson.Fragment(orjson.dumps(o)[:-1] + b"," + members + b"}") for o in outputs]
    return outputs


async def post_generation(request: web.Request) -> web.StreamResponse:
    """``POST /v1/generations``: validate, draw a fault, maybe create a job, answer."""
    sim = request.app[SIMULATOR_KEY]
    reg = sim.registry
    cfg = sim.config
    seq = reg.next_post_seq()
    raw = await request.read()
    body, parse_error = _parse_body(raw)
    reference = _client_reference_of(body)
    kept = raw if cfg.record_bodies else None

    if not _authorized(request):
        reg.note_post_outcome(reference, 401, kept)
        return _error(401, "unauthorized", "missing or empty bearer token")
    limited = _over_limit(sim, request, "POST")
    if limited is not None:
        reg.note_post_outcome(reference, 429, kept)
        return limited
    error = parse_error or _validate(body)
    if error is not None:
        reg.note_post_outcome(reference, 400, kept)
        return _error(400, "invalid_request", error)
    throttled = _over_concurrency(sim, request, body["model"])
    if throttled is not None:
        reg.note_post_outcome(reference, throttled.status, kept)
        return throttled

    decision = sim.decider.decide_post(cfg.fault_rates)
    if decision.fault is not None:
        reg.faults_injected[decision.fault.value] += 1
    job: JobRecord | None = None
    if decision.create_job:
        traits = sim.decider.job_traits(cfg.fault_rates)
        asked = read_request(body)
        now = time.time()
        started_at, completed_at = job_schedule(now, cfg.durations(asked.context_tokens, asked.generated_tokens))
        job = JobRecord(
            job_id="job_" + secrets.token_hex(8),
            client_reference=asked.client_reference,
            model=asked.model,
            context_tokens=asked.context_tokens,
            generated_tokens=asked.generated_tokens,
            created_at=now,
            started_at=started_at,
            completed_at=completed_at,
            final_status="failed" if traits.fails else "succeeded",
            outputs=traits.outputs,
            create_post_seq=seq,
            create_fault=decision.fault.value if decision.fault is not None else None,
            create_http_status=decision.status,
            faults=tuple(sorted(traits.faults)),
            unknown_status=traits.unknown_status,
            charge_amount=str(
                Decimal(cfg.price_per_context_token) * asked.context_tokens
                + Decimal(cfg.price_per_generated_token) * asked.generated_tokens
            ),
            currency=cfg.price_currency,
            account=_account(request),
        )
        reg.add_job(job)
        if JobFault.NEVER_FINISHES not in job.faults:
            sim.callbacks.schedule(cfg, job.job_id, job.completed_at, job.status)
    reg.note_post_outcome(reference, decision.status, kept)

    fault = decision.fault
    if fault is PostFault.RATE_LIMITED_429:
        return _json(
            {"error": {"code": "rate_limited", "message": "too many requests"}},
            status=429,
            headers={"Retry-After": cfg.retry_after_header or str(cfg.retry_after_s)},
        )
    if fault is PostFault.INTERNAL_5XX:
        return _error(decision.status, "internal_error", "simulated internal error")
    assert job is not None
    if fault is PostFault.UPSTREAM_502:
        return _error(502, "upstream_error", "simulated upstream error after job creation", job_id=job.job_id)
    if fault is PostFault.DROP_AFTER_CREATE:
        if request.transport is not None:
            request.transport.close()
        # Nothing can be written any more; aiohttp drops this response silently.
        return web.Response(status=500)
    if fault is PostFault.SLOW_RESPONSE:
        try:
            async with asyncio.timeout(cfg.slow_response_s):
                await sim.stopping.wait()
        except TimeoutError:
            pass
    return _json(
        {
            "id": job.job_id,
            "status": "queued",
            "created_at": job.created_at,
            "poll_after_ms": poll_after_ms(
                time.time(), job.completed_at, min_ms=cfg.poll_min_ms, max_ms=cfg.poll_max_ms
            ),
        },
        status=201,
    )


def _job_answer(job: JobRecord, now: float, cfg: SimulatorConfig, status: str, answered: str | None) -> dict[str, Any]:
    """The seed-shaped answer about ``job`` at unix time ``now`` whose real status is ``status`` and whose
    answered one (a fault may change it) ``answered``: terminal answers carry ``completed_at`` and, succeeded or
    failed, the charge; succeeded the outputs, failed the error and the refund."""
    data: dict[str, Any] = {
        "id": job.job_id,
        "model": job.model,
        "status": answered,
        "created_at": job.created_at,
        "started_at": job.started_at if status != "queued" else None,
        "completed_at": None,
        "metadata": {"client_reference": job.client_reference},
        "poll_after_ms": poll_after_ms(now, job.completed_at, min_ms=cfg.poll_min_ms, max_ms=cfg.poll_max_ms),
    }
    if answered == "canceled":
        data["completed_at"] = job.canceled_at
    if answered == "succeeded" or answered == "failed":
        data["completed_at"] = job.completed_at
        data["charge"] = job.charge()
        if answered == "succeeded":
            data["outputs"] = _outputs(job, cfg.output_extra_json, cfg.output_ttl_s)
        else:
            data["error"] = {"code": "generation_failed", "message": "simulated generation failure"}
            data["refund"] = {"id": job.refund_id, "amount": job.charge_amount, "currency": job.currency}
    return data


async def get_generation(request: web.Request) -> web.Response:
    """``GET /v1/generations/{id}``: simulated work, then the job's status computed from the clock.

    A terminal answer carries the job's ``charge``; a failed one also its ``refund``. The job's GET-side faults
    (``JobFault``) change the answer: 404 inside the not-found window, an undocumented status, ``queued`` while
    running.
    """
    sim = request.app[SIMULATOR_KEY]
    reg = sim.registry
    latency_s = sim.config.get_latency_ms / 1000.0
    reg.gets += 1
    limited = _over_limit(sim, request, "GET")
    if limited is not None:
        return limited
    job = reg.jobs.get(request.match_info["job_id"])
    if job is None:
        reg.gets_not_found += 1
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        return _error(404, "not_found", "no such generation")

    job.gets += 1
    job.gets_in_flight += 1
    if job.gets_in_flight > job.max_gets_in_flight:
        job.max_gets_in_flight = job.gets_in_flight
    try:
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        cfg = sim.config
        now = time.time()
        if JobFault.NOT_FOUND_WINDOW in job.faults and now < job.created_at + cfg.not_found_window_s:
            job.gets_not_found += 1
            reg.gets_not_found += 1
            return _error(404, "not_found", "no such generation")
        status = job.status(now)
        answered: str | None = status
        if JobFault.UNKNOWN_STATUS in job.faults:
            answered = job.unknown_status
        elif JobFault.STATUS_REGRESSION in job.faults and status == "running" and job.gets % 2 == 0:
            answered = "queued"
            job.regressed_gets += 1
        data = _job_answer(job, now, cfg, status, answered)
        if answered in ("canceled", "succeeded", "failed"):
            job.terminal_gets += 1
            if job.first_terminal_get_at is None:
                job.first_terminal_get_at = now
        headers = {"Retry-After": cfg.retry_after_header} if cfg.retry_after_header else None
        if cfg.retry_after_dates:  # the poll hint as a date on this server's clock, with the Date it is read against
            headers = dated_retry_after(now, data["poll_after_ms"] / 1000.0)
        return _json(data, headers=headers)
    finally:
        job.gets_in_flight -= 1


async def cancel_generation(request: web.Request) -> web.Response:
    """``POST /v1/generations/{id}/cancel``: cancel a job that has not ended (200 with ``status: canceled``; its
    GETs answer ``canceled`` from now on, without outputs); 409 ``already_terminal`` (with the job's ``job_status``) for
    a job that ended first, 404 for an unknown id. Counted among the account's POSTs for the rate limit."""
    sim = request.app[SIMULATOR_KEY]
    if not _authorized(request):
        return _error(401, "unauthorized", "missing or empty bearer token")
    limited = _over_limit(sim, request, "POST")
    if limited is not None:
        return limited
    reg = sim.registry
    reg.cancels += 1
    job = reg.jobs.get(request.match_info["job_id"])
    if job is None:
        return _error(404, "not_found", "no such generation")
    job.cancels += 1
    now = time.time()
    status = job.status(now)
    if status in ("succeeded", "failed", "canceled"):
        return _error(409, "already_terminal", f"the generation is already {status}", job_status=status)
    job.canceled_at = now
    return _json({"id": job.job_id, "status": "canceled"})


async def list_generations(request: web.Request) -> web.Response:
    """``GET /v1/generations?client_reference=...``: the jobs created with that client reference, oldest first
    (``{"data": [{"id", "status", "created_at"}]}``), listed ``lookup_lag_s`` after creation (the consistency
    lag). Offered only with ``lookup_enabled`` (the real API documents no such lookup): 404 otherwise."""
    sim = request.app[SIMULATOR_KEY]
    cfg = sim.config
    if not cfg.lookup_enabled:
        return _error(404, "not_found", "no such endpoint")
    if not _authorized(request):
        return _error(401, "unauthorized", "missing or empty bearer token")
    limited = _over_limit(sim, request, "GET")  # a lookup is one of the account's GETs
    if limited is not None:
        return limited
    reference = request.query.get("client_reference")
    if not reference:
        return _error(400, "invalid_request", "client_reference is required")
    reg = sim.registry
    reg.lookups += 1
    if cfg.get_latency_ms > 0:
        await asyncio.sleep(cfg.get_latency_ms / 1000.0)
    now = time.time()
    op = reg.operations.get(reference)
    jobs = [reg.jobs[j] for j in op.jobs] if op is not None else []
    visible = sorted((j for j in jobs if j.created_at <= now - cfg.lookup_lag_s), key=lambda j: j.created_at)
    return _json({"data": [{"id": j.job_id, "status": j.status(now), "created_at": j.created_at} for j in visible]})


#: The dialect of a prediction API of the Replicate kind (``SimulatorConfig.dialect``).
REPLICATE = "replicate-predictions"

#: The seed's status words that the prediction API says differently.
_PREDICTION_STATUS = {"queued": "starting", "running": "processing"}

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait(?:=(\d+(?:\.\d+)?))?(?:$|[,;\s])")


def _rfc3339(unix_s: Any) -> str | None:
    """Unix seconds as an RFC 3339 UTC date-time with milliseconds (``...Z``), None for None."""
    if not isinstance(unix_s, int | float):
        return None
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_prediction(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """A seed-shaped job answer (:func:`_job_answer`, or the create/cancel answer) as a prediction: ``status`` in
    ``starting|processing|succeeded|failed|canceled`` (other words pass through), ``output`` the outputs' texts
    (None until succeeded), ``error`` text, RFC 3339 times, ``urls.get`` / ``urls.cancel`` under ``origin``;
    no charge, refund or poll hint."""
    job_id = data["id"]
    status = data.get("status")
    outputs = data.get("outputs")
    error = data.get("error")
    return {
        "id": job_id,
        "model": data.get("model"),
        "status": _PREDICTION_STATUS.get(status, status) if isinstance(status, str) else status,
        "output": [o.get("text") if isinstance(o, dict) else o for o in outputs] if outputs is not None else None,
        "error": error.get("message") if isinstance(error, dict) else None,
        "created_at": _rfc3339(data.get("created_at")),
        "started_at": _rfc3339(data.get("started_at")),
        "completed_at": _rfc3339(data.get("completed_at")),
        "urls": {"get": f"{origin}/v1/predictions/{job_id}", "cancel": f"{origin}/v1/predictions/{job_id}/cancel"},
    }


async def _held_for_wait(request: web.Request, job_id: str) -> dict[str, Any] | None:
    """For a create call with ``Prefer: wait`` (or ``wait=<s>``): wait until the job ends or the bounded wait
    (``prefer_wait_max_s``) passes, then the job's seed-shaped answer; None without the preference."""
    match = _PREFER_WAIT.search(request.headers.get("Prefer", ""))
    if match is None:
        return None
    sim = request.app[SIMULATOR_KEY]
    job = sim.registry.jobs.get(job_id)
    if job is None:
        return None
    asked_s = float(match.group(1)) if match.group(1) else sim.config.prefer_wait_max_s
    wait_s = max(0.0, min(asked_s, sim.config.prefer_wait_max_s, job.completed_at - time.time()))
    if wait_s > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await sim.stopping.wait()
    now = time.time()
    status = job.status(now)
    return _job_answer(job, now, sim.config, status, status)


@web.middleware
async def _prediction_shape(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Serves the seed's handlers in the prediction API's shape: job answers through :func:`to_prediction`,
    errors as ``{"title": <code>, "detail": <message>, "status": <http status>, ...}``; a create call with
    ``Prefer: wait`` held (:func:`_held_for_wait`). Headers (``Retry-After``, ``Date``) are kept."""
    response = await handler(request)
    if not request.path.startswith("/v1/predictions") or not isinstance(response, web.Response):
        return response
    raw = response.body
    if not isinstance(raw, bytes) or not raw:
        return response
    data = orjson.loads(raw)
    if not isinstance(data, dict):
        return response
    error = data.get("error")
    if "id" not in data and isinstance(error, dict):
        rest = {k: v for k, v in error.items() if k not in ("code", "message")}
        body: dict[str, Any] = {
            "title": error.get("code"),
            "detail": error.get("message"),
            "status": response.status,
            **rest,
        }
    elif "id" in data:
        if request.method == "POST" and response.status == 201:
            data = await _held_for_wait(request, data["id"]) or data
        body = to_prediction(data, f"{request.scheme}://{request.host}")
    else:
        return response
    kept = {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")}
    return _json(body, status=response.status, headers=kept)


async def sim_summary(request: web.Request) -> web.Response:
    """``GET /_sim/summary`` (with ``rate_limit_429s``: the 429s the per-account limit answered, per method;
    ``concurrency_throttled``: the POSTs the concurrency limit answered; ``max_active_jobs``: most jobs of one
    account queued or running at once; ``callbacks``: the completion callbacks planned, faulted, sent and answered,
    :mod:`streams_harness.simulator.callbacks`)."""
    sim = request.app[SIMULATOR_KEY]
    refused = sim.limiter.refused
    return _json(
        {
            **sim.registry.summary(time.time()),
            "rate_limit_429s": {m: refused[m] for m in ("POST", "GET")},
            "callbacks": sim.callbacks.summary(),
        }
    )


async def sim_jobs(request: web.Request) -> web.Response:
    """``GET /_sim/jobs``: every job record, in creation order."""
    now = time.time()
    jobs = request.app[SIMULATOR_KEY].registry.jobs
    return _json({"jobs": [job.to_record(now) for job in jobs.values()]})


async def sim_operation(request: web.Request) -> web.Response:
    """``GET /_sim/operations/{client_reference}`` (unknown references answer zero posts and no jobs; ``bodies``
    holds the POST bodies received while ``record_bodies`` was on)."""
    reg = request.app[SIMULATOR_KEY].registry
    now = time.time()
    op = reg.operations.get(request.match_info["client_reference"])
    if op is None:
        return _json({"posts": 0, "post_statuses": [], "jobs": [], "bodies": []})
    return _json(
        {
            "posts": op.posts,
            "post_statuses": op.post_statuses,
            "jobs": [reg.jobs[j].to_record(now) for j in op.jobs],
            "bodies": op.bodies,
        }
    )


async def sim_config(request: web.Request) -> web.Response:
    """``POST /_sim/config``: apply a partial config (JSON object), answer the full config."""
    sim = request.app[SIMULATOR_KEY]
    try:
        body, parse_error = orjson.loads(await request.read()), None
    except orjson.JSONDecodeError:
        body, parse_error = None, "body is not valid JSON"
    if parse_error is not None or not isinstance(body, dict):
        return _error(400, "invalid_request", parse_error or "body must be a JSON object")
    try:
        new = sim.config.updated(body, allow_static=False)
    except (ValueError, TypeError) as exc:
        return _error(400, "invalid_request", str(exc))
    if new.seed != sim.config.seed:
        sim.decider.reseed(new.seed)
    sim.config = new
    logger.info(
        "simulator config changed: %s",
        {**body, **({"callback_secret": "**********"} if "callback_secret" in body else {})},
    )
    return _json(new.to_dict())


async def sim_reset(request: web.Request) -> web.Response:
    """``POST /_sim/reset``: clear all records and reseed the RNG."""
    request.app[SIMULATOR_KEY].reset()
    return _json({"ok": True})


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``."""
    return _json({"ok": True})


async def _on_shutdown(app: web.Application) -> None:
    # Release slow POST handlers so the server stops without waiting slow_response_s.
    app[SIMULATOR_KEY].stopping.set()


async def _on_cleanup(app: web.Application) -> None:
    await app[SIMULATOR_KEY].callbacks.close()


def make_app(config: SimulatorConfig | None = None) -> web.Application:
    """Build the simulator application for ``config`` (default: ``SimulatorConfig()``).

    The state is reachable with :func:`get_simulator`.
    """
    config = config or SimulatorConfig()
    if config.dialect == REPLICATE:
        app = web.Application(middlewares=[_prediction_shape])
        app[SIMULATOR_KEY] = Simulator(config)
        app.router.add_post("/v1/predictions", post_generation)
        app.router.add_get("/v1/predictions/{job_id}", get_generation, allow_head=False)
        app.router.add_post("/v1/predictions/{job_id}/cancel", cancel_generation)
    else:
        app = web.Application()
        app[SIMULATOR_KEY] = Simulator(config)
        app.router.add_post("/v1/generations", post_generation)
        app.router.add_get("/v1/generations", list_generations, allow_head=False)
        app.router.add_get("/v1/generations/{job_id}", get_generation, allow_head=False)
        app.router.add_post("/v1/generations/{job_id}/cancel", cancel_generation)
    app.router.add_get("/_sim/summary", sim_summary, allow_head=False)
    app.router.add_get("/_sim/jobs", sim_jobs, allow_head=False)
    app.router.add_get("/_sim/operations/{client_reference}", sim_operation, allow_head=False)
    app.router.add_post("/_sim/config", sim_config)
    app.router.add_post("/_sim/reset", sim_reset)
    app.router.add_get("/healthz", healthz, allow_head=False)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app
