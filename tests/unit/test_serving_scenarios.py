"""The serve core (kernel.core.serving) driven in process with a fake clock in milliseconds: a hung admission or
look, the poll backoff, fairness between workspaces, reload, stop, and the paused / foreign / held-elsewhere
transitions. No threads, no files: each scenario feeds the events the service's driver would feed and checks the
actions it would run (kernel.service.loop runs them in its pools)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from channel.messages import Policy, StoreRef
from channel.safefs import Identity
from kernel.core import serving as sv
from kernel.core.budget import Balance
from kernel.core.polling import DirStamp
from kernel.core.records import WorkspaceRow

MS = 0.001
POLL_S, IDLE_S, QUANTUM_S = 0.5, 4.0, 0.02


def row(key: str) -> WorkspaceRow:
    ino = sum(ord(c) for c in key)
    return WorkspaceRow(
        key, f"/ws/{key}", Identity(1, ino, 1000), Balance(10, 5, 36000), Policy(), "t", "poll", "", None
    )


@dataclass
class Harness:
    """The core, a fake clock (ms), and a driver that answers each poll look at once with the channel's stamp."""

    core: sv.Serving = field(default_factory=lambda: sv.Serving(POLL_S, IDLE_S, QUANTUM_S))
    ms: int = 0
    stamps: dict[str, DirStamp] = field(default_factory=dict)
    looked_at: dict[str, list[int]] = field(default_factory=dict)  # key -> the times (ms) it was looked at
    listed: list[str] = field(default_factory=list)

    @property
    def now(self) -> float:
        return self.ms * MS

    def feed(self, ev: sv.Event) -> list[sv.Action]:
        actions = self.core.handle(ev)
        for a in actions:
            if isinstance(a, sv.PollLooks):
                self._poll()
        return actions

    def _poll(self) -> None:
        wall_ns = 10**18 + self.ms * 1_000_000  # the wall clock, long after every stamp (none is racy)
        for key in self.core.polls.due(self.now, 512):
            self.looked_at.setdefault(key, []).append(self.ms)
            if self.core.polls.looked(key, self.stamps.get(key), wall_ns, self.now):
                self.listed.append(key)
                self.core.polls.listed(key, self.now)

    def run_until(self, ms: int, step_ms: int = 1) -> None:
        while self.ms < ms:
            self.ms += step_ms
            self.feed(sv.Tick(self.now))


def stamp(n: int) -> DirStamp:
    return DirStamp(1, 2, n, n, 3, 2)


def served_keys(core: sv.Serving, rows: list[WorkspaceRow]) -> set[str]:
    return {r.key for r in core.served(rows, lambda key: True)}


def shows(actions: list[sv.Action]) -> list[sv.ShowProblem]:
    """The problems these actions show (or clear) in the store."""
    return [a for a in actions if isinstance(a, sv.ShowProblem)]


def logs(actions: list[sv.Action]) -> list[str]:
    """The events these actions log."""
    return [a.event for a in actions if isinstance(a, sv.Log)]


# --- hang --------------------------------------------------------------------------------------------------


def test_a_hung_admission_shows_its_problem_once_and_holds_no_other_workspace() -> None:
    h = Harness()
    rows = [row("a"), row("b"), row("c")]
    h.feed(sv.Admitting(("a", "b", "c")))
    assert {h.core.phase(k) for k in "abc"} == {sv.Phase.UNADMITTED}
    assert served_keys(h.core, rows) == set()
    h.feed(sv.LookTaken("start-up admission 1", "a"))
    h.ms += 30_000
    shown = h.feed(sv.Overdue("start-up admission 1", "12:00:00", 30.0))
    problem = sv.overdue_problem("12:00:00", 30.0, served=False)
    assert shows(shown) == [sv.ShowProblem("a", problem)]
    assert logs(shown) == ["channel_problem"]
    assert h.core.problem("a") == problem
    assert "this workspace is not served until it returns" in problem
    assert h.core.phase("a") is sv.Phase.OVERDUE
    # Another call admits the rest meanwhile: they are served, the hung one is not.
    for key in "bc":
        assert h.feed(sv.LookDone(key, sv.Outcome.SERVED, stale=True)) == [sv.Reserve()]
    assert served_keys(h.core, rows) == {"b", "c"}
    # It returns: the problem is cleared only while it still shows the overdue one, then it is served.
    returned = h.feed(sv.Returned("start-up admission 1"))
    assert shows(returned) == [sv.ShowProblem("a", None, unless=problem)]
    assert logs(returned) == ["channel_io_returned"]
    assert h.core.phase("a") is sv.Phase.UNADMITTED
    h.feed(sv.LookDone("a", sv.Outcome.SERVED))
    assert served_keys(h.core, rows) == {"a", "b", "c"}


