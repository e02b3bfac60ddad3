"""docs/operator.md lists every log event the kernel writes (issue 12: an operator greps for what they saw)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `log.event("name", ...)`, and the serve core's `Log("name", ...)` actions (kernel.core.serving), which the service
# logs as they are.
EVENT_CALL = re.compile(r"\b(?:event|Log)\(\s*\"([a-z_]+)\"")


def kernel_events() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "kernel").rglob("*.py"):
        found |= set(EVENT_CALL.findall(path.read_text()))
    return found


def test_every_log_event_is_in_the_operator_guide() -> None:
    events = kernel_events()
    assert len(events) > 40, sorted(events)
    docs = (ROOT / "docs" / "operator.md").read_text()
    missing = sorted(e for e in events if f"`{e}`" not in docs)
    assert not missing, f"docs/operator.md does not list these log events: {missing}"
