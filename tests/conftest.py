"""Shared test configuration.

Tests that need a real component (bubblewrap, the throwaway Slurm cluster) carry the `bwrap` or `slurm` marker
and call `need(...)`. Outside CI a missing component skips the test; with `CI=true` it fails it, because CI must
exercise the real thing.

`./dev test` runs the tiers in parallel (pytest-xdist, `--dist loadgroup`); `pytest_collection_modifyitems` below
decides what may run beside what. Every test gets its own `tmp_path` and picks free ports, so tests are safe to
run concurrently unless they share something, and what they share is grouped onto one worker, run in order:
- the tests that use a throwaway Slurm cluster (the `slurm` marker or the `slurm_conf` fixture): several stop its
  controller for 30 s or fill its only node, which would fail or stall any other test using it. `./dev test`
  starts several clusters (SYSCALL_TEST_SLURM_CONFS); each module of such tests is given one of them, in turn,
  and the modules given the same cluster form one group;
- the tests of a module, class or package-scoped fixture (one kernel serving a module's scenarios): split over
  workers each would build its own, and some start background work that a later test of the module reads.
Groups and tests marked `slow` are sent first so that the longest work is not left for the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testenv import IN_CI, ROOT, need, python38

from kernel.io import stepguard

__all__ = ["IN_CI", "ROOT", "need"]


SLURM_GROUP = "slurm-cluster-"
SHARED_SCOPES = ("module", "class", "package")
# module path (`tests/integration/test_x.py`) -> the index of its cluster in slurm_confs(), set at collection
CLUSTER_OF = pytest.StashKey[dict[str, int]]()


def slurm_confs() -> list[str]:
    """The SLURM_CONF of every throwaway cluster `./dev test` started (SLURM_CONF alone when it started one)."""
    confs = [c for c in os.environ.get("SYSCALL_TEST_SLURM_CONFS", "").split(os.pathsep) if c]
    return confs or [os.environ.get("SLURM_CONF", "")]


def uses_slurm(item: pytest.Item) -> bool:
    return item.get_closest_marker("slurm") is not None or "slurm_conf" in getattr(item, "fixturenames", ())


def module_path(node: pytest.Item | pytest.Collector) -> str:
    return node.nodeid.split("::")[0]


def xdist_group(item: pytest.Item, cluster_of: dict[str, int]) -> str | None:
    """The one group `item` runs in under `--dist loadgroup`, or None (it may run anywhere, beside anything)."""
    marked = [
        m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")
    ]
    if marked:
        return str(marked[0])
    if uses_slurm(item):
        return f"{SLURM_GROUP}{cluster_of[module_path(item)]}"
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        if defs and defs[-1].scope in SHARED_SCOPES:
            return module_path(item)
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group markers into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a worker has dist "no" and xdist's `loadgroup` flag; the controller (which collects only for
    # --collect-only) has dist "loadgroup"
    if (
        not getattr(config.option, "loadgroup", False)
        and config.getoption("dist", default="no") != "loadgroup"
    ):
        return
    # every worker collects the same items in the same order, so each computes the same clusters and groups
    cluster_of: dict[str, int] = {}
    for item in items:
        if uses_slurm(item):
            cluster_of.setdefault(module_path(item), len(cluster_of) % len(slurm_confs()))
    config.stash[CLUSTER_OF] = cluster_of
    first: list[pytest.Item] = []
    slow: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        group = xdist_group(item, cluster_of)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if group is not None and group.startswith(SLURM_GROUP):
            first.append(item)
        elif item.get_closest_marker("slow") is not None or group is not None:
            slow.append(item)
        else:
            rest.append(item)
    items[:] = first + slow + rest


def pytest_collection_finish(session: pytest.Session) -> None:
    # The groups reach xdist's scheduler only as an `@group` suffix that xdist writes into each node id; were that
    # lost (pytest 9.2 with xdist 3.8: pytest-dev/pytest-xdist#1386), every group would be spread over the
    # workers in silence and the Slurm tests would stop each other's controller.
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} tests (the first: {lost[0]})")


def bwrap_works() -> tuple[bool, str]:
    exe = shutil.which("bwrap")
    if exe is None:
        return False, "bwrap is not installed (apt-get install bubblewrap)"
    probe = subprocess.run(
        [exe, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {probe.stderr.strip()}"
    return True, ""


@pytest.fixture(scope="session")
def bwrap_available() -> None:
    ok, why = bwrap_works()
    need("bubblewrap", ok, why)


@pytest.fixture(scope="module")
def slurm_conf(request: pytest.FixtureRequest) -> Path:
    """The SLURM_CONF of the throwaway cluster that `./dev test` started for this module's tests (their group's
    own under xdist, the first otherwise)."""
    conf = slurm_confs()[request.config.stash.get(CLUSTER_OF, {}).get(module_path(request.node), 0)]
    ok = bool(conf) and Path(conf).is_file() and shutil.which("sbatch") is not None
    need("slurm", ok, "no throwaway cluster is running (run the tests through ./dev test)")
    return Path(conf)


# Every store step of an in-process service in these tests runs under the guard: a filesystem call it makes
# fails the call and the test (kernel.io.stepguard).
stepguard.install()


@pytest.fixture(scope="session")
def py38() -> str:
    """The oldest Python the tool supports (3.8), for the MCP server's tests; CI must have it."""
    exe, why = python38()
    if exe is None:
        if IN_CI:
            pytest.fail(f"{why} (CI=true: the MCP server must be tested on the tool's oldest Python, 3.8)")
        pytest.skip(why)
    return exe


@pytest.fixture(autouse=True)
def no_file_calls_in_store_steps() -> Iterator[None]:
    stepguard.clear()
    yield
    found = stepguard.found()
    stepguard.clear()
    assert not found, "store steps touched the filesystem (they hold the store's lock):\n" + "\n".join(found)
