"""Health, readiness and Prometheus metrics."""

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from memory_server.api.deps import PrincipalDep, RuntimeDep
from memory_server.timing import in_thread

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    checks = await in_thread(runtime.ready)
    ok = all(checks.values())
    return JSONResponse({"status": "ready" if ok else "not ready", "checks": checks}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request, runtime: RuntimeDep, principal: PrincipalDep) -> Response:
    principal.require_admin()
    metrics = request.app.state.metrics
    info = await in_thread(runtime.index.info)
    metrics.index_position.set(info.applied_position)
    metrics.index_points.set(info.points)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
