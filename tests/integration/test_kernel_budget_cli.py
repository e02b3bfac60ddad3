"""Issue 13: the operator's `syscall-kernel budget` (its own process) and the running kernel's budget.json writes.

The store is the truth; budget.json (which the agent reads and acts on) must converge to the store's balance and
never go back to an older one. The old `budget` command wrote budget.json itself, outside the running kernel's
order (kernel.io.budgetorder), so:
 (a) a kernel write whose balance was read before the command's commit, delayed (a slow channel), landed after the
     command's write: budget.json showed the old balance until some later charge;
 (b) a charge made by the kernel between the command's commit and its write was overwritten by the command's
     older balance (and so was a second operator's change, made in between, with no kernel running).
Each race is made deterministic here: (a) with the test-only hang point of the kernel's after-ready refresh
(kernel.io.crash.hang_point), (b) with a real store whose commit, in the command's process, waits for the other
party to finish its change first (the command's code runs as `syscall-kernel budget` runs it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kernelproc import Kernel, git_workspace, put_request, wait_answer, wait_for

from channel.paths import workspace_key
from kernel.core.config import load
from kernel.core.records import WorkspaceRow
from kernel.io import admin
from kernel.io.enroll import Enrolled, Grant, Published, enroll
from kernel.io.install import ToolSource
from kernel.io.store import Store

CONFIG = 'backend = "none"\npoll_seconds = 0.1\nrescan_seconds = 0.5\n[defaults]\nlaunches = 10\n'


def budget(ws: Path) -> dict[str, Any]:
    return json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]  # type: ignore[no-any-return]


def stored(k: Kernel) -> dict[str, Any]:
    [ws] = json.loads(k.cli("status", "--json").stdout)["workspaces"]
    return ws["budget"]  # type: ignore[no-any-return]


def hang_at(hang: Path, text: str) -> None:
    tmp = hang.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, hang)  # the hang point never reads a half-written file


class PausedStore(Store):
    """A real store whose next commit, once made, runs `after_commit` before the committing code goes on: the
    command's process paused between its commit and what it does next."""

    after_commit: Callable[[], None] | None = None

    @contextlib.contextmanager
    def transaction(self, *, durable: bool = True) -> Iterator[None]:
        with super().transaction(durable=durable):
            yield
        hook, self.after_commit = self.after_commit, None
        if hook is not None:
            hook()


def add_launches(n: int) -> admin.BudgetEdit:
    return admin.BudgetEdit(add={"launches": n}, set={})


def sleep_request(rid: str) -> dict[str, Any]:
    launch = {"name": "t", "command": "true", "minutes": 1, "gpus": 0, "artifacts": []}
    return {"protocol": 1, "id": rid, "type": "sleep", "launches": [launch]}


def stays(ws: Path, want: int, seconds: float) -> None:
    """budget.json keeps showing `want` launches for `seconds` (several poll intervals and rescans)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert budget(ws)["launches"] == want
        time.sleep(0.05)


def test_a_kernel_write_read_before_the_change_never_lands_last(tmp_path: Path) -> None:
    """(a) The kernel's after-ready refresh reads the balance (10 launches), then its channel hangs; the operator
    adds 5 meanwhile. The old command wrote 15 at once, and the refresh then wrote its 10 over it (the file
    differed), which stayed. Now the running kernel rewrites budget.json itself, in its own order, after the
    refresh: 15 within a few poll intervals, and never 10 after it."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    hang = tmp_path / "hang"
    hang_at(hang, f"refresh {ws.resolve()}")
    k.start(env={"SYSCALL_KERNEL_HANG_CHANNEL": str(hang)})
    try:
        k.wait_log("event=hang_injected step=refresh", 30)
        out = k.cli("budget", str(ws), "--add-launches", "5").stdout
        assert "now: 15 launches" in out
        assert (
            f"the running kernel (pid {k.proc.pid if k.proc else 0}) rewrites it within poll_seconds" in out
        )
        hang.unlink()
        k.wait_log("event=channels_refreshed", 10)
        wait_for(lambda: budget(ws)["launches"] == 15, 5, "budget.json showing the operator's change")
        stays(ws, 15, 1.5)
        # The kernel charges from the new balance, and budget.json follows.
        put_request(ws, "s1", sleep_request("s1"))
        assert wait_answer(ws, "s1")["type"] == "accepted"
        wait_for(lambda: budget(ws)["launches"] == 14, 5, "the charge in budget.json")
        assert stored(k)["launches"] == 14
        assert k.stop() == 0
    finally:
        hang.unlink(missing_ok=True)
        k.ensure_stopped()


