"""A request that arrives while the service loop is idle is started where the watcher hands it over
(`Service._arrived` -> `Pipeline.start_now`): its channel I/O is on a pool thread before the loop runs anything
else. In process, with a real store, real enrollment, real inotify and real directories."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
from _parts import TOOL, ReadyNotifier, enrolled

from kernel.core.config import LiveConfig, parse
from kernel.io.store import Store
from kernel.service.loop import Service


def test_a_request_to_an_idle_kernel_starts_its_turn_where_the_event_is_handed_over(tmp_path: Path) -> None:
    cfg = parse(f'state_dir = "{tmp_path}/state"\n', "<test>", env={})
    store = Store.open(cfg.paths.store)
    ws, row = enrolled(tmp_path, store, cfg)
    notifier = ReadyNotifier()
    svc = Service(LiveConfig(cfg), store, notifier, TOOL)
    began: list[tuple[str, bool]] = []
    real = svc.pipeline.start_now

    def spy(key: str, *args: object) -> bool:
        ok = real(key, *args)  # type: ignore[arg-type]
        began.append((key, ok))
        return ok

    svc.pipeline.start_now = spy  # type: ignore[method-assign]
    answer = ws / ".syscall" / "answers" / "s1.json"

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            with anyio.fail_after(20):
                await notifier.is_ready.wait()
                while svc.pipeline.inflight or svc.pipeline.has_work():  # noqa: ASYNC110 - the sweep after `ready`
                    await anyio.sleep(0.05)
                await anyio.sleep(0.2)
            req = ws / ".syscall" / "requests"
            (req / ".s1.tmp").write_text(json.dumps({"protocol": 1, "id": "s1", "type": "status"}))
            (req / ".s1.tmp").rename(req / "s1.json")
            with anyio.fail_after(10):
                while not answer.exists():  # noqa: ASYNC110 - a file, not an event
                    await anyio.sleep(0.01)
            svc.stop("test")
        assert (row.key, True) in began, f"the turn was not started at the hand-over: {began}"
        assert json.loads(answer.read_text())["id"] == "s1"

    try:
        anyio.run(main)
    finally:
        store.close()
