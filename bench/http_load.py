"""Part 3: HTTP under load on loopback: N concurrent clients, 80% search / 20% add, fixed duration.

The load generator shares the 2 cores with the server, so it has to be cheap: every CPU-second it
takes is one the server does not get, and the throughput a closed loop of clients reaches, with it
its latencies, depends on it. httpx's async client spent ~8 ms of CPU a request at 64 connections,
aiohttp ~0.25 ms on a Zen 5 (10% of what server and client took together, round 35); the client
here is a plain HTTP/1.1 client on asyncio's protocols (`Connection`): one keep-alive connection per
simulated client, one request at a time on it, the response read to its last byte (Content-Length
or chunked) before the next is sent, ~0.09 ms a request.
"""

import argparse
import asyncio
import json
import os
import random
import time
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from bench.server import cpu_seconds, running_server
from bench.workload import machine, memories, percentiles, queries, user_id, write_result


def prefill(server, n: int, chunk: int = 1000):
    data = memories(n)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=300) as client:
        for i in tqdm(range(0, n, chunk), desc=f"http: prefill {n}", unit="batch"):
            items = [{"text": t, "user_id": u} for u, t in data[i:i + chunk]]
            client.post("/v1/memories/batch", json={"items": items}).raise_for_status()


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that sends a request and reads its whole response before
    the next: what each simulated client of the load needs and nothing more (no redirects, cookies,
    pooling, compression or streaming), at a fraction of a general client's CPU."""

    def __init__(self):
        self.transport = None
        self._buffer = bytearray()
        self._waiting: asyncio.Future | None = None
        self._lost: Exception | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> "Connection":
        _, connection = await asyncio.get_running_loop().create_connection(cls, host, port)
        return connection

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiting is not None and not self._waiting.done():
            try:
                response = self._response()
            except ValueError as exc:  # a response this client cannot read: the connection is done
                self._waiting.set_exception(exc)
                self.transport.close()
                return
            if response is not None:
                self._waiting.set_result(response)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = ConnectionResetError("the server closed the connection")
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_exception(self._lost)

    async def request(self, head: bytes, body: bytes, timeout: float) -> tuple[int, dict[str, str], bytes]:
        """Send `head` (request line and headers, without Content-Length and the blank line) and
        `body`; (status, headers with lower-case names, body) once the whole response is in."""
        if self._lost is not None:
            raise self._lost
        loop = asyncio.get_running_loop()
        self._waiting = loop.create_future()
        self.transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
        timer = loop.call_later(timeout, lambda w=self._waiting: w.done() or w.set_exception(asyncio.TimeoutError()))
        try:
            return await self._waiting
        finally:
            timer.cancel()
            self._waiting = None

    def _response(self) -> tuple[int, dict[str, str], bytes] | None:
        """The response at the start of the buffer, taken off it; None while it is incomplete."""
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        lines = self._buffer[:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if "content-length" in headers:
            stop = start + int(headers["content-length"])
            if len(self._buffer) < stop:
                return None
            body = bytes(self._buffer[start:stop])
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body, stop = self._chunks(start)
            if body is None:
                return None
        else:
            raise ValueError("a response with neither Content-Length nor chunked encoding")
        del self._buffer[:stop]
        return status, headers, body

    def _chunks(self, at: int) -> tuple[bytes | None, int]:
        parts = []
        while True:
            line_end = self._buffer.find(b"\r\n", at)
            if line_end < 0:
                return None, at
            size = int(self._buffer[at:line_end].split(b";")[0], 16)
            if len(self._buffer) < line_end + 2 + size + 2:
                return None, at
            if size == 0:
                trailer_end = self._buffer.find(b"\r\n\r\n", line_end)  # the last chunk, then trailers
                if trailer_end < 0:
                    return None, at
                return b"".join(parts), trailer_end + 4
            parts.append(bytes(self._buffer[line_end + 2:line_end + 2 + size]))
            at = line_end + 2 + size + 2


def request_head(server, path: str) -> bytes:
    """A POST's request line and headers for `path` on `server`, JSON body, kept alive."""
    host = urlsplit(server.url).netloc
    headers = {"Host": host, "Content-Type": "application/json", "Connection": "keep-alive", **server.headers}
    return (f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())).encode("latin-1")


