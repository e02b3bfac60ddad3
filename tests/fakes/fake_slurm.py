"""A fake Slurm: `sbatch`, `squeue`, `sacct` and `scancel` as small programs on PATH, backed by one JSON file.

For fast unit tests of the backend's logic and for bench/scheduler_load.py, which counts how often each client is
invoked; the REAL Slurm (scripts/slurm-cluster) stays the reference, and tests/integration/test_slurm_cluster.py
checks that this fake's output reads the same through kernel.backends.slurm's parsers. Jobs never run by themselves: a test
moves them with `set_state`, drops them from the queue with `purge` (as MinJobAge does) and injects failures
with `fail_next`. It mimics the quirks the kernel must handle: the single-unknown-id exit 1 of `squeue -j`,
`CANCELLED by <uid>`, banners before `sbatch --parsable`, `id;cluster`, and `sacct` on a cluster without
accounting.

    fake = FakeSlurm(tmp_path, accounting=False)
    subprocess.run(["sbatch", "--parsable", "--array=0-3%2", script], env=fake.env())
    fake.set_state("100", 0, "RUNNING"); fake.calls()  # {"sbatch": 1}

Run as a program, this file is the fake client itself: `fake_slurm.py CMD STATE_FILE ARGS...`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

COMMANDS = ("sbatch", "squeue", "sacct", "scancel")
ACTIVE = {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "REQUEUED"}
SACCT_FIELDS = {"JobIDRaw", "JobID", "State", "ExitCode", "Elapsed", "Start", "End", "NodeList"}
SINGLE = "-"  # task key of a job that is not an array

State = dict[str, Any]


# --- the state file --------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked_state(path: Path) -> Iterator[State]:
    """Read-modify-write the state under an exclusive lock (clients may run concurrently)."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state: State = json.loads(path.read_text())
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)


def _new_state(accounting: bool, banner: str, cluster: str | None, first_id: int) -> State:
    return {
        "next_id": first_id,
        "jobs": {},
        "calls": dict.fromkeys(COMMANDS, 0),
        "last_args": {},
        "log": [],
        "failures": {c: [] for c in COMMANDS},
        "accounting": accounting,
        "banner": banner,
        "cluster": cluster,
        "uid": os.getuid(),
    }


class FakeSlurm:
    """The test-side handle: installs the clients into `root/bin` and reads or moves the fake's state."""

    def __init__(
        self,
        root: Path,
        *,
        accounting: bool = False,
        banner: str = "",
        cluster: str | None = None,
        first_id: int = 100,
    ) -> None:
        self.root = root
        self.bin = root / "bin"
        self.state_file = root / "fake-slurm.json"
        self.bin.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(_new_state(accounting, banner, cluster, first_id)))
        me = Path(__file__).resolve()
        for cmd in COMMANDS:
            shim = self.bin / cmd
            shim.write_text(
                "#!/bin/sh\n"
                f"exec {shlex.quote(sys.executable)} {shlex.quote(str(me))} {cmd} "
                f'{shlex.quote(str(self.state_file))} "$@"\n'
            )
            shim.chmod(0o755)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env.pop("SLURM_CONF", None)
        return env

    def state(self) -> State:
        with locked_state(self.state_file) as s:
            return s

    def calls(self) -> dict[str, int]:
        return dict(self.state()["calls"])

    def call_log(self) -> list[tuple[float, str]]:
        return [(t, c) for t, c in self.state()["log"]]

    def set_state(
        self,
        job_id: str,
        task: int | None,
        state: str,
        *,
        exit_code: str = "0:0",
        reason: str = "None",
        cancelled_by: int | None = None,
    ) -> None:
        """Move one task (task None = a job that is not an array) to `state`."""
        with locked_state(self.state_file) as s:
            t = _task(s, job_id, task)
            _move(s, s["jobs"][job_id], t, state, exit_code, reason, cancelled_by)

    def set_states(self, moves: list[tuple[str, int | None, str]], *, exit_code: str = "0:0") -> None:
        """Move many tasks at once (one state rewrite, for load benchmarks): (job id, task, state) each."""
        with locked_state(self.state_file) as s:
            for job_id, task, state in moves:
                _move(s, s["jobs"][job_id], _task(s, job_id, task), state, exit_code, "None", None)

    def purge(self, job_id: str) -> None:
        """Drop a job from the queue (MinJobAge passed); accounting, if enabled, still has it."""
        with locked_state(self.state_file) as s:
            s["jobs"][job_id]["purged"] = True

    def fail_next(
        self,
        cmd: str,
        rc: int,
        stderr: str = "",
        stdout: str = "",
        *,
        act: bool = False,
        delay: float = 0.0,
    ) -> None:
        """The next `cmd` exits `rc` with this output; `act` does the work first (an sbatch that timed out after
        Slurm created the job); `delay` seconds pass before it answers (a controller that does not respond)."""
        with locked_state(self.state_file) as s:
            s["failures"][cmd].append(
                {"rc": rc, "stderr": stderr, "stdout": stdout, "act": act, "delay": delay}
            )

    def last_args(self, cmd: str) -> list[str]:
        """The arguments of the latest `cmd` invocation."""
        args: list[str] = self.state()["last_args"].get(cmd, [])
        return args

    def add_jobs(self, count: int, *, array: int = 1, name_prefix: str = "bench") -> list[str]:
        """Create `count` pending jobs at once, without `count` sbatch invocations (for load benchmarks)."""
        with locked_state(self.state_file) as s:
            return [
                _create(s, f"{name_prefix}-{i}", list(range(array)) if array > 1 else None, None, False)
                for i in range(count)
            ]


