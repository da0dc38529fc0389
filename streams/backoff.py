"""Delay before the next poll of a remote job (docs/design.md, "Leases, polls and the rate budget").

The API's hint (``Retry-After`` or ``poll_after_ms``, read by :mod:`streams.remote.client`) wins when usable,
clamped to ``[min_s, cap_s]``; otherwise a capped exponential with "equal jitter" (half fixed, half random; AWS
Architecture Blog, "Exponential Backoff and Jitter"). The next poll is therefore never before now + ``min_s``,
never after now + ``cap_s``, and an unreadable hint (None, NaN) gets the exponential fallback.
"""

from __future__ import annotations

import math
import random

_RNG = random.Random()


def next_poll_delay_s(
    poll_count: int,
    hint_s: float | None,
    *,
    base_s: float,
    cap_s: float,
    min_s: float,
    rng: random.Random | None = None,
    hints_trusted_polls: int | None = None,
) -> float:
    """Seconds until the next GET of a job already observed ``poll_count`` times.

    Args:
        poll_count: observations so far (0 for the first poll).
        hint_s: the API's hint in seconds, or None.
        base_s, cap_s, min_s: exponential base, upper cap and lower floor (seconds).
        rng: random source (tests pass a seeded one).
        hints_trusted_polls: when set, the hint is followed as it is only for the job's first this many
            observations; from then on the delay is at least ``base_s * 2 ** (poll_count - hints_trusted_polls)``
            (capped): a provider whose hint keeps saying "soon" for a job that never finishes cannot make it cost
            a GET every ``min_s``.

    Returns a delay in ``[min_s, cap_s]``: a hint below ``min_s`` (past, negative) gives ``min_s``, one above
    ``cap_s`` (``inf`` included) gives ``cap_s``, a NaN hint counts as none.
    """
    if hint_s is not None and not math.isnan(hint_s):
        delay = min(cap_s, max(min_s, hint_s))
        if hints_trusted_polls is not None and poll_count >= hints_trusted_polls:
            floor = min(cap_s, base_s * float(2 ** min(poll_count - hints_trusted_polls, 30)))
            delay = max(delay, floor)
        return delay
    r = rng or _RNG
    ceiling = min(cap_s, base_s * float(2 ** min(poll_count, 30)))
    return max(min_s, ceiling / 2 + r.uniform(0, ceiling / 2))
