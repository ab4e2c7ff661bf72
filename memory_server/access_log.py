"""The access log: one line a request on standard output, written by the app (app.ObserveRequests)
instead of uvicorn's access logger.

    2026-12-07 21:10:00,123 INFO memory_server.access: 127.0.0.1:45678 - "POST /v1/memories/search HTTP/1.1" 200 3.4ms

uvicorn's line went through `logging` (a record, its formatter, the handler's lock, a write and a
flush): ~16 µs of the event loop's CPU a line alone on an Intel Xeon, ~4× that under load, ~3% of
the requests a loaded server answers (bench/analysis.md, rounds 40 and 41). Here a line is one
f-string (~0.6 µs), and lines are written together: at most FLUSH_SECONDS after the first of them,
or once they fill a pipe's atomic write (two worker processes share the output; a write up to
PIPE_BUF bytes is never interleaved with another's)."""

import asyncio
import sys
import time
from urllib.parse import quote

FLUSH_SECONDS = 0.1
PIPE_BUF = 4096
SAFE = "/?&=:+,;@!$'()*~%"  # left as they are when a target is percent-encoded


class AccessLog:
    def __init__(self, stream=None):
        self.stream = stream  # None: sys.stdout as it is at each write (a test may capture it)
        self._lines: list[str] = []
        self._bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._second, self._stamp = -1, ""

    def request(self, scope, status: int, seconds: float) -> None:
        """The line of a request answered `status` in `seconds` (on the event loop that served it)."""
        client = scope.get("client")
        # The request's target as the client sent it: the parser refused control characters in it.
        # Anything else (bytes outside printable ASCII, a path built by hand) is percent-encoded,
        # so that a line stays one line.
        raw, query = scope.get("raw_path"), scope.get("query_string")
        target = (raw or quote(scope["path"]).encode()) + (b"?" + query if query else b"")
        path = target.decode("latin-1")
        if not (path.isascii() and path.isprintable()):  # ASCII: a line's characters are its bytes (PIPE_BUF)
            path = quote(target, safe=SAFE)
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        line = (f'{self._stamp},{int((now - second) * 1000):03d} INFO memory_server.access: '
                f'{f"{client[0]}:{client[1]}" if client else "-"} - "{scope["method"]} {path} '
                f'HTTP/{scope.get("http_version", "1.1")}" {status} {seconds * 1000:.1f}ms\n')
        if self._bytes + len(line) > PIPE_BUF:
            self.flush()
        self._lines.append(line)
        self._bytes += len(line)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        text, self._lines, self._bytes = "".join(self._lines), [], 0
        stream = self.stream or sys.stdout
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):  # output closed (a stopping process, a gone pipe): lines are lost, requests are not
            pass
