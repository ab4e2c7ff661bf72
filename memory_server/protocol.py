"""uvicorn's HTTP/1.1 protocol (httptools) with each request's head bounded in size and in time.

uvicorn keeps every byte of a request head that has not ended (512 MiB of headers grew a server
by 550 MiB), and times only idle keep-alive connections: a connection that sends nothing, or a
head a byte at a time, was held for ever (session 27's review). Here a head larger than
HEAD_LIMIT is answered 431 and its connection closed; a head not complete within the configured
time after its first byte (or after the connection opened) is answered 408, or the silent
connection closed."""

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Bytes received while a head is incomplete. A read can hold the head's end and up to 256 KiB of
# body (asyncio reads that much at once), so the bound sits above that: heads of real clients are a
# few KiB, and 64 KiB is the most common server limit.
HEAD_LIMIT = 512 * 1024


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Give uvicorn `functools.partial(BoundedHttpToolsProtocol, head_timeout=seconds)` as `http`."""

    def __init__(self, *args, head_timeout: float = 30.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._reading_head = True
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            if self._head_timer is None and not self._busy():  # a later request's first bytes
                self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)
            self._head_bytes += len(data)
            if self._head_bytes > HEAD_LIMIT:
                self._refuse(431, "request_header_fields_too_large", "Request Header Fields Too Large",
                             f"the request's head (line and headers) exceeds {HEAD_LIMIT // 1024} KiB")
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._reading_head, self._head_bytes = False, 0
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True  # the next request's head: its timer starts with its first byte

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A head that began arriving while a response was being made is timed from now: a slow
        # response (a large batch) must not be cut off by the timer of the request behind it.
        if (self._reading_head and self._head_bytes and self._head_timer is None and not self._busy()
                and not self.transport.is_closing()):
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def _busy(self) -> bool:
        """A request on this connection is still being answered (or waits behind one)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self._reading_head or self.transport.is_closing() or self._busy():
            return  # (busy: timed again once its response is out)
        if self._head_bytes:
            self._refuse(408, "request_timeout", "Request Timeout",
                         f"the request's head did not arrive within {self.head_timeout:g} s")
        else:
            self.transport.close()  # it never said anything

    def _refuse(self, status: int, code: str, reason: str, message: str) -> None:
        body = json.dumps({"error": {"code": code, "message": message, "field": None}}).encode()
        self.transport.write(b"".join((
            f"HTTP/1.1 {status} {reason}\r\n".encode(), b"content-type: application/json\r\n",
            f"content-length: {len(body)}\r\n".encode(), b"connection: close\r\n\r\n", body)))
        self.transport.close()
        self._cancel_head_timer()
        self._reading_head = False
