"""One log line per event, as `event=<name> ws=<workspace> id=<request> key=value ...`, or (`log_format =
"json"`) as one JSON object per line: `{"time", "level", "event", <fields>}`.

Values written by agents (ids are already validated; names, reasons) are escaped and capped, so a hostile name
cannot forge a log line (JSON escapes them by itself). Outside systemd each line starts with an RFC 3339 time with
the local zone's offset (`2026-11-30T16:40:01.123+00:00`). Under systemd (`$JOURNAL_STREAM` set) each line
carries a `<N>` syslog priority prefix for journald and no time of its own (journald adds it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import traceback
from datetime import datetime
from typing import Final

log: Final = logging.getLogger("syscall-kernel")

_PRIORITY: Final = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}
_PLAIN: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@+,")


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at).astimezone().isoformat(timespec="milliseconds")


class _Formatter(logging.Formatter):
    def __init__(self, *, journal: bool, as_json: bool) -> None:
        super().__init__()
        self.journal = journal
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        name = getattr(record, "event_name", None)
        fields: dict[str, object] = getattr(record, "event_fields", {})
        level = record.levelname.lower()
        if self.as_json:
            body: dict[str, object] = {} if self.journal else {"time": rfc3339(record.created)}
            body |= {"level": level, "event": name or "message"}
            body |= {k: v if isinstance(v, int | float | bool) else str(v) for k, v in fields.items()}
            if name is None:
                body["message"] = record.getMessage()
            line = json.dumps(body, ensure_ascii=True)
        else:
            line = record.getMessage()
            if not self.journal:
                line = f"{rfc3339(record.created)} {record.levelname} {line}"
        return f"<{_PRIORITY.get(record.levelno, 6)}>{line}" if self.journal else line


def setup(level: int = logging.INFO, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _Formatter(journal=bool(os.environ.get("JOURNAL_STREAM")), as_json=log_format == "json")
    )
    log.handlers[:] = [handler]
    threading.excepthook = _thread_hook
    log.setLevel(level)
    log.propagate = False


class Whole(str):
    """A value kept whole up to 8,000 characters (a traceback, a refusal whose advice comes last), escaped like
    every other; plain values are cut at 200."""


def crashed(exc: BaseException, where: str = "main") -> None:
    """An error nothing handled: one `crashed` line at crit with the whole traceback (escaped, one line)."""
    event(
        "crashed",
        logging.CRITICAL,
        where=where,
        error=f"{type(exc).__name__}: {exc}",
        traceback=Whole("".join(traceback.format_exception(exc))),
    )


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        crashed(args.exc_value, where=f"thread {args.thread.name if args.thread else '?'}")


def value(v: object) -> str:
    text = str(v)
    if text and len(text) <= 200 and all(c in _PLAIN for c in text):
        return text
    cap = 8000 if isinstance(v, Whole) else 200
    shown = ascii(text[:cap])
    return shown if len(text) <= cap else shown + "..."


def fmt(name: str, **fields: object) -> str:
    parts = [f"event={name}"]
    parts += [f"{k}={value(v)}" for k, v in fields.items() if v is not None]
    return " ".join(parts)


def event(name: str, level: int = logging.INFO, **fields: object) -> None:
    if log.isEnabledFor(level):
        kept = {k: v for k, v in fields.items() if v is not None}
        log.log(level, fmt(name, **fields), extra={"event_name": name, "event_fields": kept})
