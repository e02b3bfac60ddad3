"""Handing work from a thread to the event loop without waiting for it.

`anyio.from_thread.run_sync` blocks the calling thread until the loop has run the function. A thread that only hands
work over (the inotify reader, a channel I/O thread reporting that its call returned) gains nothing by waiting, and
waking it again costs a GIL hand-off at the moment the thread the work was handed to wants the GIL: on the request
path that is visible latency. `call_soon` schedules and returns.
"""

from __future__ import annotations

from collections.abc import Callable

from anyio.lowlevel import EventLoopToken


def call_soon(token: EventLoopToken, fn: Callable[..., object], *args: object) -> None:
    """Run `fn(*args)` on `token`'s event loop soon; return at once. Whatever `fn` raises is the loop's (it is
    logged by the loop's exception handler), so `fn` must handle its own errors. RuntimeError (anyio's
    RunFinishedError) if that loop has finished."""
    # `run_sync_soon` is the backend contract's "schedule a synchronous callable in an event loop without
    # waiting" (anyio.abc.AsyncBackend), which anyio's own portals use; the token names the backend and its loop.
    token.backend_class.run_sync_soon(fn, args, token.native_token)
