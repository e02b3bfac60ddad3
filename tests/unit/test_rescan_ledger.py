"""The rescan's ledger (kernel.core.polling.RescanLedger), with a fake clock and fake evidence: which served
channels a rescan checks in full (listing and owner read), and why an unchanged one is trusted without its
server's clock."""

from __future__ import annotations

from kernel.core.polling import DirStamp, Evidence, RescanLedger

RACY = 2.0
OWNER = (1, 7, 300, 5, 5)


def ev(mtime_ns: int = 5, ino: int = 1, owner: tuple[int, int, int, int, int] | None = OWNER) -> Evidence:
    return DirStamp(1, ino, mtime_ns, mtime_ns, 4096, 2), owner


def look(led: RescanLedger, key: str, evidence: Evidence, now: float) -> bool:
    """A look at `key` when due (it must be)."""
    assert key in led.due(now, 100), (key, now)
    return led.looked(key, evidence, 0, now)


def served(now: float = 0.0, *keys: str) -> RescanLedger:
    led = RescanLedger(racy_s=RACY)
    led.sync(set(keys) or {"a"}, now)
    return led


def confirmed() -> RescanLedger:
    """A ledger whose channel "a" was served at 0 and confirmed (its evidence `ev()` trusted) at RACY."""
    led = served(0.0)
    look(led, "a", ev(), 0.0)
    look(led, "a", ev(), RACY)
    led.checked("a", RACY)
    assert led.trusted("a")
    return led


def test_a_new_channel_is_confirmed_racy_s_after_its_first_look_then_costs_no_check() -> None:
    led = served(0.0)
    assert look(led, "a", ev(), 0.0) is False  # just served: its admission and first listing just ran
    assert led.next_at() == RACY  # looked at again then, to confirm it
    assert led.due(RACY - 0.1, 10) == []
    assert look(led, "a", ev(), RACY) is True  # the confirming check
    led.checked("a", RACY)
    assert led.trusted("a")
    assert led.next_at() is None  # nothing due until the next rescan
    for rescan in (30.0, 60.0, 90.0):
        led.rescan(rescan)
        assert look(led, "a", ev(), rescan) is False  # unchanged: no listing, no owner read
    assert led.next_at() is None


def test_a_check_begun_too_soon_after_the_first_look_confirms_nothing() -> None:
    """The server's clock may run behind ours: a request renamed in within one timestamp tick of the change
    we saw leaves the evidence equal. Only a check begun `racy_s` after the first look is sure to have seen
    it; one begun earlier leaves the evidence unconfirmed, and the next look checks it again."""
    led = served(0.0)
    look(led, "a", ev(), 0.0)
    led.checked("a", 1.0)  # e.g. the first sweep, begun 1 s after the look
    assert not led.trusted("a")
    assert look(led, "a", ev(), RACY) is True  # equal evidence, still checked
    led.checked("a", RACY)
    assert led.trusted("a")


def test_changed_evidence_is_checked_at_the_rescan_that_sees_it_and_confirmed_later() -> None:
    led = confirmed()
    led.rescan(30.0)
    assert look(led, "a", ev(mtime_ns=9), 30.0) is True  # a new request, or a take-over's kernel.json
    led.checked("a", 30.1)
    assert not led.trusted("a")  # begun within racy_s of the first look at this evidence
    assert led.next_at() == 30.0 + RACY
    assert look(led, "a", ev(mtime_ns=9), 30.0 + RACY) is True
    led.checked("a", 30.0 + RACY)
    assert led.trusted("a")
    led.rescan(60.0)
    assert look(led, "a", ev(mtime_ns=9), 60.0) is False


def test_a_new_kernel_json_is_checked_though_requests_is_unchanged() -> None:
    led = confirmed()
    led.rescan(30.0)
    assert look(led, "a", ev(owner=(1, 8, 300, 9, 9)), 30.0) is True  # another kernel's store took it over


def test_evidence_that_changes_back_is_checked_again() -> None:
    """The channel was swapped away (its check failed, so nothing confirmed) and back: trust is not restored."""
    led = confirmed()
    led.rescan(30.0)
    assert look(led, "a", ev(ino=99), 30.0) is True  # swapped: the check fails (no `checked`)
    led.rescan(60.0)
    assert look(led, "a", ev(), 60.0) is True  # back as it was: checked, not taken as trusted


def test_a_failed_stat_is_checked_at_every_rescan_and_never_trusted() -> None:
    led = served(0.0)
    for now in (0.0, 30.0, 60.0):
        led.rescan(now)
        assert look(led, "a", ev(owner=None), now) is True
        led.checked("a", now + 5)
        assert not led.trusted("a")
    led.rescan(90.0)
    assert look(led, "a", (None, OWNER), 90.0) is True


def test_a_look_in_flight_is_never_asked_for_twice_and_a_skipped_one_comes_back() -> None:
    led = served(0.0, "a", "b")
    assert sorted(led.due(0.0, 10)) == ["a", "b"]
    led.rescan(1.0)  # the rescan does not queue a look in flight again
    assert led.due(1.0, 10) == []
    led.skipped("b", 1.0)
    assert led.next_at() == 1.0 + RACY
    assert led.due(1.0 + RACY, 10) == ["b"]
    assert led.looked("a", ev(), 0, 3.0) is False


def test_sync_follows_the_served_set_and_due_respects_the_limit() -> None:
    led = served(0.0, *(f"k{i}" for i in range(10)))
    taken = led.due(0.0, 4)
    assert len(taken) == 4
    led.sync({"k0", "new"}, 1.0)
    assert led.keys() == {"k0", "new"}
    assert set(led.due(1.0, 10)) == {"new"} | ({"k0"} - set(taken))
