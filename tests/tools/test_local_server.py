"""tools.local_server's port choice: the ports of one server never coincide."""

from __future__ import annotations

import socket

from tools.local_server import free_port


def test_free_ports_are_never_handed_out_twice_and_are_bindable() -> None:
    # The kernel hands a just-closed port out again quickly (2000 bare bind-to-0 probes repeat ~8% of
    # the time): a server started with two equal ports refuses to start.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports[-1]))
