"""How the app serves its routes."""

import inspect

from memory_server.app import ROUTERS


def test_every_route_is_async_so_its_response_is_not_validated_in_a_second_thread_pool_hop():
    # FastAPI validates a plain `def` route's return value in the thread pool, a second hop per
    # request that under load queues again behind every waiting request; routes hand their
    # blocking work to the pool themselves (memory_server/api/deps.py).
    routes = [route for router in ROUTERS for route in router.routes]
    assert len(routes) >= 10
    assert [route.path for route in routes if not inspect.iscoroutinefunction(route.endpoint)] == []
