"""Jobs in the real bwrap jail through the local backend: what they can do, and what they cannot reach.

Every "cannot reach" test runs the same command unjailed first (jail 'none') and shows it succeeds there, so the
jail, not a typo in a path, is what stops it.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_local_backend import (
    NONE,
    PLAIN_GIT,
    World,
    exits,
    intervals,
    kill_leftovers,
    make_world,
    result,
    text,
    wait_for,
    with_backend,
)
from testenv import scratch_gone

from kernel.backends import jobscript
from kernel.backends import local as L
from kernel.backends.base import JobSpec
from kernel.node.jail import JailPolicy

pytestmark = pytest.mark.bwrap


@pytest.fixture
def jailed(tmp_path: Path, bwrap_available: None) -> Iterator[tuple[World, JailPolicy]]:
    w = make_world(tmp_path, {"train.py": "print('committed')\n", "data/in.txt": "input\n"})
    # The kernel's state dir lives next to the run dir, as in the default layout.
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "kernel.sqlite").write_text("kernel state")
    policy = JailPolicy(hide=(str(tmp_path / "state"), str(w.run_dir)))
    yield w, policy
    kill_leftovers(w.run_dir)


def run(specs: list[JobSpec], **kw: object) -> None:
    async def go(b: L.LocalBackend) -> None:
        for s in specs:
            await b.submit(s)
        await exits(b, sum(s.array for s in specs))

    with_backend(go, **kw)  # type: ignore[arg-type]


def test_a_job_succeeds_on_the_dirty_snapshot_and_delivers_an_artifact(
    jailed: tuple[World, JailPolicy],
) -> None:
    w, policy = jailed
    cmd = "mkdir -p out && cat dirty.txt data/in.txt > out/result.txt && ls -A > out/listing.txt"
    spec = w.spec("ok", cmd, jail=policy, artifacts=("out/result.txt", "out/listing.txt"))
    run([spec])
    assert (result(spec).code, result(spec).kind) == (0, "exited")
    delivered = spec.task_dir(0) / "artifacts" / "out" / "result.txt"
    assert delivered.read_text() == "measured as it is\ninput\n"
    log = jobscript.read_artifact_log(spec.task_dir(0))
    assert log[0] == jobscript.ArtifactRecord(
        path="out/result.txt",
        status="copied",
        size=delivered.stat().st_size,
        sha256=hashlib.sha256(delivered.read_bytes()).hexdigest(),
    )
    listing = (spec.task_dir(0) / "artifacts" / "out" / "listing.txt").read_text().split()
    assert ".git" not in listing, "the job must not reach the repository"
    assert ".syscall" not in listing
    assert sorted(listing) == ["data", "dirty.txt", "out", "train.py"]
    scratch_gone(w.scratch)
    assert list(w.scratch.iterdir()) == []


def test_a_failing_command_reports_its_code(jailed: tuple[World, JailPolicy]) -> None:
    w, policy = jailed
    spec = w.spec("bad", "echo oops >&2; exit 7", jail=policy)
    run([spec])
    assert (result(spec).code, result(spec).kind) == (7, "exited")
    assert text(spec, "stderr") == "oops\n"


def test_walltime_kills_the_jailed_job(jailed: tuple[World, JailPolicy]) -> None:
    w, policy = jailed
    marker = f"sleep 119.{time.monotonic_ns() % 10**6:06d}"  # a unique command line to look for afterwards
    spec = w.spec("slow", f"echo ready; {marker}", jail=policy, minutes=1)
    t0 = time.monotonic()
    run([spec], seconds_per_minute=1.0)
    assert time.monotonic() - t0 < 60
    assert (result(spec).code, result(spec).kind) == (jobscript.EXIT_TIMEOUT, "timeout")
    assert text(spec, "stdout") == "ready\n"
    leftovers = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert leftovers.stdout == "", "the jailed process outlived its walltime"


def test_array_with_concurrency_one_in_the_jail(jailed: tuple[World, JailPolicy]) -> None:
    w, policy = jailed
    spec = w.spec("sweep", 'echo "$SWEEP_INDEX"; sleep 0.2', jail=policy, array=3, concurrency=1)
    run([spec], max_parallel=3)
    spans = intervals(spec)
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans)), spans
    assert [text(spec, "stdout", t) for t in range(3)] == ["0\n", "1\n", "2\n"]


def test_cancel_stops_a_jailed_job(jailed: tuple[World, JailPolicy]) -> None:
    w, policy = jailed
    spec = w.spec("long", "echo ready; sleep 120", jail=policy)

    async def go(b: L.LocalBackend) -> None:
        await b.submit(spec)
        await wait_for(lambda: (spec.task_dir(0) / "stdout").exists() and text(spec, "stdout") == "ready\n")
        await b.cancel(spec.key)
        await exits(b, 1)

    with_backend(go)
    assert (result(spec).code, result(spec).kind) == (jobscript.EXIT_TERMINATED, "terminated")


def test_an_artifact_symlinked_to_etc_passwd_is_skipped_with_a_reason(
    jailed: tuple[World, JailPolicy],
) -> None:
    w, policy = jailed
    spec = w.spec(
        "sneaky", "ln -s /etc/passwd stolen && ln -s ../../.. up", jail=policy, artifacts=("stolen", "up")
    )
    run([spec])
    log = {r.path: r for r in jobscript.read_artifact_log(spec.task_dir(0))}
    assert log["stolen"].status == "skipped"
    assert "outside the job's tree" in (log["stolen"].reason or "")
    assert log["up"].status == "skipped"
    assert not (spec.task_dir(0) / "artifacts" / "stolen").exists()


def _targets(w: World, spec_dir: Path) -> dict[str, str]:
    other = w.root / "other-ws"
    other.mkdir(exist_ok=True)
    (other / "secret.txt").write_text("other agent's work")
    return {
        "run-dir": f"cat {spec_dir / 'command.txt'}",
        "run-dir-listing": f"ls {w.run_dir}",
        "state-dir": f"cat {w.root / 'state' / 'kernel.sqlite'}",
        "other-workspace": f"cat {other / 'secret.txt'}",
        "own-repository": f"ls {w.ws / '.git'}",
        "shadow": "cat /etc/shadow",
    }


@pytest.mark.parametrize(
    "target", ["run-dir", "run-dir-listing", "state-dir", "other-workspace", "own-repository", "shadow"]
)
def test_host_paths_are_out_of_reach(jailed: tuple[World, JailPolicy], target: str) -> None:
    w, policy = jailed
    probe = w.spec(f"probe-{target}", "true", jail=NONE)  # only for its launch dir path
    cmd = _targets(w, probe.paths.launch_dir)[target]
    control = w.spec(f"free-{target}", cmd, jail=NONE)
    jailed_spec = w.spec(f"jail-{target}", cmd, jail=policy)
    run([control, jailed_spec])
    assert result(control).code == 0, f"the control run could not read it either: {text(control, 'stderr')}"
    assert result(jailed_spec).code != 0
    assert text(jailed_spec, "stdout") == ""
    assert "No such file" in text(jailed_spec, "stderr")


class _Listener:
    """A TCP server on the host's loopback; counts connections that reach it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_the_network_is_out_of_reach(jailed: tuple[World, JailPolicy]) -> None:
    w, policy = jailed
    listener = _Listener()
    try:
        connect = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {listener.port}), timeout=5)\""
        control = w.spec("net-free", connect, jail=NONE)
        run([control])
        assert result(control).code == 0
        assert listener.hits == 1
        jailed_spec = w.spec("net-jail", connect, jail=policy)
        run([jailed_spec])
        assert result(jailed_spec).code != 0
        assert listener.hits == 1
    finally:
        listener.close()


