"""Cancelling helper tasks without swallowing the caller's own cancellation."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Future) -> None:
    """Cancel ``tasks`` and wait until each has ended, whatever it raised (its errors
    are retrieved and dropped: the caller has already given up on it). If the caller
    itself is cancelled meanwhile, the tasks are still waited for, and then the
    cancellation is raised: a server shutting the handler down must see it."""
    for t in tasks:
        t.cancel()
    own = False
    for t in tasks:
        while not t.done():
            try:
                await asyncio.wait({t})  # raises only for the caller's own cancellation
            except asyncio.CancelledError:
                own = True
        if not t.cancelled():
            t.exception()  # retrieved: no "never retrieved" warning
    if own:
        raise asyncio.CancelledError()
