"""streams/bounded.py: ``asyncio.wait_for`` is kept out of the product, and a client's close is cut off at its
bound."""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path

import pytest

from streams.bounded import answer_within, close_within

ROOT = Path(__file__).resolve().parents[2]


def test_no_asyncio_wait_for_in_the_product() -> None:
    """CPython 3.11's ``wait_for`` can swallow a cancel (gh-86296): the product bounds awaits with
    ``asyncio.timeout``."""
    found = []
    for path in sorted((ROOT / "streams").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


async def test_a_close_that_never_ends_is_cut_off_and_said() -> None:
    never = asyncio.get_running_loop().create_future()
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("streams.bounded").addHandler(handler)
    try:
        assert await close_within(never, 0.05, "the test's client") is False
    finally:
        logging.getLogger("streams.bounded").removeHandler(handler)
    assert logged == ["the test's client did not close within 0.05 s; left behind"]
    assert never.cancelled()


async def test_a_close_that_ends_or_fails_is_awaited_as_it_is() -> None:
    async def closes() -> None:
        await asyncio.sleep(0)

    async def fails() -> None:
        raise OSError("broken pipe")

    assert await close_within(closes(), 5.0, "a client") is True
    with pytest.raises(OSError, match="broken pipe"):
        await close_within(fails(), 5.0, "a client")


async def test_an_answer_is_given_up_at_its_bound_without_waiting_for_the_question_to_wind_down() -> None:
    """A probe (``/readyz``) answers within its time even when the question takes long to cancel (asyncpg's cancel
    of a statement on a frozen PostgreSQL waits for its own connect): ``asyncio.timeout`` waited for that (32 s
    measured with a 2 s probe timeout), ``answer_within`` does not."""
    winding_down, wound_down = asyncio.Event(), asyncio.Event()

    async def slow_to_cancel() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            winding_down.set()
            await wound_down.wait()  # as long as the test says
            raise
        return "never"

    async def quick() -> str:
        return "answers"

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError, match=r"no answer within 0\.1 s"):
        await answer_within(slow_to_cancel(), 0.1)
    assert loop.time() - started < 1.0
    await asyncio.wait_for(winding_down.wait(), 1.0)  # cancelled all the same
    wound_down.set()
    others = asyncio.all_tasks() - {asyncio.current_task()}
    assert not (await asyncio.wait(others, timeout=1.0))[1]  # and it ends
    assert await answer_within(quick(), 1.0) == "answers"
