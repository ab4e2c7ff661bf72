"""Where a request's time went: named stages, sent back in the `Server-Timing` response header
and counted in the `memory_server_http_request_stage_seconds` histogram of `/metrics`.

The HTTP layer starts a `Timings` for each request (`timed_request`); the code under it marks its
stages with `stage("name")`, which costs nothing when no request is being timed (in-process use).
`in_thread` runs the request's blocking work in a request thread with the request's context, so
the stages a request thread records land on the request's own `Timings`. Stages of the same name
add up.

Stages: `queue` (waiting for a request thread), `embed` (waiting for the model, batching included),
`index` (the vector index: queries, following and applying the change log), `db` (SQL), `respond`
(from the request thread's end to the response's start: the event loop taking the result back and
turning it into JSON), and `app` (the whole request inside the server, from routing to the
response's start).
"""

import asyncio
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from functools import partial, wraps

_current: ContextVar["Timings | None"] = ContextVar("memory_server_timings", default=None)


class Timings:
    __slots__ = ("started", "stages", "thread_ended")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stages: dict[str, float] = {}
        self.thread_ended: float | None = None  # when the request's last request-thread work ended

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def finish(self) -> dict[str, float]:
        """At the response's start: each stage in seconds, then `respond` (when a request thread
        ran) and `app` for the whole request."""
        now = time.perf_counter()
        finished = dict(self.stages)
        if self.thread_ended is not None:
            finished["respond"] = now - self.thread_ended
        finished["app"] = now - self.started
        return finished

    @staticmethod
    def header(finished: dict[str, float]) -> bytes:
        """The `Server-Timing` value of `finish()`'s stages, in milliseconds."""
        return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in finished.items()).encode()


@contextmanager
def timed_request() -> Iterator[Timings]:
    timings = Timings()
    token = _current.set(timings)
    try:
        yield timings
    finally:
        _current.reset(token)


@contextmanager
def stage(name: str) -> Iterator[None]:
    timings = _current.get()
    if timings is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        timings.add(name, time.perf_counter() - started)


def timed_iter(name: str, items: Iterator) -> Iterator:
    """`items`, with the time spent waiting for each next one counted as stage `name`."""
    timings = _current.get()
    if timings is None:
        yield from items
        return
    while True:
        started = time.perf_counter()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            timings.add(name, time.perf_counter() - started)
        yield item


def queued(function: Callable) -> Callable:
    """`function`, with the time from this call to the moment it starts (in a pool thread) counted
    as stage `queue`, and its end noted (for `respond`): wrap it when handing it to the thread pool."""
    timings = _current.get()
    if timings is None:
        return function
    submitted = time.perf_counter()

    @wraps(function)
    def run(*args, **kwargs):
        timings.add("queue", time.perf_counter() - submitted)
        try:
            return function(*args, **kwargs)
        finally:
            timings.thread_ended = time.perf_counter()

    return run


async def in_thread(function: Callable, *args, **kwargs):
    """`function(*args, **kwargs)` in a request thread, with this context, its wait for a thread
    timed as `queue`. The request threads are the event loop's default executor (the app's lifespan
    sizes it; waiting calls start in arrival order): handing a call over that way costs ~40 µs of
    CPU, anyio's `to_thread` (FastAPI's and Starlette's thread pool) ~90 µs (bench/analysis.md, round 21)."""
    call = partial(copy_context().run, queued(function), *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(None, call)


async def awaited(name: str, future: Future | None):
    """The result of a concurrent Future (work handed to another thread, such as the model's),
    awaited on the event loop, the wait timed as stage `name`; None for no future."""
    if future is None:
        return None
    with stage(name):
        return await asyncio.wrap_future(future)


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its Python name (or `name`) in the operating system too (Linux; the
    first 15 characters), where Python 3.11 leaves every thread named after the process: `top -H`,
    `ps -L` and /proc then tell the model's threads (`embedding-batcher-N`) from the request threads
    (`request_N`), and the HTTP benchmark counts the model's share of a request's CPU by it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    PR_SET_NAME = 15
    prctl(PR_SET_NAME, (name or threading.current_thread().name).encode()[:15], 0, 0, 0)
