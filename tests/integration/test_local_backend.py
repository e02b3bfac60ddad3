"""The local backend running real job wrappers on real snapshots (jail 'none' here; bwrap in test_jail_bwrap).

Timing facts come from the wrapper's own `started`/`ended` files; waits are on conditions with deadlines.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
from kernelproc import PLAIN_GIT
from testenv import fill, scratch_gone, tmpfs
from watchdog.observers import inotify_c as ic

from kernel.backends import jobscript
from kernel.backends import local as L
from kernel.backends.base import JobSpec, TaskExit
from kernel.io import snapshot as S
from kernel.io.repo import KernelRepo
from kernel.node.jail import JailPolicy

T = TypeVar("T")
NONE = JailPolicy(kind="none")


@dataclass
class World:
    root: Path
    ws: Path
    run_dir: Path
    scratch: Path
    snap: S.Snapshot

    def spec(self, launch: str, command: str, **kw: Any) -> JobSpec:
        fields: dict[str, Any] = {
            "workspace": "ws-test",
            "workspace_path": str(self.ws),
            "seq": 1,
            "launch": launch,
            "run_dir": str(self.run_dir),
            "command": command,
            "commit": self.snap.commit,
            "tree": self.snap.tree,
            "minutes": 5,
            "jail": NONE,
            "scratch": str(self.scratch),
            "kill_grace_s": 1.0,
        }
        fields.update(kw)
        spec = JobSpec(**fields)
        jobscript.write_launch(spec)
        return spec


def make_world(root: Path, files: dict[str, str] | None = None) -> World:
    ws = root / "ws"
    ws.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=ws, env=PLAIN_GIT, check=True)
    for rel, text in (files or {"train.py": "print('committed')\n"}).items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=ws, env=PLAIN_GIT, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=ws, env=PLAIN_GIT, check=True)
    (ws / "dirty.txt").write_text("measured as it is\n")
    kernel_tmp = root / "kernel-tmp"
    kernel_tmp.mkdir()
    (root / "runs").mkdir(exist_ok=True)  # a test may have mounted a filesystem of its own there
    repo = KernelRepo.at(root / "runs", "ws-test")
    snap = anyio.run(lambda: S.take_snapshot(ws, repo, 1, tmp_dir=kernel_tmp))
    (root / "scratch").mkdir()
    return World(root, ws, root / "runs", root / "scratch", snap)


def kill_leftovers(run_dir: Path) -> None:
    """Never leave a wrapper running after a test, whatever it asserted."""
    for pid_file in run_dir.rglob(L.PID_FILE):
        rec = msgspec.json.decode(pid_file.read_bytes(), type=L.PidRecord)
        if rec.pid is not None and L.is_same_process(rec):
            os.killpg(rec.pid, signal.SIGKILL)
            with_deadline(lambda pid=rec.pid: L.proc_start_ticks(pid) is None, 10)
        if rec.pid is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(rec.pid, os.WNOHANG)


def with_deadline(cond: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {seconds} s")
        time.sleep(0.01)


async def wait_for(cond: Callable[[], bool], seconds: float = 20.0) -> None:
    """Poll a filesystem condition the job creates (it raises no event we could wait on)."""
    with anyio.fail_after(seconds):
        while True:
            if cond():
                return
            await anyio.sleep(0.01)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = make_world(tmp_path)
    yield w
    kill_leftovers(w.run_dir)


def with_backend(fn: Callable[[L.LocalBackend], Awaitable[T]], **kw: Any) -> T:
    """Run `fn` against a served LocalBackend; the service loop stops afterwards (jobs are not killed)."""

    async def main() -> T:
        backend = L.LocalBackend(**kw)
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)
            try:
                return await fn(backend)
            finally:
                tg.cancel_scope.cancel()

    return anyio.run(main)


async def exits(backend: L.LocalBackend, n: int, seconds: float = 60.0) -> list[TaskExit]:
    with anyio.fail_after(seconds):
        return [await backend.wait_any_exit() for _ in range(n)]


def result(spec: JobSpec, task: int = 0) -> jobscript.ExitRecord:
    rec = jobscript.read_exit(spec.task_dir(task))
    assert rec is not None, f"{spec.task_dir(task)} has no exit-code"
    return rec


def text(spec: JobSpec, name: str, task: int = 0) -> str:
    return (spec.task_dir(task) / name).read_text()


def intervals(spec: JobSpec) -> list[tuple[float, float]]:
    out = []
    for t in range(spec.array):
        started = jobscript.read_timestamp(spec.task_dir(t), "started")
        ended = jobscript.read_timestamp(spec.task_dir(t), "ended")
        assert started is not None
        assert ended is not None
        out.append((started.timestamp(), ended.timestamp()))
    return sorted(out)


# --- tests -------------------------------------------------------------------------------------------------


def test_success_failure_and_outputs(world: World) -> None:
    ok = world.spec("ok", "cat dirty.txt; echo to-err >&2")
    bad = world.spec("bad", "echo failing; exit 3")

    async def go(b: L.LocalBackend) -> list[TaskExit]:
        await b.submit(ok)
        await b.submit(bad)
        return await exits(b, 2)

    done = with_backend(go)
    assert {(e.key, e.task) for e in done} == {(ok.key, 0), (bad.key, 0)}
    assert result(ok) == msgspec.structs.replace(result(ok), code=0, kind="exited")
    assert text(ok, "stdout") == "measured as it is\n"
    assert text(ok, "stderr") == "to-err\n"
    assert (result(bad).code, result(bad).kind) == (3, "exited")
    scratch_gone(world.scratch)  # on every exit
    assert list(world.scratch.iterdir()) == []


IN_MOVED_TO, IN_DELETE, IN_ISDIR = 0x80, 0x200, 0x40000000


class DirEvents:
    """One inotify queue over several directories: its events in the order the kernel made them, across them."""

    def __init__(self, dirs: list[Path]) -> None:
        self.fd = ic.inotify_init()
        assert self.fd >= 0
        self.dirs = {ic.inotify_add_watch(self.fd, os.fsencode(d), IN_MOVED_TO | IN_DELETE): d for d in dirs}

    def read(self) -> list[tuple[Path, int, str]]:
        """What is queued now, as (directory, mask, name)."""
        out = []
        try:
            while select.select([self.fd], [], [], 0)[0]:
                buf = os.read(self.fd, 1 << 16)
                while buf:
                    wd, mask, _cookie, size = struct.unpack_from("iIII", buf)
                    name = buf[16 : 16 + size].rstrip(b"\0").decode()
                    out.append((self.dirs[wd], mask, name))
                    buf = buf[16 + size :]
        finally:
            os.close(self.fd)
        return out


def test_exit_code_is_written_before_the_scratch_is_removed(world: World) -> None:
    """Run as Slurm runs job.sh (no detached cleanup): the end is on record first, then the tree goes."""
    spec = world.spec("order", "mkdir -p a/b && echo x > a/b/c")
    tdir = spec.task_dir(0)
    tdir.mkdir(parents=True, exist_ok=True)
    watch = DirEvents([tdir, world.scratch])
    env = jobscript.wrapper_env({"PATH": "/usr/bin:/bin"}, task=0, tmpdir=str(world.scratch))
    job = spec.paths.launch_dir / "job.sh"
    done = subprocess.run([sys.executable, "-I", "-S", str(job)], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = watch.read()
    recorded = seen.index((tdir, IN_MOVED_TO, "exit-code"))
    [removed] = [
        i for i, (d, mask, _) in enumerate(seen) if d == world.scratch and mask == IN_DELETE | IN_ISDIR
    ]
    assert recorded < removed, seen
    assert list(world.scratch.iterdir()) == []


def test_the_local_backend_frees_the_slot_while_a_child_of_the_wrapper_removes_the_scratch(
    world: World,
) -> None:
    """The slot is the wrapper's process: it is gone once exit-code is written, and a child it left (reparented
    to this process, a subreaper for the test) removes the scratch."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        spec = world.spec("slot", "mkdir -p a/b && echo x > a/b/c")

        async def go(b: L.LocalBackend) -> None:
            await b.submit(spec)
            await exits(b, 1)

        with_backend(go)
        assert (result(spec).code, result(spec).kind) == (0, "exited")
        # The backend ran the wrapper with this interpreter; a child of it that has exited is a zombie now, so
        # it is told by its command name (a zombie's command line reads empty).
        left = [pid for pid, name in children_of(os.getpid()) if name == Path(sys.executable).name[:15]]
        assert left, "no process of the wrapper outlived it: the scratch was removed before the slot was free"
        for pid in left:
            os.waitpid(pid, 0)
        assert list(world.scratch.iterdir()) == []
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


