"""A SIGHUP reaches every component that reads a live key (kernel.service.reload.LIVE), in process.

The service used to hand the merged config to four of its objects by hand; the executor's parts (the dispatcher,
the waker, the upkeep and the submit evaluation) kept the config they were built with, so
`[defaults.submit] share_baselines` was logged `changed=` and never reached a submit's plan. Now every component
reads the one `LiveConfig` the reload sets.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import msgspec
from _parts import TOOL

from kernel.core.config import Config, LiveConfig, load
from kernel.io.store import Store
from kernel.service import reload
from kernel.service.factory import executor_factory
from kernel.service.loop import Service
from kernel.service.notify import Notifier

BEFORE = """\
workspaces = ["{root}/one/*"]
rescan_seconds = 30
poll_seconds = 0.5
poll_idle_seconds = 4
batch_per_workspace = 8
batch_per_pass = 256
temp_grace_minutes = 10
stall_seconds = 60
channel_io_deadline_seconds = 10
heavy_io_deadline_seconds = 300
[defaults]
max_minutes = 60
[defaults.submit]
share_baselines = false
"""
AFTER = """\
workspaces = ["{root}/one/*", "{root}/two/*"]
rescan_seconds = 7
poll_seconds = 0.25
poll_idle_seconds = 9
batch_per_workspace = 3
batch_per_pass = 99
temp_grace_minutes = 2
stall_seconds = 11
channel_io_deadline_seconds = 4
heavy_io_deadline_seconds = 42
[defaults]
max_minutes = 30
[defaults.submit]
share_baselines = true
"""
# What the kernel keeps until a restart is the same in both files.
KEPT = 'backend = "local"\njail = "none"\nstate_dir = "{root}/state"\n'

# (the key, who reads it, how it reads it): each component that reads a live key, as it reads it.
READERS: list[tuple[str, str, Callable[[Service], object]]] = [
    ("workspaces", "the enrollment's globs", lambda s: s.enroller.cfg.workspaces),
    ("defaults", "the policies the service reapplies and admits", lambda s: s.cfg.defaults),
    ("defaults", "the enrollment of new workspaces", lambda s: s.enroller.cfg.defaults),
    (
        "defaults.share_baselines",
        "the submit plan's baseline key",
        lambda s: s.executor.evaluation.cfg.defaults.share_baselines,  # type: ignore[attr-defined]
    ),
    ("rescan_seconds", "the service loop's rescan", lambda s: s.cfg.rescan_seconds),
    ("poll_seconds", "the service loop's poll tick", lambda s: s.cfg.poll_seconds),
    ("poll_seconds", "the poll schedule's fast interval", lambda s: s.polls.base_s),
    ("poll_idle_seconds", "the poll schedule's idle interval", lambda s: s.polls.idle_max_s),
    ("batch_per_workspace", "the pipeline's turns", lambda s: s.pipeline.cfg.batch_per_workspace),
    ("batch_per_pass", "the pipeline's passes", lambda s: s.pipeline.cfg.batch_per_pass),
    ("temp_grace_minutes", "the pipeline's temp ageing", lambda s: s.pipeline.cfg.temp_grace_minutes),
    ("stall_seconds", "the service's health", lambda s: s.cfg.stall_seconds),
    (
        "channel_io_deadline_seconds",
        "the request path's channel I/O pool",
        lambda s: s.pipeline.chanio.deadline,
    ),
    ("channel_io_deadline_seconds", "the look pool", lambda s: s.looks.deadline),
    (
        "heavy_io_deadline_seconds",
        "the executor's heavy pool",
        lambda s: s.executor.heavy.deadline,  # type: ignore[attr-defined]
    ),
]


def configs_in(root: object) -> Iterator[tuple[str, Config]]:
    """Every Config reachable from `root` through the attributes of kernel objects (and the containers they
    hold), with the path it was reached by."""
    seen: set[int] = set()
    todo: list[tuple[str, object]] = [("svc", root)]
    while todo:
        path, obj = todo.pop(0)  # breadth first: each found by its shortest path
        if isinstance(obj, Config):
            yield path, obj  # each holder of it, not only the first
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            continue
        if isinstance(obj, list | tuple | set | frozenset):
            todo += [(f"{path}[]", v) for v in obj]
            continue
        if not type(obj).__module__.startswith(("kernel.", "channel.")) or isinstance(obj, msgspec.Struct):
            continue
        names = list(getattr(obj, "__dict__", {}))
        names += [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
        todo += [(f"{path}.{n}", getattr(obj, n)) for n in names if hasattr(obj, n)]


def live_view(cfg: Config) -> dict[str, object]:
    return {k: getattr(cfg, k) for k in sorted(reload.LIVE)}


def test_every_reader_of_a_live_key_sees_the_reloaded_value(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(KEPT.format(root=tmp_path) + BEFORE.format(root=tmp_path))
    cfg = load(config)
    (tmp_path / "state").mkdir()
    store = Store.open(cfg.paths.store)
    live = LiveConfig(cfg)
    svc = Service(live, store, Notifier(None, None), TOOL, executor_factory(live))
    backend = svc.executor.backend  # type: ignore[attr-defined]

    async def reload_while_the_backend_runs() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)
            await svc.reload()
            tg.cancel_scope.cancel()

    try:
        config.write_text(KEPT.format(root=tmp_path) + AFTER.format(root=tmp_path))
        anyio.run(reload_while_the_backend_runs)
        new = load(config)
        _, applied, kept = reload.merge(cfg, new)
        assert {key.split(".")[0] for key in applied} == set(reload.LIVE), "every live key changed"
        assert not kept, "nothing is kept"
        # Every live key has its readers listed here, and every one of them sees the new value.
        assert {key.split(".")[0] for key, _, _ in READERS} == set(reload.LIVE)
        stale = []
        for key, who, read in READERS:
            want = operator.attrgetter(key)(new)
            if read(svc) != want:
                stale.append(f"{key}: {who} reads {read(svc)!r}, not {want!r}")
        assert not stale, stale
        # And no component kept a config of its own: every config reachable from the service is the new one.
        found = list(configs_in(svc))
        assert found
        old = [path for path, c in found if live_view(c) != live_view(new)]
        assert not old, f"configs from before the reload, at {old}"
    finally:
        store.close()


def test_the_health_check_follows_a_reloaded_stall_limit(tmp_path: Path) -> None:
    """What a reader does with the value, for one key: a pass running 30 s is a stall under the new 11 s limit."""
    config = tmp_path / "config.toml"
    config.write_text(KEPT.format(root=tmp_path) + BEFORE.format(root=tmp_path))
    cfg = load(config)
    (tmp_path / "state").mkdir()
    store = Store.open(cfg.paths.store)
    svc = Service(LiveConfig(cfg), store, Notifier(None, None), TOOL)
    try:
        svc.pipeline.pass_started = time.time() - 30
        assert svc.healthy()
        config.write_text(KEPT.format(root=tmp_path) + AFTER.format(root=tmp_path))
        anyio.run(svc.reload)
        assert not svc.healthy()
    finally:
        store.close()


def test_the_operator_guide_names_what_a_reload_applies_and_what_it_keeps() -> None:
    """docs/operator.md's SIGHUP paragraph: every live key under "Applied live", every other key under "kept"."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    para = " ".join(text.split("reads the config file again between two passes.", 1)[1].split())
    applied, kept = para.split("Every other key", 1)
    kept = kept.split("is kept until a restart", 1)[0]

    def keys(part: str) -> set[str]:
        named = {m.strip("[]") for m in re.findall(r"`([^`]+)`", part)}
        fields = set(Config.__struct_fields__) - {"source"}
        return {
            f for f in fields if f in named or any(n.endswith("*") and f.startswith(n[:-1]) for n in named)
        }

    assert keys(applied) == set(reload.LIVE)
    assert keys(kept) == set(Config.__struct_fields__) - set(reload.LIVE) - {"source"}
