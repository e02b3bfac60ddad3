"""A real kernel process for the benchmarks: git workspaces copied from one template, a config, a start that
waits for log events, a SIGTERM stop; a workspace's git, its uv.lock and its tool. Shared by the benches."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_workspaces(spaces: Path, n: int, *, commit: bool = True) -> list[Path]:
    """`n` git workspaces `spaces/ws00000`... copied from a template beside `spaces`, with one commit (train.py:
    each automatic enrollment records a base that the kernel imports after `ready`) or, `commit=False`, none
    (nothing to import); ones that exist already are kept."""
    template = spaces.parent / ("template" if commit else "template-empty")
    if not template.exists():
        template.mkdir(parents=True)
        subprocess.run(["git", "init", "-q", str(template)], check=True)
        if commit:
            env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b"}
            env["GIT_COMMITTER_EMAIL"] = "b@b"
            (template / "train.py").write_text("print('hello')\n")
            subprocess.run(["git", "-C", str(template), "add", "train.py"], check=True)
            subprocess.run(["git", "-C", str(template), "commit", "-qm", "start"], check=True, env=env)
    out = []
    for i in range(n):
        ws = spaces / f"ws{i:05d}"
        if not ws.exists():
            ws.mkdir(parents=True)
            shutil.copytree(template / ".git", ws / ".git")
            if commit:
                shutil.copy2(template / "train.py", ws / "train.py")
        out.append(ws)
    return out


def kernel_env() -> dict[str, str]:
    drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "PYTHONDONTWRITEBYTECODE")
    return {k: v for k, v in os.environ.items() if k not in drop}


def warm_imports(root: Path = ROOT) -> None:
    """Import the kernel once, so the first start does not pay for compiling its bytecode."""
    subprocess.run([sys.executable, "-c", "import kernel.cli"], cwd=root, env=kernel_env())


def write_config(path: Path, state_dir: Path, spaces: Path, extra: str = "") -> Path:
    path.write_text(
        f'state_dir = "{state_dir}"\nworkspaces = ["{spaces}/*"]\n{extra}'
        + ("allow_root = true\n" if os.geteuid() == 0 else "")
    )
    return path


def stamp(line: bytes) -> float:
    return datetime.fromisoformat(line.split()[0].decode()).timestamp()


class Kernel:
    """`syscall-kernel serve --config CONFIG`, its output appended to LOG (kept across starts)."""

    def __init__(self, config: Path, log: Path, root: Path = ROOT) -> None:
        self.config = config
        self.log = log
        self.root = root  # the checkout whose kernel runs (another one, for a before/after pair)
        self.proc: subprocess.Popen[bytes] | None = None

    def count(self, needle: bytes) -> int:
        return self.log.read_bytes().count(needle) if self.log.exists() else 0

    def start(self) -> None:
        out = open(self.log, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kernel.cli", "serve", "--config", str(self.config)],
            cwd=self.root,
            stdout=out,
            stderr=out,
            env=kernel_env(),
        )

    def wait(self, needle: bytes, n: int, limit: float = 3600, every: float = 0.02) -> None:
        """Until the log holds `needle` `n` times (SystemExit if the kernel exits or `limit` s pass)."""
        deadline = time.monotonic() + limit
        while self.count(needle) < n:
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"waiting for {needle!r}: the kernel exited or took too long; see {self.log}"
                )
            time.sleep(every)

    def start_ready(self) -> float:
        """Start and wait for `event=ready`; seconds from the process start."""
        before = self.count(b"event=ready")
        t0 = time.perf_counter()
        self.start()
        self.wait(b"event=ready", before + 1)
        return time.perf_counter() - t0

    def starting_to_ready(self, nth: int) -> float:
        """Seconds from the nth (0-based) `event=starting` line to the `event=ready` after it."""
        lines = self.log.read_bytes().splitlines()
        i = [k for k, line in enumerate(lines) if b"event=starting" in line][nth]
        ready = next(line for line in lines[i:] if b"event=ready" in line)
        return round(stamp(ready) - stamp(lines[i]), 2)

    def stop(self) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds until the process was gone)."""
        assert self.proc is not None
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        return rc, time.perf_counter() - t0


PYTHON = "/usr/bin/python3"


def git(ws: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=b", "-c", "user.email=b@example.invalid", *args],
        cwd=ws,
        check=True,
        capture_output=True,
    )


def lock(ws: Path, deps: list[str], version: int, requires_python: str = ">=3.10") -> None:
    """Write `ws`'s pyproject.toml (project version 0.`version`.0, `deps`), lock it with the kernel's uv for the
    system's python3, and commit both."""
    from kernel.io.envcache import PASSED_VARS, uv_binary

    listed = ", ".join(f'"{d}"' for d in deps)
    (ws / "pyproject.toml").write_text(
        f'[project]\nname = "bench"\nversion = "0.{version}.0"\nrequires-python = "{requires_python}"\n'
        f"dependencies = [{listed}]\n"
    )
    subprocess.run(
        [uv_binary(), "lock", "--no-config", "--python", PYTHON, "--quiet"],
        cwd=ws,
        check=True,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(ws.parent),
            "UV_CACHE_DIR": str(ws.parent / "lock-cache"),
            **{k: v for k, v in os.environ.items() if k in PASSED_VARS},
        },
    )
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", f"lock {version}")


def tool(ws: Path, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The workspace's installed tool with `args` (SystemExit with its output if it fails and `check`)."""
    done = subprocess.run(
        [sys.executable, str(ws / ".syscall" / "syscall"), *args],
        cwd=ws,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and done.returncode != 0:
        raise SystemExit(f"{args}: {done.stdout}{done.stderr}")
    return done
