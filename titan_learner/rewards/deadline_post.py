"""One HTTP POST that must be over within a total deadline: connect, send, status line, headers
and the whole reply body.

A socket timeout (urllib's `timeout=`) bounds each blocking operation, not the request: an
endpoint that trickles a byte every few seconds would keep a judge request open for ever while
every single read returns in time. Here a watchdog timer shuts the socket down at the deadline,
which wakes whichever operation is blocked on it, and the request ends with TimeoutError.
It connects to the URL's host directly: proxy variables (HTTP_PROXY, HTTPS_PROXY) are not read.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.parse

_SHOWN_BODY_CHARS = 300


class HTTPStatusError(Exception):
    """A reply with a status >= 400; its text says the status and the start of the body."""

    def __init__(self, code: int, reason: str, body: bytes) -> None:
        self.code = code
        text = " ".join(body.decode(errors="replace").split())[:_SHOWN_BODY_CHARS]
        super().__init__(f"HTTP {code} {reason}" + (f": {text}" if text else ""))


def post_within(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> bytes:
    """The reply body of POST `body` to `url`, all of it within `timeout_s` seconds.

    Raises TimeoutError past the deadline, HTTPStatusError for a status >= 400, OSError or
    http.client.HTTPException when the connection fails or the reply is not HTTP.
    """
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    connection_class = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout_s)
    expired = threading.Event()
    connected: list[socket.socket] = []  # the reply keeps the socket, not the connection

    def cut() -> None:
        expired.set()
        for sock in connected:
            with contextlib.suppress(OSError):  # closed already: the request ended meanwhile
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked send or recv

    watchdog = threading.Timer(timeout_s, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.connect()  # bounded by the socket timeout: no socket to shut down before it
        connected.append(connection.sock)
        if expired.is_set():
            raise TimeoutError
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("POST", target, body, headers)
        response = connection.getresponse()
        reply = response.read()
        if expired.is_set():  # a reply without a length ends quietly where it was cut
            raise TimeoutError
    except (OSError, http.client.HTTPException) as err:
        if expired.is_set() or isinstance(err, TimeoutError):
            raise TimeoutError(f"no whole reply in {timeout_s:g} s") from None
        raise
    finally:
        watchdog.cancel()
        connection.close()
    if response.status >= 400:
        raise HTTPStatusError(response.status, response.reason, reply)
    return reply
