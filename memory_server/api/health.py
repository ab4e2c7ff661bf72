"""Health, readiness and Prometheus metrics."""

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from memory_server.api.deps import PrincipalDep, RuntimeDep
from memory_server.api.responses import documented_errors
from memory_server.schemas import Readiness
from memory_server.timing import in_thread

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", response_model=Readiness,
            responses={503: {"model": Readiness, "description": "a backend (database, model, index) is not ready"}})
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    checks = await in_thread(runtime.ready)
    ok = all(checks.values())
    return JSONResponse({"status": "ready" if ok else "not ready", "checks": checks}, status_code=200 if ok else 503)


# HEAD too, as load balancers and uptime checks often probe (not in the OpenAPI document: the same answers).
for _path, _probe in (("/healthz", healthz), ("/readyz", readyz)):
    router.add_api_route(_path, _probe, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text format"},
    **documented_errors(401, 403, 422, 503)})
async def metrics(request: Request, runtime: RuntimeDep, principal: PrincipalDep) -> Response:
    principal.require_operator()  # the counts cover every tenant's requests and memories
    metrics = request.app.state.metrics
    info = await in_thread(runtime.index.info)
    metrics.index_position.set(info.applied_position)
    metrics.index_points.set(info.points)
    metrics.index_left_out.set(len(runtime.sync.left_out))
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
