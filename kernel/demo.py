"""`syscall-kernel demo`: the kernel's main job, end to end, on the embedded local backend.

In a temporary directory: a small git workspace (a training script), a kernel config (the bwrap jail when bwrap
works here, else `jail = "none"` with its warning), enrollment, and a real `syscall-kernel serve` process. Then it
acts as an agent would, through the installed tool: stage a 2-task sweep that writes an artifact and a launch
that fails, sleep, wait for the wake and print it. Everything is removed afterwards (`--keep` keeps it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from kernel.io import hostproc
from kernel.node.jail import NONE_WARNING

TRAIN_PY: Final = '''\
"""A stand-in for a training run: one learning rate per sweep task."""
import json
import os
import sys

LRS = [0.1, 0.03]
if len(sys.argv) > 1:
    print(f"train.py: unknown option {sys.argv[1]!r}", file=sys.stderr)
    sys.exit(2)
lr = LRS[int(os.environ.get("SWEEP_INDEX", "0"))]
loss = 1.0
for step in range(200):
    loss -= lr * loss * 0.05
os.makedirs("out", exist_ok=True)
with open("out/metrics.json", "w") as f:
    json.dump({"lr": lr, "final_loss": round(loss, 6)}, f)
print(f"lr={lr} final_loss={loss:.6f}")
'''

READY_TIMEOUT_S: Final = 60.0
WAKE_TIMEOUT_S: Final = 120
DEMO: Final = hostproc.declare(
    "demo",
    agent_input="none: the demo's own workspace, script and tool, made here",
    containment="the demo's own processes (git, the kernel's CLI, the tool, bwrap's probe), each with a deadline; "
    "the kernel it starts is stopped when the demo ends",
    timeout_s=WAKE_TIMEOUT_S + 30,
)


def bwrap_works() -> bool:
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    probe = hostproc.run(
        DEMO,
        [exe, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc", "true"],
        timeout=30,
    )
    return probe.returncode == 0


def _say(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _git(ws: Path, *args: str) -> None:
    done = hostproc.run(
        DEMO, ["git", "-c", "user.name=demo", "-c", "user.email=demo@example.invalid", *args], cwd=ws
    )
    if done.returncode != 0:
        raise DemoError(f"git {args[0]} failed: {done.stderr.decode(errors='replace').strip()}")


def _text(argv: list[str], cwd: Path | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one of the demo's own commands."""
    done = hostproc.run(DEMO, argv, cwd=cwd)
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def _kernel_cli(config: Path, *args: str) -> tuple[int, str, str]:
    return _text([sys.executable, "-m", "kernel.cli", *args, "--config", str(config)])


class DemoError(Exception):
    pass


def _agent(ws: Path, python: str, *args: str) -> str:
    shown = "python3 .syscall/syscall " + shlex.join(args)
    _say(f"$ {shown}")
    code, stdout, stderr = _text([python, ".syscall/syscall", *args], cwd=ws)
    out = (stdout + stderr).rstrip("\n")
    if out:
        _say(out)
    _say()
    if code != 0:
        raise DemoError(f"`{shown}` exited with {code}")
    return stdout


def _wait_ready(proc: hostproc.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(
                f"the kernel exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}"
            )
        if "event=ready" in log.read_text(errors="replace"):
            return
        time.sleep(0.02)
    raise DemoError(f"the kernel did not become ready within {READY_TIMEOUT_S:.0f} s")


def run(keep: bool = False) -> int:
    top = Path(tempfile.mkdtemp(prefix="syscall-demo-"))
    proc: hostproc.Popen[bytes] | None = None
    log = top / "kernel.log"
    try:
        ws = top / "workspace"
        ws.mkdir()
        _git(ws, "init", "-q")
        (ws / "train.py").write_text(TRAIN_PY)
        (ws / ".gitignore").write_text("out/\n")
        _git(ws, "add", "train.py", ".gitignore")
        _git(ws, "commit", "-q", "-m", "a training script")
        jail = "bwrap" if bwrap_works() else "none"
        config = top / "config.toml"
        # A demo run as root (a container) is allowed to: it serves only its own temporary workspace.
        root = "allow_root = true\n" if os.geteuid() == 0 else ""
        config.write_text(f'state_dir = "{top / "state"}"\njail = "{jail}"\n{root}')
        _say(f"syscall-kernel demo in {top}")
        _say(f"backend: local; jail: {jail}")
        if jail == "none":
            _say(f"WARNING: bwrap does not work here, so {NONE_WARNING}")
        code, stdout, stderr = _kernel_cli(
            config, "enroll", str(ws), "--launches", "10", "--sleeps", "5", "--gpu-hours", "2"
        )
        if code != 0:
            raise DemoError(f"enroll failed: {stderr.strip()}")
        _say(stdout.rstrip("\n"))
        with open(log, "ab") as log_file:
            proc = hostproc.popen(
                DEMO,
                [sys.executable, "-m", "kernel.cli", "serve", "--config", str(config)],
                stdout=log_file,
                stderr=log_file,
                env={k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")},
            )
        _wait_ready(proc, log)
        _say(f"kernel running (pid {proc.pid}); now acting as the agent, in {ws}:")
        _say()
        python = shutil.which("python3") or sys.executable
        _agent(
            ws,
            python,
            "launch",
            "--name",
            "sweep",
            "--array",
            "2",
            "--minutes",
            "5",
            "--gpus",
            "1",
            "--artifact",
            "out/metrics.json",
            "--why",
            "which learning rate lowers the loss more",
            "--",
            "python3",
            "train.py",
        )
        _agent(
            ws,
            python,
            "launch",
            "--name",
            "broken",
            "--minutes",
            "2",
            "--why",
            "a typo",
            "--",
            "python3",
            "train.py",
            "--lr=oops",
        )
        _agent(ws, python, "sleep", "--note", "demo sweep", "--wait", "--timeout", str(WAKE_TIMEOUT_S))
        _agent(ws, python, "budget")
        delivered = sorted(
            str(p.relative_to(ws)) for p in (ws / ".syscall" / "results").rglob("*") if p.is_file()
        )
        _say("Delivered into the channel: " + ", ".join(delivered))
        return 0
    except DemoError as e:
        _say(f"syscall-kernel demo: {e}")
        if log.exists():
            _say(log.read_text(errors="replace")[-3000:])
        return 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except hostproc.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        if keep:
            _say(f"(kept {top})")
        else:
            shutil.rmtree(top, ignore_errors=True)
