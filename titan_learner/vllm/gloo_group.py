"""A weight-transfer gloo group whose sockets are on the address its peers reach.

A gloo group built with torch's default device binds the address this machine's hostname
resolves to, and tells its peers to connect there. Where the hostname resolves to loopback
(`127.0.0.1 vm` or Debian's `127.0.1.1`, as in most containers), a rollout server on another
machine is told to connect to 127.0.0.1, which is itself: the join times out, even though the
rendezvous store was reached. So each side binds its group to its own address on the route to
the other: the trainer to the address it gave the workers (`route_address` toward the server),
a worker to its address toward the trainer. torch's `GLOO_SOCKET_IFNAME` still picks the
interface of the trainer's own process group; this group needs the one toward its peer.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def route_address(host: str, port: int) -> str:
    """This machine's address on its route to `host:port` (127.0.0.1 toward this machine). A
    UDP socket's connect picks the route and sends nothing."""
    family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return probe.getsockname()[0]


def bound_group(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, address: str
) -> dist.ProcessGroupGloo:
    """A gloo group over `store` whose connections are made on `address` (this machine's)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
