"""`free_port` hands out ports that outgoing connections cannot take first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from inferx import devstack
from inferx.devstack import free_port


def test_ports_lie_below_the_ephemeral_range_and_are_never_repeated() -> None:
    low, _high = devstack._ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if low - 20000 >= 2000:
        assert all(20000 <= port < low for port in ports)


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        real_randint = devstack.random.randint
        calls: list[int] = []

        def taken_first(low: int, high: int) -> int:
            calls.append(low)
            return taken if len(calls) == 1 else real_randint(low, high)

        monkeypatch.setattr(devstack.random, "randint", taken_first)
        monkeypatch.setattr(devstack, "_ephemeral_range", lambda: (65535, 65535))
        port = free_port()
    assert len(calls) >= 2  # the taken port was drawn, probed and passed over
    assert port != taken


def test_a_port_handed_out_is_usable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_each_slice_hands_out_ports_of_its_own_part_of_the_range(monkeypatch) -> None:
    """Parallel test processes (pytest-xdist's workers) each take their own slice."""
    monkeypatch.setattr(devstack, "_ephemeral_range", lambda: (32768, 60999))
    halves = []
    for index in (0, 1):
        monkeypatch.setattr(devstack, "port_slice", (index, 2))
        halves.append({free_port() for _ in range(50)})
    assert all(20000 <= port < 26384 for port in halves[0])
    assert all(26384 <= port < 32768 for port in halves[1])


def test_processes_started_by_a_test_keep_its_slice() -> None:
    """A test's `inferx bench` starts a stack of its own: it must choose in the test
    process's slice, not the whole range where another test process chooses too."""
    show = "from inferx import devstack; print(*devstack.port_slice)"
    for value, expected in (("1/2", "1 2"), ("", "0 1"), ("2/2", "0 1"), ("x/y", "0 1")):
        env = {**os.environ, devstack.PORT_SLICE_ENV: value}
        shown = subprocess.run(
            [sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True
        )
        assert shown.stdout.split() == expected.split(), value
