"""cancel_and_wait: helper tasks are cancelled and waited for; the caller's own
cancellation is passed on, never swallowed."""

import asyncio

import pytest

from kvpath.proxy.aio import cancel_and_wait


async def _slow_to_stop(stopped: list):
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(0.2)  # cleans up before it ends
        stopped.append(True)
        raise


def test_a_cancelled_caller_still_waits_for_the_tasks_then_raises():
    async def main():
        stopped: list = []
        child = asyncio.create_task(_slow_to_stop(stopped))
        await asyncio.sleep(0.01)
        handler = asyncio.create_task(cancel_and_wait(child))
        await asyncio.sleep(0.05)
        handler.cancel()  # the server shuts the handler down while it waits
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert child.done() and stopped == [True]

    asyncio.run(main())


def test_errors_of_the_cancelled_tasks_are_dropped_and_the_caller_goes_on():
    async def boom():
        try:
            await asyncio.sleep(60)
        finally:
            raise RuntimeError("cleanup failed")

    async def main():
        tasks = [asyncio.create_task(boom()), asyncio.create_task(asyncio.sleep(60))]
        await asyncio.sleep(0.01)
        await cancel_and_wait(*tasks)  # no exception
        assert all(t.done() for t in tasks)
        return "went on"

    assert asyncio.run(main()) == "went on"
