"""The kernel's Prometheus metrics (served only with `metrics_listen`; docs/operator.md, Metrics).

One registry of this process, not prometheus-client's global one (no process/platform collectors mixed in).
Counters and histograms are incremented where things happen (the pipeline's answers and passes, the Slurm
backend's client calls); gauges of state (sleeps and tasks by state, budgets, channels with problems) are set from
the store every few seconds by the service (`refresh`), never read from the store at scrape time: the HTTP
thread touches nothing but these numbers.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kernel.io.store import Store

REGISTRY: Final = CollectorRegistry(auto_describe=True)
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
DEGRADED: Final = Gauge(
    P + "degraded",
    "1 while the kernel is degraded (store writes fail, heavy work overdue, enrollment waits for a hung filesystem)",
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


_seen: Final[dict[str, set[tuple[str, ...]]]] = {}


def set_exactly(name: str, gauge: Gauge, values: dict[tuple[str, ...], float]) -> None:
    """Set a labelled gauge to exactly `values`: label sets set before and now absent are removed."""
    for labels in _seen.get(name, set()) - set(values):
        gauge.remove(*labels)
    for labels, v in values.items():
        gauge.labels(*labels).set(v)
    _seen[name] = set(values)


def refresh(store: Store, degraded: bool) -> None:
    """Set the state gauges from the store (on the store's worker thread)."""
    sleeps, tasks = store.state_counts()
    set_exactly("sleeps", SLEEPS, {(k,): v for k, v in sleeps.items()})
    set_exactly("tasks", TASKS, {(k,): v for k, v in tasks.items()})
    rows = store.workspaces()
    budgets: dict[tuple[str, ...], float] = {}
    for r in rows:
        b = r.balance.to_message()
        budgets |= {
            (r.key, "launches"): b.launches,
            (r.key, "sleeps"): b.sleeps,
            (r.key, "gpu_hours"): b.gpu_hours,
        }
    set_exactly("budget", BUDGET_LEFT, budgets)
    WORKSPACES.set(len(rows))
    CHANNEL_PROBLEMS.set(sum(r.problem is not None for r in rows))
    DEGRADED.set(1 if degraded else 0)


def serve_http(listen: str) -> None:
    """Start the scrape endpoint (a daemon thread) on `host:port`; OSError when it cannot listen."""
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host.strip("[]"), registry=REGISTRY)
