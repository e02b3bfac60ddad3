"""The operator's controls of enrolled workspaces: unenroll, pause and resume, budget changes.

Each is one store transaction (the running kernel notices the store changed within `poll_seconds` and follows:
an unenrolled or paused workspace is no longer served) followed by its side effect on the channel: an unenrolled
workspace's channel is removed (its records stay in the store); a budget change is published in `budget.json`
(`publish_budget`: by the running kernel when there is one, else here). Every budget change is recorded with who
made it and when (`history --budget`).
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import time
from dataclasses import dataclass
from typing import Final, Literal

from channel import safefs
from channel.paths import CHANNEL_DIR
from kernel.core import ledger
from kernel.core.budget import GPU_SECONDS_PER_HOUR, Balance, gpu_seconds
from kernel.core.records import WorkspaceRow
from kernel.io import chanlock, statedir
from kernel.io.enroll import OwnedElsewhere, check_owner, write_budget
from kernel.io.store import Store, timestamp

BUDGET_KINDS: Final = ("launches", "sleeps", "gpu_hours")
# How long `publish_budget` waits for another short holder of the channel's lock (another operator's `budget`).
LOCK_WAIT_S: Final = 5.0


class AdminError(Exception):
    """The operation is refused; the message says why and what to do."""


def who() -> str:
    """The operator making a change: the login behind sudo when there is one, else this process's user."""
    user = os.environ.get("SUDO_USER")
    try:
        me = getpass.getuser()
    except (KeyError, OSError):
        me = f"uid {os.geteuid()}"
    return f"{user} (via sudo as {me})" if user else me


def find(store: Store, path: str) -> WorkspaceRow:
    """The enrolled workspace at `path` (or with that key)."""
    row = store.workspace_by_path(os.path.realpath(path)) or store.workspace(path)
    if row is None or store.admin(row.key).unenrolled_at is not None:
        raise AdminError(f"{path} is not an enrolled workspace (`syscall-kernel status` lists them)")
    return row


def unenroll(store: Store, path: str, *, force: bool = False) -> WorkspaceRow:
    """Stop serving the workspace and remove its channel; its records stay. Refused while a sleep is in flight
    unless `force` (its jobs then run on unwatched, and no wake is written)."""
    row = find(store, path)
    live = store.current_sleep(row.key)
    if live is not None and not force:
        raise AdminError(
            f"{row.path} has sleep {live.id} (seq {live.seq}) in flight ({live.state}); wait for its wake or cancel "
            "it, or pass --force"
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


@dataclass(frozen=True, slots=True)
class Published:
    """How `budget.json` shows a balance the store now holds. `written`: rewritten by this process, now.
    `kernel`: this store's running kernel (pid `kernel`) rewrites it at its next poll tick, while it serves the
    channel. `not_written`: neither, and `why`; a kernel rewrites it from the store when it next serves the channel
    (its next start, or its look at the channel once the problem is gone)."""

    how: Literal["written", "kernel", "not_written"]
    kernel: int | None = None
    why: str | None = None


def publish_budget(store: Store, row: WorkspaceRow, *, wait_s: float = LOCK_WAIT_S) -> Published:
    """After a commit that changed `row`'s balance in this process (not the kernel's): bring `budget.json` to the
    store's balance, without ever putting an older balance over a newer one (kernel.io.budgetorder).

    Invariant: budget.json is written only by the process holding the channel's lock (kernel.io.chanlock), from a
    balance read while it holds it. A kernel holds the lock as long as it serves the channel and orders its own
    writes (BudgetOrder); this process holds it only across one read of the balance and one write, so its write
    can neither interleave with a kernel's writes nor carry a balance older than the one any earlier holder wrote
    (the store's balance only moves forward, and it is read after the lock is taken, so after the last holder let
    go). Hence:
    - a kernel runs on this store (its state dir lock): nothing is written here; the kernel notices the commit at
      its next poll tick and rewrites budget.json in its own order. Taking the lock here would take the channel
      away from it for a rescan.
    - else the lock is taken (waiting up to `wait_s` for another operator's command), the balance read and written.
      A kernel starting meanwhile finds the lock held, and serves the channel from its next rescan on.
    - the lock is held by another process past `wait_s`: if it is this store's kernel (started since the check), it
      read the balance after the commit, and writes it; else another store's kernel or the agent holds the
      channel: not ours to write.
    On a filesystem without flock nothing keeps a kernel starting at this very moment off the channel; then the
    write here may land after that kernel's first charge, and budget.json shows the older balance until its next
    write."""
    kernel = statedir.holder(store.path.parent)
    if kernel is not None:
        return Published("kernel", kernel=kernel)
    try:
        with safefs.open_channel(row.path, row.identity) as ch:
            check_owner(store, ch, row.path)
            with chanlock.held_briefly(ch, wait_s=wait_s):
                current = store.workspace(row.key)
                if current is None:
                    return Published("not_written", why="the workspace is no longer enrolled")
                write_budget(ch, current.balance, timestamp())
    except chanlock.HeldElsewhere as exc:
        kernel = statedir.holder(store.path.parent)
        if kernel is not None and kernel == exc.pid:
            return Published("kernel", kernel=kernel)
        return Published(
            "not_written",
            why=f"another process ({exc}) holds the channel's lock: another kernel serves it, or the agent holds it",
        )
    except OwnedElsewhere as exc:
        return Published("not_written", why=str(exc))
    except safefs.ChannelMoved as exc:
        return Published("not_written", why=f"the channel is not the one enrolled: {exc}")
    except (safefs.Refused, OSError) as exc:
        return Published("not_written", why=f"{type(exc).__name__}: {exc}")
    return Published("written")


def change_budget(
    store: Store, path: str, edit: BudgetEdit, by: str
) -> tuple[WorkspaceRow, Balance, Balance, Published]:
    """Apply and record the edit in one transaction (read and written together: a charge by the running kernel
    cannot slip in between), then publish it in budget.json (`publish_budget`)."""
    if not edit.add and not edit.set:
        raise AdminError("nothing to change: give --add-launches/--add-sleeps/--add-gpu-hours or --set-...")
    row = find(store, path)
    now = timestamp()
    with store.transaction():
        current = store.workspace(row.key)
        assert current is not None
        after = edited(current.balance, edit)
        store.set_balance(row.key, after)
        store.add_budget_change(row.key, now, by, edit.describe(), current.balance, after)
    return row, current.balance, after, publish_budget(store, row)