def test_the_kernels_environment_is_not_visible(
    jailed: tuple[World, JailPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, policy = jailed
    monkeypatch.setenv("SYSCALL_TEST_SECRET", "hunter2")
    spec = w.spec("env", "env; cat /proc/[0-9]*/environ | tr '\\0' '\\n'", jail=policy, eval_seeds=(99,))
    run([spec])  # the backend's base env defaults to the kernel's own os.environ
    out = text(spec, "stdout")
    assert "hunter2" not in out
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env["EVAL_SEED"] == "99"
    assert env["SWEEP_INDEX"] == "0"
    assert set(env) <= {
        "PATH",
        "LANG",
        "HOME",
        "TMPDIR",
        "SWEEP_INDEX",
        "SYSCALL_TASK",
        "SYSCALL_LAUNCH",
        "SYSCALL_SLEEP",
        "SYSCALL_SNAPSHOT",
        "SLURM_ARRAY_TASK_ID",
        "EVAL_SEED",
        "PWD",
        "SHLVL",
        "_",
    }


def test_a_smudge_filter_does_not_run_when_the_job_materialises(
    tmp_path: Path, bwrap_available: None
) -> None:
    marker = tmp_path / "smudge-ran"
    w = make_world(tmp_path, {"a.txt": "raw\n", ".gitattributes": "* filter=evil\n"})
    for key in ("clean", "smudge"):
        subprocess.run(
            ["git", "config", f"filter.evil.{key}", f"sh -c 'touch {marker}; cat'"],
            cwd=w.ws,
            env=PLAIN_GIT,
            check=True,
        )
    spec = w.spec("mat", "cat a.txt", jail=JailPolicy())
    run([spec])
    assert text(spec, "stdout") == "raw\n"
    assert not marker.exists()
    assert result(spec).code == 0


def test_bwrap_is_found_on_the_kernels_path_not_only_in_the_standard_directories(
    jailed: tuple[World, JailPolicy], tmp_path: Path
) -> None:
    """Found on a GPU node: the start-up check finds bwrap on the kernel's PATH (here a directory outside the
    jail's standard PATH), so every job must find it there too, not fail with 'the jail could not be started'."""
    w, policy = jailed
    real = shutil.which("bwrap")
    assert real is not None
    bindir = tmp_path / "opt-bwrap" / "bin"
    bindir.mkdir(parents=True)
    used = tmp_path / "shim-used"
    shim = bindir / "bwrap"
    shim.write_text(f'#!/bin/sh\necho used > {used}\nexec {real} "$@"\n')
    shim.chmod(0o755)
    spec = w.spec("found", "echo in the jail", jail=policy)
    run([spec], base_env={"PATH": f"{bindir}:/usr/bin:/bin"})
    assert (result(spec).code, result(spec).kind) == (0, "exited"), text(spec, "stderr")
    assert used.exists(), "the jail was started from the standard directories, not from the kernel's PATH"
