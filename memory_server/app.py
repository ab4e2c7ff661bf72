"""create_app(settings) -> FastAPI: a lifespan opens and closes the backends; plain ASGI layers in
front observe every request, hold bodies to the limit and answer the hot routes directly."""

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from memory_server import __version__
from memory_server.access_log import AccessLog
from memory_server.api import health, keys, memories
from memory_server.api.deps import PRINCIPAL, principal_for
from memory_server.api.direct import DirectRoutes, direct_routes
from memory_server.api.responses import (
    DATABASE_UNAVAILABLE, caused_by_outage, database_unavailable_response, domain_error_response, error_response,
    internal_error_response, response_for_error, validation_error_response,
)
from memory_server.config import Settings
from memory_server.embedding import Embedder
from memory_server.errors import MemoryServerError
from memory_server.metrics import Metrics
from memory_server.runtime import Runtime, ensure_bootstrap_key
from memory_server.timing import name_os_thread, timed_request

log = logging.getLogger("memory_server")
_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
                 429: "rate_limited", 503: "unavailable"}
ROUTERS = (health.router, memories.router, keys.router)


def configure_logging(settings: Settings) -> None:
    """Log lines with time and level, unless the embedding application configured logging itself."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def create_app(settings: Settings | None = None, *, embedder: Embedder | None = None) -> FastAPI:
    """The app; with no settings, they are read from the environment (how the worker processes of
    `serve --workers N` build theirs)."""
    if settings is None:
        settings = Settings()
        configure_logging(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Requests run their blocking work in the event loop's default executor (timing.in_thread);
        # its size bounds how many share the GIL at once.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(settings.request_threads, thread_name_prefix="request", initializer=name_os_thread))
        runtime = Runtime.open(settings, embedder=embedder, background=True)
        key_file = ensure_bootstrap_key(runtime.engine, settings.data_dir)
        if key_file is not None:
            log.warning("created the bootstrap admin key; it is in %s (mode 0600)", key_file)
        app.state.runtime = runtime
        # Everything alive now (the model, the engine, modules, schemas) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it all while
        # every request in the process waits (~100-150 ms each, several a minute under load:
        # bench/analysis.md, round 21).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            runtime.close()
            if app.state.access_log is not None:
                app.state.access_log.flush()

    # No redirects to the path without its trailing slash: clients follow a 307 with the same method,
    # and `DELETE /v1/memories/?user_id=u` (a memory id left empty) became a delete of u's every memory.
    app = MemoryServerApp(title="memory-server", version=__version__, lifespan=lifespan, redirect_slashes=False,
                          description="Long-term memory for LLM agents. Contract: API.md.")
    app.state.metrics = Metrics()
    # Like any INFO line, the access log is left out at a higher log level.
    app.state.access_log = AccessLog() if settings.access_log and settings.log_level in ("INFO", "DEBUG") else None
    for router in ROUTERS:
        app.include_router(router)
    _install_error_handlers(app)
    front = app.behind
    if settings.direct_routes:
        front = DirectRoutes(front, app, direct_routes(memories.router, memories.DIRECT))
    front = BodyLimit(front, max_bytes=settings.max_body_bytes)
    front = KeyFirst(front, app)
    app.front = ObserveRequests(front, metrics=app.state.metrics, server_timing=settings.server_timing,
                                access_log=app.state.access_log)
    return app


class MemoryServerApp(FastAPI):
    """FastAPI behind a front of plain ASGI layers (`front`, set by create_app) that every request
    passes first. The front sits outside FastAPI's own middleware stack, which a request it answers
    (memory_server/api/direct.py) never enters."""

    front = None

    async def __call__(self, scope, receive, send):
        await (self.front or self.behind)(scope, receive, send)

    async def behind(self, scope, receive, send):
        """FastAPI itself."""
        await super().__call__(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MemoryServerError)
    async def _domain(_: Request, exc: MemoryServerError):
        return domain_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = tuple(first.get("loc", ()))
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        return validation_error_response([{**first, "loc": loc}])

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = exc.headers
        if exc.status_code == 405:  # Starlette's `Allow` names the first route of the path only
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(app, request.scope))}
        return error_response(exc.status_code, _STATUS_CODES.get(exc.status_code, "error"), str(exc.detail),
                              headers=headers)

    async def _database_error(_: Request, exc: Exception):
        if caused_by_outage(exc):
            return database_unavailable_response(exc)
        log.exception("unhandled error")
        return internal_error_response()

    for kind in (DBAPIError, *DATABASE_UNAVAILABLE):  # an outage's errors, and database errors it caused
        app.add_exception_handler(kind, _database_error)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return internal_error_response()


def _allowed_methods(app: FastAPI, scope) -> list[str]:
    """Every method some route of this path answers (a 405's `Allow` header)."""
    methods = set()
    # FastAPI's own routes (the docs) and ours, as their routers hold them: an included router
    # stands in the app's list as one entry that matches no request by itself.
    for route in (*app.router.routes, *(route for router in ROUTERS for route in router.routes)):
        if route.matches(scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


class ObserveRequests:
    """Request count, latency and the time of each stage (memory_server/timing.py) per route
    template, and (unless turned off) a `Server-Timing` header with the request's stages. Plain
    ASGI: Starlette's `@app.middleware` wraps every request in extra tasks and streams, ~1 ms each
    on a busy 2-core box."""

    def __init__(self, app, metrics: Metrics, server_timing: bool = True, access_log: AccessLog | None = None):
        self.app = app
        self.metrics = metrics
        self.server_timing = server_timing
        self.access_log = access_log  # a line for each request (access_log.py); None: none

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status, finished = time.perf_counter(), 500, {}

        async def observed_send(message):
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status, finished = message["status"], timings.finish()
                if self.server_timing:
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (b"server-timing", timings.header(finished))]}
            await send(message)

        try:
            with timed_request() as timings:
                await self.app(scope, receive, observed_send)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            metrics, elapsed = self.metrics, time.perf_counter() - started
            metrics.request_count(scope["method"], path, str(status)).inc()
            metrics.request_latency(scope["method"], path).observe(elapsed)
            if self.access_log is not None:
                self.access_log.request(scope, status, elapsed)
            for name, seconds in finished.items():
                if name != "app":  # the latency histogram's
                    metrics.stage_latency(path, name).observe(seconds)