PR_SET_CHILD_SUBREAPER = 36


def children_of(parent: int) -> list[tuple[int, str]]:
    """(pid, command name) of the processes (zombies too) whose parent is `parent`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                raw = (entry / "stat").read_bytes()
                if int(raw[raw.rindex(b")") + 2 :].split()[1]) == parent:
                    out.append((int(entry.name), raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode()))
    return out


def test_empty_command_and_failed_materialisation_have_their_own_codes(world: World) -> None:
    empty = world.spec("empty", "  \n")
    broken = world.spec("broken", "true", tree="0" * 40)

    async def go(b: L.LocalBackend) -> None:
        await b.submit(empty)
        await b.submit(broken)
        await exits(b, 2)

    with_backend(go)
    assert (result(empty).code, result(empty).kind) == (jobscript.EXIT_EMPTY_COMMAND, "empty_command")
    assert (result(broken).code, result(broken).kind) == (
        jobscript.EXIT_MATERIALISE_FAILED,
        "materialise_failed",
    )
    assert "[syscall-wrapper]" in text(broken, "stderr")
    scratch_gone(world.scratch)
    assert list(world.scratch.iterdir()) == []


def test_a_blob_replaced_in_the_kernels_repository_fails_materialisation(world: World) -> None:
    """Defence in depth: the wrapper re-hashes every blob it writes (the kernel's repository is the kernel's,
    but what runs must be exactly the recorded tree)."""
    repo = world.run_dir / "repos" / "ws-test.git"
    plain = {**PLAIN_GIT, "GIT_DIR": str(repo)}
    # Every object loose (fast-import leaves small imports loose already), so one can be rewritten in place.
    for pack in sorted((repo / "objects" / "pack").glob("pack-*.pack")):
        moved = world.root / pack.name
        pack.rename(moved)
        pack.with_suffix(".idx").unlink()
        subprocess.run(["git", "unpack-objects", "-q"], stdin=moved.open("rb"), env=plain, check=True)
    listing = subprocess.run(
        ["git", "ls-tree", world.snap.tree, "train.py"], env=plain, check=True, capture_output=True, text=True
    ).stdout
    oid = listing.split()[2]
    loose = repo / "objects" / oid[:2] / oid[2:]
    loose.chmod(0o644)
    forged = b"print('forged')\n"
    loose.write_bytes(zlib.compress(b"blob %d\0" % len(forged) + forged))
    spec = world.spec("tampered", "cat train.py")

    async def go(b: L.LocalBackend) -> None:
        await b.submit(spec)
        await exits(b, 1)

    with_backend(go)
    assert (result(spec).code, result(spec).kind) == (jobscript.EXIT_MATERIALISE_FAILED, "materialise_failed")
    assert "does not hash to its id" in text(spec, "stderr")
    assert text(spec, "stdout") == ""


def test_walltime_kills_and_records_timeout(world: World) -> None:
    spec = world.spec("slow", "echo ready; sleep 60", minutes=1)

    async def go(b: L.LocalBackend) -> float:
        t0 = time.monotonic()
        await b.submit(spec)
        await exits(b, 1)
        return time.monotonic() - t0

    elapsed = with_backend(go, seconds_per_minute=1.0)
    rec = result(spec)
    assert (rec.code, rec.kind, rec.signal) == (jobscript.EXIT_TIMEOUT, "timeout", "SIGUSR2")
    assert elapsed < 30
    assert text(spec, "stdout") == "ready\n"
    assert (spec.task_dir(0) / "ended").exists()


def test_array_with_concurrency_one_runs_one_task_at_a_time(world: World) -> None:
    spec = world.spec("sweep", 'echo "$SWEEP_INDEX $SLURM_ARRAY_TASK_ID"; sleep 0.3', array=3, concurrency=1)

    async def go(b: L.LocalBackend) -> None:
        await b.submit(spec)
        await exits(b, 3)

    with_backend(go, max_parallel=4)
    spans = intervals(spec)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, f"tasks overlapped: {spans}"
    assert [text(spec, "stdout", t) for t in range(3)] == ["0 0\n", "1 1\n", "2 2\n"]


def test_the_global_limit_holds_across_launches(world: World) -> None:
    a = world.spec("a", "sleep 0.3", array=2)
    b_ = world.spec("b", "sleep 0.3")

    async def go(b: L.LocalBackend) -> None:
        await b.submit(a)
        await b.submit(b_)
        await exits(b, 3)

    with_backend(go, max_parallel=1)
    spans = sorted(intervals(a) + intervals(b_))
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, f"more than one job ran at once: {spans}"


def test_cancel_stops_running_tasks_and_finishes_queued_ones(world: World) -> None:
    spec = world.spec("long", "echo ready; sleep 60", array=2, concurrency=1)

    async def go(b: L.LocalBackend) -> list[TaskExit]:
        await b.submit(spec)
        await wait_for(lambda: (spec.task_dir(0) / "stdout").exists() and text(spec, "stdout") == "ready\n")
        cancelled = await b.cancel(spec.key)
        assert sorted(r.task for r in cancelled) == [0, 1]
        return await exits(b, 2)

    done = with_backend(go)
    assert sorted(e.task for e in done) == [0, 1]
    running, queued = result(spec, 0), result(spec, 1)
    assert (running.code, running.kind, running.signal) == (
        jobscript.EXIT_TERMINATED,
        "terminated",
        "SIGTERM",
    )
    assert (queued.code, queued.kind) == (jobscript.EXIT_TERMINATED, jobscript.KIND_CANCELLED)
    assert not (spec.task_dir(1) / "started").exists(), "a cancelled queued task must never start"


def test_job_wrappers_do_not_inherit_the_kernels_environment(world: World) -> None:
    spec = world.spec("env", "env")

    async def go(b: L.LocalBackend) -> None:
        await b.submit(spec)
        await exits(b, 1)

    with_backend(go, base_env={"PATH": "/usr/bin:/bin", "KERNEL_SECRET_TOKEN": "hunter2"})
    out = text(spec, "stdout")
    assert "hunter2" not in out
    assert "KERNEL_SECRET_TOKEN" not in out
    assert "SWEEP_INDEX=0" in out


def test_submit_is_idempotent_per_launch(world: World) -> None:
    spec = world.spec("once", "echo run >> /dev/stdout")

    async def go(b: L.LocalBackend) -> None:
        first = await b.submit(spec)
        assert await b.submit(spec) == first
        await exits(b, 1)
        with anyio.move_on_after(0.5):
            extra = await b.wait_any_exit()
            raise AssertionError(f"a second exit: {extra}")

    with_backend(go)
    assert text(spec, "stdout") == "run\n"


def test_a_restarted_backend_recovers_running_and_finished_jobs(world: World) -> None:
    quick = world.spec("quick", "echo done")
    # Task 0 runs until cancelled; task 1 (queued behind it) ends at once.
    cmd = 'if [ "$SWEEP_INDEX" = 0 ]; then echo ready; sleep 60; fi; echo done'
    long = world.spec("long", cmd, array=2, concurrency=1)

    async def before_crash(b: L.LocalBackend) -> None:
        await b.submit(quick)
        await b.submit(long)
        await exits(b, 1)
        await wait_for(lambda: (long.task_dir(0) / "stdout").exists() and text(long, "stdout") == "ready\n")
        # The service loop is cancelled without any cleanup: like a kernel crash, the wrappers live on.

    with_backend(before_crash, max_parallel=4)
    pid = msgspec.json.decode((long.task_dir(0) / L.PID_FILE).read_bytes(), type=L.PidRecord)
    assert L.is_same_process(pid), "the job must survive the backend going away"
    assert jobscript.read_exit(long.task_dir(0)) is None

    async def after_restart(b: L.LocalBackend) -> list[TaskExit]:
        found = await b.recover(world.run_dir)
        assert [(r.key, r.task) for r in found.finished] == [(quick.key, 0)]
        assert [(r.key, r.task) for r in found.running] == [(long.key, 0)]
        assert [(r.key, r.task) for r in found.requeued] == [(long.key, 1)]
        assert found.lost == ()
        assert await b.recover(world.run_dir) == L.Recovered((), (), (), ())  # already adopted
        await b.cancel(long.key, [0])
        return await exits(b, 2)

    done = with_backend(after_restart, max_parallel=4)
    assert sorted(e.task for e in done) == [0, 1]
    assert result(long, 0).kind == "terminated"
    assert (result(long, 1).code, result(long, 1).kind) == (0, "exited"), "the queued task ran after recovery"
    assert text(quick, "stdout") == "done\n"


def test_recovery_marks_a_wrapper_that_vanished_as_lost(world: World) -> None:
    spec = world.spec("ghost", "true")
    tdir = spec.task_dir(0)
    L._write(spec.paths.launch_dir / L.SPEC_FILE, msgspec.json.encode(spec))
    # Claimed, spawn never returned (kernel died in between): never run twice, reported as lost.
    L._write(tdir / L.PID_FILE, msgspec.json.encode(L.PidRecord(pid=None)))

    async def go(b: L.LocalBackend) -> L.Recovered:
        return await b.recover(world.run_dir)

    found = with_backend(go)
    assert [(r.key, r.task) for r in found.lost] == [(spec.key, 0)]
    assert (result(spec).code, result(spec).kind) == (jobscript.EXIT_LOST, jobscript.KIND_LOST)
    assert not (tdir / "started").exists()


KERNEL_SCRIPT = """
import sys, anyio, msgspec
from kernel.backends.base import JobSpec
from kernel.backends.local import LocalBackend
spec = msgspec.json.decode(open(sys.argv[1], "rb").read(), type=JobSpec)
async def main():
    backend = LocalBackend()
    async with anyio.create_task_group() as tg:
        await tg.start(backend.run)
        await backend.submit(spec)
        await anyio.sleep_forever()
