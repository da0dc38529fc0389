"""The simulator's completion callbacks: a signed POST (Standard Webhooks) to ``callback_url`` when a job ends.

Each job that reaches a terminal status gets one delivery (``webhook-id`` ``msg_<hex>``, the same on every retry of
it), body ``{"type": "generation.completed", "timestamp": <unix s>, "data": {"id": <job id>, "status": ...}}``,
sent ``callback_delay_ms`` after the completion. Faults, drawn from their own seeded RNG (the POST and GET fault
draws stay as without callbacks): ``callback_loss`` (never sent), ``callback_duplicates`` (sent twice, same id),
``callback_reorder`` (held back a further random part of ``callback_reorder_window_ms``, so later completions
overtake it), ``callback_bad_signature`` (signed with a key the receiver does not know). An answer other than
2xx, or no answer, is retried up to ``callback_attempts`` times in all, 0.2 s, 0.4 s, ... apart (a 404 from a
receiver that has not saved the job id yet is thus seen again). A job canceled or never finishing sends none.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from streams.config import callback_secret_key
from streams.remote.callbacks import signature
from streams_harness.simulator.config import SimulatorConfig

logger = logging.getLogger("streams_harness.simulator.callbacks")

#: Statuses a delivery reports (a job canceled or still running by then sends none).
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "canceled"})
#: First pause between two attempts of one delivery (s); doubled after each.
RETRY_BASE_S = 0.2
#: Deadline of one attempt (s).
ATTEMPT_TIMEOUT_S = 5.0
#: The key of a delivery sent with a bad signature (no receiver is configured with it).
WRONG_KEY = b"not the endpoint's secret"
#: What :attr:`CallbackSender.counts` reports (``GET /_sim/summary``'s ``callbacks``); ``attempts`` counts the
#: attempts that ended, each with its outcome (``acknowledged``, ``refused`` or ``unanswered``) and, when answered,
#: its status, so ``attempts == acknowledged + refused + unanswered`` at every read.
COUNT_KINDS = (
    "scheduled",
    "lost",
    "duplicated",
    "reordered",
    "bad_signature",
    "attempts",
    "acknowledged",
    "refused",
    "unanswered",
)


class CallbackSender:
    """Sends the completion callbacks of one simulator (see the module docstring)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed ^ 0x5EED)
        self.counts: Counter[str] = Counter()
        #: HTTP statuses the receiver answered, by status.
        self.statuses: Counter[int] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    def summary(self) -> dict[str, Any]:
        """The counts (and the receiver's statuses) as JSON-ready data."""
        statuses = {str(k): v for k, v in sorted(self.statuses.items())}
        return {**{kind: self.counts[kind] for kind in COUNT_KINDS}, "statuses": statuses}

    def clear(self, seed: int) -> None:
        """Forget the counts and restart the RNG (``POST /_sim/reset``); deliveries under way go on."""
        self.rng = random.Random(seed ^ 0x5EED)
        self.counts.clear()
        self.statuses.clear()

    def schedule(
        self, config: SimulatorConfig, job_id: str, completed_at: float, status_at: Callable[[float], str]
    ) -> None:
        """Plan the delivery for ``job_id`` ending at ``completed_at`` (unix s), with the faults drawn now;
        ``status_at`` gives the job's status at a time (no delivery when it is not terminal then)."""
        if not config.callback_url:
            return
        self.counts["scheduled"] += 1
        if self.rng.random() < config.callback_loss:
            self.counts["lost"] += 1
            return
        delay_s = config.callback_delay_ms / 1000.0
        if self.rng.random() < config.callback_reorder:
            self.counts["reordered"] += 1
            delay_s += self.rng.random() * config.callback_reorder_window_ms / 1000.0
        copies = 1
        if self.rng.random() < config.callback_duplicates:
            self.counts["duplicated"] += 1
            copies = 2
        bad = self.rng.random() < config.callback_bad_signature
        if bad:
            self.counts["bad_signature"] += 1
        webhook_id = "msg_" + secrets.token_hex(12)
        for copy in range(copies):
            wait_s = max(0.0, completed_at - time.time()) + delay_s + copy * 0.05
            task = asyncio.create_task(self._deliver(config, webhook_id, job_id, status_at, wait_s, bad))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _deliver(
        self,
        config: SimulatorConfig,
        webhook_id: str,
        job_id: str,
        status_at: Callable[[float], str],
        wait_s: float,
        bad: bool,
    ) -> None:
        await asyncio.sleep(wait_s)
        status = status_at(time.time())
        if status not in TERMINAL_STATUSES or status == "canceled":
            return
        body = orjson.dumps(
            {"type": "generation.completed", "timestamp": int(time.time()), "data": {"id": job_id, "status": status}}
        )
        key = WRONG_KEY if bad else callback_secret_key(config.callback_secret)
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S))
        for attempt in range(config.callback_attempts):
            if attempt:
                await asyncio.sleep(RETRY_BASE_S * 2 ** (attempt - 1))
            timestamp_s = int(time.time())
            headers = {
                "content-type": "application/json",
                "webhook-id": webhook_id,
                "webhook-timestamp": str(timestamp_s),
                "webhook-signature": signature(key, webhook_id, timestamp_s, body),
            }
            answered: int | None = None
            try:
                async with self._session.post(config.callback_url, data=body, headers=headers) as answer:
                    answered = answer.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.info("callback %s for %s: attempt %d unanswered: %s", webhook_id, job_id, attempt + 1, exc)
            # An attempt is counted once it ended, together with its outcome: a reader never sees it without one.
            self.counts["attempts"] += 1
            if answered is None:
                self.counts["unanswered"] += 1
                continue
            self.statuses[answered] += 1
            if 200 <= answered < 300:
                self.counts["acknowledged"] += 1
                return
            self.counts["refused"] += 1

    async def close(self) -> None:
        """Stop the deliveries under way and close the HTTP session."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
