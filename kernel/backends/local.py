"""The embedded local backend: runs job wrappers as child processes of the kernel (laptops, tests, the demo).

Each wrapper starts in its own session, so a kernel crash or restart does not take running jobs with it; the
backend records the wrapper's pid, the process start time and the boot id in `<task dir>/local.pid`, and the
JobSpec in `<launch dir>/local.json`, so a restarted kernel (`recover`) tells running tasks (adopts them) from
finished ones (exit-code present), from queued ones that never started (queued again), from lost ones (started,
gone without an exit-code: an exit-code saying so is written). A task never starts twice: its `local.pid` claim
is written before the spawn.

Concurrency: at most `max_parallel` wrappers at once, and at most `JobSpec.width` per launch; a wrapper leaves
as soon as its exit-code is written (`detach_cleanup`: a child of it removes the task's scratch), so its slot is
free then. Walltime: SIGUSR2
to the wrapper's process group (the wrapper records `timeout` and stops the jail), SIGKILL after the grace.
Cancel: SIGTERM likewise (`terminated`); queued tasks are finished at once as `cancelled`. Exits are noticed at
once through a pidfd; `wait_any_exit` hands them to the kernel.

A full disk (or any other failure to write in the run directory) never raises out of the service loop or
`recover`: an exit record the backend cannot write is held in memory (`disk_full` when the disk had no room) and
read by `outcome_of` like one on disk; a task whose claim cannot be written is not started and ends so. After a
restart such a task has no record and no live wrapper: it is classified `lost`, or `disk_full` when even that
cannot be written.

`run()` is the backend's service loop: start it in the kernel's task group; every watcher runs inside it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from kernel.backends import jobscript
from kernel.backends.base import Backend, BackendUnavailable, JobSpec, Recovered, TaskExit, TaskRef
from kernel.core import exits
from kernel.core.exits import Outcome
from kernel.io import hostproc

SPEC_FILE: Final = "local.json"
WRAPPER: Final = hostproc.declare(
    "local.wrapper",
    agent_input="the job's command and snapshot, which the wrapper runs only inside the configured jail",
    containment="the kernel's own interpreter (-I -S) runs the kernel-rendered job script in a new session, stdin "
    "/dev/null, output to the task's scheduler log; the wrapper jails the command and enforces its walltime",
)
PID_FILE: Final = "local.pid"
# A task whose wrapper could not be started (its end, unless a full disk explains it: jobscript.held_record).
EXIT_NOT_STARTED: Final = jobscript.EXIT_WRAPPER_ERROR
KIND_NOT_STARTED: Final = "wrapper_error"


class PidRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pid: int | None  # None: claimed, the spawn had not returned yet
    start_ticks: int | None = None
    boot_id: str | None = None
    deadline_wall: float | None = None  # time.time() at which the walltime ends


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def is_same_process(rec: PidRecord) -> bool:
    return (
        rec.pid is not None
        and rec.boot_id == boot_id()
        and rec.start_ticks is not None
        and proc_start_ticks(rec.pid) == rec.start_ticks
    )


def job_id(spec: JobSpec, task: int) -> str:
    return f"local-{spec.workspace}-{spec.seq}-{spec.launch}-{task}"


def _write(path: Path, data: bytes) -> None:
    """`path` replaced whole by `data`; a failed write (a full disk) leaves no temp file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _reap(pid: int) -> int | None:
    """The wait status of an exited child (its pidfd is readable, so this does not block); None if not ours."""
    with contextlib.suppress(ChildProcessError):
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return status
    return None


@dataclass
class _Proc:
    task: int
    pid: int
    pidfd: int
    deadline: float  # monotonic
    child: bool  # ours to reap
    kill_at: float = math.inf
    stop: str | None = None  # "timeout" | "cancelled"
    scope: anyio.CancelScope | None = None  # the watcher's current wait, cancelled to re-arm its timeout


@dataclass
class _Launch:
    spec: JobSpec
    pending: deque[int] = field(default_factory=deque)
    running: dict[int, _Proc] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


