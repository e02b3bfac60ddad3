"""The gate for every process the kernel starts on its host.

The agent may be hostile, and every feature that handed its bytes to another program (uv, an interpreter, git
walking the live tree, the scorer reading the live tree) opened a hole. So no module of the kernel starts a
process itself: each one names a `Site` declared here, which says what agent-controlled input reaches the
process and how that process is contained (a jail profile, a deadline, a cap on what it may print), and starts it
through `run`, `popen`, `run_async` or `spawn`. `tests/unit/test_host_processes.py` fails when `subprocess`,
`os.exec*`, `os.spawn*`, `os.posix_spawn*`, `anyio.run_process`/`open_process` or `asyncio`'s subprocess
functions appear anywhere else in `kernel/` (the node's job wrapper, `kernel/node/wrapper.py`, is a separate
program rendered into each job script; it is the jail's launcher and runs no agent byte outside it).

The rule each site's declaration must keep: no agent-controlled byte is executed or interpreted on the host
outside a jail. Bytes git only stores or hashes (blobs fed to `fast-import`, objects re-hashed by `cat-file`) are
data, not code; git never reads the agent's `.git` (kernel.io.snapshot, kernel.io.repo) and never walks the live
tree without a deadline.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Final

import anyio

# What callers need of subprocess, so no other module imports it.
CompletedProcess = subprocess.CompletedProcess
Popen = subprocess.Popen
TimeoutExpired = subprocess.TimeoutExpired
SubprocessError = subprocess.SubprocessError
PIPE: Final = subprocess.PIPE
DEVNULL: Final = subprocess.DEVNULL


class OutputTooLarge(Exception):
    """A process printed more than its site allows; it was killed."""


@dataclass(frozen=True, slots=True)
class Site:
    """One place the kernel starts a process, and its containment."""

    name: str
    # Which agent-controlled bytes reach the process ("none" when none do), and what it does with them.
    agent_input: str
    # How the process is contained: its jail, environment, deadline, output cap.
    containment: str
    # Seconds before the process is killed (None: the caller's own deadline applies, said in `containment`).
    timeout_s: float | None = None
    # Bytes of stdout + stderr captured at most; past it the process is killed (OutputTooLarge). None: no capture
    # cap, because the process's output is the kernel's own (a version string, a CLI's short answer).
    output_cap: int | None = None


SITES: dict[str, Site] = {}


def declare(
    name: str,
    *,
    agent_input: str,
    containment: str,
    timeout_s: float | None = None,
    output_cap: int | None = None,
) -> Site:
    """Declare a site (once per name, at import time of the module that uses it)."""
    if name in SITES:
        raise ValueError(f"host process site {name!r} is declared twice")
    site = Site(name, agent_input, containment, timeout_s, output_cap)
    SITES[name] = site
    return site


def _captured(
    input: bytes | None, env: Mapping[str, str] | None, cwd: str | os.PathLike[str] | None
) -> dict[str, Any]:
    """The pipes and place of a process whose output the gate captures."""
    return {
        "stdin": subprocess.PIPE if input is not None else subprocess.DEVNULL,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "env": None if env is None else dict(env),
        "cwd": cwd,
    }


def run(
    site: Site,
    argv: Sequence[str],
    *,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    pass_fds: Sequence[int] = (),
    start_new_session: bool = False,
) -> subprocess.CompletedProcess[bytes]:
    """Run to completion, stdout and stderr captured (at most the site's cap), stdin `input` or /dev/null. Raises
    TimeoutExpired past the deadline (`timeout`, else the site's), OutputTooLarge past the cap, OSError when it
    cannot start. The process is killed and reaped in every case."""
    limit = timeout if timeout is not None else site.timeout_s
    if site.output_cap is None:
        return subprocess.run(
            list(argv),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            env=None if env is None else dict(env),
            cwd=cwd,
            timeout=limit,
            check=False,
            pass_fds=tuple(pass_fds),
            start_new_session=start_new_session,
        )
    return _run_capped(site, list(argv), input, env, cwd, limit, pass_fds, start_new_session)


def _run_capped(
    site: Site,
    argv: list[str],
    input: bytes | None,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    limit: float | None,
    pass_fds: Sequence[int],
    start_new_session: bool,
) -> subprocess.CompletedProcess[bytes]:
    assert site.output_cap is not None
    cap = site.output_cap
    deadline = None if limit is None else time.monotonic() + limit
    proc = subprocess.Popen(
        argv, **_captured(input, env, cwd), pass_fds=tuple(pass_fds), start_new_session=start_new_session
    )
    chunks: dict[int, list[bytes]] = {1: [], 2: []}
    total = 0
    pending = memoryview(input or b"")
    try:
        with selectors.DefaultSelector() as sel:
            assert proc.stdout is not None
            assert proc.stderr is not None
            sel.register(proc.stdout, selectors.EVENT_READ, 1)
            sel.register(proc.stderr, selectors.EVENT_READ, 2)
            if proc.stdin is not None:
                if pending:
                    os.set_blocking(proc.stdin.fileno(), False)
                    sel.register(proc.stdin, selectors.EVENT_WRITE, 0)
                else:
                    proc.stdin.close()
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(argv, limit or 0)
                for key, _ in sel.select(left):
                    stream: IO[bytes] = key.fileobj  # type: ignore[assignment]
                    if key.data == 0:
                        try:
                            pending = pending[os.write(stream.fileno(), pending[: 1 << 16]) :]
                        except BrokenPipeError:
                            pending = memoryview(b"")
                        if not pending:
                            sel.unregister(stream)
                            stream.close()
                        continue
                    data = os.read(stream.fileno(), 1 << 16)
                    if not data:
                        sel.unregister(stream)
                        continue
                    total += len(data)
                    if total > cap:
                        raise OutputTooLarge(f"{site.name}: {argv[0]} printed more than {cap} bytes")
                    chunks[key.data].append(data)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        code = proc.wait(left)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        for s in (proc.stdin, proc.stdout, proc.stderr):
            if s is not None and not s.closed:
                s.close()
    return subprocess.CompletedProcess(argv, code, b"".join(chunks[1]), b"".join(chunks[2]))


def popen(site: Site, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
    """A process the caller drives (a pipe it streams to or from); the caller owns its deadline and reaps it, as
    the site's `containment` says."""
    return subprocess.Popen(list(argv), **kw)


async def run_async(
    site: Site,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: bytes | None = None,
    limit_s: float | None = None,
    on_output: Callable[[bytes], object] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """`run` for the event loop: stdout and stderr captured (at most the site's cap, counted as they arrive; each
    piece also given to `on_output` as it arrives, for a live log), stdin `input` or /dev/null. TimeoutExpired past the deadline (`limit_s`, else the site's), OutputTooLarge past
    its cap; the process is killed and reaped in every case, a cancellation included."""
    args = list(argv)
    limit = limit_s if limit_s is not None else site.timeout_s
    chunks: dict[int, list[bytes]] = {1: [], 2: []}
    total = 0
    too_large = False
    async with await anyio.open_process(args, **_captured(input, env, cwd)) as proc:

        async def drain(stream: Any, which: int) -> None:
            nonlocal total, too_large
            async for data in stream:
                total += len(data)
                if site.output_cap is not None and total > site.output_cap:
                    # Stop reading both streams now: a child that outlives the killed process (a pipeline's
                    # other half) may hold the other pipe open, and waiting for its EOF would turn the cap
                    # into the deadline.
                    too_large = True
                    proc.kill()
                    tg.cancel_scope.cancel()
                    return
                chunks[which].append(data)
                if on_output is not None:
                    on_output(data)

        try:
            with anyio.move_on_after(limit) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drain, proc.stdout, 1)
                    tg.start_soon(drain, proc.stderr, 2)
                    if proc.stdin is not None:
                        async with proc.stdin:
                            if input:
                                with contextlib.suppress(anyio.BrokenResourceError):
                                    await proc.stdin.send(input)
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                with anyio.CancelScope(shield=True):
                    await proc.wait()
    if scope.cancelled_caught:
        raise subprocess.TimeoutExpired(args, limit or 0)
    if too_large:
        raise OutputTooLarge(f"{site.name}: {args[0]} printed more than {site.output_cap} bytes")
    return subprocess.CompletedProcess(args, code, b"".join(chunks[1]), b"".join(chunks[2]))


def spawn(site: Site, path: str, argv: Sequence[str], env: Mapping[str, str], **kw: Any) -> int:
    """`os.posix_spawn` of a detached process (the local backend's job wrapper); returns its pid."""
    return os.posix_spawn(path, list(argv), dict(env), **kw)


# A question to a program of the operator's installation (bwrap's `true`, scontrol, sacctmgr, `uv --version`):
# shared by every module that asks one, since the containment is the same.
TOOL_QUERY: Final = declare(
    "tool.query",
    agent_input="none: the operator's installation asked about itself (bwrap's `true`, scontrol, sacctmgr, "
    "uv --version)",
    containment="a deadline of 30 s, stdin /dev/null, at most 1 MiB of output",
    timeout_s=30,
    output_cap=1 << 20,
)
