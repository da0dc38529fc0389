"""The names a teardown derives and the shared names it refuses, before any service is asked."""

from __future__ import annotations

import pytest

from streams.config import Settings
from streams.errors import SharedResourceRefusedError
from streams.setup.admin import delete_topics
from streams.setup.teardown import Selection, check_selection, run_names, teardown_command

#: Nothing listens here: a call that reached Kafka would fail with KafkaAdminError, not the refusal.
NOWHERE = Settings(kafka_bootstrap="127.0.0.1:9", kafka_admin_deadline_s=0.5)


async def test_the_python_helper_refuses_the_unprefixed_topics() -> None:
    with pytest.raises(SharedResourceRefusedError, match=r"STREAMS_TOPIC_PREFIX is empty.*Nothing was deleted"):
        await delete_topics(NOWHERE)


def test_a_run_ids_names_are_the_harness_runs() -> None:
    settings = Settings(database_url="postgresql://u:p@h:5432/streams", topic_prefix="ci.", app_id="generation-streams")
    assert run_names(settings, "Main-1") == Selection(
        database="streams_main-1", topic_prefix="ci.Main-1.", groups=("generation-streams-Main-1",)
    )


def test_the_printed_command_names_everything() -> None:
    selection = Selection(database="streams_r1", topic_prefix="r1.", groups=("g-r1", "g r2"))
    assert teardown_command(selection) == (
        "streams teardown --database streams_r1 --topic-prefix r1. --group g-r1 --group 'g r2'"
    )


@pytest.mark.parametrize(
    "selection",
    [
        Selection(database=None, topic_prefix=""),
        Selection(database=None, topic_prefix="generation.sub"),
        Selection(database="streams", topic_prefix="r1."),
    ],
)
def test_shared_names_are_refused_unless_asked(selection: Selection) -> None:
    settings = Settings(database_url="postgresql://u:p@h:5432/streams")
    with pytest.raises(SharedResourceRefusedError, match="Nothing was removed"):
        check_selection(settings, selection, include_shared=False)
    check_selection(settings, selection, include_shared=True)
