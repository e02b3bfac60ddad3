"""Issue 23, items 5, 6 and 8: what the agent controls in a snapshot's listing (its tree's `.gitignore` files, its
index, the `sharedindex.*` files beside it) is bounded on the total, before the expensive step, and never blocks
the kernel (real git, real files; kernel.io.snapshot, kernel.io.gitlisting). The listing's tests run twice: with
the listing jail of a kernel whose jail is bwrap (kernel.node.jail.listing_bwrap_argv, real bwrap), and unjailed
(jail = none or apptainer).

The figures each test prints (`-s`) are measured, not asserted against a clock: what the snapshot read and wrote
(this process's /proc/self/io: the kernel copies the index itself, git only reads the copy) and how long it took.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kernelproc import plain_git

from kernel.io import gitlisting
from kernel.io import repo as R
from kernel.io import snapshot as S
from kernel.node.jail import JailPolicy

MiB = 1024 * 1024


def make_ws(tmp_path: Path, files: dict[str, str]) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir(parents=True)
    plain_git(ws, "init", "-q", "-b", "main")
    for rel, text in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    plain_git(ws, "add", "-A")
    plain_git(ws, "commit", "-qm", "init")
    return ws


@pytest.fixture(params=["none", pytest.param("bwrap", marks=pytest.mark.bwrap)])
def jail(request: pytest.FixtureRequest, tmp_path: Path) -> JailPolicy | None:
    """The listing's jail: None (unjailed), or bwrap's as the kernel builds it (kernel.io.snapshot.listing_jail)."""
    if request.param == "none":
        return None
    request.getfixturevalue("bwrap_available")
    return JailPolicy(kind="bwrap", hide=(str(tmp_path / "ktmp"), str(tmp_path / "run")))


def snap(ws: Path, tmp_path: Path, jail: JailPolicy | None = None, **kw: int) -> S.Snapshot:
    return S.snapshot_sync(
        ws, R.KernelRepo.at(tmp_path / "run", "ws-abc"), 1, tmp_dir=tmp_path / "ktmp", jail=jail, **kw
    )


def io_now() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


@contextmanager
def measured(what: str) -> Iterator[dict[str, float]]:
    """What the block read and wrote (bytes through read()/write() of this process) and its seconds, printed."""
    got: dict[str, float] = {}
    before, t0 = io_now(), time.monotonic()
    try:
        yield got
    finally:
        after = io_now()
        got.update(
            read=after["rchar"] - before["rchar"],
            written=after["wchar"] - before["wchar"],
            seconds=time.monotonic() - t0,
        )
        print(
            f"{what}: read {got['read'] / MiB:.2f} MiB, wrote {got['written'] / MiB:.2f} MiB, "
            f"{got['seconds'] * 1000:.0f} ms"
        )


def running_in(cwd: Path, within_s: float = 10.0) -> list[int]:
    """The live processes (zombies aside) whose working directory is `cwd`, once none is left or `within_s` has
    passed: a SIGKILLed process is gone only once the scheduler runs it, which a loaded machine can delay."""
    end = time.monotonic() + within_s
    while (found := _running_in(cwd)) and time.monotonic() < end:
        time.sleep(0.02)
    return found


def _running_in(cwd: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and os.readlink(f"/proc/{pid}/cwd") == str(cwd):
                found.append(int(pid))
        except OSError:
            continue
    return found


# --- item 5: a .gitignore git cannot open -----------------------------------------------------------------------


@pytest.mark.parametrize("where", [".gitignore", "sub/deep/.gitignore"])
def test_a_fifo_gitignore_is_refused_naming_it_without_waiting(
    tmp_path: Path, where: str, jail: JailPolicy | None
) -> None:
    ws = make_ws(tmp_path, {"a.txt": "a\n", "sub/deep/b.txt": "b\n"})
    os.mkfifo(ws / where)
    t0 = time.monotonic()
    with pytest.raises(S.SnapshotError, match=f"{where!r} in the workspace is a FIFO") as got:
        snap(ws, tmp_path, jail)
    print(
        f"refused in {(time.monotonic() - t0) * 1000:.0f} ms (STALL_S = {gitlisting.STALL_S} s): {got.value}"
    )
    assert not isinstance(got.value, S.SnapshotTooLarge)
    (ws / where).unlink()  # the fix the message names
    assert snap(ws, tmp_path, jail).files == 2


def test_a_fifo_the_agent_holds_open_for_writing_does_not_block(
    tmp_path: Path, jail: JailPolicy | None
) -> None:
    """With a writer, git's open() returns, and a FIFO's size is 0: git reads nothing from it."""
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    os.mkfifo(ws / ".gitignore")
    writer = os.open(ws / ".gitignore", os.O_RDWR)
    try:
        assert snap(ws, tmp_path, jail).files == 1
    finally:
        os.close(writer)


def test_the_deadline_holds_where_the_watch_cannot_tell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jail: JailPolicy | None
) -> None:
    """A `.gitignore` swapped for a FIFO after any check, on a machine where /proc does not say what git is blocked
    on: the deadline ends git (its process group killed) and the snapshot is the agent's SnapshotError, never the
    kernel's outage (the old kernel waited git's 600 s timeout and called it a RepoError: retried)."""
    ws = make_ws(tmp_path, {"a.txt": "a\n", "sub/b.txt": "b\n"})
    (ws / "sub" / ".gitignore").write_text("*.log\n")  # untracked: git reads it from the tree
    assert snap(ws, tmp_path, jail).files == 3  # the check: a regular .gitignore lists fine
    (ws / "sub" / ".gitignore").unlink()
    os.mkfifo(ws / "sub" / ".gitignore")  # the swap
    monkeypatch.setattr(gitlisting, "blocked_open", lambda pid: None)
    monkeypatch.setattr(S, "LIST_DEADLINE_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(
        S.SnapshotError, match=r"could not be listed within 0\.5 s \(a \.gitignore that is a FIFO"
    ):
        snap(ws, tmp_path, jail)
    took = time.monotonic() - t0
    print(f"refused at the deadline after {took * 1000:.0f} ms")
    assert took < 30  # far below git's own 600 s timeout: the listing did end at the deadline
    assert running_in(ws) == [], "git was left running"


def test_a_sparse_gitignore_of_gigabytes_takes_no_memory(tmp_path: Path, jail: JailPolicy | None) -> None:
    """git reads a `.gitignore` whole into memory: the old kernel's git allocated and read a sparse 4 GiB one (4 GiB
    resident, ~11 s, and as many as there are heavy slots at once). Its address space is capped now: malloc fails
    at once and the snapshot is the agent's SnapshotError saying so."""
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    sparse(ws / ".gitignore", 4096 * MiB)  # 4 GiB of holes: within what malloc grants unlimited
    t0 = time.monotonic()
    with pytest.raises(
        S.SnapshotError, match=r"Out of memory.*git may use \d+ bytes here: is a \.gitignore"
    ) as e:
        snap(ws, tmp_path, jail)
    print(f"refused in {(time.monotonic() - t0) * 1000:.0f} ms: {e.value}")