def test_a_hung_look_is_not_started_twice_and_other_looks_go_on() -> None:
    h = Harness()
    a, b = row("a"), row("b")
    assert h.feed(sv.LookWanted(a)) == [sv.Look(a, paused=False)]
    h.ms += 30_000
    assert shows(h.feed(sv.Overdue("a", "12:00:00", 30.0)))[0].key == "a"
    # Every rescan asks again: the hung look holds one thread, not one per rescan.
    for _ in range(5):
        h.ms += 60_000
        assert h.feed(sv.LookWanted(a)) == []
    assert h.feed(sv.LookWanted(b)) == [sv.Look(b, paused=False)]
    h.feed(sv.LookDone("b", sv.Outcome.SERVED))
    assert served_keys(h.core, [a, b]) == {"b"}
    assert h.core.phase("a") is sv.Phase.OVERDUE


def test_an_overdue_rewatch_shows_its_problem_and_leaves_the_workspace_served() -> None:
    h = Harness()
    a = row("a")
    h.feed(sv.LookTaken("a", "a"))
    assert shows(h.feed(sv.Overdue("a", "12:00:00", 30.0))) == [
        sv.ShowProblem("a", sv.overdue_problem("12:00:00", 30.0, served=False))
    ]
    assert served_keys(h.core, [a]) == {"a"}
    assert shows(h.feed(sv.Returned("a"))) == [
        sv.ShowProblem("a", None, unless=sv.overdue_problem("12:00:00", 30.0, served=False))
    ]


def test_the_overdue_message_is_built_in_one_place_for_looks_and_turns() -> None:
    look = sv.overdue_problem("t", 2.5, served=False)
    turn = sv.overdue_problem("t", 2.5, served=True)
    assert look.startswith("channel I/O has not returned since t (over 2.5 s: a hung filesystem?); ")
    assert turn.startswith("channel I/O has not returned since t (over 2.5 s: a hung filesystem?); ")
    assert "nothing more is started for this workspace until it returns" in turn
    assert look.endswith("other workspaces are served meanwhile")
    assert turn.endswith("other workspaces are served meanwhile")


# --- backoff and fairness ---------------------------------------------------------------------------------


