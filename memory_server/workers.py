"""`serve --workers N`: N server processes behind one port, each with a listening socket of its own.

uvicorn's workers share one listening socket, and a worker that wakes up accepts every connection
waiting at that moment: a client pool that opens its keep-alive connections at once can land on
one worker while the other idles (seen in the HTTP benchmark: 16 connections split 16/0, half the
throughput). Here every worker binds the port itself with SO_REUSEPORT, and the kernel spreads new
connections over the workers' sockets by a hash of each connection's addresses. Linux only (other
systems' SO_REUSEPORT does not spread connections); elsewhere `serve` falls back to uvicorn's workers.

The supervisor (this process) holds the port, starts the workers, starts a worker again when one
exits, and on SIGINT/SIGTERM stops them all, each finishing the requests it has in hand.
"""

import logging
import multiprocessing
import signal
import socket
import sys
import time
from multiprocessing.connection import wait

from memory_server.errors import StartupError

log = logging.getLogger("memory_server")

QUICK_EXIT_SECONDS = 20.0  # a worker gone sooner than this after its start counts as a failed start
FAILED_STARTS = 3  # in a row, and the supervisor gives up (a bad setting, not bad luck)
STOP_SECONDS = 30.0  # how long a stopping worker gets to finish its requests


def spreads_connections() -> bool:
    """Whether this system spreads connections over sockets that share a port (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def _socket(host: str, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to the port (never listening, so it takes no connections) that the supervisor
    keeps while it runs: it gives port 0 its number and keeps the port ours between worker restarts.
    The first bind is without SO_REUSEPORT: it fails when anything already serves the port, an older
    memory-server included, instead of quietly sharing that port's connections with it."""
    try:
        with _socket(host, reuse_port=False) as probe:
            probe.bind((host, port))
            port = probe.getsockname()[1]
        held = _socket(host, reuse_port=True)
        held.bind((host, port))
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return held


def _serve(host: str, port: int, options: dict) -> None:
    """One worker: its own listening socket on the shared port, and the app built from the environment."""
    import uvicorn

    sock = _socket(host, reuse_port=True)
    sock.bind((host, port))
    sock.listen(2048)
    config = uvicorn.Config("memory_server.app:create_app", factory=True, host=host, port=port, **options)
    uvicorn.Server(config).run(sockets=[sock])


def run(count: int, host: str, port: int, options: dict) -> int:
    """Run `count` workers until SIGINT/SIGTERM; returns the exit status."""
    held = reserve_port(host, port)
    port = held.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    stopping = False

    def stop(_signum, _frame):
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}

    def start(n: int):
        process = context.Process(target=_serve, args=(host, port, options), name=f"memory-server-worker-{n}")
        process.start()
        return process, time.monotonic()

    workers = [start(n) for n in range(count)]
    log.info("serving on http://%s:%d with %d worker processes (one listening socket each)", host, port, count)
    failed_starts, status = 0, 0
    try:
        while not stopping:
            wait([process.sentinel for process, _ in workers], timeout=0.5)
            for n, (process, started) in enumerate(workers):
                if process.is_alive() or stopping:
                    continue
                quick = time.monotonic() - started < QUICK_EXIT_SECONDS
                failed_starts = failed_starts + 1 if quick else 0
                if failed_starts >= FAILED_STARTS:
                    log.error("workers keep exiting as they start (exit code %s); stopping: see the log above",
                              process.exitcode)
                    stopping, status = True, 1
                    break
                log.warning("worker %d (pid %d) exited with code %s; starting another", n, process.pid,
                            process.exitcode)
                workers[n] = start(n)
    finally:
        for process, _ in workers:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn finishes the requests in hand, then exits
        deadline = time.monotonic() + STOP_SECONDS
        for process, _ in workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        held.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status
