"""The floor: the pipeline's calls to Kafka, Redis, PostgreSQL and the remote API for each operation, with no
logic and batched as far as each call allows, in one process. What the services and the network cost at
least; the benchmark divides the pipeline's throughput by it (``ratio_to_floor``).

Per batch of submissions: Redis ``SET NX PX`` (submit lease), ``PEXPIRE`` (renewal before the POST), ``DEL``,
each pipelined into one round trip; PostgreSQL accept, claim, save of the job ids and the accounting, one
statement each for the whole batch; the POSTs concurrently. Per batch of polls: Redis ``SET NX PX``, two
``PEXPIRE``, ``DEL``, pipelined; PostgreSQL claim, save of the answers with outputs and outbox rows, accounting,
one statement each; the GETs concurrently. Due polls are claimed and published, and the outbox relayed, with the
ledger's own batch queries. No schema validation, no outcome classification, no retries: every call is
expected to succeed (the benchmark's workload). The ledger's triggers still write the transition log and
outbox events, as for the pipeline.

Run by the benchmark: ``python -m streams_harness.bench.floor --ready-dir PATH`` with the run's ``STREAMS_*``
settings in the environment; runs until stopped. Several processes share the work: one consumer group (the
settings' app id) splits the partitions, and the due polls and the outbox are claimed with ``SKIP LOCKED``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from streams.config import Settings, lease_key
from streams.coordination.lease import make_redis
from streams.ledger.pool import create_pool
from streams.ledger.store import Ledger
from streams.model.states import is_terminal, state_for_remote_status
from streams_harness.bench.counters import BENCH

WORKER = "floor"
BATCH = 1000
#: Batches processed at once (their HTTP calls and statements overlap).
BATCHES_IN_FLIGHT = 4


class Floor:
    """The floor's connections and its steps (see the module docstring)."""

    def __init__(self, settings: Settings, ledger: Ledger, http: aiohttp.ClientSession) -> None:
        self.settings = settings
        self.ledger = ledger
        self.pool = ledger.pool
        self.redis = make_redis(settings.redis_url.get_secret_value(), 5.0)
        self.http = http
        self.headers = {
            "Authorization": f"Bearer {settings.remote_api_key.get_secret_value()}",
            "Content-Type": "application/json",
        }
        self.producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all", linger_ms=2)

    async def _leases(self, command: str, ids: list[str], action: str, times: int = 1) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for _ in range(times):
                for op in ids:
                    key = lease_key(self.settings, action, op)
                    if command == "set":
                        pipe.set(key, "floor", nx=True, px=self.settings.lease_ttl_ms)
                    elif command == "renew":
                        pipe.pexpire(key, self.settings.lease_ttl_ms)
                    else:
                        pipe.delete(key)
            await pipe.execute()

    async def _account(self, calls: list[tuple[str, str, int, str, str | None, float, int]]) -> None:
        operation_ids, methods, status_codes, outcomes, remote_job_ids, durations_ms, fencing_tokens = (
            list(c) for c in zip(*calls, strict=True)
        )
        await BENCH.floor_record_calls_many.execute(
            self.pool,
            operation_ids=operation_ids,
            methods=methods,
            status_codes=status_codes,
            outcomes=outcomes,
            remote_job_ids=remote_job_ids,
            durations_ms=durations_ms,
            fencing_tokens=fencing_tokens,
            worker=WORKER,
        )

    async def submit(self, events: list[dict[str, Any]]) -> None:
        ids = [e["operation_id"] for e in events]
        await self._leases("set", ids, "submit")
        requests = [orjson.dumps(e["request"]).decode() for e in events]
        submitted = [e["submitted_at_ms"] for e in events]
        await BENCH.floor_accept_many.execute(
            self.pool, operation_ids=ids, requests=requests, submitted_at_ms=submitted, worker=WORKER
        )
        claimed = {
            r["operation_id"]: r["fencing_token"]
            for r in await BENCH.floor_claim_submit_many.fetch(self.pool, operation_ids=ids, worker=WORKER)
        }
        await self._leases("renew", ids, "submit")

        async def post(event: dict[str, Any]) -> tuple[str, int, str, float]:
            request = event["request"]
            body = {"model": self.settings.remote_model, **request}
            body["metadata"] = {**request.get("metadata", {}), "client_reference": event["operation_id"]}
            started = time.perf_counter()
            async with self.http.post("/v1/generations", data=orjson.dumps(body), headers=self.headers) as r:
                answer = orjson.loads(await r.read())
                status = r.status
            return answer["id"], status, answer.get("poll_after_ms", 0) / 1000.0, (time.perf_counter() - started) * 1e3

        todo = [e for e in events if e["operation_id"] in claimed]
        results = await asyncio.gather(*(post(e) for e in todo))
        done = [e["operation_id"] for e in todo]
        await BENCH.floor_save_submitted_many.execute(
            self.pool,
            operation_ids=done,
            remote_job_ids=[r[0] for r in results],
            first_poll_delays_s=[r[2] for r in results],
            worker=WORKER,
        )
        await self._account(
            [(op, "POST", r[1], "created", r[0], r[3], claimed[op]) for op, r in zip(done, results, strict=True)]
        )
        await self._leases("delete", ids, "submit")

    async def observe(self, events: list[dict[str, Any]]) -> None:
        ids = [e["operation_id"] for e in events]
        await self._leases("set", ids, "observe")
        rows = await BENCH.floor_claim_observe_many.fetch(
            self.pool, operation_ids=ids, poll_claim_ids=[e["poll_claim_id"] for e in events], worker=WORKER
        )

        async def get(job_id: str) -> tuple[dict[str, Any], int, float]:
            started = time.perf_counter()
            async with self.http.get(f"/v1/generations/{job_id}", headers=self.headers) as r:
                return orjson.loads(await r.read()), r.status, (time.perf_counter() - started) * 1e3

        answers = await asyncio.gather(*(get(r["remote_job_id"]) for r in rows))
        await self._leases("renew", ids, "observe", times=2)
        states, delays, completed, outputs, observations = [], [], [], [], []
        for body, _, _ in answers:
            state = state_for_remote_status(body["status"])
            assert state is not None, body
            terminal = is_terminal(state)
            states.append(state.value)
            delays.append(None if terminal else body.get("poll_after_ms", 0) / 1000.0)
            completed.append(int(body["completed_at"] * 1000) if body.get("completed_at") else None)
            outputs.append(orjson.dumps(body.get("outputs") or []).decode())
            observations.append(orjson.dumps({"job_id": body["id"], "status": body["status"]}).decode())
        await BENCH.floor_save_observations_many.execute(
            self.pool,
            operation_ids=[r["operation_id"] for r in rows],
            fencing_tokens=[r["fencing_token"] for r in rows],
            states=states,
            observations=observations,
            next_poll_delays_s=delays,
            remote_completed_at_ms=completed,
            outputs=outputs,
            worker=WORKER,
        )
        await self._account(
            [
                (r["operation_id"], "GET", a[1], a[0]["status"], r["remote_job_id"], a[2], r["fencing_token"])
                for r, a in zip(rows, answers, strict=True)
            ]
        )
        await self._leases("delete", ids, "observe")

    async def schedule(self) -> int:
        """Claim due polls and publish them; returns how many."""
        polls = await self.ledger.claim_due_polls(BATCH, self.settings.visibility_timeout_s)
        now_ms = int(time.time() * 1000)
        futures = [
            await self.producer.send(
                self.settings.topic("polls"),
                orjson.dumps(
                    {
                        "operation_id": p.operation_id,
                        "remote_job_id": p.remote_job_id,
                        "poll_claim_id": p.poll_claim_id,
                        "claimed_at_ms": now_ms,
                    }
                ),
                key=p.operation_id.encode(),
            )
            for p in polls
        ]
        await asyncio.gather(*futures)
        return len(polls)

    async def relay(self) -> int:
        """Publish one batch of the outbox; returns how many rows (0 when another process's relay held the lock)."""

        async def publish(rows: list[dict[str, Any]]) -> None:
            futures = [
                await self.producer.send(
                    self.settings.topic(row["topic_role"]), row["payload"].encode(), key=row["operation_id"].encode()
                )
                for row in rows
            ]
            await asyncio.gather(*futures)

        marked = await self.ledger.relay_outbox(BATCH, publish)
        return 0 if marked is None else marked

    async def consume(self, consumer: AIOKafkaConsumer) -> None:
        """Hand each fetched batch of submissions and of polls to its step, several batches at a time."""
        in_flight = asyncio.Semaphore(BATCHES_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def step(work: Any) -> None:
            try:
                await work
            finally:
                in_flight.release()

        submissions = self.settings.topic("submissions")
        while True:
            batches = await consumer.getmany(timeout_ms=20, max_records=BATCH)
            events: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            for tp, messages in batches.items():
                events[tp.topic == submissions].extend(orjson.loads(m.value) for m in messages)
            for is_submission, batch in events.items():
                if batch:
                    await in_flight.acquire()
                    task = asyncio.create_task(step(self.submit(batch) if is_submission else self.observe(batch)))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)

    async def repeat(self, tick: Any) -> None:
        """Run ``tick`` back to back, pausing 20 ms whenever it finds nothing."""
        while True:
            if not await tick():
                await asyncio.sleep(0.02)


