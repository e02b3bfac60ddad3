"""The operator's commands where an operator meets them (issue 24): a full state disk, a closed stdout (`| head`),
`history` without `--budget`, a budget change that changes nothing, the audit's "who", `check`'s messages, and
`status` while the config file is broken (and the running kernel's failed reload in STATUS=).

Each drives the real `syscall-kernel` command against a real store (and, where named, a real kernel process).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kernelproc import ROOT, Kernel, git_workspace, put_request, wait_answer, wait_for
from testenv import fill, need, tmpfs


def sleep_request(rid: str) -> dict[str, Any]:
    return {"protocol": 1, "id": rid, "type": "sleep", "launches": [{"name": "train", "command": "true"}]}


def test_status_and_check_on_a_full_state_disk_say_what_where_and_how(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\n')
    with tmpfs(k.state, "2m"):
        k.enroll(git_workspace(tmp_path / "ws"))
        fill(k.state / "filler")
        for args in (
            ("status",),
            ("status", "--json"),
            ("check",),
            ("history",),
            ("budget", "x", "--add-launches", "1"),
        ):
            out = k.cli(*args, check=False)
            said = out.stderr + out.stdout
            assert "Traceback" not in said, (args, said)
            assert out.returncode == 1, (args, out.returncode, said)
            # What failed, where, and what to do.
            assert f"the state store {k.state / 'state.sqlite'} cannot be used" in said, (args, said)
            assert f"the filesystem of state_dir {k.state} is full" in said, (args, said)
            assert "free space there" in said, (args, said)
        assert "error   store: the state store" in k.cli("check", check=False).stdout
        (k.state / "filler").unlink()
        assert k.cli("status").returncode == 0


def closed_stdout(*args: str, config: Path) -> subprocess.CompletedProcess[bytes]:
    """Run a command whose stdout is a pipe nobody reads any more (`| head` after head exited)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(
            [sys.executable, "-m", "kernel.cli", *args, "--config", str(config)],
            cwd=ROOT,
            stdout=w,
            stderr=subprocess.PIPE,
            timeout=60,
            check=False,
        )
    finally:
        os.close(w)