async def _load(server, clients: int, duration: float, search_share: float, seed: int):
    rng = random.Random(seed)
    qs = queries(5000, seed=seed)
    lat = {"search": [], "add": []}
    timings = {"search": [], "add": []}  # (latency, {stage: seconds}) from the Server-Timing header
    errors = {}
    stop = time.perf_counter() + duration
    added = 0
    heads = {"search": request_head(server, "/v1/memories/search"), "add": request_head(server, "/v1/memories")}
    address = urlsplit(server.url)

    async def worker():
        nonlocal added
        connection = None
        while time.perf_counter() < stop:
            if rng.random() < search_share:
                op = "search"
                u, q = rng.choice(qs)
                body = {"query": q, "filters": {"user_id": u}, "top_k": 10}
            else:
                op = "add"
                added += 1
                u = user_id(rng.randrange(1000))
                body = {"text": f"Load test note {added} from {u}: {rng.choice(qs)[1]}", "user_id": u}
            t = time.perf_counter()
            try:
                if connection is None:
                    connection = await Connection.open(address.hostname, address.port)
                status, headers, _ = await connection.request(heads[op], json.dumps(body).encode(), timeout=30)
                ok, why, stages = status < 300, f"HTTP {status}", headers.get("server-timing")
                if headers.get("connection", "").lower() == "close":  # the server ends it after this answer
                    connection.transport.close()
                    connection = None
            except (OSError, ValueError, asyncio.TimeoutError) as exc:
                ok, why = False, type(exc).__name__
                if connection is not None:
                    connection.transport.close()
                connection = None  # the next request opens a new connection
            if ok:
                lat[op].append(time.perf_counter() - t)
                if stages:
                    timings[op].append((lat[op][-1], stages))
            else:
                errors[why] = errors.get(why, 0) + 1
        if connection is not None:
            connection.transport.close()

    await asyncio.gather(*(worker() for _ in range(clients)))
    return lat, errors, timings


def server_timing(value: str) -> dict[str, float]:
    """A `Server-Timing` header's stages, in seconds: "embed;dur=1.5, app;dur=3" -> {embed: 0.0015, app: 0.003}."""
    stages = {}
    for part in value.split(","):
        name, _, params = part.strip().partition(";")
        duration = next((p.split("=", 1)[1] for p in params.split(";") if p.strip().startswith("dur=")), None)
        if name and duration is not None:
            stages[name] = stages.get(name, 0.0) + float(duration) / 1000
    return stages


def where_time_went(samples: list[tuple[float, str]], share: float = 0.01) -> dict:
    """Mean milliseconds per stage over all requests and over the slowest `share` of them.
    `outside` is what the client waited beyond the server's `app` time (the event loop's queue,
    HTTP parsing, the kernel, the load generator itself); `unnamed` is the part of `app` no stage
    names (request and response models, routing, the service's own Python)."""
    if not samples:
        return {}
    rows = []
    for latency, header in samples:
        stages = server_timing(header)
        app = stages.pop("app", 0.0)
        rows.append((latency, {**stages, "unnamed": app - sum(stages.values()), "outside": latency - app}))
    rows.sort(key=lambda row: row[0])
    slowest = rows[-max(1, int(len(rows) * share)):]
    names = sorted({name for _, stages in rows for name in stages})

    def means(chosen):
        return {"latency": 1000 * sum(latency for latency, _ in chosen) / len(chosen),
                **{name: 1000 * sum(stages.get(name, 0.0) for _, stages in chosen) / len(chosen) for name in names}}

    return {"n": len(rows), "all_ms": means(rows), f"slowest_{share:.0%}_ms": means(slowest)}


