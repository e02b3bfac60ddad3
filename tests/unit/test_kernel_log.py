"""The log: uncaught errors at crit through the logger, RFC 3339 times, JSON lines."""

from __future__ import annotations

import json
import re
import threading

import pytest

from kernel.io import log


def test_an_uncaught_thread_error_is_one_crit_line_with_its_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    old = threading.excepthook
    try:
        log.setup()

        def boom() -> None:
            raise RuntimeError("disk\nsaid no")

        t = threading.Thread(target=boom, name="worker-1")
        t.start()
        t.join()
    finally:
        threading.excepthook = old
    [line] = capsys.readouterr().err.splitlines()
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d CRITICAL event=crashed ", line)
    assert "where='thread worker-1'" in line
    assert "error='RuntimeError: disk\\nsaid no'" in line
    assert "in boom" in line


def test_under_journald_a_crit_line_carries_priority_2_and_json_stays_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:1")
    log.setup(log_format="json")
    log.crashed(ValueError("x"))
    log.event("answered", ws="w", id="a\nb", ms=1.5)
    crit, answered = capsys.readouterr().err.splitlines()
    assert crit.startswith("<2>{")
    assert json.loads(crit[3:])["event"] == "crashed"
    assert json.loads(answered[3:]) == {
        "level": "info",
        "event": "answered",
        "ws": "w",
        "id": "a\nb",
        "ms": 1.5,
    }
