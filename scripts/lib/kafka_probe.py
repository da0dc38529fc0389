"""Kafka checks for scripts/prod-services, with aiokafka (the project's own Kafka client).

    kafka_probe.py [SECURITY] ready [--brokers N] [--pid PID]...
        wait until a group coordinator is found for a throwaway group (a new broker answers on its port before
        it can coordinate a group: __consumer_offsets is created on the first look-up) and, with --brokers, until
        the metadata lists N brokers; fail at once when one of the PIDs exits
    kafka_probe.py [SECURITY] leaders TOPIC
        one line per partition: partition, leader, replicas, in-sync replicas
    kafka_probe.py [SECURITY] coordinator GROUP
        the node id, host and port of the group's coordinator

SECURITY: --bootstrap HOST:PORT[,...] --security-protocol PLAINTEXT|SSL|SASL_SSL [--sasl-mechanism M --username U]
[--cafile CA --certfile CERT --keyfile KEY]; the SASL password is read from the environment (KAFKA_PROBE_PASSWORD),
not the command line. --timeout S bounds the whole command (default 120).
Exit status: 0 done, 1 timed out or failed (the last error on stderr), 3 a --pid process exited.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.helpers import create_ssl_context


def admin(args: argparse.Namespace) -> AIOKafkaAdminClient:
    options: dict[str, Any] = {
        "bootstrap_servers": args.bootstrap,
        "security_protocol": args.security_protocol,
        "request_timeout_ms": 5000,
        "client_id": "prod-services-probe",
    }
    if args.security_protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = create_ssl_context(cafile=args.cafile, certfile=args.certfile, keyfile=args.keyfile)
    if args.security_protocol.startswith("SASL"):
        options.update(
            sasl_mechanism=args.sasl_mechanism,
            sasl_plain_username=args.username,
            sasl_plain_password=os.environ.get("KAFKA_PROBE_PASSWORD", ""),
        )
    return AIOKafkaAdminClient(**options)


class LastError(logging.Handler):
    """Keeps aiokafka's last logged error (why a connection failed: the exception only says "Unable to
    bootstrap") instead of printing one line per attempt."""

    message = ""

    def emit(self, record: logging.LogRecord) -> None:
        LastError.message = record.getMessage()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def once(args: argparse.Namespace) -> str:
    client = admin(args)
    try:
        await asyncio.wait_for(client.start(), 10)
        if args.command == "ready":
            group = f"prod-services-ready-{uuid.uuid4().hex[:8]}"
            node = await asyncio.wait_for(client.find_coordinator(group), 10)
            brokers = client._client.cluster.brokers()  # aiokafka has no public accessor
            if args.brokers and len(brokers) < args.brokers:
                raise RuntimeError(f"the metadata lists {len(brokers)} broker(s), not {args.brokers}")
            return f"group coordinator: node {node}; brokers: {sorted(b.nodeId for b in brokers)}"
        if args.command == "coordinator":
            node = await asyncio.wait_for(client.find_coordinator(args.name), 10)
            broker = client._client.cluster.broker_metadata(node)
            where = f"{broker.host}:{broker.port}" if broker else "?"
            return f"group {args.name}: coordinator node {node} ({where})"
        topics = await asyncio.wait_for(client.describe_topics([args.name]), 10)
        lines = []
        for topic in topics:
            if topic["error_code"]:
                raise RuntimeError(f"topic {args.name}: error code {topic['error_code']}")
            for p in sorted(topic["partitions"], key=lambda p: p["partition"]):
                lines.append(
                    f"{topic['topic']} partition {p['partition']}: leader {p['leader']} "
                    f"replicas {','.join(map(str, p['replicas']))} isr {','.join(map(str, p['isr']))}"
                    + (f" offline {','.join(map(str, p['offline_replicas']))}" if p.get("offline_replicas") else "")
                )
        return "\n".join(lines)
    finally:
        await client.close()


async def main(args: argparse.Namespace) -> int:
    # ready waits up to --timeout; the other commands retry a transient failure (a broker just restarted) for 15 s
    deadline = time.monotonic() + (args.timeout if args.command == "ready" else min(args.timeout, 15))
    last: BaseException | None = None
    while True:
        for pid in args.pid:
            if not alive(pid):
                print(f"kafka_probe: process {pid} exited", file=sys.stderr)
                return 3
        try:
            print(await once(args))
            return 0
        except Exception as exc:  # report the last one when the time is up
            last = exc
        if time.monotonic() > deadline:
            reason = f" (aiokafka logged: {LastError.message})" if LastError.message else ""
            print(f"kafka_probe: {args.command} failed: {type(last).__name__}: {last}{reason}", file=sys.stderr)
            return 1
        await asyncio.sleep(0.5)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--security-protocol", default="PLAINTEXT", choices=["PLAINTEXT", "SSL", "SASL_SSL"])
    parser.add_argument("--sasl-mechanism", default="SCRAM-SHA-512")
    parser.add_argument("--username")
    parser.add_argument("--cafile")
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    parser.add_argument("--timeout", type=float, default=120)
    sub = parser.add_subparsers(dest="command", required=True)
    ready = sub.add_parser("ready")
    ready.add_argument("--brokers", type=int, default=0)
    ready.add_argument("--pid", type=int, action="append", default=[])
    sub.add_parser("leaders").add_argument("name", metavar="TOPIC")
    sub.add_parser("coordinator").add_argument("name", metavar="GROUP")
    args = parser.parse_args()
    if args.command != "ready":
        args.pid = []
    return args


if __name__ == "__main__":
    aiokafka_log = logging.getLogger("aiokafka")
    aiokafka_log.addHandler(LastError(logging.WARNING))
    aiokafka_log.propagate = False
    sys.exit(asyncio.run(main(parse())))