def test_every_command_is_quiet_when_its_reader_goes_away(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.cli("budget", str(ws), "--add-launches", "1")
    for args in (
        ("status",),
        ("status", "--json"),
        ("check",),
        ("check", "--json"),
        ("history",),
        ("history", "--budget"),
        ("history", "--budget", "--json"),
        ("pause", str(ws)),
        ("resume", str(ws)),
        ("budget", str(ws), "--add-launches", "1"),
    ):
        done = closed_stdout(*args, config=k.config)
        # As a command killed by SIGPIPE (128 + 13), with nothing on stderr: no traceback, no "Exception ignored".
        assert (done.returncode, done.stderr.decode()) == (128 + signal.SIGPIPE, ""), args
    # argparse's own help output ignores a closed stdout (exit 0); nothing on stderr either.
    done = closed_stdout("status", "--help", config=k.config)
    assert (done.returncode, done.stderr.decode()) == (0, "")


def test_history_without_budget_lists_each_workspaces_sleeps_and_requests(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\npoll_seconds = 0.1\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    empty = k.cli("history")
    assert "0 requests recorded" in empty.stdout
    assert "no sleeps recorded" in empty.stdout
    k.start()
    try:
        put_request(ws, "s1", sleep_request("s1"))
        assert wait_answer(ws, "s1")["type"] == "accepted"
        put_request(ws, "st", {"protocol": 1, "id": "st", "type": "status"})
        wait_answer(ws, "st")
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
    out = k.cli("history").stdout
    assert "2 requests recorded" in out, out
    [line] = [x for x in out.splitlines() if x.startswith("  seq 1 ")]
    assert " s1 " in line
    assert "1 PENDING" in line, line  # backend "none": accepted, never run
    [one] = [json.loads(x) for x in k.cli("history", str(ws), "--json").stdout.splitlines()]
    assert (one["seq"], one["id"], one["tasks"]) == (1, "s1", {"PENDING": 1})
    assert "the budget changes" in k.cli("history", "--help").stdout


def test_a_budget_change_that_changes_nothing_is_not_recorded(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    out = k.cli("budget", str(ws), "--add-gpu-hours", "0.0001").stdout
    assert "unchanged" in out
    assert "nothing recorded" in out
    assert "whole GPU-seconds" in out
    assert k.cli("history", "--budget").stdout == "no budget changes recorded\n"
    k.cli("budget", str(ws), "--add-gpu-hours", "0.001")  # 3.6 GPU-seconds: a change
    assert len(k.cli("history", "--budget", "--json").stdout.splitlines()) == 1


def test_the_audit_records_the_real_user_and_sudo_user_only_as_a_claim(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    env = {**os.environ, "SUDO_USER": "mallory", "USER": "mallory", "LOGNAME": "mallory"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kernel.cli",
            "budget",
            str(ws),
            "--add-launches",
            "1",
            "--config",
            str(k.config),
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    [change] = [json.loads(x) for x in k.cli("history", "--budget", "--json").stdout.splitlines()]
    me = pwd.getpwuid(os.getuid()).pw_name
    assert change["who"] == f"{me} (SUDO_USER='mallory', claimed by the environment)"


def test_check_names_what_is_really_wrong(tmp_path: Path) -> None:
    deep = tmp_path / "no" / "such" / "state"
    config = tmp_path / "c.toml"
    root = "allow_root = true\n" if os.geteuid() == 0 else ""
    config.write_text(f'state_dir = "{deep}"\n{root}backend = "slurm"\n')
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    done = subprocess.run(
        [sys.executable, "-m", "kernel.cli", "check", "--config", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = done.stdout.splitlines()
    # The run dir is made inside the state dir, after it: not "will be created (in /)".
    [run] = [x for x in lines if " run_dir: " in x]
    assert run == f"error   run_dir: {deep}/runs is inside state_dir, which cannot be created (see state_dir)"
    need("the Slurm clients", shutil.which("sbatch") is not None, "sbatch is not on PATH")
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this host's clients have a default slurm.conf")
    # No slurm.conf: no controller found (the clients' own words blame DNS SRV).
    [slurm] = [x for x in lines if x.startswith("error   slurm: ")]
    assert slurm.startswith("error   slurm: no Slurm controller found: SLURM_CONF is not set"), slurm
    assert "Set SLURM_CONF" in slurm


def test_a_broken_config_file_shows_in_status_line_and_does_not_block_status(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\n')
    k.enroll(git_workspace(tmp_path / "ws"))
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        srv.settimeout(30)
        proc = k.start({"NOTIFY_SOCKET": path})
        try:
            good = k.config.read_text()
            k.config.write_text(good + "no_such_key = 1\n")
            proc.send_signal(signal.SIGHUP)
            k.wait_log("event=reload_failed", 10)

            def status_says_reload_failed() -> bool:
                msg = srv.recv(4096).decode()
                return any(x.startswith("STATUS=") and "reload failed (" in x for x in msg.splitlines())

            wait_for(status_says_reload_failed, 15, "STATUS= to say the reload failed")
            # `status` with the broken file says how to read the state anyway, and that works.
            broken = k.cli("status", check=False)
            assert broken.returncode == 2
            assert "no_such_key" in broken.stderr
            assert "status --state-dir DIR" in broken.stderr
            shown = k.cli("status", "--state-dir", str(k.state))
            assert f"kernel: running (pid {proc.pid}): reload failed (" in shown.stdout, shown.stdout
            assert "1 workspaces" in shown.stdout
            # Fixed and reloaded: the line says so no more.
            k.config.write_text(good)
            proc.send_signal(signal.SIGHUP)
            k.wait_log("event=reloaded", 10)
            wait_for(
                lambda: (
                    "reload failed" not in (json.loads(k.cli("status", "--json").stdout)["kernel_status"])
                ),
                15,
                "the status line without the failed reload",
            )
            assert k.stop() == 0
        finally:
            k.ensure_stopped()


def test_status_says_ready_at_once_and_an_operators_enroll_is_logged(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\npoll_seconds = 0.1\n')
    k.enroll(git_workspace(tmp_path / "ws"))
    k.start()
    try:
        # Right after `ready` (the status tick is every 5 s): not "starting".
        line = json.loads(k.cli("status", "--json").stdout)["kernel_status"]
        assert line.startswith("serving 1 workspaces"), line
        late = git_workspace(tmp_path / "late")
        k.enroll(late)
        k.wait_log("event=enroll_noticed ws=", 10)
        assert f"path={late.resolve()}" in k.log_text()
        k.cli("unenroll", str(late))
        k.wait_log("event=unenroll_noticed ws=", 10)
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
