"""A response sent before the request body is read (413, 401, 404, ...) closes the connection, and first
waits, within bounds, for a body of declared size: nginx's lingering close.

Clients such as urllib send the whole body before they read anything; closing with body bytes unread
makes the kernel answer them with a reset, and the client fails while sending, the response unread.
Uvicorn (in Serve's proxy) closes right after the response when the client asked for `Connection:
close`, as urllib always does, and otherwise discards the body for as long as the client sends it.
So the response goes out at once with `Connection: close`, and its end waits for the rest of a body
whose Content-Length is at most `max_bytes`; a longer or chunked body is not waited for. The declared
length is the bound on what the server reads: Serve's proxy reads ahead of the replica, so a count
kept here would not be one.
"""
from __future__ import annotations

import asyncio

DRAIN_MIN_BYTES = 64 * 1024 * 1024  # what a 20 MB upload needs, whatever the request limit
DRAIN_SECONDS = 30.0  # nginx's lingering_time
DRAIN_IDLE_SECONDS = 5.0  # nginx's lingering_timeout: a client that stops sending is not waited for


def drain_limit(max_request_bytes: int) -> int:
    return max(DRAIN_MIN_BYTES, 4 * max_request_bytes)


class RequestBody:
    """Wraps one HTTP request's ASGI receive and send: tracks whether the client is still sending its body,
    and makes a response that comes first close the connection, lingering until the body is in."""

    def __init__(self, headers: dict[bytes, bytes], receive, send, max_bytes: int):
        self._receive, self._send = receive, send
        length = headers.get(b"content-length", b"").strip()
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        self.pending = chunked or (length != b"" and length != b"0")
        self.linger = not chunked and length.isdigit() and int(length) <= max_bytes

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            self.pending = False
        return message

    async def send(self, message) -> None:
        if not self.pending:
            return await self._send(message)
        if message["type"] == "http.response.start":
            # the body is not all read: the connection is not reused, so uvicorn reads no further
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False) and self.linger:
            await self._send({**message, "more_body": True})  # the whole response, readable now
            await self.discard()
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await self._send(message)

    async def discard(self) -> None:
        """Reads the rest of the body (at most the declared length), within the time bounds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        while self.pending:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self.receive(), min(left, DRAIN_IDLE_SECONDS))
            except asyncio.TimeoutError:
                return