def test_a_charge_after_the_commit_is_never_overwritten_by_the_command(tmp_path: Path) -> None:
    """(b) The operator's change commits (15 launches); before the command goes on, the running kernel charges a
    sleep (14) and writes budget.json. The old command then wrote its 15 over the kernel's 14, which stayed until
    the next charge. Now the command leaves budget.json to the running kernel: it shows 14, the store's balance."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.start()
    store = PausedStore.open(k.state / "state.sqlite")
    try:

        def kernel_charges() -> None:
            put_request(ws, "s1", sleep_request("s1"))
            assert wait_answer(ws, "s1")["type"] == "accepted"
            wait_for(lambda: budget(ws)["launches"] == 14, 5, "the kernel's charge in budget.json")

        store.after_commit = kernel_charges
        _, before, after, published = admin.change_budget(store, str(ws), add_launches(5), "op")
        assert (before.launches, after.launches) == (10, 15)
        assert published.how == "kernel"
        assert published.kernel == (k.proc.pid if k.proc else None)
        assert stored(k)["launches"] == 14
        stays(ws, 14, 1.5)
        assert k.stop() == 0
    finally:
        store.close()
        k.ensure_stopped()


def test_with_no_kernel_running_the_command_writes_budget_json_at_once(tmp_path: Path) -> None:
    """No kernel runs: the command itself writes budget.json, and says so; the agent reading it right after sees
    the change."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    out = k.cli("budget", str(ws), "--add-launches", "5", "--set-sleeps", "3").stdout
    assert "  budget.json rewritten" in out
    assert (budget(ws)["launches"], budget(ws)["sleeps"]) == (15, 3)


def test_two_operators_at_once_leave_the_later_balance(tmp_path: Path) -> None:
    """(b) with no kernel: one operator's change commits (15); before that command writes budget.json, a second
    operator's change commits (16) and is written. The old first command then wrote its 15 over the 16. Now each
    command reads the balance it writes while it holds the channel's lock: budget.json shows 16."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    first = PausedStore.open(k.state / "state.sqlite")
    second = Store.open(k.state / "state.sqlite")
    try:
        seen: list[Published] = []

        def second_operator() -> None:
            *_, published = admin.change_budget(second, str(ws), add_launches(1), "op2")
            seen.append(published)
            assert budget(ws)["launches"] == 16

        first.after_commit = second_operator
        _, _, after, published = admin.change_budget(first, str(ws), add_launches(5), "op1")
        assert after.launches == 15
        assert [p.how for p in (*seen, published)] == ["written", "written"]
        assert budget(ws)["launches"] == 16
        assert [c.after.launches for c in second.budget_changes()] == [15, 16]
    finally:
        first.close()
        second.close()


def test_a_channel_that_cannot_be_written_is_said_and_the_next_start_writes_it(tmp_path: Path) -> None:
    """The command cannot write budget.json (the agent put a directory in its place): it says so (it used to skip
    the write silently), the change is recorded, and the next kernel start writes budget.json from the store."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    path = ws / ".syscall" / "budget.json"
    path.unlink()
    path.mkdir()
    done = k.cli("budget", str(ws), "--add-launches", "5")
    assert "now: 15 launches" in done.stdout
    assert "budget.json not rewritten (" in done.stdout
    assert "a kernel rewrites budget.json from the store when it next serves the workspace" in done.stdout
    path.rmdir()
    k.start()
    try:
        wait_for(
            lambda: path.exists() and budget(ws)["launches"] == 15, 10, "budget.json written at the start"
        )
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_a_running_kernel_that_cannot_write_budget_json_tries_again(tmp_path: Path) -> None:
    """The running kernel's rewrite fails (the agent put a directory where budget.json goes); once the agent
    removes it, the kernel writes the operator's change at its next rescan. The old command's write failed the
    same way, silently, and nothing wrote budget.json until the next charge."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.start()
    try:
        path = ws / ".syscall" / "budget.json"
        path.unlink()
        path.mkdir()
        k.cli("budget", str(ws), "--add-launches", "5")
        k.wait_log("event=channel_problem", 10)
        path.rmdir()
        wait_for(lambda: path.is_file() and budget(ws)["launches"] == 15, 10, "budget.json written again")
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


class ChargedAfterRead(Store):
    """A real store whose next read of a workspace row runs `after_read` before handing the row back: the
    command's process paused between reading the balance and what it does next."""

    after_read: Callable[[], None] | None = None

    def workspace(self, key: str) -> WorkspaceRow | None:
        row = super().workspace(key)
        hook, self.after_read = self.after_read, None
        if hook is not None:
            hook()
        return row


