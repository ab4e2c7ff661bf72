"""The hot routes (add, batch add, search) answered straight from ASGI, ahead of FastAPI.

FastAPI's machinery around a request (its middleware stack, routing, dependency solving, parsing the
body to Python objects and then validating them, validating the response model before serialising
it) cost ~0.6 ms of CPU a search on a 2-core Zen 3, a third of what the request cost in-process
(bench/analysis.md, round 21), and under load every request waits for the CPU of all the others.
Here the same request is read, authenticated, parsed and validated as FastAPI does it (json.loads,
then the body model), handed to the route's own call (memory_server/api/memories.py, `DIRECT`: the
one its FastAPI endpoint makes), and its response model serialised; everything else goes to FastAPI.

The routes stay declared in FastAPI, which documents them (OpenAPI) and answers them when
`MEMORY_SERVER_DIRECT_ROUTES=false`. Both ways give the same responses, errors included (the HTTP
tests of bad input run both ways). The key was verified before either (app.py KeyFirst).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from inspect import signature

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.responses import Response

from memory_server.api.deps import PRINCIPAL
from memory_server.api.responses import response_for_error, validation_error_response
from memory_server.errors import BadRequest


@dataclass(frozen=True)
class DirectRoute:
    route: APIRoute  # FastAPI's declaration: its path names the route in /metrics
    body: type[BaseModel]
    call: Callable  # async (memories, principal, body) -> response model


def direct_routes(router, calls) -> dict[tuple[str, str], DirectRoute]:
    """(method, path) -> DirectRoute for each (endpoint, call) of `calls`, read off the endpoint's
    declaration in `router`: its path, methods and body model."""
    routes = {}
    for endpoint, call in calls:
        route = next(r for r in router.routes if isinstance(r, APIRoute) and r.endpoint is endpoint)
        direct = DirectRoute(route, signature(endpoint).parameters["body"].annotation, call)
        routes.update({(method, route.path): direct for method in route.methods})
    return routes


class DirectRoutes:
    """Plain ASGI in front of the FastAPI app: answers the requests of `routes`, passes on the rest."""

    def __init__(self, app, fastapi: FastAPI, routes: dict[tuple[str, str], DirectRoute]):
        self.app = app
        self.fastapi = fastapi
        self.routes = routes

    async def __call__(self, scope, receive, send):
        direct = self.routes.get((scope.get("method"), scope.get("path"))) if scope["type"] == "http" else None
        if direct is None:
            return await self.app(scope, receive, send)
        scope["route"] = direct.route
        response = await self._answer(direct, scope, receive)
        if response is not None:  # else the client left
            await response(scope, receive, send)

    async def _answer(self, direct: DirectRoute, scope, receive) -> Response | None:
        """The response, or None when the client left before its body arrived."""
        try:
            body = await _read_body(receive)
            if body is None:
                return None
            request = _parse(direct.body, body, Headers(scope=scope).get("content-type"))
            result = await direct.call(self.fastapi.state.runtime.memories, scope[PRINCIPAL], request)
            return Response(result.model_dump_json(), media_type="application/json")
        except ValidationError as exc:
            return validation_error_response(exc.errors(include_url=False))
        except Exception as exc:
            return response_for_error(exc)


def _parse(model: type[BaseModel], body: bytes, content_type: str | None) -> BaseModel:
    """The body as `model`, read as FastAPI reads a JSON body, so that the errors are its errors: no
    body is a missing one, and a body not declared as JSON is validated as it is (bytes, which no
    model accepts). (pydantic's own JSON parser would be faster, but words its errors differently.)"""
    if not body:
        raise ValidationError.from_exception_data(model.__name__, [{"type": "missing", "loc": (), "input": None}])
    if _is_json(content_type):
        try:
            body = json.loads(body)
        except ValueError as exc:
            raise ValidationError.from_exception_data(
                model.__name__, [{"type": "json_invalid", "loc": (), "input": body, "ctx": {"error": str(exc)}}]) from None
        except RecursionError:  # nested deeper than the parser goes: FastAPI's answer to any unreadable body
            raise BadRequest("There was an error parsing the body") from None
    return model.model_validate(body, from_attributes=True)  # as FastAPI validates a body


def _is_json(content_type: str | None) -> bool:
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


async def _read_body(receive) -> bytes | None:
    """The whole request body, or None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
