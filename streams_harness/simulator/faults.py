"""Fault rates and the seeded fault decisions of the provider simulator (pure, no I/O).

Every valid ``POST /v1/generations`` asks :meth:`FaultDecider.decide_post` which
fault (if any) to inject.  The kinds are checked in this fixed order, each with
one independent draw from the seeded RNG, and the first hit wins:

1. ``rate_limited_429``  - 429 + ``Retry-After``; no job is created.
2. ``upstream_502``      - 502 whose error body carries the created ``job_id``.
3. ``internal_5xx``      - 500 or 503 without job id; the job is created or not (50/50).
4. ``drop_after_create`` - job created, connection closed without a response.
5. ``slow_response``     - job created, the 201 is delayed by ``slow_response_s``.

Per-job properties are drawn from the same RNG at creation time, so a given seed
and request sequence is reproducible: terminal failure, a second output, and the
GET-side faults (each drawn only when its rate is above 0, so turning them on
leaves every other draw of a seed as it was):

* ``not_found_window``  - GET answers 404 for ``not_found_window_s`` after creation.
* ``unknown_status``    - every GET answers a status the API never documented
                          (``aborted``, ``paused`` or ``null``).
* ``never_finishes``    - the job stays ``running`` forever.
* ``status_regression`` - while running, every second GET answers ``queued``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum


class PostFault(StrEnum):
    """Fault kinds injected on ``POST /v1/generations`` (values are the summary keys)."""

    RATE_LIMITED_429 = "rate_limited_429"
    UPSTREAM_502 = "upstream_502"
    INTERNAL_5XX = "internal_5xx"
    DROP_AFTER_CREATE = "drop_after_create"
    SLOW_RESPONSE = "slow_response"


JOB_FAILED = "job_failed"
"""Summary key for jobs that end in status ``failed``."""


class JobFault(StrEnum):
    """Faults of a job's GET answers, drawn at creation (values are the summary keys)."""

    NOT_FOUND_WINDOW = "not_found_window"
    UNKNOWN_STATUS = "unknown_status"
    NEVER_FINISHES = "never_finishes"
    STATUS_REGRESSION = "status_regression"


#: The unknown statuses a job with ``unknown_status`` answers (``None`` is sent as ``"status": null``).
UNKNOWN_STATUSES: tuple[str | None, ...] = ("aborted", "paused", None)

FAULT_KINDS: tuple[str, ...] = (*(f.value for f in PostFault), JOB_FAILED, *(f.value for f in JobFault))
"""All keys of ``faults_injected`` in ``GET /_sim/summary``."""


@dataclass(frozen=True, slots=True)
class FaultRates:
    """Probabilities in ``[0, 1]`` of each fault (0 disables it).

    Attributes:
        rate_limited_429: P(429) per valid POST.
        upstream_502: P(502 with job id) per valid POST that was not rate limited.
        internal_5xx: P(500/503 without job id) per remaining POST.
        drop_after_create: P(connection dropped after creating the job).
        slow_response: P(201 delayed by ``slow_response_s``).
        job_failed: P(a created job ends ``failed``).
        multi_output: P(a succeeded job has a second output).
        not_found_window: P(a created job answers 404 for a window after creation).
        unknown_status: P(a created job answers an undocumented status to every GET).
        never_finishes: P(a created job stays ``running`` forever).
        status_regression: P(a created job answers ``queued`` to every second GET while running).
    """

    rate_limited_429: float = 0.0
    upstream_502: float = 0.0
    internal_5xx: float = 0.0
    drop_after_create: float = 0.0
    slow_response: float = 0.0
    job_failed: float = 0.0
    multi_output: float = 0.1
    not_found_window: float = 0.0
    unknown_status: float = 0.0
    never_finishes: float = 0.0
    status_regression: float = 0.0


@dataclass(frozen=True, slots=True)
class PostDecision:
    """Outcome of the fault draw for one valid POST.

    Attributes:
        fault: the injected fault, or ``None`` for a normal 201.
        create_job: whether a job is created.
        status: the HTTP status to answer with (``0`` when the connection is dropped).
    """

    fault: PostFault | None
    create_job: bool
    status: int


@dataclass(frozen=True, slots=True)
class JobTraits:
    """Per-job properties drawn at creation.

    Attributes:
        fails: the job ends in status ``failed`` instead of ``succeeded``.
        outputs: number of outputs on success (1 or 2).
        faults: the GET-side faults of the job.
        unknown_status: the status answered when ``unknown_status`` is among ``faults``.
    """

    fails: bool
    outputs: int
    faults: frozenset[JobFault] = frozenset()
    unknown_status: str | None = None


class FaultDecider:
    """Seeded source of all random decisions (``random.Random(seed)``).

    Not thread-safe; the simulator calls it from its single event loop.
    """

    def __init__(self, seed: int) -> None:
        """Create a decider whose draws are determined by ``seed``."""
        self._rng = random.Random(seed)

    def reseed(self, seed: int) -> None:
        """Restart the random sequence from ``seed``."""
        self._rng.seed(seed)

    def _hit(self, rate: float) -> bool:
        return self._rng.random() < rate

    def decide_post(self, rates: FaultRates) -> PostDecision:
        """Decide the fault for one valid POST (order documented in the module docstring)."""
        if self._hit(rates.rate_limited_429):
            return PostDecision(PostFault.RATE_LIMITED_429, create_job=False, status=429)
        if self._hit(rates.upstream_502):
            return PostDecision(PostFault.UPSTREAM_502, create_job=True, status=502)
        if self._hit(rates.internal_5xx):
            status = 500 if self._rng.random() < 0.5 else 503
            return PostDecision(PostFault.INTERNAL_5XX, create_job=self._rng.random() < 0.5, status=status)
        if self._hit(rates.drop_after_create):
            return PostDecision(PostFault.DROP_AFTER_CREATE, create_job=True, status=0)
        if self._hit(rates.slow_response):
            return PostDecision(PostFault.SLOW_RESPONSE, create_job=True, status=201)
        return PostDecision(None, create_job=True, status=201)

    def job_traits(self, rates: FaultRates) -> JobTraits:
        """Draw whether a new job fails, how many outputs it has on success, and its GET-side faults."""
        fails = self._hit(rates.job_failed)
        outputs = 2 if self._hit(rates.multi_output) else 1
        faults = frozenset(
            kind
            for kind, rate in (
                (JobFault.NOT_FOUND_WINDOW, rates.not_found_window),
                (JobFault.UNKNOWN_STATUS, rates.unknown_status),
                (JobFault.NEVER_FINISHES, rates.never_finishes),
                (JobFault.STATUS_REGRESSION, rates.status_regression),
            )
            if rate > 0 and self._hit(rate)
        )
        unknown = self._rng.choice(UNKNOWN_STATUSES) if JobFault.UNKNOWN_STATUS in faults else None
        return JobTraits(fails=fails, outputs=outputs, faults=faults, unknown_status=unknown)