def _task(s: State, job_id: str, task: int | None) -> dict[str, Any]:
    job = s["jobs"].get(job_id)
    if job is None:
        raise KeyError(f"fake slurm has no job {job_id}")
    key = SINGLE if task is None else str(task)
    if key not in job["tasks"]:
        raise KeyError(f"fake slurm job {job_id} has no task {key}")
    t: dict[str, Any] = job["tasks"][key]
    return t


def _move(
    s: State,
    job: dict[str, Any],
    t: dict[str, Any],
    state: str,
    exit_code: str,
    reason: str,
    cancelled_by: int | None,
) -> None:
    now = time.time()
    if t["state"] == "PENDING" and state != "PENDING":
        if job["array"] is not None:
            # A task split off a pending array gets its own job id, as in Slurm.
            t["own_id"] = str(s["next_id"])
            s["next_id"] += 1
        t["start"] = now
    t["state"] = state
    t["reason"] = reason
    t["exit"] = exit_code
    t["cancelled_by"] = cancelled_by
    if state not in ACTIVE:
        t["end"] = now


def _create(s: State, name: str, array: list[int] | None, throttle: int | None, held: bool) -> str:
    job_id = str(s["next_id"])
    s["next_id"] += 1
    keys = [SINGLE] if array is None else [str(k) for k in array]
    s["jobs"][job_id] = {
        "name": name,
        "array": array,
        "throttle": throttle,
        "submit": time.time(),
        "purged": False,
        "tasks": {
            k: {
                "own_id": job_id,
                "state": "PENDING",
                "reason": "JobHeldUser" if held else "None",
                "exit": "0:0",
                "start": None,
                "end": None,
                "cancelled_by": None,
            }
            for k in keys
        },
    }
    return job_id


# --- the clients -----------------------------------------------------------------------------------------


class Result:
    def __init__(self, rc: int = 0, stdout: str = "", stderr: str = "") -> None:
        self.rc, self.stdout, self.stderr = rc, stdout, stderr


# Options that take a separate value, per client (`-n` is --name for squeue but --noheader for sacct).
VALUED = {
    "sbatch": {"-J", "-a", "-t", "-p", "-A", "-q", "-o", "-e", "-D", "-c", "-N", "-n"},
    "squeue": {"-j", "-o", "-t", "-n", "-u", "-M", "-p", "--name", "--jobs", "--format", "--states"},
    "sacct": {"-j", "-o", "-S", "-E", "-M", "-s", "--jobs", "--format", "--starttime", "--endtime"},
    "scancel": {"-n", "-u", "-s", "-t", "-M", "--name", "--signal", "--state", "--user"},
}