def test_the_untracked_listing_stops_at_the_file_limit(tmp_path: Path, jail: JailPolicy | None) -> None:
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    for i in range(3000):
        (ws / f"u{i}").write_text("")
    with pytest.raises(S.SnapshotTooLarge, match="more than 100 files unignored, past the snapshot limit"):
        snap(ws, tmp_path, jail, max_files=100)


def git_blocked_in(ws: Path, within: float) -> int:
    """The host pid of the listing git, this process's child (unjailed) or grandchild (through bwrap), once it is
    blocked in an open() inside `ws`."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except (OSError, ValueError):
                continue
            mine = os.getpid() in (parent, grandparent)
            if comm == "git" and mine and cwd == str(ws) and gitlisting.blocked_open(pid):
                return pid
        time.sleep(0.02)
    raise AssertionError(f"no listing git blocked in {ws} within {within} s")


@pytest.mark.bwrap
def test_the_listing_git_runs_in_the_jail_seeing_only_the_workspace_and_its_scratch_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bwrap_available: None
) -> None:
    """Seen from the host while git is blocked opening a FIFO `.gitignore` (the watch told to wait): git is pid 1
    of namespaces of its own (mount, pid, network, user, ipc, uts, cgroup), and in its mount namespace the
    workspace and the scratch git directory are read-only, while the rest of the kernel's tmp, the run directory,
    another workspace, /proc and the host's /etc/shadow are not there at all. The old kernel's git ran in the
    kernel's own namespaces, seeing all of it."""
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    other = make_ws(tmp_path / "other", {"secret.txt": "s\n"})
    (tmp_path / "ktmp").mkdir()
    (tmp_path / "ktmp" / "kernel-secret").write_text("k\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "marker").write_text("r\n")
    os.mkfifo(ws / ".gitignore")
    monkeypatch.setattr(gitlisting, "STALL_S", 120.0)
    jail = JailPolicy(kind="bwrap", hide=(str(tmp_path / "ktmp"), str(tmp_path / "run")))
    done: list[S.Snapshot] = []
    th = threading.Thread(target=lambda: done.append(snap(ws, tmp_path, jail)))
    th.start()
    try:
        pid = git_blocked_in(ws, 30)
        for ns in ("mnt", "pid", "net", "user", "ipc", "uts", "cgroup"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
        status = Path(f"/proc/{pid}/status").read_text()
        assert [ln.split()[-1] for ln in status.splitlines() if ln.startswith("NSpid:")] == ["1"]
        environ = dict(
            v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v
        )
        gitdir = os.fsdecode(environ[b"GIT_DIR"])
        assert gitdir.startswith(str(tmp_path / "ktmp")), gitdir
        root = f"/proc/{pid}/root"
        assert os.path.isfile(root + str(ws / "a.txt"))
        assert os.path.isfile(root + gitdir + "/index")
        for target in (ws / "planted", Path(gitdir) / "planted"):
            with pytest.raises(OSError, match="Read-only file system") as no:
                os.close(os.open(root + str(target), os.O_WRONLY | os.O_CREAT, 0o644))
            assert no.value.errno == errno.EROFS, target
        hidden = [other / "secret.txt", tmp_path / "ktmp" / "kernel-secret", tmp_path / "run" / "marker"]
        for gone in [*map(str, hidden), "/proc/1/status", "/etc/shadow"]:
            assert not os.path.lexists(root + gone), gone
    finally:
        os.close(os.open(ws / ".gitignore", os.O_WRONLY | os.O_NONBLOCK))  # a writer: git's open() returns
        th.join(60)
    assert [s.files for s in done] == [1]
    assert not (ws / "planted").exists()


@pytest.mark.bwrap
def test_a_listing_jail_that_cannot_start_is_the_kernels_side_not_the_agents(
    tmp_path: Path, bwrap_available: None
) -> None:
    """An operator's system_dirs without a shell: bwrap's own error is a RepoError (the dispatcher's
    ExecutorUnavailable, retried), never the agent's snapshot.failed."""
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    broken = JailPolicy(kind="bwrap", system_dirs=(str(tmp_path / "no-such-dir"),))
    with pytest.raises(R.RepoError, match=r"listing of .* could not start: bwrap: execvp /bin/sh") as got:
        snap(ws, tmp_path, broken)
    assert not isinstance(got.value, S.SnapshotError)
    with pytest.raises(gitlisting.ListingJailFailed, match="bwrap: Can't find source path"):
        listing(["true"], ws, JailPolicy(kind="bwrap"), readable=(str(tmp_path / "no-such-gitdir"),))


def listing(
    argv: list[str], cwd: Path, jail: JailPolicy | None = None, readable: tuple[str, ...] = (), **kw: int
) -> tuple[int, bytes, str]:
    limits = {"deadline": 30, "max_bytes": MiB, "max_records": None, "max_memory": 1024 * MiB, **kw}
    env = {"PATH": os.environ["PATH"]}
    return gitlisting.run_listing(argv, env, str(cwd), jail=jail, readable=readable, **limits)  # type: ignore[arg-type]


def test_the_runner_names_what_any_child_blocks_on_and_kills_its_group(
    tmp_path: Path, jail: JailPolicy | None
) -> None:
    """Jailed, the process is pid 1 of its namespace: killing it takes the grandchild too (the namespace ends)."""
    (tmp_path / "x").mkdir()
    os.mkfifo(tmp_path / "x" / "pipe")
    script = "sleep 300 & exec cat x/pipe"  # a grandchild in the same process group, then a blocking open
    with pytest.raises(gitlisting.ListingBlocked) as got:
        listing(["sh", "-c", script], tmp_path, jail)
    assert got.value.path == "x/pipe"
    assert running_in(tmp_path) == [], "the process group was left running"


def test_the_runner_stops_output_at_its_caps(tmp_path: Path, jail: JailPolicy | None) -> None:
    with pytest.raises(gitlisting.ListingTooLarge, match=f"more than {MiB} bytes of file names"):
        listing(["yes"], tmp_path, jail)  # endless output without a NUL
    with pytest.raises(gitlisting.ListingTooLarge, match="more than 1000 files"):
        listing(["sh", "-c", "while :; do printf 'f\\0'; done"], tmp_path, jail, max_records=1000)
    assert running_in(tmp_path) == []


def test_the_runner_caps_the_childs_memory(tmp_path: Path) -> None:
    rc, _, why = listing(
        ["python3", "-c", "b = bytearray(512 * 1024 * 1024)"], tmp_path, max_memory=128 * MiB
    )
    assert rc != 0, why
    assert "MemoryError" in why
    rc, _, _ = listing(["python3", "-c", "b = bytearray(16 * 1024 * 1024)"], tmp_path, max_memory=256 * MiB)
    assert rc == 0


# --- item 6: sharedindex files ----------------------------------------------------------------------------------


def sparse(path: Path, size: int, head: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def test_planted_sharedindex_files_are_never_copied(tmp_path: Path) -> None:
    """The old kernel copied every `sharedindex.<hex>` beside the index into its tmp (up to 512 MiB each, no cap
    on their number); only the one a split index's link extension names is read now, and this index names none."""
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    for i in range(4):
        sparse(ws / ".git" / f"sharedindex.{i:040x}", 256 * MiB, b"DIRC\0\0\0\2\0\0\0\1")
    with measured("4 planted sparse sharedindex files of 256 MiB") as got:
        s = snap(ws, tmp_path)
    assert s.files == 1
    assert got["written"] < 8 * MiB, got  # the old kernel: 1 GiB written into state_dir/tmp
    assert got["read"] < 8 * MiB, got


def test_a_split_index_naming_a_planted_huge_sharedindex_is_refused_from_its_size(tmp_path: Path) -> None:
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    plain_git(ws, "update-index", "--split-index")
    [shared] = (ws / ".git").glob("sharedindex.*")
    sparse(shared, 300 * MiB, b"DIRC\0\0\0\2\0\0\0\1")  # a header of 1 entry, 300 MiB of holes
    with (
        measured("a named sharedindex of 300 MiB claiming 1 entry") as got,
        pytest.raises(S.SnapshotError) as err,
    ):
        snap(ws, tmp_path)
    print(err.value)
    assert f"{shared.name} is {300 * MiB} bytes, more than the" in str(err.value)
    assert "an index of 1 entries may take here" in str(err.value)
    assert got["written"] < 1 * MiB, got
    assert got["read"] < 1 * MiB, got


def test_only_the_sharedindex_the_link_names_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = make_ws(tmp_path, {"a.txt": "a\n", "b.txt": "b\n"})
    plain_git(ws, "update-index", "--split-index")
    [real] = (ws / ".git").glob("sharedindex.*")
    decoy = ws / ".git" / f"sharedindex.{'f' * 40}"
    decoy.write_bytes(real.read_bytes())
    copied: list[str] = []
    write_bytes = Path.write_bytes

    def spy(self: Path, data: bytes) -> int:
        copied.append(self.name)
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", spy)
    assert snap(ws, tmp_path).files == 2
    assert [n for n in copied if n.startswith("sharedindex.")] == [real.name]


# --- item 8: the index's entry count --------------------------------------------------------------------------


def test_a_header_claiming_three_million_entries_is_refused_before_reading_on(tmp_path: Path) -> None:
    ws = make_ws(tmp_path, {"a.txt": "a\n"})
    index = ws / ".git" / "index"
    sparse(index, 250 * MiB, b"DIRC\0\0\0\2" + (3_000_000).to_bytes(4, "big"))
    claim = "a 250 MiB index whose header claims 3,000,000 entries"
    with (
        measured(claim) as got,
        pytest.raises(S.SnapshotTooLarge, match=r"\.git/index holds 3000000 ent") as err,
    ):
        snap(ws, tmp_path)
    print(err.value)
    assert "more than the snapshot limit of 200000 files" in str(err.value)
    assert got["read"] < 1 * MiB, got  # the header, not the 250 MiB
    assert got["written"] < 1 * MiB, got


def test_a_real_index_past_the_file_limit_is_refused_from_its_header(tmp_path: Path) -> None:
    ws = make_ws(tmp_path, {f"d{i % 50}/f{i}": "" for i in range(5000)})
    size = (ws / ".git" / "index").stat().st_size
    what = f"a real git index of 5000 entries ({size} bytes), limit 1000"
    with (
        measured(what) as got,
        pytest.raises(S.SnapshotTooLarge, match=r"\.git/index holds 5000 entries") as err,
    ):
        snap(ws, tmp_path, max_files=1000)
    print(err.value)
    assert got["read"] < size, got  # refused before the entries were read
    assert got["written"] < size, got


def test_a_listing_runs_beside_another_without_sharing_its_wait(
    tmp_path: Path, jail: JailPolicy | None
) -> None:
    """Two blocked listings at once are each refused on their own (nothing global is held while one waits)."""
    spaces = []
    for name in ("one", "two"):
        ws = make_ws(tmp_path / name, {"a.txt": "a\n"})
        os.mkfifo(ws / ".gitignore")
        spaces.append((ws, tmp_path / name))
    errors: list[BaseException] = []

    def run(ws: Path, t: Path) -> None:
        try:
            snap(ws, t, jail)
        except S.SnapshotError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=pair) for pair in spaces]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(errors) == 2, errors


def test_the_enrollments_tracked_channel_check_is_a_bounded_listing_too(
    tmp_path: Path, jail: JailPolicy | None
) -> None:
    """`enroll` asks which `.syscall/` paths the index tracks through the same bounded (and, with bwrap, jailed)
    listing as a snapshot, not a plain git on the host."""
    ws = make_ws(tmp_path, {"a.txt": "a\n", ".syscall/leak.json": "{}\n"})
    assert S.tracked_under(str(ws), ".syscall", jail) == [".syscall/leak.json"]
    (ws / ".git" / "index").write_bytes(b"DIRC\0\0\0\2\0\0\0\1" + b"\0" * 200)
    with pytest.raises(S.SnapshotError, match="index cannot be read"):
        S.tracked_under(str(ws), ".syscall", jail)