def run_level(server, clients: int, duration: float, search_share: float = 0.8, seed: int = 3) -> dict:
    server_cpu, client_cpu, t0 = cpu_seconds(server.pid), time.process_time(), time.perf_counter()
    lat, errors, timings = asyncio.run(_load(server, clients, duration, search_share, seed))
    wall = time.perf_counter() - t0
    done = len(lat["search"]) + len(lat["add"])
    server_cpu = {kind: seconds - server_cpu[kind] for kind, seconds in cpu_seconds(server.pid).items()}
    client_cpu = time.process_time() - client_cpu
    level = {
        "clients": clients, "seconds": wall, "requests": done, "throughput_rps": done / wall,
        "errors": sum(errors.values()), "error_kinds": errors,
        "all": percentiles(lat["search"] + lat["add"]),
        "search": percentiles(lat["search"]), "add": percentiles(lat["add"]),
        # Where the time went, by the server's Server-Timing header: on average, and in the slowest 1%.
        "stages": {op: where_time_went(samples) for op, samples in timings.items() if samples},
        # Share of one core each side used; both near 1.0+ on a 2-core box means the box is saturated.
        "server_cpu_per_s": server_cpu["total"] / wall,
        "client_cpu_per_s": client_cpu / wall,
    }
    if done:
        level["server_cpu_ms_per_request"] = {kind: 1000 * seconds / done for kind, seconds in server_cpu.items()}
        level["client_cpu_ms_per_request"] = 1000 * client_cpu / done
        level["ceilings"] = ceilings(level["server_cpu_ms_per_request"], level["client_cpu_ms_per_request"],
                                     os.cpu_count() or 1, clients)
    return level


def ceilings(server_ms: dict[str, float], client_ms: float, cores: int, clients: int) -> dict:
    """What the box allows at this CPU a request, the load generator's included (it shares the
    cores): the throughput with every core busy, the throughput if only the model's CPU (and the
    load generator's) were left, and the mean latency a closed loop of `clients` would have then.
    In a closed loop the mean latency is clients / throughput and the p99 is above the mean, so
    when `min_mean_latency_model_only_ms` is over a latency target, no change outside the model can
    meet that target on this box."""
    busy = cores * 1000 / (server_ms["total"] + client_ms)
    model_only = cores * 1000 / (server_ms["model"] + client_ms)
    return {"rps_all_cores_busy": busy, "rps_model_only": model_only,
            "min_mean_latency_model_only_ms": 1000 * clients / model_only}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="16,64")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per concurrency level")
    p.add_argument("--prefill", type=int, default=10000)
    p.add_argument("--workers", default="1,2", help="server processes (`serve --workers`), one run each")
    p.add_argument("--search-share", type=float, default=0.8,
                   help="share of requests that are searches, the rest adds (1.0: searches only; 0.0: adds only), "
                        "to tell what each kind of request costs")
    p.add_argument("--out", default="http")
    a = p.parse_args(argv)
    if not 0.0 <= a.search_share <= 1.0:
        p.error("--search-share must be between 0 and 1")
    mix = f"{a.search_share:.0%} search / {1 - a.search_share:.0%} add"
    result = {"machine": machine(), "prefill": a.prefill, "mix": mix, "levels": [],
              "client": "one asyncio process of plain HTTP/1.1 clients (bench/http_load.py: Connection)",
              "notes": ["query-embedding cache off (MEMORY_SERVER_QUERY_CACHE_SIZE=0): the synthetic queries "
                        "repeat far more often than real ones would, so every search embeds its query"]}
    for workers in (int(w) for w in a.workers.split(",")):
        # The synthetic queries repeat (a few hundred distinct), so a cache would make searches look free.
        env = {"MEMORY_SERVER_QUERY_CACHE_SIZE": "0", "MEMORY_SERVER_WORKERS": str(workers)}
        with running_server(extra_env=env) as server:
            prefill(server, a.prefill)
            run_level(server, 4, min(5.0, a.duration))  # warm-up (every worker up), not reported
            for clients in (int(c) for c in a.clients.split(",")):
                print(f"http: {workers} worker(s), {clients} clients for {a.duration:.0f}s ...", flush=True)
                level = {"workers": workers, **run_level(server, clients, a.duration, a.search_share)}
                print(f"  {level['throughput_rps']:.0f} req/s, p99 {level['all'].get('p99_ms', 0):.0f} ms, "
                      f"{level['errors']} errors", flush=True)
                result["levels"].append(level)
    print(write_result(a.out, result))


if __name__ == "__main__":
    main()