def _opts(args: list[str], cmd: str) -> tuple[dict[str, str], list[str]]:
    """`--k=v`, `--k v`, `-k v` and bare flags, enough for the argv the kernel renders."""
    flags_with_values = VALUED[cmd]
    opts: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            opts[k] = v
        elif a in flags_with_values and i + 1 < len(args):
            opts[a] = args[i + 1]
            i += 1
        elif a.startswith("-"):
            opts[a] = ""
        else:
            rest.append(a)
        i += 1
    return opts, rest


def _ranges(values: list[int]) -> str:
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def _elapsed(t: dict[str, Any]) -> str:
    if t["start"] is None:
        return "00:00:00"
    secs = int((t["end"] or time.time()) - t["start"])
    days, rem = divmod(secs, 86400)
    hms = f"{rem // 3600:02d}:{rem % 3600 // 60:02d}:{rem % 60:02d}"
    return f"{days}-{hms}" if days else hms


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch)) if epoch else "Unknown"


def sbatch(s: State, args: list[str]) -> Result:
    opts, rest = _opts(args, "sbatch")
    script = rest[0] if rest else None
    if script is None and "--wrap" not in opts:
        return Result(1, stderr="sbatch: error: Batch job submission failed: no script and no --wrap\n")
    if script is not None and not Path(script).is_file():
        return Result(1, stderr=f"sbatch: error: Unable to open file {script}\n")
    array: list[int] | None = None
    throttle: int | None = None
    if "--array" in opts:
        spec, _, k = opts["--array"].partition("%")
        lo, _, hi = spec.partition("-")
        array = list(range(int(lo), int(hi or lo) + 1))
        throttle = int(k) if k else None
    job_id = _create(s, opts.get("--job-name", "sbatch"), array, throttle, "--hold" in opts)
    s["jobs"][job_id]["workdir"] = opts.get("--chdir", opts.get("-D", os.getcwd()))
    if "--parsable" not in opts:
        return Result(0, stdout=f"Submitted batch job {job_id}\n")
    banner = s["banner"] + "\n" if s["banner"] else ""
    suffix = f";{s['cluster']}" if s["cluster"] else ""
    return Result(0, stdout=f"{banner}{job_id}{suffix}\n")


def _wanted(
    s: State, spec: str | None, include_purged: bool = False
) -> tuple[list[tuple[str, str | None]], list[str]]:
    """(job id, task key or None for all) pairs named by a `-j` list, and the names that are unknown."""
    if spec is None:
        return [(j, None) for j in s["jobs"]], []
    found: list[tuple[str, str | None]] = []
    unknown: list[str] = []
    for item in spec.split(","):
        base, _, task = item.partition("_")
        job = s["jobs"].get(base)
        if job is None or (job["purged"] and not include_purged) or (task and task not in job["tasks"]):
            unknown.append(item)
        else:
            found.append((base, task or None))
    return found, unknown


def squeue(s: State, args: list[str]) -> Result:
    opts, _ = _opts(args, "squeue")
    fmt = opts.get("-o", opts.get("--format", "%i|%T"))
    spec = opts.get("-j", opts.get("--jobs"))
    found, unknown = _wanted(s, spec)
    if spec is not None and unknown and not found and len(spec.split(",")) == 1:
        return Result(1, stderr="slurm_load_jobs error: Invalid job id specified\n")
    name = opts.get("--name", opts.get("-n"))
    all_states = opts.get("-t", "").lower() == "all"
    split = "-r" in opts or "--array" in opts
    lines: list[str] = [] if "-h" in opts or "--noheader" in opts else [fmt.replace("%", "")]
    for job_id, only in found:
        job = s["jobs"][job_id]
        if job["purged"] or (name is not None and job["name"] not in name.split(",")):
            continue
        tasks = [(k, t) for k, t in job["tasks"].items() if (only is None or k == only)]
        tasks = [(k, t) for k, t in tasks if all_states or t["state"] in ACTIVE]
        pending = [
            int(k) for k, t in tasks if k != SINGLE and t["state"] == "PENDING" and t["own_id"] == job_id
        ]
        if pending and not split:
            throttle = f"%{job['throttle']}" if job["throttle"] else ""
            r = f"{_ranges(sorted(pending))}{throttle}"
            reason = tasks[0][1]["reason"]
            where = job.get("workdir", "")
            lines.append(
                _row(fmt, f"{job_id}_[{r}]", job_id, job_id, r, "PENDING", reason, job["name"], where)
            )
            tasks = [(k, t) for k, t in tasks if k == SINGLE or int(k) not in pending]
        for k, t in tasks:
            shown = job_id if k == SINGLE else f"{job_id}_{k}"
            lines.append(
                _row(
                    fmt,
                    shown,
                    t["own_id"],
                    job_id,
                    "N/A" if k == SINGLE else k,
                    t["state"],
                    t["reason"],
                    job["name"],
                    job.get("workdir", ""),
                )
            )
    stderr = "slurm_load_jobs error: Invalid job id specified\n" if unknown and not found else ""
    return Result(0, stdout="".join(f"{line}\n" for line in lines), stderr=stderr)


