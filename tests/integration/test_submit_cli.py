"""``streams submit FILE`` as a person runs it (the script in a subprocess) against the real Kafka: a file with a
bad line publishes nothing; a given ``submitted_at_ms`` is kept, a missing one stamped; a request carrying
``metadata.client_reference`` is refused in words."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams.config import Settings
from streams.wire import exactjson
from tests.integration.operators_support import streams_cli

pytestmark = pytest.mark.integration

REQUEST = '{"model": "genace-1", "input": {"prompt": "p", "max_tokens": 18446744073709551617}}'


async def published(settings: Settings, prefix: str) -> list[dict[str, object]]:
    """The submissions whose operation id (their key) starts with ``prefix``, read from the beginning of the topic
    up to its end offsets as they are now. Other tests' events on the topic are not decoded: some are invalid on
    purpose (``NaN``, ``1e5000``)."""
    topic = settings.topic("submissions")
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(settings.partitions)]  # as created for the session
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        values = []
        behind = set(partitions)
        while behind:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                ours = [r.value for r in records if r.key is not None and r.key.startswith(prefix.encode())]
                values += [exactjson.loads(value) for value in ours if value is not None]
            behind = {tp for tp in behind if await consumer.position(tp) < end[tp]}
    finally:
        await consumer.stop()
    return [v for v in values if str(v["operation_id"]).startswith(prefix)]


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "submissions.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("bad_line", "words"),
    [
        ("{not json", "line 2: "),
        ('{"operation_id": "OP-bad", "request": {"metadata": {"client_reference": "zzz"}}}', "may not carry"),
        ('{"operation_id": "OP-bad"}', "missing request"),
    ],
)
async def test_a_bad_line_publishes_nothing(migrated: Settings, tmp_path: Path, bad_line: str, words: str) -> None:
    prefix = f"submit-{uuid.uuid4().hex[:8]}-"
    lines = [
        f'{{"operation_id": "{prefix}1", "request": {REQUEST}}}',
        bad_line.replace("OP-", prefix),
        f'{{"operation_id": "{prefix}3", "request": {REQUEST}}}',
    ]
    result = await streams_cli(migrated, "submit", str(write_lines(tmp_path, lines)))
    assert result.exit_code == 1, result.stderr
    assert await published(migrated, prefix) == []  # not even line 1, before the bad one
    assert result.stderr.splitlines() == [result.stderr.strip()]  # one line, no traceback
    assert "line 2: " in result.stderr and words in result.stderr and "nothing was published" in result.stderr


async def test_client_reference_is_refused_in_words(migrated: Settings, tmp_path: Path) -> None:
    line = '{"operation_id": "x-1", "request": {"metadata": {"client_reference": "zzz"}}}'
    result = await streams_cli(migrated, "submit", str(write_lines(tmp_path, [line])))
    assert result.exit_code == 1
    assert "should not be valid" not in result.stderr
    assert (
        "at request/metadata/client_reference: a request may not carry metadata.client_reference: the product "
        "sends the operation id as the provider's client reference" in result.stderr
    )


async def test_submitted_at_ms_is_kept_when_given_and_stamped_when_not(migrated: Settings, tmp_path: Path) -> None:
    prefix = f"submit-{uuid.uuid4().hex[:8]}-"
    lines = [
        f'{{"operation_id": "{prefix}given", "request": {REQUEST}, "submitted_at_ms": 1767225600000}}',
        "",
        f'{{"operation_id": "{prefix}stamped", "request": {REQUEST}, "source": {{"row": 7}}}}',
    ]
    # Another test's event, invalid on purpose, on the same topic: the reader skips what is not ours.
    producer = AIOKafkaProducer(bootstrap_servers=migrated.kafka_bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(migrated.topic("submissions"), b'{"operation_id": "other", "n": NaN}', b"other")
    finally:
        await producer.stop()
    before_ms = int(time.time() * 1000)
    result = await streams_cli(migrated, "submit", str(write_lines(tmp_path, lines)))
    after_ms = int(time.time() * 1000)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "published 2 submissions"
    values = {v["operation_id"]: v for v in await published(migrated, prefix)}
    assert set(values) == {f"{prefix}given", f"{prefix}stamped"}
    assert values[f"{prefix}given"]["submitted_at_ms"] == 1767225600000
    stamped = values[f"{prefix}stamped"]["submitted_at_ms"]
    assert isinstance(stamped, int) and before_ms <= stamped <= after_ms
    assert values[f"{prefix}stamped"]["source"] == {"row": 7}
    given = values[f"{prefix}given"]["request"]
    assert isinstance(given, dict) and given["input"]["max_tokens"] == 18446744073709551617
