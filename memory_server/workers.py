"""`serve --workers N`: one listening socket in a supervisor that hands each connection to the worker
holding the fewest.

How connections reach the workers decides how evenly they share the load, and with keep-alive
clients a connection stays where it first landed. uvicorn's workers share one listening socket, and
a worker that wakes up accepts every connection waiting at that moment (16 pooled connections split
16/0 in the HTTP benchmark). A socket per worker with SO_REUSEPORT (rounds 5-17) lets the kernel
pick by a hash of the addresses: 64 connections split 38/26 and 43/21, and the clients of the fuller
worker waited up to twice as long (bench/analysis.md, round 18). Here, as in Node.js's cluster
module, the supervisor accepts and passes each connection's descriptor over a Unix socket
(SCM_RIGHTS) to the worker with the fewest open connections; the worker serves it with uvicorn's own
protocol and says when it closes. Connections that stay open, the case that matters, cost the
supervisor nothing after their first moment.

The supervisor also starts the workers, starts a worker again when one exits, and on SIGINT/SIGTERM
stops them all, each finishing the requests it has in hand. Unix only (descriptor passing); elsewhere
`serve` falls back to uvicorn's workers.
"""

import asyncio
import logging
import multiprocessing
import signal
import socket
import time
from multiprocessing.connection import wait

import uvicorn

from memory_server.errors import StartupError

log = logging.getLogger("memory_server")

QUICK_EXIT_SECONDS = 20.0  # a worker gone sooner than this after its start counts as a failed start
FAILED_STARTS = 3  # in a row, and the supervisor gives up (a bad setting, not bad luck)
STOP_SECONDS = 30.0  # how long a stopping worker gets to finish its requests
# One byte a message on a worker's channel: supervisor -> worker, a connection (its descriptor
# rides along); worker -> supervisor, ready to serve, or one of its connections closed.
CONNECTION, READY, CLOSED = b"F", b"R", b"C"


def hands_off_connections() -> bool:
    """Whether this system can pass connections between processes (Unix descriptor passing)."""
    return hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")


def listen(host: str, port: int) -> socket.socket:
    """The one listening socket, held by the supervisor for as long as it runs (port 0 gets its
    number here). No SO_REUSEPORT: binding fails when anything already serves the port, an older
    memory-server included, instead of quietly sharing its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def _serve(channel: socket.socket, options: dict) -> None:
    """One worker: uvicorn with the app built from the environment, serving the connections that
    arrive on `channel`."""
    config = uvicorn.Config("memory_server.app:create_app", factory=True, **options)
    HandedServer(config, channel).run()


class HandedServer(uvicorn.Server):
    """uvicorn without a listening socket of its own: connections come from the supervisor."""

    def __init__(self, config, channel: socket.socket):
        super().__init__(config)
        self.channel = channel

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=[])
        if self.should_exit or not self.started:
            return
        self.channel.setblocking(False)
        asyncio.get_running_loop().add_reader(self.channel.fileno(), self._receive)
        self._tell(READY)

    async def shutdown(self, sockets=None) -> None:
        asyncio.get_running_loop().remove_reader(self.channel.fileno())
        await super().shutdown(sockets)

    def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.channel, 64, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:  # the supervisor is gone: finish and exit
                loop.remove_reader(self.channel.fileno())
                self.should_exit = True
                return
            for fd in fds:
                connection = socket.socket(fileno=fd)
                loop.create_task(self._serve_connection(loop, connection))

    async def _serve_connection(self, loop, connection: socket.socket) -> None:
        try:
            await loop.connect_accepted_socket(self._protocol, connection)
        except OSError:  # the client left while the connection was on its way here
            connection.close()
            self._tell(CLOSED)

    def _protocol(self):
        protocol = self.config.http_protocol_class(config=self.config, server_state=self.server_state,
                                                   app_state=self.lifespan.state)
        lost = protocol.connection_lost

        def connection_lost(exc):
            try:
                lost(exc)
            finally:
                self._tell(CLOSED)

        protocol.connection_lost = connection_lost
        return protocol

    def _tell(self, message: bytes) -> None:
        try:
            self.channel.send(message)
        except OSError:  # the supervisor is gone; _receive sees it and stops the worker
            pass


class _Worker:
    """The supervisor's view of one worker process: its channel, whether it serves, how many of the
    connections handed to it are still open."""

    def __init__(self, context, n: int, options: dict):
        self.channel, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = context.Process(target=_serve, args=(child_end, options), name=f"memory-server-worker-{n}")
        self.process.start()
        child_end.close()
        self.channel.setblocking(False)
        self.started = time.monotonic()
        self.ready = False
        self.connections = 0

    def take(self, connection: socket.socket) -> bool:
        try:
            socket.send_fds(self.channel, [CONNECTION], [connection.fileno()])
        except OSError:  # gone, or not reading: another worker takes it
            return False
        self.connections += 1
        return True

    def read_messages(self) -> None:
        try:
            data = self.channel.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the process is exiting; the sentinel tells the supervisor
            self.ready = False
            return
        self.ready = self.ready or READY in data
        self.connections = max(0, self.connections - data.count(CLOSED))

    def close(self) -> None:
        self.channel.close()


def _hand_out(listener: socket.socket, workers: list[_Worker]) -> None:
    """Accept every waiting connection and give each to the ready worker holding the fewest."""
    while True:
        ready = [w for w in workers if w.ready]
        if not ready:
            return
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. out of descriptors: try again on the next round
            log.warning("accepting a connection failed: %s", exc)
            return
        with connection:
            for worker in sorted(ready, key=lambda w: w.connections):
                if worker.take(connection):
                    break
            else:
                log.warning("no worker could take a connection; it was closed")


def run(count: int, host: str, port: int, options: dict) -> int:
    """Run `count` workers until SIGINT/SIGTERM; returns the exit status."""
    listener = listen(host, port)
    port = listener.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    stopping = False

    def stop(_signum, _frame):
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    workers = [_Worker(context, n, options) for n in range(count)]
    log.info("serving on http://%s:%d with %d worker processes (connections handed to the least busy)",
             host, port, count)
    failed_starts, status = 0, 0
    try:
        while not stopping:
            # The listener is watched only while some worker can take a connection: until then
            # clients wait in the kernel's backlog instead of being accepted and dropped.
            watched = [w.channel for w in workers] + [w.process.sentinel for w in workers]
            if any(w.ready for w in workers):
                watched.append(listener)
            woken = wait(watched, timeout=0.5)
            for worker in workers:
                if worker.channel in woken:
                    worker.read_messages()
            if listener in woken:
                _hand_out(listener, workers)
            for n, worker in enumerate(workers):
                if worker.process.is_alive() or stopping:
                    continue
                quick = time.monotonic() - worker.started < QUICK_EXIT_SECONDS
                failed_starts = failed_starts + 1 if quick else 0
                if failed_starts >= FAILED_STARTS:
                    log.error("workers keep exiting as they start (exit code %s); stopping: see the log above",
                              worker.process.exitcode)
                    stopping, status = True, 1
                    break
                log.warning("worker %d (pid %d) exited with code %s; starting another", n, worker.process.pid,
                            worker.process.exitcode)
                worker.close()
                workers[n] = _Worker(context, n, options)
    finally:
        listener.close()  # no new connections; the workers finish the ones they hold
        for worker in workers:
            if worker.process.is_alive():
                worker.process.terminate()  # SIGTERM: uvicorn finishes the requests in hand, then exits
        deadline = time.monotonic() + STOP_SECONDS
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status