def _row(
    fmt: str, i: str, a: str, f: str, k: str, state: str, reason: str, name: str = "", workdir: str = ""
) -> str:
    out = fmt
    for token, value in (("%i", i), ("%A", a), ("%F", f), ("%K", k), ("%T", state), ("%r", reason)):
        out = out.replace(token, value)
    return out.replace("%j", name).replace("%Z", workdir)


def sacct(s: State, args: list[str]) -> Result:
    if not s["accounting"]:
        return Result(1, stderr="Slurm accounting storage is disabled\n")
    opts, _ = _opts(args, "sacct")
    fields = opts.get("-o", opts.get("--format", "JobID,State,ExitCode")).split(",")
    bad = [f for f in fields if f not in SACCT_FIELDS]
    if bad:
        return Result(1, stderr=f"sacct: error: Invalid field requested: {bad[0]}\n")
    found, _ = _wanted(s, opts.get("-j"), include_purged=True)
    lines: list[str] = []
    for job_id, only in found:
        job = s["jobs"][job_id]
        for k, t in job["tasks"].items():
            if only is not None and k != only:
                continue
            state = t["state"]
            if state == "CANCELLED" and t["cancelled_by"] is not None:
                state = f"CANCELLED by {t['cancelled_by']}"
            values = {
                "JobIDRaw": t["own_id"],
                "JobID": job_id if k == SINGLE else f"{job_id}_{k}",
                "State": state,
                "ExitCode": t["exit"],
                "Elapsed": _elapsed(t),
                "Start": _when(t["start"]),
                "End": _when(t["end"]),
                "NodeList": "fake1" if t["start"] else "None assigned",
            }
            lines.append("|".join(values[f] for f in fields))
    return Result(0, stdout="".join(f"{line}\n" for line in lines))


def scancel(s: State, args: list[str]) -> Result:
    _, ids = _opts(args, "scancel")
    errors: list[str] = []
    for item in ids:
        base, _, task = item.partition("_")
        job = s["jobs"].get(base)
        if job is None or job["purged"]:
            errors.append(f"scancel: error: Kill job error on job id {item}: Invalid job id specified\n")
            continue
        keys = list(job["tasks"]) if not task else _ranges_back(task)
        for k in keys:
            t = job["tasks"].get(k)
            if t is not None and t["state"] in ACTIVE:
                _move(s, job, t, "CANCELLED", "0:15", t["reason"], s["uid"])
    return Result(1 if errors else 0, stderr="".join(errors))


def _ranges_back(task: str) -> list[str]:
    body = task.strip("[]").split("%", 1)[0]
    out: list[str] = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        out.extend(str(v) for v in range(int(lo), int(hi or lo) + 1))
    return out


HANDLERS = {"sbatch": sbatch, "squeue": squeue, "sacct": sacct, "scancel": scancel}


def main(argv: list[str]) -> int:
    cmd, state_file, args = argv[0], Path(argv[1]), argv[2:]
    with locked_state(state_file) as s:
        s["calls"][cmd] += 1
        s["log"].append([time.time(), cmd])
        s.setdefault("last_args", {})[cmd] = args
        failure = s["failures"][cmd].pop(0) if s["failures"][cmd] else None
        result = HANDLERS[cmd](s, args) if failure is None or failure["act"] else Result()
    if failure is not None:
        time.sleep(failure.get("delay", 0.0))
        result = Result(failure["rc"], failure["stdout"], failure["stderr"])
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
