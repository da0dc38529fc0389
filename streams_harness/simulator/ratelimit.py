"""The simulator's per-account request limit (pure, no I/O): one token bucket per account and method.

Off by default. When ``rate_limit_post_per_s`` / ``rate_limit_get_per_s`` is set, each account (the bearer
token of the request) may send that many POSTs / GETs per second, with bursts of up to ``rate_limit_burst``;
a request over the limit is answered 429 with ``Retry-After`` (whole seconds, rounded up: the time until a
token is back) and counted. Like a provider, the bucket counts every authenticated request, valid or not.
"""

from __future__ import annotations

import email.utils
import math
from collections import Counter
from dataclasses import dataclass, field

#: Tokens short of one that still count as one (float rounding of ``elapsed * rate``).
_EPSILON = 1e-9


@dataclass(slots=True)
class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate_per_s`` per second; one request takes one token.

    Times are seconds of a monotonic clock given by the caller.
    """

    rate_per_s: float
    burst: int
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """Take a token at ``now``: 0.0 when one was there, else the seconds until one will be (nothing taken)."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1.0 - _EPSILON:  # a request exactly on the pace is never refused by rounding
            self.tokens = max(0.0, self.tokens - 1.0)
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


def retry_after_header(wait_s: float) -> str:
    """``Retry-After`` delay-seconds for a wait of ``wait_s`` seconds: a whole number, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))


def dated_retry_after(now_s: float, wait_s: float) -> dict[str, str]:
    """``Date`` and an HTTP-date ``Retry-After`` (RFC 9110 10.2.3, both on this server's clock) for a wait of
    ``wait_s`` seconds from ``now_s`` (epoch seconds): ``Date`` is ``now_s`` cut to the second, ``Retry-After``
    that plus the wait rounded up to a whole second, at least 1 s."""
    sent_s = math.floor(now_s)
    after_s = sent_s + max(1, math.ceil(now_s + wait_s - sent_s))
    return {
        "Date": email.utils.formatdate(sent_s, usegmt=True),
        "Retry-After": email.utils.formatdate(after_s, usegmt=True),
    }


@dataclass
class AccountLimiter:
    """Buckets per (account, method); ``refused`` counts the 429s answered per method (``POST``, ``GET``)."""

    buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)

    def check(self, account: str, method: str, rate_per_s: float, burst: int, now: float) -> float | None:
        """None when ``account`` may send this ``method`` request at ``now`` (or no limit is set: ``rate_per_s``
        0), else the seconds until it may (counted in :attr:`refused`). A changed rate or burst applies to the
        bucket from now on."""
        if rate_per_s <= 0:
            return None
        bucket = self.buckets.get((account, method))
        if bucket is None:
            bucket = self.buckets[(account, method)] = TokenBucket(rate_per_s, burst, float(burst), now)
        bucket.rate_per_s, bucket.burst = rate_per_s, burst
        wait_s = bucket.take(now)
        if wait_s == 0.0:
            return None
        self.refused[method] += 1
        return wait_s

    def clear(self) -> None:
        """Forget every bucket and count."""
        self.buckets.clear()
        self.refused.clear()
