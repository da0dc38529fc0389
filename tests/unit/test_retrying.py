"""``first_attempt_plain``: the retry policy is built only after a failed first attempt, which it counts."""

from __future__ import annotations

import pytest
import tenacity

from streams.retrying import first_attempt_plain


def policy(built: list[int], attempts: int = 3) -> tenacity.AsyncRetrying:
    built.append(1)
    return tenacity.AsyncRetrying(stop=tenacity.stop_after_attempt(attempts), wait=tenacity.wait_none(), reraise=True)


async def test_a_first_success_never_builds_the_policy() -> None:
    built: list[int] = []

    async def ok() -> str:
        return "done"

    assert await first_attempt_plain(ok, lambda: policy(built)) == "done"
    assert built == []


async def test_the_first_failure_is_the_policys_first_attempt() -> None:
    built: list[int] = []
    calls: list[int] = []

    async def fails_twice() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError(f"attempt {len(calls)}")
        return len(calls)

    assert await first_attempt_plain(fails_twice, lambda: policy(built, attempts=3)) == 3
    assert built == [1]


async def test_attempts_are_counted_with_the_plain_one() -> None:
    calls: list[int] = []

    async def always() -> None:
        calls.append(1)
        raise RuntimeError(f"attempt {len(calls)}")

    with pytest.raises(RuntimeError, match="attempt 3"):
        await first_attempt_plain(always, lambda: policy([], attempts=3))
    assert len(calls) == 3


async def test_an_exception_outside_retry_on_propagates_at_once() -> None:
    built: list[int] = []

    async def wrong() -> None:
        raise KeyError("not retried")

    with pytest.raises(KeyError):
        await first_attempt_plain(wrong, lambda: policy(built), retry_on=RuntimeError)
    assert built == []
