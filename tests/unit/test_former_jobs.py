"""A lookup by client reference leaves out the jobs of a former operation of the same id (``streams purge
--ids-older-than`` frees ids): created well before this operation was accepted, they are never its own."""

from __future__ import annotations

from streams.ledger.records import FORMER_JOB_MARGIN_S, LookupClaim
from streams.model.answers import LookupJob
from streams.worker.stages.reconciler import _not_former

ACCEPTED_MS = 1_800_000_000_000
MARGIN_MS = int(FORMER_JOB_MARGIN_S * 1000)


def claim(accepted_at_ms: int | None = ACCEPTED_MS, former: frozenset[str] = frozenset()) -> LookupClaim:
    return LookupClaim("op-1", 3, 40.0, 1, accepted_at_ms, former)


def test_jobs_created_before_the_acceptance_by_more_than_the_margin_are_left_out() -> None:
    former = LookupJob("job_old", "succeeded", ACCEPTED_MS - 400 * 86_400_000)
    edge = LookupJob("job_edge", "running", ACCEPTED_MS - MARGIN_MS)  # a provider's clock a day behind: kept
    own = LookupJob("job_own", "queued", ACCEPTED_MS + 150)
    undated = LookupJob("job_undated", "queued", None)  # nothing to tell it by: kept
    assert _not_former(claim(), [former, edge, own, undated]) == [edge, own, undated]
    assert _not_former(claim(), [LookupJob("j", "queued", ACCEPTED_MS - MARGIN_MS - 1)]) == []


def test_an_unknown_acceptance_leaves_every_job() -> None:
    jobs = [LookupJob("job_old", "succeeded", 1), LookupJob("job_own", "queued", ACCEPTED_MS)]
    assert _not_former(claim(None), jobs) == jobs


def test_the_jobs_the_accounting_learned_before_the_acceptance_are_left_out_however_recent() -> None:
    """A former operation of the id, freed with a short horizon (--skip-replay-check): its job was created minutes
    before this operation, within the margin, but the accounting learned it before this operation was accepted."""
    former = LookupJob("job_former", "succeeded", ACCEPTED_MS - 60_000)
    own = LookupJob("job_own", "queued", ACCEPTED_MS + 150)
    assert _not_former(claim(former=frozenset({"job_former"})), [former, own]) == [own]
    assert _not_former(claim(None, frozenset({"job_former"})), [former, own]) == [own]


def test_an_undated_job_is_left_out_only_when_the_id_had_a_former_operation() -> None:
    undated = LookupJob("job_undated", "queued", None)
    assert _not_former(claim(), [undated]) == [undated]
    assert _not_former(claim(former=frozenset({"job_former"})), [undated]) == []
    had_calls = LookupClaim("op-1", 3, 40.0, 1, ACCEPTED_MS, frozenset(), had_former=True)  # sent, job never learned
    assert _not_former(had_calls, [undated]) == []
