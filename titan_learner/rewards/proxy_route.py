"""Which HTTP proxy, if any, a request to a URL goes through.

The standard environment variables decide (HTTP_PROXY, HTTPS_PROXY, NO_PROXY, lower-case too),
read by the stdlib's own `urllib.request.getproxies()` and `proxy_bypass()`, so the semantics are
urllib's: the proxy of the URL's scheme, unless NO_PROXY names the host (a name, a domain
suffix, host:port, or `*`). rewards.deadline_post then speaks plain HTTP to the proxy: an
absolute URL for an http target, a CONNECT tunnel for an https one (TLS end to end with the
target, its certificate checked against the target's name).

Where this differs from urllib, it is to be plain: a proxy URL must be http:// (urllib would
speak TLS to an https:// one for an http target and plain HTTP for an https target, and fail
obscurely on socks5://), a proxy without a port is on 80 (urllib: 80 or 443, by the target's
scheme), and a user without a password still sends Proxy-Authorization.
"""

from __future__ import annotations

import base64
import urllib.parse
import urllib.request
from dataclasses import dataclass

_DEFAULT_PORT = 80


@dataclass(frozen=True)
class Proxy:
    """A proxy's address and, from the URL's user:password, its Proxy-Authorization value."""

    host: str
    port: int
    authorization: str | None = None

    @property
    def address(self) -> str:
        """host:port, for messages: never the credentials."""
        return f"{self.host}:{self.port}"


def proxy_for(url: str) -> Proxy | None:
    """The proxy a request to `url` goes through under this environment, or None: direct.

    Raises ValueError for a proxy URL that is not plain HTTP (https://, socks5://, ...).
    """
    parts = urllib.parse.urlsplit(url)
    proxy_url = urllib.request.getproxies().get(parts.scheme)
    if not proxy_url or urllib.request.proxy_bypass(parts.netloc.rpartition("@")[2]):
        return None
    return parse_proxy(proxy_url)


def parse_proxy(proxy_url: str) -> Proxy:
    """An http://[user:password@]host[:port] proxy URL (or host:port) as a Proxy."""
    parts = urllib.parse.urlsplit(proxy_url if "://" in proxy_url else f"http://{proxy_url}")
    if parts.scheme != "http" or not parts.hostname:
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        raise ValueError(f"proxy {shown!r} is not an http://host:port proxy")
    authorization = None
    if parts.username is not None:
        user_pass = f"{urllib.parse.unquote(parts.username)}:"
        user_pass += urllib.parse.unquote(parts.password or "")
        authorization = "Basic " + base64.b64encode(user_pass.encode()).decode("ascii")
    return Proxy(parts.hostname, parts.port or _DEFAULT_PORT, authorization)
