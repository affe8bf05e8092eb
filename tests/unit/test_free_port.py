"""``free_port``: a port below the system's ephemeral range (where no socket asking for
port 0 can be handed it before the store binds it), free to bind."""

from __future__ import annotations

import socket

from reshard import comm


def test_free_port_is_below_the_ephemeral_range_and_free():
    low, _ = comm._ephemeral_ports()
    ports = {comm.free_port() for _ in range(20)}
    if low > comm._PORTS_FROM + 100:
        assert all(comm._PORTS_FROM <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # drawn, not one fixed port
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_free_port_falls_back_to_any_free_port_without_such_a_range(monkeypatch):
    monkeypatch.setattr(comm, "_ephemeral_ports", lambda: (1024, 65535))
    port = comm.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