def enroll_in_process(k: Kernel, store: Store, ws: Path, grant: Grant) -> Enrolled:
    return enroll(store, load(k.config), str(ws), ToolSource.bundled(), grant)


def test_enroll_with_a_grant_keeps_a_charge_made_meanwhile(tmp_path: Path) -> None:
    """`enroll --gpu-hours` on a served workspace read its row, then wrote the whole balance back: a sleep the
    running kernel charged in between (launches and sleeps) was undone in the store. Now the balance is read in
    the enrollment's transaction."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.start()
    store = ChargedAfterRead.open(k.state / "state.sqlite")
    try:

        def kernel_charges() -> None:
            put_request(ws, "s1", sleep_request("s1"))
            assert wait_answer(ws, "s1")["type"] == "accepted"

        store.after_read = kernel_charges
        done = enroll_in_process(k, store, ws, Grant(gpu_hours=5))
        assert (done.row.balance.launches, done.row.balance.sleeps) == (9, 49)
        b = stored(k)
        assert (b["launches"], b["sleeps"], b["gpu_hours"]) == (9, 49, 5)
        assert done.budget_shown == Published("kernel", kernel=k.proc.pid if k.proc else None)
        wait_for(lambda: budget(ws)["gpu_hours"] == 5, 5, "the grant in budget.json")
        stays(ws, 9, 1.5)
        assert k.stop() == 0
    finally:
        store.close()
        k.ensure_stopped()


def test_enroll_with_a_grant_never_overwrites_a_later_charge(tmp_path: Path) -> None:
    """(b) for `enroll --launches`: its commit, then a charge by the running kernel (written), then the command's
    own budget.json write of the older balance, which stayed. Now the running kernel publishes it."""
    k = Kernel(tmp_path, CONFIG)
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.start()
    store = PausedStore.open(k.state / "state.sqlite")
    try:

        def kernel_charges() -> None:
            put_request(ws, "s1", sleep_request("s1"))
            assert wait_answer(ws, "s1")["type"] == "accepted"
            wait_for(lambda: budget(ws)["launches"] == 19, 5, "the kernel's charge in budget.json")

        store.after_commit = kernel_charges
        done = enroll_in_process(k, store, ws, Grant(launches=20))
        assert done.row.balance.launches == 20
        assert stored(k)["launches"] == 19
        stays(ws, 19, 1.5)
        assert k.stop() == 0
    finally:
        store.close()
        k.ensure_stopped()


def test_a_change_made_while_the_kernel_starts_is_followed(tmp_path: Path) -> None:
    """The operator changes A's budget while the kernel admits its channels at start, after A's channel was
    refreshed (budget.json brought to the balance read then) and before the admission ended (B's channel hangs).
    The kernel took the store's version as of the admission's end as seen, so it never noticed that change:
    A's budget.json showed the old balance until a charge. Now the version is the one read before the start read
    anything."""
    k = Kernel(tmp_path, "channel_io_deadline_seconds = 120\n" + CONFIG)
    one, two = git_workspace(tmp_path / "one"), git_workspace(tmp_path / "two")
    # Admitted in key order: A (refreshed in full at admission: its tool is not this kernel's), then B.
    a, b = sorted((one, two), key=lambda p: workspace_key(str(p.resolve())))
    k.enroll(a)
    k.enroll(b)
    with contextlib.closing(Store.open(k.state / "state.sqlite")) as store:
        row = store.workspace(workspace_key(str(a.resolve())))
        assert row is not None
        with store.transaction():
            store.put_workspace(dataclasses.replace(row, tool_sha256="0" * 64))
    hang = tmp_path / "hang"
    hang_at(hang, f"admit {b.resolve()}")
    k.start(env={"SYSCALL_KERNEL_HANG_CHANNEL": str(hang)}, wait_ready=False)
    try:
        k.wait_log("event=hang_injected step=admit", 30)  # A was admitted (and refreshed) before B
        assert budget(a)["launches"] == 10
        k.cli("budget", str(a), "--add-launches", "5")
        hang.unlink()
        k.wait_log("event=ready", 30)
        wait_for(lambda: budget(a)["launches"] == 15, 5, "A's budget.json showing the change")
        stays(a, 15, 1.5)
        assert k.stop() == 0
    finally:
        hang.unlink(missing_ok=True)
        k.ensure_stopped()
