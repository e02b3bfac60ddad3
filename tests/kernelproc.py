"""A real kernel process for integration and fault tests: config, enrollment, requests, answers.

Everything waits on a condition with a deadline; nothing sleeps to let things settle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kernel.io.stepguard import ENV as STORE_GUARD

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float, what: str, step: float = 0.005) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def git_workspace(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


def committed_workspace(path: Path) -> Path:
    """A new git workspace at `path` with one empty commit (a base the kernel imports)."""
    path.mkdir(parents=True)
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "init"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
            cwd=path,
            check=True,
            capture_output=True,
        )
    return path


# git with no user or system config (what a test's git must not depend on), committing as the test's user.
PLAIN_GIT = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_SYSTEM": "/dev/null",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
}


def plain_git(ws: Path, *args: str) -> str:
    """git in `ws` with PLAIN_GIT's environment, checked: its stdout, stripped."""
    return subprocess.run(
        ["git", *args], cwd=ws, env=PLAIN_GIT, check=True, capture_output=True, text=True
    ).stdout.strip()


def git(ws: Path, *args: str) -> str:
    """git in `ws` as the test's user (name and email set, so a commit needs no config), checked: its stdout,
    stripped."""
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=ws,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def make_workspace(path: Path, files: dict[str, str] | None = None) -> Path:
    """A new git workspace at `path` with `files` (default: a README naming it) in its first commit."""
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for name, text in ({"README": f"workspace {path.name}\n"} if files is None else files).items():
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init", "--allow-empty")
    return path


def run_tool(ws: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The workspace's installed agent tool (`.syscall/syscall ARGS`), run in `ws` as an agent runs it."""
    return subprocess.run(
        [sys.executable, str(ws / ".syscall" / "syscall"), *args],
        cwd=ws,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tool_popen(ws: Path, *args: str) -> subprocess.Popen[str]:
    """`run_tool`, started and not waited for (a `sleep` left blocking while the test does something else)."""
    return subprocess.Popen(
        [sys.executable, str(ws / ".syscall" / "syscall"), *args],
        cwd=ws,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def put_request(ws: Path, rid: str, data: bytes | dict[str, Any]) -> None:
    """Commit a request the way the tool does: temp file, fsync-free here, rename into requests/."""
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    req = ws / ".syscall" / "requests"
    tmp = req / f".{rid}.tmp"
    tmp.write_bytes(body)
    os.rename(tmp, req / f"{rid}.json")


def status(rid: str) -> dict[str, Any]:
    return {"protocol": 1, "id": rid, "type": "status"}


def answer_path(ws: Path, rid: str) -> Path:
    return ws / ".syscall" / "answers" / f"{rid}.json"


def read_answer(ws: Path, rid: str) -> dict[str, Any] | None:
    try:
        return json.loads(answer_path(ws, rid).read_bytes())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


def wake_md_bytes(ws: Path, sleep_id: str, timeout: float = 30.0) -> bytes:
    """A wake's markdown, `wakes/<sleep_id>.md`. The kernel writes it right after `<sleep_id>.json` (PROTOCOL.md
    section 8), which is what `sleep --wait` returns on, so it may not be there yet when the JSON is."""
    path = ws / ".syscall" / "wakes" / f"{sleep_id}.md"
    wait_for(path.exists, timeout, f"{path.name} after its wake's JSON in {ws.name}")
    return path.read_bytes()


def wake_md(ws: Path, sleep_id: str, timeout: float = 30.0) -> str:
    return wake_md_bytes(ws, sleep_id, timeout).decode()


def wait_answer(ws: Path, rid: str, timeout: float = 10.0) -> dict[str, Any]:
    return wait_for(lambda: read_answer(ws, rid), timeout, f"the answer to {rid} in {ws.name}")


class Kernel:
    """`syscall-kernel` run as a real process with its own config and state directory."""

    def __init__(self, tmp: Path, extra: str = "", *, name: str = "kernel", root: Path = ROOT) -> None:
        # The source tree whose `kernel.cli` runs (`python -m` from it: another commit's tree runs its own code).
        self.root = root
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state = self.dir / "state"
        self.config = self.dir / "config.toml"
        # The tests may run as root (CI containers): `serve` refuses root unless told.
        root = "allow_root = true\n" if os.geteuid() == 0 else ""
        self.config.write_text(f'state_dir = "{self.state}"\n{root}{extra}\n')
        self.log = self.dir / "kernel.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "kernel.cli", *args, "--config", str(self.config)],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        # What the command said, in the failure itself (CalledProcessError would show the exit status only).
        assert not check or done.returncode == 0, (
            f"syscall-kernel {' '.join(args)} exited {done.returncode}:\n{done.stderr}{done.stdout}"
        )
        return done

    def enroll(self, ws: Path, *args: str) -> None:
        self.cli("enroll", str(ws), *args)

    def start(
        self,
        env: dict[str, str] | None = None,
        *,
        wait_ready: bool = True,
        prefix: list[str] | None = None,
        python: str = sys.executable,
    ) -> subprocess.Popen[bytes]:
        """Start `serve` with `python`; `prefix` is a command that execs the kernel (e.g. into its own mount
        namespace)."""
        self._log_file = open(self.log, "ab")  # noqa: SIM115 - closed in stop()/kill()
        full_env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        # Every store step of a test's kernel uses sqlite only, or that call fails (kernel.io.stepguard).
        full_env.setdefault(STORE_GUARD, "1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*(prefix or []), python, "-m", "kernel.cli", "serve", "--config", str(self.config)],
            cwd=self.root,
            stdout=self._log_file,
            stderr=self._log_file,
            env=full_env,
        )
        if wait_ready:
            self.wait_log("event=ready", 60)
        return self.proc

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_log(self, needle: str, timeout: float, count: int = 1) -> None:
        def seen() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"the kernel exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}"
                )
            return self.log_text().count(needle) >= count

        wait_for(seen, timeout, f"{needle!r} in the kernel log", step=0.02)

    def stop(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        finally:
            self._close()
        touched = [line for line in self.log_text().splitlines() if "event=store_step_file_call" in line]
        assert not touched, "the kernel's store steps touched the filesystem:\n" + "\n".join(touched)
        return rc

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)
        self._close()

    def _close(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def ensure_stopped(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._close()
