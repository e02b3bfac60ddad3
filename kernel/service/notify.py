"""The systemd notification protocol (sd_notify), written by hand: one datagram to `$NOTIFY_SOCKET`.

`READY=1` once the kernel serves, `STATUS=` lines as it works, `WATCHDOG=1` every half `$WATCHDOG_USEC` while
healthy, `STOPPING=1` when it drains. Outside systemd (no `$NOTIFY_SOCKET`) every call is a no-op.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Final

_MAX_STATUS: Final = 400


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None) -> None:
        self._sock: socket.socket | None = None
        self._address: str | bytes | None = None
        self.watchdog_usec = watchdog_usec
        if address:
            # A leading '@' names a Linux abstract socket.
            self._address = b"\0" + address[1:].encode() if address.startswith("@") else address
            # Non-blocking: a receiver that stops reading (its queue holds net.unix.max_dgram_qlen datagrams,
            # 10 by default) drops a status line, never stalls the event loop that sends it.
            self._sock = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
            )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Notifier:
        env = dict(os.environ) if env is None else env
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if raw.isdigit() and int(raw) > 0 and (not pid or pid == str(os.getpid())):
            usec = int(raw)
        return cls(env.get("NOTIFY_SOCKET") or None, usec)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings: half the watchdog timeout, as sd_watchdog_enabled(3) advises."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 2_000_000

    def send(self, *lines: str) -> None:
        if self._sock is None or self._address is None:
            return
        # systemd gone or its queue full (BlockingIOError): notification must never break or stall serving.
        with contextlib.suppress(OSError):
            self._sock.sendto("\n".join(lines).encode(), self._address)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status[:_MAX_STATUS]}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status[:_MAX_STATUS]}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status[:_MAX_STATUS]}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