class LocalBackend:
    name = "local"

    def __init__(
        self,
        *,
        max_parallel: int | None = None,
        base_env: Mapping[str, str] | None = None,
        seconds_per_minute: float = 60.0,
        python: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`base_env` is what job wrappers may inherit from (only PATH, TMPDIR and the GPU list are taken from
        it); `seconds_per_minute` shortens walltimes for tests and the demo."""
        self.max_parallel = max_parallel or os.cpu_count() or 1
        self.seconds_per_minute = seconds_per_minute
        self.python = python or sys.executable
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._clock = clock
        self._launches: dict[str, _Launch] = {}
        self._order: list[str] = []  # launches in submission order (FIFO across launches)
        self._wake = anyio.Event()
        self._to_watch: list[tuple[_Launch, _Proc]] = []
        self._exits_in, self._exits_out = anyio.create_memory_object_stream[TaskExit](math.inf)
        self._tg: TaskGroup | None = None
        # Exit records that could not be written (a full disk), by task directory; read like those on disk.
        self._held: dict[Path, jobscript.ExitRecord] = {}

    # --- queries (sync: they do not block) ------------------------------------------------------------------

    @property
    def running_count(self) -> int:
        return sum(len(la.running) for la in self._launches.values())

    def running_tasks(self, key: str) -> list[int]:
        la = self._launches.get(key)
        return sorted(la.running) if la else []

    # --- the service loop -----------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                while True:
                    self._schedule()
                    for la, proc in self._to_watch:
                        tg.start_soon(self._watch, la, proc)
                    self._to_watch.clear()
                    await self._wake.wait()
                    self._wake = anyio.Event()
            finally:
                self._tg = None
                self._exits_in.close()
                self._exits_out.close()

    def _poke(self) -> None:
        self._wake.set()

    def _schedule(self) -> None:
        started = True
        while started and self.running_count < self.max_parallel:
            started = False
            for key in self._order:
                la = self._launches[key]
                if la.pending and len(la.running) < la.spec.width:
                    self._start(la, la.pending.popleft())
                    started = True
                    if self.running_count >= self.max_parallel:
                        return

    def _finish(self, la: _Launch, task: int, record: jobscript.ExitRecord) -> None:
        """End a task that will not run (or ran no wrapper) with `record`, at once."""
        tdir = la.spec.task_dir(task)
        self._record(tdir, record)
        la.finished.add(task)
        self._exits_in.send_nowait(TaskExit(key=la.spec.key, task=task, task_dir=os.fspath(tdir)))

    def _record(self, tdir: Path, record: jobscript.ExitRecord) -> None:
        """Write `record` as the task's exit record; one that cannot be written is held instead (see the module's
        note)."""
        try:
            jobscript.write_exit(tdir, record)
        except OSError as e:
            self._held[tdir] = jobscript.held_record(record, e)

    def _exit_of(self, tdir: Path) -> jobscript.ExitRecord | None:
        rec = jobscript.read_exit(tdir)
        return self._held.get(tdir) if rec is None else rec

    def _start(self, la: _Launch, task: int) -> None:
        spec = la.spec
        tdir = spec.task_dir(task)
        pid_path = tdir / PID_FILE
        try:
            tdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            # The claim comes before the spawn: a kernel dying in between leaves a task that is never run twice.
            _write(pid_path, msgspec.json.encode(PidRecord(pid=None)))
        except OSError as e:
            detail = f"the task could not be started: its run directory could not be written: {e}"
            self._finish(la, task, jobscript.ExitRecord(EXIT_NOT_STARTED, KIND_NOT_STARTED, detail=detail))
            return
        job_sh = spec.paths.launch_dir / jobscript.NAMES.JOB_SCRIPT
        out = os.fspath(tdir / jobscript.NAMES.SCHEDULER_OUT)
        # Jobs' scratch is the kernel's TMPDIR (the unit points it outside PrivateTmp=, which systemd empties when
        # the kernel stops while jobs go on running), unless the launch names its own.
        scratch = spec.scratch or self._base_env.get("TMPDIR") or None
        env = jobscript.wrapper_env(self._base_env, task=task, tmpdir=scratch, detach_cleanup=True)
        # The kernel's own interpreter runs the (stdlib-only) wrapper: no PATH lookup, no shim, no site import.
        try:
            pid = hostproc.spawn(
                WRAPPER,
                self.python,
                [self.python, "-I", "-S", os.fspath(job_sh)],
                env,
                setsid=True,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 1, out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
                    (os.POSIX_SPAWN_DUP2, 1, 2),
                ],
            )
        except OSError as e:
            # The world's fault (no interpreter, no file descriptors): the task ends, explained; the kernel serves on.
            detail = f"the job wrapper could not be started: {e}"
            self._finish(la, task, jobscript.ExitRecord(EXIT_NOT_STARTED, KIND_NOT_STARTED, detail=detail))
            return
        pidfd = os.pidfd_open(pid)
        walltime = spec.minutes * self.seconds_per_minute
        rec = PidRecord(
            pid=pid,
            start_ticks=proc_start_ticks(pid),
            boot_id=boot_id(),
            deadline_wall=time.time() + walltime,
        )
        # On a full disk the claim stays (the task is never run twice) and the pid is known from memory.
        with contextlib.suppress(OSError):
            _write(pid_path, msgspec.json.encode(rec))
        proc = _Proc(task=task, pid=pid, pidfd=pidfd, deadline=self._clock() + walltime, child=True)
        la.running[task] = proc
        self._to_watch.append((la, proc))

    async def _watch(self, la: _Launch, proc: _Proc) -> None:
        try:
            while True:
                timeout = min(proc.deadline, proc.kill_at) - self._clock()
                with anyio.move_on_after(max(timeout, 0.0)) as scope:
                    proc.scope = scope
                    await anyio.wait_readable(proc.pidfd)
                    break
                now = self._clock()
                if now >= proc.kill_at:
                    self._signal(proc, signal.SIGKILL)
                    proc.kill_at = math.inf
                elif now >= proc.deadline and proc.stop is None:
                    proc.stop = "timeout"
                    proc.deadline = math.inf
                    self._signal(proc, signal.SIGUSR2)
                    proc.kill_at = now + la.spec.kill_grace_s * 2 + 1.0
            status = _reap(proc.pid) if proc.child else None
        finally:
            os.close(proc.pidfd)
        tdir = la.spec.task_dir(proc.task)
        if jobscript.read_exit(tdir) is None:
            self._record(tdir, self._missing_exit(proc, status))
        del la.running[proc.task]
        la.finished.add(proc.task)
        self._exits_in.send_nowait(TaskExit(key=la.spec.key, task=proc.task, task_dir=os.fspath(tdir)))
        self._poke()

    @staticmethod
    def _missing_exit(proc: _Proc, status: int | None) -> jobscript.ExitRecord:
        detail = "the job wrapper ended without writing exit-code"
        disk_full = (
            status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == jobscript.EXIT_DISK_FULL
        )
        if status is not None and os.WIFSIGNALED(status):
            detail += f" (killed by {signal.Signals(os.WTERMSIG(status)).name})"
        elif disk_full:
            detail = (
                "the run directory's disk is full: the job wrapper stopped without room for its exit record"
            )
        if disk_full and proc.stop is None:
            # The wrapper's own exit status says what ended it: the disk, not something that killed it.
            rec = jobscript.ExitRecord(jobscript.EXIT_DISK_FULL, jobscript.KIND_DISK_FULL, detail=detail)
        elif proc.stop == "timeout":
            rec = jobscript.ExitRecord(jobscript.EXIT_TIMEOUT, "timeout", signal="SIGKILL", detail=detail)
        elif proc.stop == "cancelled":
            rec = jobscript.ExitRecord(
                jobscript.EXIT_TERMINATED, "terminated", signal="SIGKILL", detail=detail
            )
        else:
            rec = jobscript.ExitRecord(jobscript.EXIT_LOST, jobscript.KIND_LOST, detail=detail)
        return rec

    @staticmethod
    def _signal(proc: _Proc, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    # --- the Backend protocol -------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> list[TaskRef]:
        try:
            return self._submit(spec)
        except OSError as e:  # the run directory cannot be read or written: the world's, tried again later
            raise BackendUnavailable(f"submitting {spec.key}: {e}") from e

    def _submit(self, spec: JobSpec) -> list[TaskRef]:
        refs = [TaskRef(key=spec.key, task=t, job_id=job_id(spec, t)) for t in range(spec.array)]
        if spec.key in self._launches:
            return refs
        launch_dir = spec.paths.launch_dir
        if not (launch_dir / jobscript.NAMES.JOB_SCRIPT).is_file():
            raise FileNotFoundError(
                f"{launch_dir}: job.sh is missing; write it with kernel.backends.jobscript first"
            )
        if (launch_dir / SPEC_FILE).exists():
            # Submitted before a restart that skipped recover(): look before acting, never run a task twice.
            found: dict[str, list[TaskRef]] = {"running": [], "finished": [], "requeued": [], "lost": []}
            self._recover_launch(spec, found)
            for ref in found["finished"] + found["lost"]:
                tdir = os.fspath(spec.task_dir(ref.task))
                self._exits_in.send_nowait(TaskExit(key=spec.key, task=ref.task, task_dir=tdir))
            self._poke()
            return refs
        _write(launch_dir / SPEC_FILE, msgspec.json.encode(spec))
        self._add(spec, pending=range(spec.array))
        self._poke()
        return refs

    def _add(self, spec: JobSpec, pending: Sequence[int] = (), finished: Sequence[int] = ()) -> _Launch:
        la = _Launch(spec, pending=deque(pending), finished=set(finished))
        self._launches[spec.key] = la
        self._order.append(spec.key)
        return la

    async def cancel(self, key: str, tasks: Sequence[int] | None = None) -> list[TaskRef]:
        try:
            return self._cancel(key, tasks)
        except OSError as e:  # an exit record cannot be written: the world's, tried again later
            raise BackendUnavailable(f"cancelling {key}: {e}") from e

    def _cancel(self, key: str, tasks: Sequence[int] | None) -> list[TaskRef]:
        la = self._launches.get(key)
        if la is None:
            return []
        wanted = set(range(la.spec.array) if tasks is None else tasks)
        out: list[TaskRef] = []
        for t in [t for t in la.pending if t in wanted]:
            la.pending.remove(t)
            self._finish(
                la,
                t,
                jobscript.ExitRecord(
                    jobscript.EXIT_TERMINATED, jobscript.KIND_CANCELLED, detail="cancelled before it started"
                ),
            )
            out.append(TaskRef(key=key, task=t, job_id=job_id(la.spec, t)))
        for t, proc in la.running.items():
            if t in wanted and proc.stop is None:
                proc.stop = "cancelled"
                self._signal(proc, signal.SIGTERM)
                proc.kill_at = self._clock() + la.spec.kill_grace_s * 2 + 1.0
                if proc.scope is not None:
                    proc.scope.cancel()  # the watcher re-arms with the kill deadline
                out.append(TaskRef(key=key, task=t, job_id=job_id(la.spec, t)))
        self._poke()
        return out

    def outcome_of(self, task_dir: Path) -> Outcome | None:
        """The exit record (on disk, or held: see the module's note) read through the one table
        (kernel.core.exits); no scheduler adds to it."""
        rec = self._exit_of(task_dir)
        return None if rec is None else exits.outcome(rec.kind, rec.code, rec.signal, detail=rec.detail)

    def degraded(self) -> str | None:
        return None  # no scheduler to lose: the jobs are this kernel's children

    def hint_of(self, task_dir: Path) -> str | None:
        """The local backend adds nothing to what the exit record says."""
        return None

    async def wait_any_exit(self) -> TaskExit:
        return await self._exits_out.receive()

    async def recover(self, run_dir: Path) -> Recovered:
        """Adopt the launches recorded under `run_dir` that this backend does not know yet."""
        found: dict[str, list[TaskRef]] = {"running": [], "finished": [], "requeued": [], "lost": []}
        # A plain thread: the kernel's own run_dir on the kernel's disk (not agent-controlled; a hang there is
        # the kernel's own outage), read once at start-up.
        for spec_path in sorted(
            await anyio.to_thread.run_sync(lambda: list(run_dir.glob(f"*/*/*/{SPEC_FILE}")))
        ):
            spec = msgspec.json.decode(spec_path.read_bytes(), type=JobSpec)
            if spec.key not in self._launches:
                self._recover_launch(spec, found)
        self._poke()
        return Recovered(*(tuple(found[k]) for k in ("running", "finished", "requeued", "lost")))

    def _recover_launch(self, spec: JobSpec, found: dict[str, list[TaskRef]]) -> None:
        la = self._add(spec)
        for t in range(spec.array):
            ref = TaskRef(key=spec.key, task=t, job_id=job_id(spec, t))
            tdir = spec.task_dir(t)
            if jobscript.read_exit(tdir) is not None:
                la.finished.add(t)
                found["finished"].append(ref)
                continue
            try:
                rec: PidRecord | None = msgspec.json.decode((tdir / PID_FILE).read_bytes(), type=PidRecord)
            except FileNotFoundError:
                rec = None
            except (OSError, msgspec.DecodeError):  # a claim it cannot read may have started: never run twice
                rec = PidRecord(pid=None)
            if rec is None:
                la.pending.append(t)
                found["requeued"].append(ref)
            elif rec.pid is not None and is_same_process(rec) and (proc := self._adopt(rec, t)) is not None:
                la.running[t] = proc
                self._to_watch.append((la, proc))
                found["running"].append(ref)
            elif jobscript.read_exit(tdir) is not None:  # it finished while we looked
                la.finished.add(t)
                found["finished"].append(ref)
            else:
                self._record(
                    tdir,
                    jobscript.ExitRecord(
                        jobscript.EXIT_LOST,
                        jobscript.KIND_LOST,
                        detail="the job wrapper was gone without an exit-code when the kernel restarted",
                    ),
                )
                la.finished.add(t)
                found["lost"].append(ref)

    def _adopt(self, rec: PidRecord, task: int) -> _Proc | None:
        assert rec.pid is not None
        try:
            pidfd = os.pidfd_open(rec.pid)
        except ProcessLookupError:
            return None
        if not is_same_process(rec):  # the pid was reused between the check and the open
            os.close(pidfd)
            return None
        remaining = (rec.deadline_wall or math.inf) - time.time()
        # Our own child only if this process spawned it (a test dropping a backend); waitpid tells.
        return _Proc(task=task, pid=rec.pid, pidfd=pidfd, deadline=self._clock() + remaining, child=True)


if TYPE_CHECKING:  # mypy checks that LocalBackend is a Backend
    _conforms: Backend = LocalBackend()
