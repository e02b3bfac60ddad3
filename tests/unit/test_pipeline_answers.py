"""Answers are never lost: an answer the kernel cannot write keeps its request, and is delivered once it can
(spec 3.4, 7.1). Real store, real enrollment, real directories."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from _parts import enrolled

from kernel.core.config import Config, LiveConfig
from kernel.io.store import Store, StoreWorker
from kernel.service.executor import PendingExecutor
from kernel.service.pipeline import Pipeline


def put(ch: Path, rid: str) -> Path:
    req = ch / "requests" / f"{rid}.json"
    tmp = ch / "requests" / f".{rid}.tmp"
    tmp.write_text(json.dumps({"protocol": 1, "id": rid, "type": "status"}))
    tmp.rename(req)
    return req


@pytest.mark.parametrize("block", ["symlink", "directory in the way"])
def test_a_blocked_answer_keeps_its_request_and_is_delivered_once_unblocked(
    tmp_path: Path, cfg: Config, store: Store, block: str
) -> None:
    ws, row = enrolled(tmp_path, store, cfg)
    ch = ws / ".syscall"
    worker = StoreWorker(store)
    pipeline = Pipeline(LiveConfig(cfg), worker, PendingExecutor(worker))
    pipeline.set_workspaces([row])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    answers = ch / "answers"
    if block == "symlink":
        answers.rename(ch / "answers.real")
        answers.symlink_to(elsewhere)
    else:
        (answers / "s1.json").mkdir()

    req = put(ch, "s1")
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    assert req.exists(), "the request of an answer that could not be written must stay for a retry"
    assert pipeline.answered == 0
    assert list(elsewhere.iterdir()) == []  # never written through the symlink
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)  # retried, still blocked: still kept
    assert req.exists()

    if block == "symlink":
        answers.unlink()
        (ch / "answers.real").rename(answers)
    else:
        (answers / "s1.json").rmdir()
    pipeline.mark(row.key)  # the next listing (an event, the poll or the rescan)
    anyio.run(pipeline.run_pass)
    assert not req.exists()
    answer = json.loads((answers / "s1.json").read_text())
    assert (answer["id"], answer["type"]) == ("s1", "status")
    assert pipeline.answered == 1


def test_an_event_that_names_its_request_reads_only_that_request(
    tmp_path: Path, cfg: Config, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel full of temp names is not listed for every request: the event's name is enough; a name that
    is not a request, or no name, lists in full (and the rescan always does)."""
    from channel import safefs

    ws, row = enrolled(tmp_path, store, cfg)
    ch = ws / ".syscall"
    for i in range(2000):
        (ch / "requests" / f".t{i:05d}.tmp").write_bytes(b"{")
    listings = 0
    real = safefs.Channel.scan_requests

    def counting(self: safefs.Channel) -> safefs.RequestListing:
        nonlocal listings
        listings += 1
        return real(self)

    monkeypatch.setattr(safefs.Channel, "scan_requests", counting)
    worker = StoreWorker(store)
    pipeline = Pipeline(LiveConfig(cfg), worker, PendingExecutor(worker))
    pipeline.set_workspaces([row])
    for i in range(5):
        put(ch, f"r{i}")
        pipeline.mark(row.key, [f"r{i}.json"])
        anyio.run(pipeline.run_pass)
        assert (ch / "answers" / f"r{i}.json").exists()
    assert listings == 0

    (ch / "requests" / "junk").write_bytes(b"")
    pipeline.mark(row.key, ["junk"])
    anyio.run(pipeline.run_pass)
    anyio.run(pipeline.run_pass)
    assert listings == 1
    assert not (ch / "requests" / "junk").exists()

    put(ch, "r9")
    pipeline.mark(row.key)  # no names (the rescan, a lost watch): listed in full
    anyio.run(pipeline.run_pass)
    assert listings == 2
    assert (ch / "answers" / "r9.json").exists()


def test_a_read_only_answer_is_shown_before_its_record_is_synced_and_its_request_removed_after(
    tmp_path: Path, cfg: Config, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status answer is recorded without the WAL's fsync and shown at once; the store is synced (once per
    turn) before any of the turn's requests is removed, so a removed request always has a durable record."""
    ws, row = enrolled(tmp_path, store, cfg)
    ch = ws / ".syscall"
    worker = StoreWorker(store)
    pipeline = Pipeline(LiveConfig(cfg), worker, PendingExecutor(worker))
    pipeline.set_workspaces([row])
    seen: list[tuple[bool, bool, bool, bool]] = []
    real_sync = store.sync_wal

    def sync_wal() -> None:
        # At the sync: both answers shown, both requests still there.
        seen.append(
            (
                (ch / "answers" / "s1.json").exists(),
                (ch / "answers" / "s2.json").exists(),
                (ch / "requests" / "s1.json").exists(),
                (ch / "requests" / "s2.json").exists(),
            )
        )
        real_sync()

    monkeypatch.setattr(store, "sync_wal", sync_wal)
    put(ch, "s1")
    put(ch, "s2")
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    assert seen == [(True, True, True, True)], "one sync per turn, after the answers, before the removals"
    assert not (ch / "requests" / "s1.json").exists()
    assert not (ch / "requests" / "s2.json").exists()
    assert pipeline.answered == 2
    recorded = store.request(row.key, "s1")
    assert recorded is not None
    assert recorded.answer == (ch / "answers" / "s1.json").read_bytes()


def test_a_replayed_answer_is_synced_before_its_request_is_removed(
    tmp_path: Path, cfg: Config, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request answered before (its record possibly committed by a killed process without the WAL's fsync)
    and committed again with the same bytes is replayed, and the store is synced before the request goes."""
    ws, row = enrolled(tmp_path, store, cfg)
    ch = ws / ".syscall"
    worker = StoreWorker(store)
    pipeline = Pipeline(LiveConfig(cfg), worker, PendingExecutor(worker))
    pipeline.set_workspaces([row])
    put(ch, "s1")
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    first = (ch / "answers" / "s1.json").read_bytes()
    (ch / "answers" / "s1.json").write_bytes(b"")  # torn, as by a power cut
    req = ch / "requests" / "s1.json"
    req.write_bytes(b"")
    seen: list[bool] = []
    real_sync = store.sync_wal
    monkeypatch.setattr(store, "sync_wal", lambda: (seen.append(req.exists()), real_sync())[1])
    put(ch, "s1")
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    assert seen == [True], "synced once, while the request was still there"
    assert not req.exists()
    assert (ch / "answers" / "s1.json").read_bytes() == first
