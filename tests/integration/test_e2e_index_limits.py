"""Issue 23, items 6 and 8, end to end: what the agent plants in its `.git` costs the kernel nothing before the
limit applies. A real kernel process, bwrap, the local backend, each workspace's installed tool.

- Item 6: four sparse `.git/sharedindex.<hex>` files of 512 MiB beside a plain index. The old kernel copied
  each into `state_dir/tmp` and read it whole (2 GiB written per sleep, repeatable at no cost); now only the one a
  split index names is read, so the sleep runs as if they were not there. A split index whose named shared index
  is a sparse 512 MiB file is refused from its size (`snapshot.failed`, nothing charged).
- Item 8: a real index of 300,000 entries (one blob) past `[snapshot] max_files = 1000`. The old kernel had git
  print every entry and held them all before counting (memory in proportion, seconds of work); now the header's
  count refuses it (`snapshot.too_large`, nothing charged) before an entry is read.

What the kernel wrote and its peak memory are read from /proc/<pid>/io (`wchar`) and /proc/<pid>/status (`VmHWM`).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernelproc import PLAIN_GIT, Kernel, make_workspace, plain_git, run_tool

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

MiB = 1 << 20
ENTRIES = 300_000


def proc_field(pid: int, name: str, key: str) -> int:
    for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
        k, _, v = line.partition(":")
        if k == key:
            return int(v.split()[0])
    raise AssertionError(f"no {key} in /proc/{pid}/{name}")


def sparse(path: Path, size: int, head: bytes) -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def budget(ws: Path) -> object:
    return json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]


def refused_sleep(k: Kernel, ws: Path, measure: tuple[str, str], code: str) -> tuple[dict[str, object], int]:
    """Launch and sleep through the tool; the sleep must be refused with `code` at no cost. (the error, how much
    the /proc/<kernel>/`measure` field grew meanwhile)."""
    assert k.proc is not None
    held = budget(ws)
    before = proc_field(k.proc.pid, *measure)
    launched = run_tool(ws, "launch", "--name", "hello", "--", "echo hi", timeout=60)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    done = run_tool(ws, "sleep", "--json", timeout=120)
    grown = proc_field(k.proc.pid, *measure) - before
    answer = json.loads(done.stdout)
    assert answer["type"] == "rejected", answer
    assert answer["error"]["code"] == code, answer
    assert budget(ws) == held
    return answer["error"], grown


def sleep_once(ws: Path) -> dict[str, object]:
    launched = run_tool(ws, "launch", "--name", "hello", "--", "echo hi", timeout=60)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    done = run_tool(ws, "sleep", "--wait", "--json", "--timeout", "90", timeout=120)
    return {"rc": done.returncode, "out": done.stdout, "err": done.stderr}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[tuple[Kernel, Path]]:
    tmp = tmp_path_factory.mktemp("index-limits")
    k = Kernel(tmp, 'jail = "bwrap"\n[snapshot]\nmax_files = 1000\n')
    spaces = tmp / "spaces"
    for name in ("planted", "split"):
        ws = make_workspace(spaces / name, {"a.txt": f"{name}\n"})
        k.enroll(ws, "--launches", "10", "--sleeps", "10")
    k.start()
    try:
        yield k, spaces
    finally:
        k.stop()


def test_planted_sharedindex_files_are_never_copied_and_the_sleep_runs(kernel: tuple[Kernel, Path]) -> None:
    k, spaces = kernel
    ws = spaces / "planted"
    for i in range(4):
        sparse(ws / ".git" / f"sharedindex.{i:040x}", 512 * MiB, b"DIRC\0\0\0\2\0\0\0\1")
    assert k.proc is not None
    before = proc_field(k.proc.pid, "io", "wchar")
    got = sleep_once(ws)
    written = proc_field(k.proc.pid, "io", "wchar") - before
    print(
        f"4 planted sparse sharedindex files of 512 MiB: the kernel wrote {written / MiB:.1f} MiB for the sleep"
    )
    assert got["rc"] == 0, got
    wake = json.loads(str(got["out"]))
    assert [t["state"] for t in wake["tasks"]] == ["COMPLETED"], wake
    assert written < 32 * MiB  # the old kernel: 2 GiB, every planted file copied into state_dir/tmp


def test_a_split_index_naming_a_huge_sharedindex_is_refused_at_no_cost(kernel: tuple[Kernel, Path]) -> None:
    k, spaces = kernel
    ws = spaces / "split"
    plain_git(ws, "update-index", "--split-index")
    [shared] = (ws / ".git").glob("sharedindex.*")
    sparse(shared, 512 * MiB, b"DIRC\0\0\0\2\0\0\0\1")
    error, written = refused_sleep(k, ws, ("io", "wchar"), "snapshot.failed")
    print(f"a named sharedindex of 512 MiB: {error}; the kernel wrote {written / MiB:.1f} MiB")
    assert shared.name in str(error["message"])
    assert written < 8 * MiB


def test_an_index_past_the_file_limit_is_refused_from_its_header(
    tmp_path: Path, bwrap_available: None
) -> None:
    """A kernel of its own: its peak memory is this sleep's alone."""
    k = Kernel(tmp_path, 'jail = "bwrap"\n[snapshot]\nmax_files = 1000\n')
    ws = make_workspace(tmp_path / "huge", {"a.txt": "huge\n"})
    k.enroll(ws, "--launches", "10", "--sleeps", "10")
    blob = plain_git(ws, "hash-object", "-w", "a.txt")
    lines = "".join(f"100644 {blob}\td{i % 1000}/f{i}\n" for i in range(ENTRIES))
    subprocess.run(
        ["git", "update-index", "--index-info"], cwd=ws, env=PLAIN_GIT, input=lines.encode(), check=True
    )
    size = (ws / ".git" / "index").stat().st_size
    k.start()
    try:
        error, grown = refused_sleep(k, ws, ("status", "VmHWM"), "snapshot.too_large")
    finally:
        k.stop()
    print(f"an index of {ENTRIES} entries ({size / MiB:.0f} MiB): {error}; peak grew {grown} KiB")
    assert f"holds {ENTRIES + 1} entries" in str(error["message"])  # with a.txt
    assert grown < 32 * 1024  # KiB; the old kernel held every entry git printed (~100 MiB at this size)
