"""The provider check of an operator's ``adopt``: GET the job at the provider, as the observer does, before the
ledger adopts it (docs/decisions.md)."""

from __future__ import annotations

from streams.config import Settings
from streams.errors import (
    OperatorActionRefusedError,
    RemoteContractError,
    RemoteError,
    RemoteJobNotFoundError,
    RemoteUnknownStatusError,
)
from streams.remote.client import RemoteClient

#: What an adopt records in its reason when the operator skipped the check (``--without-provider-check``).
SKIPPED = "not checked at the provider (--without-provider-check)"


async def check_job_at_provider(settings: Settings, operation_id: str, remote_job_id: str) -> str:
    """GET ``remote_job_id`` once with the product's remote client (``STREAMS_REMOTE_BASE_URL``, the call deadline
    ``remote_call_deadline_s``) and say what the provider answered, for the transition's reason.

    A 200 (any status, even one the client does not know or outputs that break the contract) means the provider
    knows the job: returns e.g. ``"the provider answers status running"``.

    Raises:
        OperatorActionRefusedError: the provider answered 404 (it does not know the job), or could not be asked
            (not reached, cut off, 429, 5xx): the message says which and how to override.
    """
    remote = RemoteClient.from_settings(settings)
    try:
        snapshot = await remote.observe(operation_id, remote_job_id)
    except RemoteJobNotFoundError:
        raise OperatorActionRefusedError(
            operation_id,
            "adopt",
            f"the provider answers 404 for job {remote_job_id}: it does not know it (check the job id; a job "
            "created a moment ago may answer 404 for a few seconds: try again), or pass --without-provider-check "
            "(recorded) to adopt it anyway",
        ) from None
    except (RemoteUnknownStatusError, RemoteContractError) as exc:
        return f"the provider answers HTTP 200 for it ({exc.outcome})"
    except RemoteError as exc:
        raise OperatorActionRefusedError(
            operation_id,
            "adopt",
            f"could not ask the provider about job {remote_job_id} ({exc.outcome}: {exc}); try again when it "
            "answers, or pass --without-provider-check (recorded) to adopt it unchecked",
        ) from None
    finally:
        await remote.aclose()
    return f"the provider answers status {snapshot.status}"