def test_an_idle_polled_channel_backs_off_to_the_idle_interval_and_an_answer_brings_it_back() -> None:
    h = Harness()
    h.stamps["a"] = stamp(1)
    h.core.polls.sync({"a"}, h.now)
    h.feed(sv.Tick(h.now))
    h.run_until(20_000)
    times = h.looked_at["a"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Listed once (the first look trusts nothing), then each look that finds nothing doubles the interval.
    assert h.listed == ["a"]
    assert gaps[:4] == [500, 1000, 2000, 4000]
    assert set(gaps[4:]) == {4000}
    # The kernel answers it: the agent is likely to write again, so it is looked at every poll_s again.
    h.core.polls.active("a", h.now)
    start = h.ms
    h.run_until(start + 600)
    assert h.looked_at["a"][-1] - start <= 500


def test_the_schedule_follows_the_polled_channels_at_the_next_tick() -> None:
    """The core owns both the polled set and the schedule: a channel that turns polled is looked at from the next
    tick, one that turns watched (or is no longer served) is not looked at again."""
    h = Harness()
    h.stamps |= {"a": stamp(1), "b": stamp(1)}
    h.feed(sv.Watched("a", polled=True))
    h.feed(sv.Watched("b", polled=True))
    h.run_until(10)
    assert set(h.looked_at) == {"a", "b"}
    h.feed(sv.Watched("a", polled=False))  # re-watched with inotify
    h.feed(sv.Unserved(("b",)))
    h.looked_at.clear()
    h.run_until(10_000)
    assert h.looked_at == {}
    assert "a" not in h.core.polls
    assert "b" not in h.core.polls


def test_looks_start_at_most_once_per_quantum_and_take_every_look_then_due() -> None:
    h = Harness()
    keys = {f"w{i}" for i in range(1000)}
    for k in keys:
        h.stamps[k] = stamp(1)
    h.core.polls.sync(keys, h.now)
    starts = 0
    for _ in range(200):  # 200 ticks 1 ms apart: the loop woken by 200 events
        h.ms += 1
        starts += sum(isinstance(a, sv.PollLooks) for a in h.feed(sv.Tick(h.now)))
    assert starts <= 200 // 20 + 1
    assert set(h.looked_at) == keys  # all 1,000 were looked at, in the first batch


def test_a_busy_channel_does_not_starve_the_idle_ones() -> None:
    h = Harness()
    keys = {f"w{i}" for i in range(200)}
    for k in keys:
        h.stamps[k] = stamp(1)
    h.core.polls.sync(keys | {"busy"}, h.now)
    for t in range(0, 30_000, 5):
        h.stamps["busy"] = stamp(t + 2)  # changes before every look: listed every time
        h.ms = t
        h.feed(sv.Tick(h.now))
    # The busy one is looked at every poll_s; every idle one at least every idle_s, whatever the busy one does.
    busy = h.looked_at["busy"]
    assert max(b - a for a, b in itertools.pairwise(busy)) <= 500 + 20
    for k in keys:
        seen = h.looked_at[k]
        assert max(b - a for a, b in itertools.pairwise(seen)) <= 4000 + 20, k
        assert seen[-1] >= 30_000 - 4000 - 20, k


def test_one_workspace_with_many_wanted_looks_does_not_delay_anothers() -> None:
    h = Harness()
    looks = []
    for _ in range(100):
        looks += h.feed(sv.LookWanted(row("noisy")))
    looks += h.feed(sv.LookWanted(row("quiet")))
    assert looks == [sv.Look(row("noisy"), paused=False), sv.Look(row("quiet"), paused=False)]


# --- reload, ready, stop ----------------------------------------------------------------------------------


def test_a_reload_changes_the_poll_intervals_of_the_schedule() -> None:
    h = Harness()
    h.stamps["a"] = stamp(1)
    h.core.polls.sync({"a"}, h.now)
    h.run_until(10_000)
    h.feed(sv.Reload(0.1, 0.2))
    assert (h.core.polls.base_s, h.core.polls.idle_max_s) == (0.1, 0.2)
    h.core.polls.active("a", h.now)
    start = len(h.looked_at["a"])
    h.run_until(12_000)
    times = h.looked_at["a"][start:]
    assert max(b - a for a, b in itertools.pairwise(times)) <= 200 + 20
    # An idle interval below the fast one is raised to it, as the config's rule says.
    h.feed(sv.Reload(1.0, 0.5))
    assert (h.core.polls.base_s, h.core.polls.idle_max_s) == (1.0, 1.0)


def test_stale_channels_are_refreshed_once_after_ready_and_a_reloads_policy_after_it() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    core.handle(sv.Admitting(("a", "b")))
    core.handle(sv.LookDone("a", sv.Outcome.SERVED, stale=True))
    core.handle(sv.LookDone("b", sv.Outcome.SERVED, stale=False))
    assert core.is_stale("a")
    assert not core.is_stale("b")
    assert core.handle(sv.PolicyChanged(("b",))) == []  # before `ready`: waits for it
    assert core.handle(sv.Ready()) == [sv.Refresh(("a", "b"))]
    assert not core.is_stale("a")
    assert core.handle(sv.PolicyChanged(("a",))) == [sv.Refresh(("a",))]
    assert core.handle(sv.Reload(POLL_S, IDLE_S)) == []  # nothing stale left: nothing refreshed twice


def test_ready_refreshes_even_nothing_so_the_refresh_is_logged() -> None:
    assert sv.Serving(POLL_S, IDLE_S, QUANTUM_S).handle(sv.Ready()) == [sv.Refresh(())]


def test_after_stop_nothing_new_starts() -> None:
    h = Harness()
    h.core.handle(sv.Ready())
    h.stamps["a"] = stamp(1)
    h.core.polls.sync({"a"}, h.now)
    h.feed(sv.LookWanted(row("x")))
    assert h.feed(sv.Stop()) == []
    assert h.feed(sv.LookWanted(row("y"))) == []
    assert h.feed(sv.LookDone("x", sv.Outcome.SERVED)) == []  # no re-serve while stopping
    assert h.feed(sv.BalanceChanged(("a",))) == []
    assert h.feed(sv.PolicyChanged(("a",))) == []
    h.ms += 10_000
    assert h.feed(sv.Tick(h.now)) == []
    assert "a" not in h.looked_at


# --- republish --------------------------------------------------------------------------------------------


def test_a_balance_changed_during_its_republish_is_republished_again_and_a_failure_at_the_rescan() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    assert core.handle(sv.BalanceChanged(("a",))) == []  # before `ready`: waits
    assert core.handle(sv.Ready()) == [sv.Refresh(()), sv.Republish("a")]
    assert core.handle(sv.BalanceChanged(("a",))) == []  # one rewrite at a time per workspace
    assert core.handle(sv.Republished("a")) == [sv.Republish("a")]  # the newer balance
    assert core.handle(sv.Republished("a", failed=True)) == []
    assert core.handle(sv.BalanceChanged(())) == []  # a failed one waits for the rescan
    assert core.handle(sv.Rescan()) == [sv.Republish("a")]
    assert core.handle(sv.Republished("a")) == []
    assert core.handle(sv.Rescan()) == []


# --- paused, foreign, held elsewhere -----------------------------------------------------------------------


OTHER = StoreRef(store="0" * 32, state_dir="/other/state")
HELD = "served by another kernel (pid 42)"
FOUND = {
    sv.Outcome.FOREIGN: sv.LookDone("a", sv.Outcome.FOREIGN, owner=OTHER),
    sv.Outcome.HELD_ELSEWHERE: sv.LookDone("a", sv.Outcome.HELD_ELSEWHERE, why=HELD),
}


@pytest.mark.parametrize(
    ("outcome", "phase", "problem", "logged"),
    [
        (sv.Outcome.FOREIGN, sv.Phase.FOREIGN, sv.foreign_problem(OTHER), "channel_owned_elsewhere"),
        (sv.Outcome.HELD_ELSEWHERE, sv.Phase.HELD_ELSEWHERE, HELD, "channel_held_elsewhere"),
    ],
)
def test_a_channel_another_kernel_has_is_not_served_until_a_look_finds_it_ours(
    outcome: sv.Outcome, phase: sv.Phase, problem: str, logged: str
) -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    a = row("a")
    core.handle(sv.Admitting(("a",)))
    found = core.handle(FOUND[outcome])
    assert shows(found) == [sv.ShowProblem("a", problem)]
    assert logs(found) == [logged]
    assert core.phase("a") is phase
    assert core.problem("a") == problem
    assert served_keys(core, [a]) == set()
    # Found again at every rescan: logged and shown once.
    core.handle(sv.LookWanted(a))
    assert core.handle(FOUND[outcome]) == []
    # A look that cannot read the channel changes nothing of that (logged, not shown).
    core.handle(sv.LookWanted(a))
    assert logs(core.handle(sv.LookDone("a", sv.Outcome.PROBLEM, why="OSError: gone"))) == ["channel_problem"]
    assert core.phase("a") is phase
    assert core.problem("a") == problem
    # A turn still in flight when it was found does not clear what it shows.
    assert core.handle(sv.TurnOk("a")) == []
    core.handle(sv.LookWanted(a))
    served = core.handle(sv.LookDone("a", sv.Outcome.SERVED))
    assert served[-1] == sv.Reserve()
    if outcome is sv.Outcome.HELD_ELSEWHERE:
        assert logs(served) == ["channel_lock_taken"]
        assert shows(served) == [sv.ShowProblem("a", None, unless=HELD)]
    assert core.phase("a") is sv.Phase.SERVED
    assert served_keys(core, [a]) == {"a"}


def test_a_take_over_stops_serving_at_once_shows_it_once_and_a_look_takes_it_back() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    a = row("a")
    taken = core.handle(sv.TakenOver("a", OTHER))
    assert taken[-1] == sv.Reserve()
    assert shows(taken) == [sv.ShowProblem("a", sv.foreign_problem(OTHER))]
    assert logs(taken) == ["channel_owned_elsewhere"]
    assert "another kernel's store " + OTHER.store in sv.foreign_problem(OTHER)
    assert core.phase("a") is sv.Phase.FOREIGN
    assert served_keys(core, [a]) == set()
    assert core.handle(sv.TakenOver("a", OTHER)) == [sv.Reserve()]  # the refresh finds it too: shown once
    core.handle(sv.LookWanted(a))
    core.handle(sv.LookDone("a", sv.Outcome.SERVED))
    assert served_keys(core, [a]) == {"a"}


def test_paused_workspaces_are_not_served_and_their_looks_do_not_watch() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    a, b = row("a"), row("b")
    core.handle(sv.Paused(frozenset({"a"})))
    assert core.phase("a") is sv.Phase.PAUSED
    assert served_keys(core, [a, b]) == {"b"}
    assert core.handle(sv.LookWanted(a)) == [sv.Look(a, paused=True)]
    core.handle(sv.LookDone("a", sv.Outcome.SERVED))
    assert served_keys(core, [a, b]) == {"b"}  # still paused
    core.handle(sv.Paused(frozenset()))
    assert core.phase("a") is sv.Phase.SERVED
    assert served_keys(core, [a, b]) == {"a", "b"}
    assert core.paused() == frozenset()


def test_paused_wins_over_every_other_phase_and_a_look_in_flight_over_served() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    core.handle(sv.TakenOver("a"))
    core.handle(sv.Paused(frozenset({"a"})))
    assert core.phase("a") is sv.Phase.PAUSED
    core.handle(sv.LookWanted(row("b")))
    assert core.phase("b") is sv.Phase.LOOKING
    assert core.looking("b")
    assert core.phase("never-seen") is sv.Phase.SERVED


def test_only_the_lock_holder_serves() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    rows = [row("a"), row("b")]
    assert [r.key for r in core.served(rows, lambda key: key == "b")] == ["b"]


# --- watch state ------------------------------------------------------------------------------------------


def test_which_channels_are_polled_follows_what_each_watch_made() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    core.handle(sv.Admitting(("a", "b", "c")))
    core.handle(sv.LookDone("a", sv.Outcome.SERVED, polled=True))  # a network filesystem: polled
    core.handle(sv.LookDone("b", sv.Outcome.SERVED, polled=False))  # watched with inotify
    core.handle(sv.LookDone("c", sv.Outcome.SERVED))  # paused: no watch made
    assert core.polled() == {"a"}
    # The inotify watch limit: b falls back to polling; a's re-watch gets an inotify watch.
    core.handle(sv.Watched("b", polled=True))
    core.handle(sv.Watched("a", polled=False))
    assert core.polled() == {"b"}
    # A look that found the channel moved made no watch: what was made before stays.
    core.handle(sv.LookWanted(row("b")))
    core.handle(sv.LookDone("b", sv.Outcome.PROBLEM))
    assert core.is_polled("b")
    # No longer served: not polled (the poll schedule forgets it at its next sync).
    core.handle(sv.Unserved(("b",)))
    assert core.polled() == frozenset()


# --- a served workspace's problem: one owner ----------------------------------------------------------------


def test_a_turns_problem_is_shown_once_and_cleared_once_a_turn_opens_the_channel_again() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    failed = core.handle(sv.ChannelFailed("a", "ChannelMoved: .syscall was replaced"))
    assert shows(failed) == [sv.ShowProblem("a", "ChannelMoved: .syscall was replaced")]
    assert logs(failed) == ["channel_problem"]
    # Every turn meets it again (the rescan, events): logged and shown once.
    assert core.handle(sv.ChannelFailed("a", "ChannelMoved: .syscall was replaced")) == []
    assert core.problem("a") == "ChannelMoved: .syscall was replaced"
    ok = core.handle(sv.TurnOk("a"))
    assert shows(ok) == [sv.ShowProblem("a", None, unless="ChannelMoved: .syscall was replaced")]
    assert logs(ok) == ["channel_ok"]
    assert core.problem("a") is None
    assert core.handle(sv.TurnOk("a")) == []  # nothing shown: nothing to clear


def test_an_overdue_turn_shows_the_served_wording_and_its_return_clears_only_that() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    problem = sv.overdue_problem("12:00:00", 30.0, served=True)
    overdue = core.handle(sv.TurnOverdue("a", "12:00:00", 30.0))
    assert shows(overdue) == [sv.ShowProblem("a", problem)]
    assert "nothing more is started for this workspace until it returns" in problem
    returned = core.handle(sv.TurnReturned("a"))
    assert logs(returned) == ["channel_io_returned", "channel_ok"]
    assert shows(returned) == [sv.ShowProblem("a", None, unless=problem)]
    # The listing returned with an error: that one is the problem now, and a later return leaves it.
    core.handle(sv.TurnOverdue("a", "12:01:00", 30.0))
    core.handle(sv.ChannelFailed("a", "OSError: [Errno 5] Input/output error"))
    assert shows(core.handle(sv.TurnReturned("a"))) == []
    assert core.problem("a") == "OSError: [Errno 5] Input/output error"


def test_a_problem_an_earlier_run_recorded_is_cleared_by_the_first_turn_that_opens_the_channel() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    assert core.handle(sv.Shown((("a", "OSError: old"),))) == []
    assert core.problem("a") == "OSError: old"
    assert shows(core.handle(sv.TurnOk("a"))) == [sv.ShowProblem("a", None, unless="OSError: old")]
    # What the core decided since wins over a copy read back from the store.
    core.handle(sv.ChannelFailed("a", "OSError: new"))
    core.handle(sv.Shown((("a", "OSError: old"),)))
    assert core.problem("a") == "OSError: new"


def test_a_refresh_or_republish_failure_is_logged_once_and_not_shown_until_a_look_reads_the_channel() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    assert logs(core.handle(sv.ChannelFailed("a", "OSError: x", shown=False))) == ["channel_problem"]
    assert core.handle(sv.ChannelFailed("a", "OSError: x", shown=False)) == []
    assert core.problem("a") is None
    core.handle(sv.LookWanted(row("a")))
    core.handle(sv.LookDone("a", sv.Outcome.SERVED))
    assert logs(core.handle(sv.ChannelFailed("a", "OSError: x", shown=False))) == ["channel_problem"]


def test_an_overdue_look_of_a_served_workspace_is_not_cleared_by_its_turns() -> None:
    """A re-watch hangs while the workspace stays served: a turn that opens the channel meanwhile leaves the
    look's problem to the look's return."""
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    core.handle(sv.LookTaken("a", "a"))
    core.handle(sv.Overdue("a", "12:00:00", 30.0))
    assert core.handle(sv.TurnOk("a")) == []
    assert core.problem("a") == sv.overdue_problem("12:00:00", 30.0, served=False)
    core.handle(sv.Returned("a"))
    assert core.problem("a") is None


# --- unenrolled: forgotten ----------------------------------------------------------------------------------


def everything_of(core: sv.Serving, key: str) -> sv.Serving:
    """Give `key` every kind of entry the core keeps: a problem, a pause, stale files, a republish, a poll."""
    core.handle(sv.Ready())
    core.handle(sv.Admitting((key,)))
    core.handle(sv.LookDone(key, sv.Outcome.SERVED, stale=True, polled=True))
    core.polls.sync(set(core.polled()), 0.0)
    core.handle(sv.ChannelFailed(key, "OSError: x"))
    core.handle(sv.ChannelFailed(key, "OSError: y", shown=False))
    core.handle(sv.PolicyChanged(()))
    core.handle(sv.BalanceChanged((key,)))
    core.handle(sv.Republished(key, failed=True))
    core.handle(sv.Paused(frozenset({key})))
    assert key in core.known()
    return core


def test_an_unenrolled_workspace_is_forgotten() -> None:
    core = everything_of(sv.Serving(POLL_S, IDLE_S, QUANTUM_S), "a")
    everything_of(core, "b")
    assert core.handle(sv.Unenrolled(("a",))) == []
    assert core.known() == {"b"}
    assert "a" not in core.polls
    assert core.problem("a") is None
    assert core.handle(sv.Rescan()) == [sv.Republish("b")]  # a's failed republish is not tried again
    assert core.paused() == {"b"}


def test_an_unenrolled_workspace_with_a_look_in_flight_is_forgotten_once_it_returns() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    a = row("a")
    core.handle(sv.LookWanted(a))
    core.handle(sv.Overdue("a", "12:00:00", 30.0))
    core.handle(sv.Unenrolled(("a",)))
    assert core.phase("a") is sv.Phase.OVERDUE  # not served meanwhile
    assert logs(core.handle(sv.Returned("a"))) == ["channel_io_returned"]
    assert core.handle(sv.LookDone("a", sv.Outcome.SERVED, polled=True)) == []  # nobody's: not re-served
    assert core.known() == frozenset()
    assert not core.looking("a")


def test_a_workspace_enrolled_again_while_its_look_runs_is_served_when_it_returns() -> None:
    core = sv.Serving(POLL_S, IDLE_S, QUANTUM_S)
    a = row("a")
    core.handle(sv.LookWanted(a))
    core.handle(sv.Unenrolled(("a",)))
    core.handle(
        sv.LookWanted(a)
    )  # enrolled again (another process's `enroll`): its look is in flight already
    assert core.handle(sv.LookDone("a", sv.Outcome.SERVED)) == [sv.Reserve()]
    assert core.known() == frozenset()  # served, and nothing left to remember
