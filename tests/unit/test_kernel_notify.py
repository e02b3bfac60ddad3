"""sd_notify datagrams, received on a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kernel.service.notify import Notifier


def test_datagrams_reach_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000"})
        assert n.watchdog_interval == 1.5
        n.ready("serving 0 workspaces")
        n.watchdog()
        n.stopping("draining")
        n.close()
        got = [srv.recv(4096).decode() for _ in range(3)]
    assert got[0].splitlines()[:2] == ["READY=1", "STATUS=serving 0 workspaces"]
    assert f"MAINPID={os.getpid()}" in got[0]
    assert got[1] == "WATCHDOG=1"
    assert got[2].splitlines() == ["STOPPING=1", "STATUS=draining"]


def test_abstract_socket_names(tmp_path: Path) -> None:
    name = f"syscall-kernel-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(b"\0" + name.encode())
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        n.status("x")
        assert srv.recv(100) == b"STATUS=x"
        n.close()


def test_without_systemd_nothing_is_sent_and_nothing_fails() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.watchdog_interval is None
    n.ready("x")
    n.watchdog()


def test_watchdog_for_another_pid_is_ignored() -> None:
    n = Notifier.from_env({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert n.watchdog_interval is None


def test_a_receiver_that_stops_reading_never_stalls_the_sender(tmp_path: Path) -> None:
    """Issue 24 (found by the e2e outage test): the socket was blocking, so once the receiver's queue was full
    (net.unix.max_dgram_qlen, 10 by default) the next STATUS= blocked the kernel's event loop for good, SIGTERM
    included. Now a datagram that does not fit is dropped."""
    import threading

    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        n = Notifier(path, None)
        sent = threading.Event()

        def send_many() -> None:
            for i in range(200):
                n.status(f"line {i}")
            sent.set()

        threading.Thread(target=send_many, daemon=True).start()
        assert sent.wait(5), "a status line blocked on a full queue"
        n.close()
        assert srv.recv(4096).decode() == "STATUS=line 0"