anyio.run(main)
"""


def test_jobs_survive_a_sigkilled_kernel_and_a_new_one_adopts_them(world: World) -> None:
    spec = world.spec("survivor", "echo ready; sleep 60")
    spec_file = world.root / "spec.json"
    spec_file.write_bytes(msgspec.json.encode(spec))
    repo = Path(__file__).resolve().parents[2]
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL_SCRIPT, str(spec_file)], cwd=repo)
    try:
        with_deadline(
            lambda: (spec.task_dir(0) / "stdout").exists() and text(spec, "stdout") == "ready\n", 30
        )
    finally:
        kernel.kill()
        kernel.wait()
    pid = msgspec.json.decode((spec.task_dir(0) / L.PID_FILE).read_bytes(), type=L.PidRecord)
    assert L.is_same_process(pid), "the job died with the kernel"

    async def restarted(b: L.LocalBackend) -> list[TaskExit]:
        found = await b.recover(world.run_dir)
        assert [(r.key, r.task) for r in found.running] == [(spec.key, 0)]
        await b.cancel(spec.key)
        return await exits(b, 1)

    with_backend(restarted)
    assert (result(spec).code, result(spec).kind) == (jobscript.EXIT_TERMINATED, "terminated")


def _interpreters() -> list[str]:
    """Other Pythons on this machine (pyenv), to run job.sh as a compute node's python3 would."""
    found = []
    for version in ("3.8", "3.12", "3.13"):
        # pyenv's shims need pyenv's environment; its real binaries do not.
        real = sorted(Path("/root/.pyenv/versions").glob(f"{version}.*/bin/python{version}"))
        exe = str(real[-1]) if real else shutil.which(f"python{version}")
        if exe is not None:
            found.append(str(exe))
    return found


