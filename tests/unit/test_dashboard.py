"""The shipped Grafana dashboard (deploy/grafana/syscall-kernel.json) queries only metrics the kernel exports: the
metric names of every PromQL expression (panel targets and template variables) are parsed out and looked up in
the kernel's registry (kernel.io.metrics.REGISTRY, with its standard collectors), and it covers what an operator
watches: requests, latency, sleeps by state, budget left, Slurm health, degraded."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from testenv import ROOT

from kernel.io.metrics import REGISTRY

DASHBOARD = ROOT / "deploy" / "grafana" / "syscall-kernel.json"

# PromQL words that are not metric names where an identifier may stand.
KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"inf", "nan", "Inf", "NaN"}
)
# Series names each metric type exposes, by suffix (OpenMetrics/Prometheus text format as prometheus-client writes).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
_TOKEN = re.compile(
    r"(?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)|(?P<id>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?"
)


def exported() -> set[str]:
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not function calls, keywords, label
    names (in `{...}` matchers or `by (...)` lists), durations (`[...]`, `offset 1h`), strings or Grafana
    variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\$\{?\w+\}?", "", e)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\boffset\s+-?[0-9a-z]+", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    found = set()
    for m in _TOKEN.finditer(e):
        if m.group("id") and not m.group("call") and m.group("id") not in KEYWORDS:
            found.add(m.group("id"))
    return found


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL string of the dashboard: targets' `expr`, and query variables (`label_values(metric, l)`)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str):
                yield v
            elif k == "definition" and isinstance(v, str):
                m = re.fullmatch(r"label_values\((.*),\s*\w+\)", v)
                assert m, v
                yield m.group(1)
            else:
                yield from expressions(v)
    elif isinstance(node, list):
        for v in node:
            yield from expressions(v)


def test_the_parser_finds_metric_names_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, verb) (rate(syscall_kernel_answer_seconds_bucket{instance=~"$x",'
        'le!="+Inf"}[$__rate_interval]))) / clamp_min(sum(rate(x_total[5m] offset 1h)), 1e-9) > bool 0'
    )
    assert metric_names(expr) == {"syscall_kernel_answer_seconds_bucket", "x_total"}
    assert metric_names("time() - max(process_start_time_seconds)") == {"process_start_time_seconds"}
    assert metric_names('syscall_kernel_nope{kind="gpu_hours"} and on (workspace) up') == {
        "syscall_kernel_nope",
        "up",
    }


def test_the_registry_names_are_the_exposed_ones() -> None:
    names = exported()
    assert {"syscall_kernel_requests_total", "syscall_kernel_answer_seconds_bucket"} <= names
    assert {"process_cpu_seconds_total", "process_open_fds", "syscall_kernel_degraded"} <= names
    assert "syscall_kernel_requests" not in names  # a counter's series carries _total


def test_every_dashboard_expression_names_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = list(expressions(dash))
    assert len(exprs) >= 10
    names = exported()
    used: set[str] = set()
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
        got = metric_names(expr)
        assert got, f"{expr!r} names no metric"
        unknown = got - names
        assert not unknown, f"{expr!r} names {sorted(unknown)}, which the kernel does not export"
        used |= got
    watched = {
        "syscall_kernel_requests_total",  # requests
        "syscall_kernel_answer_seconds_bucket",  # latency
        "syscall_kernel_sleeps",  # sleeps by state
        "syscall_kernel_budget_left",  # budget left
        "syscall_kernel_scheduler_calls_total",  # Slurm health
        "syscall_kernel_degraded",
        "syscall_kernel_slurm_outage_since_seconds",  # how long the controller has been down
        "syscall_kernel_build_info",  # which release runs
    }
    assert watched <= used, sorted(watched - used)


@pytest.mark.parametrize("key", ["title", "uid", "panels", "templating"])
def test_the_dashboard_is_an_importable_grafana_dashboard(key: str) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash[key]
    assert all("datasource" in p for p in dash["panels"] if p["type"] != "row")
