"""One log line per event, as `event=<name> ws=<workspace> id=<request> key=value ...`.

Values written by agents (ids are already validated; names, reasons) are escaped and capped, so a hostile name
cannot forge a log line. Under systemd (`$JOURNAL_STREAM` set) each line carries a `<N>` syslog priority prefix
for journald and no timestamp of its own.
"""

from __future__ import annotations

import logging
import os
import sys
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


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


def setup(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def value(v: object) -> str:
    text = str(v)
    if text and len(text) <= 200 and all(c in _PLAIN for c in text):
        return text
    shown = ascii(text[:200])
    return shown if len(text) <= 200 else shown + "..."


def fmt(name: str, **fields: object) -> str:
    parts = [f"event={name}"]
    parts += [f"{k}={value(v)}" for k, v in fields.items() if v is not None]
    return " ".join(parts)


def event(name: str, level: int = logging.INFO, **fields: object) -> None:
    if log.isEnabledFor(level):
        log.log(level, fmt(name, **fields))