async def run(settings: Settings, ready_dir: Path | None) -> None:
    """Run the floor until cancelled (see the module docstring); ``ready_dir/ready-<pid>`` is written once it
    consumes."""
    pool = await create_pool(settings.database_url.get_secret_value(), min_size=4, max_size=10)
    connector = aiohttp.TCPConnector(limit=settings.http_max_connections)
    async with aiohttp.ClientSession(settings.remote_base_url.get_secret_value(), connector=connector) as http:
        floor = Floor(settings, Ledger(pool, WORKER), http)
        consumer = AIOKafkaConsumer(
            settings.topic("submissions"),
            settings.topic("polls"),
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=settings.app_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await floor.producer.start()
        await consumer.start()
        try:
            while not consumer.assignment():
                await asyncio.sleep(0.05)
            if ready_dir is not None:
                await asyncio.to_thread((ready_dir / f"ready-{os.getpid()}").write_text, "ready")
            # runs until stopped, like a worker: the benchmark watches the ledger to know when it is done
            await asyncio.gather(floor.consume(consumer), floor.repeat(floor.schedule), floor.repeat(floor.relay))
        finally:
            await consumer.stop()
            await floor.producer.stop()
            await floor.redis.aclose()
            await pool.close()


def main() -> None:
    """Command line: ``[--ready-dir PATH]``; settings from ``STREAMS_*``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ready-dir", type=Path, default=None)
    args = parser.parse_args()
    asyncio.run(run(Settings.from_env(), args.ready_dir))


if __name__ == "__main__":
    main()
