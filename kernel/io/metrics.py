"""The kernel's Prometheus metrics (served only with `metrics_listen`; docs/operator.md, Metrics).

One registry of this process, not prometheus-client's global one, with the standard collectors registered on it
(`process_*` from /proc/self: CPU, memory, open fds, start time; `python_info`; `python_gc_*`), so that the usual
process dashboards and alerts work on the kernel too.
Counters and histograms are incremented where things happen (the pipeline's answers and passes, the Slurm
backend's client calls); gauges of state (sleeps and tasks by state, budgets, channels with problems) are set from
the store every few seconds by the service (`refresh`), never read from the store at scrape time: the HTTP
thread touches nothing but these numbers.
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
from pathlib import Path
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from channel import release
from kernel.io.store import Store

REGISTRY: Final = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)
P: Final = "syscall_kernel_"

REQUESTS: Final = Counter(
    P + "requests", "Requests answered, by verb and outcome", ["verb", "outcome"], registry=REGISTRY
)
ANSWER_SECONDS: Final = Histogram(
    P + "answer_seconds",
    "From reading a request to its answer in place (sleeps: to the accepted answer)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
PASS_SECONDS: Final = Histogram(
    P + "pass_seconds",
    "Duration of one pipeline pass",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
    registry=REGISTRY,
)
SCHEDULER_CALLS: Final = Counter(
    P + "scheduler_calls",
    "Slurm client calls, by client and outcome (ok, failed)",
    ["call", "outcome"],
    registry=REGISTRY,
)
POLL_LOOKS: Final = Counter(
    P + "poll_looks",
    "Looks at polled channels (one stat of requests/), by outcome (unchanged, listed: changed, racy or new)",
    ["outcome"],
    registry=REGISTRY,
)
RESCAN_LOOKS: Final = Counter(
    P + "rescan_looks",
    "The rescan's looks at served channels (an lstat of requests/ and of kernel.json), by outcome (unchanged, "
    "checked: listed in full and its owner read, as the evidence was new, changed or not confirmed yet)",
    ["outcome"],
    registry=REGISTRY,
)
SLEEPS: Final = Gauge(P + "sleeps", "Sleeps in the store, by state", ["state"], registry=REGISTRY)
TASKS: Final = Gauge(P + "tasks", "Tasks in the store, by state", ["state"], registry=REGISTRY)
BUDGET_LEFT: Final = Gauge(
    P + "budget_left",
    "What each workspace may still spend (kind: launches, sleeps, gpu_hours)",
    ["workspace", "kind"],
    registry=REGISTRY,
)
WORKSPACES: Final = Gauge(P + "workspaces", "Enrolled workspaces", registry=REGISTRY)
CHANNEL_PROBLEMS: Final = Gauge(
    P + "channels_with_problems",
    "Enrolled workspaces whose channel has a recorded problem",
    registry=REGISTRY,
)
BUILD_INFO: Final = Gauge(
    P + "build_info",
    "Always 1: the running kernel's release (version) and the commit it was built from",
    ["version", "commit"],
    registry=REGISTRY,
)
BUILD_INFO.labels(version=release.VERSION, commit=release.COMMIT or "unknown").set(1)
SLURM_OUTAGE_SINCE: Final = Gauge(
    P + "slurm_outage_since_seconds",
    "Unix time the Slurm outage in progress began (its clients' last success before they failed); 0: none",
    registry=REGISTRY,
)
DEGRADED: Final = Gauge(
    P + "degraded",
    "1 while the kernel is degraded (store writes fail, heavy work overdue, enrollment waits for a hung filesystem, "
    "Slurm unreachable)",
    registry=REGISTRY,
)


def verb_of(outcome: str) -> tuple[str, str]:
    """(verb, outcome) labels from the pipeline's outcome word: `accepted` is a sleep answered, `cancelled` a
    cancel, `rejected:<code>` a refusal whose code names the area (the verb is not known for undecodable
    requests: `request`)."""
    if outcome.startswith("rejected:"):
        code = outcome.split(":", 1)[1]
        area = code.split(".", 1)[0]
        return (area if area in ("sleep", "cancel", "status", "queue", "history") else "request", "rejected")
    return {
        "accepted": ("sleep", "accepted"),
        "cancelled": ("cancel", "cancelled"),
        "replayed": ("any", "replayed"),
    }.get(outcome, (outcome, "answered"))


def answered(outcome: str, seconds: float) -> None:
    verb, result = verb_of(outcome)
    REQUESTS.labels(verb=verb, outcome=result).inc()
    ANSWER_SECONDS.observe(seconds)


_set: Final[dict[str, dict[tuple[str, ...], float]]] = {}


def set_exactly(name: str, gauge: Gauge, values: dict[tuple[str, ...], float]) -> None:
    """Set a labelled gauge to exactly `values`: label sets set before and now absent are removed, and only the
    values that changed are set (at 10,000 workspaces, 30,000 budget gauges at each refresh)."""
    before = _set.get(name, {})
    for labels in before.keys() - values.keys():
        gauge.remove(*labels)
    for labels, v in values.items():
        if before.get(labels) != v:
            gauge.labels(*labels).set(v)
    _set[name] = values


# The store, and its (changes by this connection, changes by others), at the last refresh: the same means the
# same figures (10,000 workspaces' balances are not read again every few seconds when nothing changed).
_refreshed_at: list[tuple[int, str, int, int]] = []


def refresh(store: Store, degraded: bool) -> None:
    """Set the state gauges from the store (on the store's worker thread)."""
    DEGRADED.set(1 if degraded else 0)
    version = (id(store), str(store.path), store.changes(), store.data_version())
    if _refreshed_at == [version]:
        return
    _refreshed_at[:] = [version]
    sleeps, tasks = store.state_counts()
    set_exactly("sleeps", SLEEPS, {(k,): v for k, v in sleeps.items()})
    set_exactly("tasks", TASKS, {(k,): v for k, v in tasks.items()})
    balances = store.balances()
    budgets: dict[tuple[str, ...], float] = {}
    for key, balance, _ in balances:
        b = balance.to_message()
        budgets[(key, "launches")] = b.launches
        budgets[(key, "sleeps")] = b.sleeps
        budgets[(key, "gpu_hours")] = b.gpu_hours
    set_exactly("budget", BUDGET_LEFT, budgets)
    WORKSPACES.set(len(balances))
    CHANNEL_PROBLEMS.set(sum(problem for _, _, problem in balances))


def serve_http(listen: str) -> None:
    """Start the scrape endpoint (a daemon thread) on `host:port`; OSError when it cannot listen."""
    host, port = _address(listen)
    start_http_server(port, addr=host, registry=REGISTRY)


def _address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def bind_problem(listen: str) -> str | None:
    """Why `serve_http(listen)` would fail now (the address in use, and by whom: `listener`), or None when a
    socket binds it as the endpoint's does (the family getaddrinfo gives first, SO_REUSEADDR). Binds and closes."""
    host, port = _address(listen)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"{listen} is in use by {listener(port)}"
        return f"{listen} cannot be bound: {exc.strerror or exc}"
    return None


_PROC: Final = Path("/proc")


def listening_sockets(port: int) -> list[tuple[int, int]]:
    """(uid, inode) of each TCP socket listening on `port` in this network namespace (/proc/net/tcp, tcp6)."""
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.append((int(f[7]), int(f[9])))
    return found


def socket_pids(inode: int) -> list[int]:
    """The processes holding socket `inode` open, among those whose fds this user may read."""
    target = f"socket:[{inode}]"
    pids = []
    for proc in _PROC.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = os.listdir(proc / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(proc / "fd" / fd) == target:
                    pids.append(int(proc.name))
                    break
            except OSError:
                continue
    return pids


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _command(pid: int) -> str:
    try:
        argv = (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(a.decode("utf-8", "replace") for a in argv if a)[:200]
    return "".join(c if c.isprintable() else "?" for c in text) or "?"


def listener(port: int) -> str:
    """Who listens on TCP `port`: the user, and the process with its command line where this user can see it."""
    sockets = listening_sockets(port)
    if not sockets:
        return "another socket (its owner is not listed in /proc/net/tcp here)"
    parts = []
    for uid, inode in sockets:
        pids = socket_pids(inode)
        who = ", ".join(f"pid {p} ({_command(p)})" for p in pids) or "a process this user cannot see"
        parts.append(f"{_user(uid)}, {who}")
    return "; ".join(dict.fromkeys(parts))