class KeyFirst:
    """Every route under /v1/ needs a key: it is verified here, before anything reads the request's
    body, and left in the scope for the route (deps.PRINCIPAL). A request without a valid key is
    answered 401 unread, so an unauthenticated client cannot make the server take in a body (up to
    the size limit, or a chunked one) or tell it to send one (`Expect: 100-continue`). Such an answer
    closes a connection whose request announced a body: the client may send it anyway, and it would
    be read as the next request."""

    def __init__(self, app, fastapi: FastAPI):
        self.app = app
        self.fastapi = fastapi

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        try:
            authorization = headers.get(b"authorization")
            scope[PRINCIPAL] = await principal_for(self.fastapi.state.runtime,
                                                   authorization.decode("latin-1") if authorization else None)
        except Exception as exc:
            response = response_for_error(exc)
            if headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers:
                response.headers["connection"] = "close"
            scope.setdefault("route", _route_of(self.fastapi, scope))  # /metrics counts it by route
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _route_of(app: FastAPI, scope):
    """The route a request's path and method match, if any."""
    for route in (*app.router.routes, *(route for router in ROUTERS for route in router.routes)):
        # (an included router stands in the app's list as one entry, which is not a Route)
        if isinstance(route, Route) and route.matches(scope)[0] is Match.FULL:
            return route
    return None


class BodyLimit:
    """Refuses bodies over the limit with 413 before anything is parsed or written."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        if declared is not None:
            return await self.app(scope, receive, send)  # the server holds the client to its Content-Length
        # No Content-Length (chunked): read the body here, refusing it as soon as it is too large.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(413, "payload_too_large", f"request body exceeds {self.max_bytes} bytes")
        await response(scope, receive, send)
