"""SIGHUP: what of a newly read config a running kernel takes, and what it keeps until a restart.

Pure: `merge(running, reread)` returns the config to run with, the dotted keys that changed and were applied, and
those that changed but cannot change while the kernel runs (they are kept, and named in the log). The service
sets the merged config into its one `LiveConfig` (kernel.core.config), which every component reads at each use.
The keys that change live are the ones read afresh at each use: the workspace globs, the defaults given to
workspaces (the policy is rewritten into every kernel.json; `share_baselines` is read by the next submit's plan),
the loop's timings and batches, the temp grace, the stall limit, the channel I/O deadline and the heavy work
deadline (the pools read them at each check). Anything that chose a resource at start (the state and run dirs, the backend and its settings, the jail, the
watch mode, the verdict hook's executor, root permission, the log format, the metrics listener) is kept.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kernel.core.config import Config

LIVE: Final = frozenset(
    {
        "workspaces",
        "defaults",
        "rescan_seconds",
        "poll_seconds",
        "poll_idle_seconds",
        "batch_per_workspace",
        "batch_per_pass",
        "temp_grace_minutes",
        "stall_seconds",
        "channel_io_deadline_seconds",
        "heavy_io_deadline_seconds",
    }
)


def changed_keys(a: object, b: object, prefix: str) -> list[str]:
    """The dotted keys under `prefix` whose values differ (Structs are compared field by field)."""
    if a == b:
        return []
    if isinstance(a, msgspec.Struct) and type(a) is type(b):
        out: list[str] = []
        for name in a.__struct_fields__:
            out += changed_keys(getattr(a, name), getattr(b, name), f"{prefix}.{name}" if prefix else name)
        return out
    return [prefix]


def merge(running: Config, reread: Config) -> tuple[Config, list[str], list[str]]:
    applied: list[str] = []
    kept: list[str] = []
    updates: dict[str, object] = {}
    for name in Config.__struct_fields__:
        if name == "source":
            continue
        keys = changed_keys(getattr(running, name), getattr(reread, name), name)
        if not keys:
            continue
        if name in LIVE:
            updates[name] = getattr(reread, name)
            applied += keys
        else:
            kept += keys
    return msgspec.structs.replace(running, **updates), applied, kept
