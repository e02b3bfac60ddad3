"""A raw JSON-RPC client for `syscall mcp` over stdio, for the wire, golden and parity tests.

It writes exactly the bytes a test gives it and reads the server's lines on a thread, so every read has a
deadline and a server that hangs fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

INIT_PARAMS = {
    "protocolVersion": "2025-11-25",
    "capabilities": {},
    "clientInfo": {"name": "raw-test-client", "version": "0"},
}


class RawClient:
    def __init__(self, python: str, tool: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [python, str(tool), "mcp", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.sent: list[Any] = []  # what was sent, in order (bytes for raw lines)
        self.received: list[Any] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next = 0
        self._stderr = ""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        self.write(json.dumps(msg).encode() + b"\n")

    def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no message from the server within {timeout} s") from None
        assert line is not None, f"the server closed stdout; stderr: {self.stderr_text()}"
        assert line.endswith(b"\n")
        msg: dict[str, Any] = json.loads(line)
        self.received.append(msg)
        return msg

    def nothing_within(self, seconds: float) -> bool:
        try:
            line = self.lines.get(timeout=seconds)
        except queue.Empty:
            return True
        self.lines.put(line)
        return False

    def request(
        self, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        """Send a request and return its response (notifications that come first are kept in `received`)."""
        self._next += 1
        rid = self._next
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            got = self.recv(max(0.1, deadline - time.monotonic()))
            if got.get("id") == rid and "method" not in got:
                return got

    def call(self, name: str, arguments: Any = None, **params: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"name": name, **params}
        if arguments is not None:
            body["arguments"] = arguments
        return self.request("tools/call", body)

    def handshake(self) -> dict[str, Any]:
        got = self.request("initialize", INIT_PARAMS)
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return got

    def close(self, timeout: float = 20.0) -> int:
        """Close the server's stdin (EOF) and return its exit status."""
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        rc = self.proc.wait(timeout)
        self._release()
        return rc

    def stderr_text(self) -> str:
        return self._stderr if self.proc.poll() is not None else "(still running)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._release()

    def _release(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self._stderr = self.proc.stderr.read().decode(errors="replace")
            self.proc.stderr.close()


_ID_RE = re.compile(r"\b\d{13}-[0-9a-f]{8}\b")
_TIME_RE = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\b")


def normalize(obj: Any) -> Any:
    """`obj` with the values that change from run to run (request ids, timestamps) replaced by placeholders."""
    if isinstance(obj, dict):
        return {k: normalize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [normalize(v) for v in obj]
    if isinstance(obj, str):
        return _TIME_RE.sub("<time>", _ID_RE.sub("<request-id>", obj))
    return obj