@pytest.mark.parametrize("python", _interpreters() or ["missing"])
def test_the_job_script_runs_on_the_oldest_and_newest_pythons(world: World, python: str) -> None:
    if python == "missing":
        pytest.skip("no other Python interpreter on this machine")
    spec = world.spec(
        "compat", "mkdir out; echo $SWEEP_INDEX > out/i.txt; cat dirty.txt", array=2, artifacts=("out/i.txt",)
    )
    job = spec.paths.launch_dir / "job.sh"
    for task in range(2):
        # task 1 as the local backend runs it: its scratch removed by a detached child (a fork on this Python)
        env = jobscript.wrapper_env(
            {"PATH": "/usr/bin:/bin"}, task=task, tmpdir=str(world.scratch), detach_cleanup=task == 1
        )
        done = subprocess.run(
            [python, "-W", "error", str(job)], env=env, capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
        assert (result(spec, task).code, text(spec, "stdout", task)) == (0, "measured as it is\n")
        assert (spec.task_dir(task) / "artifacts" / "out" / "i.txt").read_text() == f"{task}\n"
    scratch_gone(world.scratch)
    assert list(world.scratch.iterdir()) == []


def test_output_beyond_the_cap_is_dropped_and_said_so(world: World) -> None:
    spec = world.spec(
        "loud", "head -c 5000 /dev/zero | tr '\\0' x; echo; echo tail >&2", output_max_bytes=1000
    )

    async def go(b: L.LocalBackend) -> None:
        await b.submit(spec)
        await exits(b, 1)

    with_backend(go)
    out = text(spec, "stdout")
    assert out.startswith("x" * 1000)
    assert (
        out[1000:] == "\n[syscall-wrapper] output truncated: 4001 bytes beyond the cap of 1000 were dropped\n"
    )
    assert text(spec, "stderr") == "tail\n"
    assert result(spec).code == 0


def test_resubmitting_after_a_restart_never_runs_a_task_twice(world: World) -> None:
    spec = world.spec("twice", 'echo "run $SWEEP_INDEX"', array=2, concurrency=1)

    async def first(b: L.LocalBackend) -> None:
        await b.submit(spec)
        await exits(b, 2)

    with_backend(first)
    first_started = [text(spec, "started", t) for t in range(2)]

    async def again(b: L.LocalBackend) -> list[TaskExit]:
        await b.submit(spec)  # a restarted kernel re-dispatching the same sleep, without recover()
        return await exits(b, 2)

    done = with_backend(again)
    assert sorted(e.task for e in done) == [0, 1]
    assert [text(spec, "started", t) for t in range(2)] == first_started, "a task ran again"
    assert [text(spec, "stdout", t) for t in range(2)] == ["run 0\n", "run 1\n"]


def test_a_wrapper_that_cannot_start_ends_its_task_with_an_explanation(world: World) -> None:
    spec = world.spec("nopython", "true")

    async def go(b: L.LocalBackend) -> list[TaskExit]:
        await b.submit(spec)
        return await exits(b, 1)

    done = with_backend(go, python=str(world.root / "no-such-python"))
    assert [e.task for e in done] == [0]
    rec = result(spec)
    assert (rec.code, rec.kind) == (jobscript.EXIT_WRAPPER_ERROR, "wrapper_error")
    assert "could not be started" in (rec.detail or "")


@pytest.fixture
def small_world(tmp_path: Path) -> Iterator[World]:
    """A world whose run directory is a 16 MiB filesystem of its own (to be filled)."""
    with tmpfs(tmp_path / "runs", "16m"):
        w = make_world(tmp_path)
        yield w
        kill_leftovers(w.run_dir)


def test_recovery_on_a_full_disk_classifies_the_end_it_cannot_write(small_world: World) -> None:
    spec = small_world.spec("ghost", "true")
    tdir = spec.task_dir(0)
    L._write(spec.paths.launch_dir / L.SPEC_FILE, msgspec.json.encode(spec))
    L._write(tdir / L.PID_FILE, msgspec.json.encode(L.PidRecord(pid=None)))
    fill(small_world.run_dir / "filler")

    async def go(b: L.LocalBackend) -> tuple[L.Recovered, Any]:
        return await b.recover(small_world.run_dir), b.outcome_of(tdir)

    found, out = with_backend(go)
    assert [(r.key, r.task) for r in found.lost] == [(spec.key, 0)]
    assert jobscript.read_exit(tdir) is None  # no room for it
    assert out.state == "FAILED"
    assert out.hint.startswith("the run directory's disk is full: the task's exit record"), out.hint


def test_a_wrapper_killed_on_a_full_disk_still_leaves_its_exit_record(small_world: World) -> None:
    spec = small_world.spec("killed", f"touch {small_world.root}/running; sleep 60")
    tdir = spec.task_dir(0)

    async def go(b: L.LocalBackend) -> list[TaskExit]:
        await b.submit(spec)
        await wait_for(lambda: (small_world.root / "running").exists())
        fill(small_world.run_dir / "filler")
        rec = msgspec.json.decode((tdir / L.PID_FILE).read_bytes(), type=L.PidRecord)
        assert rec.pid is not None
        os.killpg(rec.pid, signal.SIGKILL)  # no exit-code from the wrapper: the backend writes one
        return await exits(b, 1)

    with_backend(go)
    rec = result(spec)  # written into the room the wrapper reserved before the job ran
    assert (rec.code, rec.kind) == (jobscript.EXIT_LOST, jobscript.KIND_LOST)
    assert "killed by SIGKILL" in (rec.detail or "")
    assert not (tdir / ".exit-code.reserve").exists()


def test_a_wrapper_that_stops_for_a_full_disk_without_a_record_ends_disk_full(world: World) -> None:
    """The wrapper's own exit status (EXIT_DISK_FULL) says the disk stopped it when it had no room left even for
    its exit record: the task is FAILED with the disk-full hint, not VANISHED "its wrapper was killed" (issue 24)."""
    spec = world.spec("full", "true")
    # Stands in for a wrapper that met a full disk before it could write anything: it exits as the real one does.
    (spec.paths.launch_dir / jobscript.NAMES.JOB_SCRIPT).write_text(
        f"import sys\nsys.exit({jobscript.EXIT_DISK_FULL})\n"
    )

    async def go(b: L.LocalBackend) -> Any:
        await b.submit(spec)
        await exits(b, 1)
        return b.outcome_of(spec.task_dir(0))

    out = with_backend(go)
    rec = result(spec)
    assert (rec.code, rec.kind) == (jobscript.EXIT_DISK_FULL, "disk_full"), rec
    assert out.state == "FAILED"
    assert out.hint.startswith("the run directory's disk is full"), out.hint
    assert "killed" not in out.hint


def test_a_success_whose_artifact_meets_a_full_disk_ends_disk_full(small_world: World) -> None:
    go = small_world.root / "go"
    spec = small_world.spec(
        "art",
        f"head -c 1048576 /dev/zero > out.bin; while [ ! -e {go} ]; do sleep 0.05; done",
        artifacts=("out.bin",),
    )
    tdir = spec.task_dir(0)

    async def run(b: L.LocalBackend) -> list[TaskExit]:
        await b.submit(spec)
        await wait_for(lambda: (tdir / "started").exists())
        fill(small_world.run_dir / "filler")  # after the wrapper reserved its record's room
        go.touch()
        return await exits(b, 1)

    with_backend(run)
    rec = result(spec)
    assert (rec.code, rec.kind, rec.command_code) == (jobscript.EXIT_DISK_FULL, "disk_full", 0)
    assert rec.detail == "the run directory's disk is full: the job's artifacts could not be stored"


def fill_inodes(where: Path) -> None:
    """Take every inode left on `where`'s filesystem (empty files: no data blocks are freed or needed)."""
    where.mkdir()
    with contextlib.suppress(OSError):
        for i in itertools.count():
            (where / str(i)).touch()


def test_a_task_that_cannot_be_claimed_on_a_full_disk_ends_disk_full_in_memory(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "runs", "16m,nr_inodes=4000"):
        w = make_world(tmp_path)
        try:
            _claim_on_a_full_disk(w)
        finally:
            kill_leftovers(w.run_dir)


def _claim_on_a_full_disk(w: World) -> None:
    go = w.root / "go"
    first = w.spec("first", f"while [ ! -e {go} ]; do sleep 0.05; done")
    second = w.spec("second", "echo never")

    async def run(b: L.LocalBackend) -> tuple[list[TaskExit], Any, Any]:
        await b.submit(first)
        await b.submit(second)  # queued behind `first` (max_parallel=1)
        await wait_for(lambda: (first.task_dir(0) / "started").exists())
        fill_inodes(
            w.run_dir / "filler"
        )  # no new file can be created: the claim of `second` cannot be written
        go.touch()
        done = await exits(b, 2)
        return done, b.outcome_of(first.task_dir(0)), b.outcome_of(second.task_dir(0))

    done, out1, out2 = with_backend(run, max_parallel=1)
    assert sorted(e.key for e in done) == sorted([first.key, second.key])
    assert out1.state == "COMPLETED"  # its record went into the room reserved before it ran
    assert jobscript.read_exit(second.task_dir(0)) is None  # no room for it: held by the backend
    assert out2.state == "FAILED"
    assert out2.hint.startswith(
        "the run directory's disk is full: the task's exit record (the task could not"
    )
    assert not (second.task_dir(0) / "started").exists()
    assert not list(second.task_dir(0).glob(".*.tmp")), "a temp file was left behind"
