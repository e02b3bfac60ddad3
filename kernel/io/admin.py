"""The operator's controls of enrolled workspaces: unenroll, pause and resume, budget changes.

Each is one store transaction (the running kernel notices the store changed within `poll_seconds` and follows:
an unenrolled or paused workspace is no longer served) followed by its side effect on the channel: an unenrolled
workspace's channel is removed (its records stay in the store); a budget change is published in `budget.json`
(`publish_budget`: by the running kernel when there is one, else here). Every budget change is recorded with who
made it and when (`history --budget`).
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import time
from dataclasses import dataclass
from typing import Final

from channel import safefs
from channel.paths import CHANNEL_DIR
from kernel.core import ledger
from kernel.core.budget import GPU_SECONDS_PER_HOUR, Balance, gpu_seconds
from kernel.core.records import WorkspaceRow
from kernel.io.enroll import Published, publish_budget
from kernel.io.store import Store, timestamp

BUDGET_KINDS: Final = ("launches", "sleeps", "gpu_hours")


class AdminError(Exception):
    """The operation is refused; the message says why and what to do."""


def who() -> str:
    """The operator making a change, for the audit: the name of this process's real uid (what the kernel can
    vouch for), and `$SUDO_USER` only as what the environment claims (anyone can set it), labelled so."""
    uid = os.getuid()
    try:
        me = pwd.getpwuid(uid).pw_name
    except KeyError:
        me = f"uid {uid}"
    claimed = os.environ.get("SUDO_USER")
    return f"{me} (SUDO_USER={claimed!r}, claimed by the environment)" if claimed else me


def find(store: Store, path: str) -> WorkspaceRow:
    """The enrolled workspace at `path` (or with that key)."""
    row = store.workspace_by_path(os.path.realpath(path)) or store.workspace(path)
    if row is None or store.admin(row.key).unenrolled_at is not None:
        raise AdminError(f"{path} is not an enrolled workspace (`syscall-kernel status` lists them)")
    return row


def unenroll(store: Store, path: str, *, force: bool = False) -> WorkspaceRow:
    """Stop serving the workspace and remove its channel; its records stay. Refused while a sleep is in flight
    unless `force`: the kernel serving the state dir (now, or the next to start) then cancels its jobs and ends
    the sleep, its wake kept in the store only (kernel.service.execute, `_withdraw`)."""
    row = find(store, path)
    live = store.current_sleep(row.key)
    if live is not None and not force:
        raise AdminError(
            f"{row.path} has sleep {live.id} (seq {live.seq}) in flight ({live.state}); wait for its wake or cancel "
            "it, or pass --force (its jobs are cancelled)"
        )
    with store.transaction():
        store.set_admin(row.key, dataclasses.replace(store.admin(row.key), unenrolled_at=timestamp()))
    # After the commit: the kernel no longer serves it, so nothing writes into the channel while it goes.
    try:
        with safefs.open_channel(row.path, row.identity):
            pass
    except safefs.ChannelMoved:
        # Not the directory enrolled: not ours to remove.
        return row
    except (safefs.Refused, OSError):
        return row
    # Moved aside first (atomic): a kernel that has not noticed yet finds no channel at the path, and a later
    # `enroll` makes a fresh one even if a late write lands in the old one while it is being removed.
    gone = os.path.join(row.path, f"{CHANNEL_DIR}.unenrolled-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(os.path.join(row.path, CHANNEL_DIR), gone)
    except OSError:
        return row
    # shutil.rmtree works through directory fds and never follows a link the agent planted inside.
    shutil.rmtree(gone, ignore_errors=True)
    return row


def set_paused(store: Store, path: str, paused: bool) -> tuple[WorkspaceRow, bool]:
    """Pause or resume; returns the row and whether anything changed."""
    row = find(store, path)
    admin = store.admin(row.key)
    if (admin.paused_at is not None) == paused:
        return row, False
    with store.transaction():
        store.set_admin(row.key, dataclasses.replace(admin, paused_at=timestamp() if paused else None))
    return row, True


@dataclass(frozen=True, slots=True)
class BudgetEdit:
    """`--add-*` (a signed change) and `--set-*` (a new value) per kind; None leaves a kind alone."""

    add: dict[str, float]
    set: dict[str, float]

    def describe(self) -> str:
        parts = [f"{k} {'+' if v >= 0 else ''}{v:g}" for k, v in self.add.items()]
        parts += [f"{k} = {v:g}" for k, v in self.set.items()]
        return ", ".join(parts)


def edited(b: Balance, edit: BudgetEdit) -> Balance:
    """The balance after the edit; AdminError when a value would go below zero (or what is reserved)."""
    set_to: dict[str, int] = {}
    for kind, v in edit.set.items():
        if v < 0:
            raise AdminError(f"--set-{kind.replace('_', '-')} must be >= 0, got {v:g}")
        set_to[_column(kind)] = gpu_seconds(v) if kind == "gpu_hours" else int(v)
    add: dict[str, int] = {}
    for kind, v in edit.add.items():
        if v != v:  # NaN: no change
            continue
        add[_column(kind)] = round(v * GPU_SECONDS_PER_HOUR) if kind == "gpu_hours" else int(v)
    try:
        return ledger.edited(b, set_to, add)
    except ledger.Overdrawn as e:
        raise AdminError(f"the change would leave {e.column.replace('_s', '-hours')} below zero") from None


def _column(kind: str) -> str:
    return "gpu_s" if kind == "gpu_hours" else kind


def change_budget(
    store: Store, path: str, edit: BudgetEdit, by: str
) -> tuple[WorkspaceRow, Balance, Balance, Published | None]:
    """Apply and record the edit in one transaction (read and written together: a charge by the running kernel
    cannot slip in between), then publish it in budget.json (`publish_budget`). An edit that leaves the balance
    as it was (a set to the value it has; GPU-hours below the ledger's whole GPU-second) records nothing and
    publishes nothing (None)."""
    if not edit.add and not edit.set:
        raise AdminError("nothing to change: give --add-launches/--add-sleeps/--add-gpu-hours or --set-...")
    row = find(store, path)
    now = timestamp()
    with store.transaction():
        current = store.workspace(row.key)
        assert current is not None
        after = edited(current.balance, edit)
        if after == current.balance:
            # Nothing to record: the audit lists changes, and budget.json already shows this balance.
            return row, current.balance, after, None
        store.set_balance(row.key, after)
        store.add_budget_change(row.key, now, by, edit.describe(), current.balance, after)
    return row, current.balance, after, publish_budget(store, row)
