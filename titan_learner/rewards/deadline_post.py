"""One HTTP POST that must be over within a total deadline: connect (through a proxy too: the
CONNECT tunnel and the TLS handshake), send, status line, headers and the whole reply body.

A socket timeout (urllib's `timeout=`) bounds each blocking operation, not the request: an
endpoint (or a proxy) that trickles a byte every few seconds would keep a judge request open
for ever while every single read returns in time. Here a watchdog timer shuts the socket down
at the deadline, which wakes whichever operation is blocked on it, and the request ends with
TimeoutError. The watchdog holds a duplicate of the socket, taken as soon as TCP connects:
http.client swaps its socket for a TLS one, and the duplicate still shuts down the same
connection, whatever stage the request is at.

With a `proxy` (rewards.proxy_route decides which), an http target is sent to the proxy with
its absolute URL, an https target through a CONNECT tunnel; a proxy's user:password goes as
Proxy-Authorization, to the proxy only.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.parse

from titan_learner.rewards.proxy_route import Proxy

_SHOWN_BODY_CHARS = 300


class HTTPStatusError(Exception):
    """A reply with a status >= 400; its text says the status and the start of the body."""

    def __init__(self, code: int, reason: str, body: bytes) -> None:
        self.code = code
        text = " ".join(body.decode(errors="replace").split())[:_SHOWN_BODY_CHARS]
        super().__init__(f"HTTP {code} {reason}" + (f": {text}" if text else ""))


def post_within(
    url: str, body: bytes, headers: dict[str, str], timeout_s: float, proxy: Proxy | None = None
) -> bytes:
    """The reply body of POST `body` to `url` (through `proxy` if given), all of it within
    `timeout_s` seconds.

    Raises TimeoutError past the deadline, HTTPStatusError for a status >= 400, OSError or
    http.client.HTTPException when the connection (or the proxy's tunnel) fails or the reply is
    not HTTP.
    """
    parts = urllib.parse.urlsplit(url)
    connection = _connection(parts, proxy, timeout_s)
    expired = threading.Event()
    duplicates: list[socket.socket] = []

    def cut() -> None:
        expired.set()
        for sock in list(duplicates):
            with contextlib.suppress(OSError):  # closed already: the request ended meanwhile
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked send, recv or handshake

    def create_connection(address, timeout=None, source_address=None) -> socket.socket:
        """socket.create_connection (bounded by the socket timeout), watched from then on."""
        sock = socket.create_connection(address, timeout, source_address)
        duplicates.append(sock.dup())
        if expired.is_set():  # the deadline passed while connecting: nothing shut down yet
            sock.close()
            raise TimeoutError
        return sock

    # http.client's seam for how it opens its TCP connection (CPython's own tests use it)
    connection._create_connection = create_connection
    watchdog = threading.Timer(timeout_s, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.connect()
        if proxy is not None and parts.scheme == "http":
            target = url  # an absolute URL: the proxy forwards it
            if proxy.authorization:
                headers = {**headers, "Proxy-Authorization": proxy.authorization}
        else:
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
        for sock in duplicates:
            sock.close()
    if response.status >= 400:
        raise HTTPStatusError(response.status, response.reason, reply)
    return reply


def _connection(
    parts: urllib.parse.SplitResult, proxy: Proxy | None, timeout_s: float
) -> http.client.HTTPConnection:
    """The connection to the target, or to the proxy (with a CONNECT tunnel for https)."""
    https = parts.scheme == "https"
    if proxy is None:
        connection_class = http.client.HTTPSConnection if https else http.client.HTTPConnection
        return connection_class(parts.hostname, parts.port, timeout=timeout_s)
    connection_class = _TunnelHTTPSConnection if https else http.client.HTTPConnection
    connection = connection_class(proxy.host, proxy.port, timeout=timeout_s)
    if https:
        tunnel_headers = {"Proxy-Authorization": proxy.authorization} if proxy.authorization else {}
        connection.set_tunnel(parts.hostname, parts.port or 443, headers=tunnel_headers)
    return connection


class _TunnelHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection whose CONNECT line brackets an IPv6 target (`CONNECT [fd00::7]:443`,
    RFC 9110's authority form): Python 3.11's writes it bare, which no proxy can parse (3.12
    brackets it itself and leaves a bracketed one as it is)."""

    def _tunnel(self) -> None:
        host = self._tunnel_host
        if ":" in host and not host.startswith("["):
            self._tunnel_host = f"[{host}]"
        try:
            super()._tunnel()
        finally:
            self._tunnel_host = host  # TLS's server_hostname and the Host header take it bare
