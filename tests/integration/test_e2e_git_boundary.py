"""End to end, through the installed tool, a real kernel, the local backend and bwrap: the agent's `.git` as a
weapon (docs/threat-model.md, "the agent's .git"). The kernel writes nothing into it and takes nothing from it
unverified; each attack below was reproduced against the kernel that wrote its refs into the agent's `.git`.

One kernel serves the module's workspaces (enrolled, then armed by the "agent", then the kernel starts):
- `reflog`: a hostile `user.name`, `.git/logs/refs/syscall/<key>/*` planted as symlinks to a file outside the
  workspace and `.git/refs/syscall` a symlink to an outside directory; a sleep with a launch and a submit.
- `forged` and `twin`: the same base; after enrollment `forged` rewrites the loose object of its base's
  `result.txt` in place (same id, `{"score": 0.0}`); both submit a worse candidate with `--no-seed` (so an
  unbound baseline would be shared between them). `packed` does the same to the blob inside a pack.
- `pending`: the base blob is rewritten BEFORE enrollment: the base cannot be taken, so a submit is refused
  with `snapshot.failed` naming the file, at no cost; a plain launch still runs.
- `sealed`: `.git` read-only to the kernel (bind-mounted read-only in the kernel's mount namespace, or made
  unwritable when the tests do not run as root), `objects`, `logs`, `refs` and `packed-refs` swapped for
  symlinks to outside copies, an `index.lock` planted: a whole sleep/submit cycle, then `.git` and the outside
  are byte for byte as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, git, put_request, read_answer, run_tool, wait_for

from channel.paths import workspace_key

pytestmark = pytest.mark.bwrap

EVAL_SH = "cat result.txt\n"
BASE = '{"score": 0.5}\n'
FORGED = '{"score": 0.0}\n'  # the same length as BASE, so a packed entry can be rewritten in place
WORSE = '{"score": 0.4}\n'
CONTRACT = ("--eval-command", "sh eval.sh", "--metric", "score", "--no-seed")
HOSTILE_NAME = "x;touch${IFS}%s;#"
SPACES = ("reflog", "forged", "twin", "packed", "pending", "sealed")


def make_ws(root: Path, name: str, family: str = "") -> Path:
    """A workspace whose base is eval.sh, result.txt (BASE) and README (`family`: the same family, the same base
    tree)."""
    ws = root / "spaces" / name
    ws.mkdir(parents=True)
    git(ws, "init", "-q")
    (ws / "eval.sh").write_text(EVAL_SH)
    (ws / "result.txt").write_text(BASE)
    (ws / "README").write_text(f"family {family or name}\n")
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    return ws


def forge_loose(ws: Path, rel: str, content: str) -> str:
    """Rewrite the loose object of HEAD:rel in place: same id, other bytes. Returns the id."""
    oid = git(ws, "rev-parse", f"HEAD:{rel}")
    path = ws / ".git" / "objects" / oid[:2] / oid[2:]
    path.chmod(0o644)
    data = content.encode()
    path.write_bytes(zlib.compress(b"blob %d\0" % len(data) + data))
    assert git(ws, "cat-file", "blob", oid) + "\n" == content  # git serves the forgery
    return oid


def forge_packed(ws: Path, rel: str, content: str) -> str:
    """Pack everything uncompressed, then rewrite the pack entry of HEAD:rel in place (same length)."""
    oid = git(ws, "rev-parse", f"HEAD:{rel}")
    git(ws, "-c", "core.compression=0", "-c", "pack.compression=0", "gc", "-q", "--prune=now")
    assert not (ws / ".git" / "objects" / oid[:2] / oid[2:]).exists()
    [idx] = (ws / ".git" / "objects" / "pack").glob("pack-*.idx")
    listing = git(ws, "verify-pack", "-v", str(idx))
    line = next(ln for ln in listing.splitlines() if ln.startswith(oid))
    _, _, _, in_pack, offset = line.split()[:5]
    stream = zlib.compress(content.encode(), 0)
    pack = idx.with_suffix(".pack")
    pack.chmod(0o644)
    with open(pack, "r+b") as f:
        f.seek(int(offset) + int(in_pack) - len(stream))
        assert len(f.read(len(stream))) == len(stream)
        f.seek(int(offset) + int(in_pack) - len(stream))
        f.write(stream)
    assert git(ws, "cat-file", "blob", oid) + "\n" == content  # git serves the forgery
    return oid


def fingerprint(root: Path) -> dict[str, tuple[int, int, int, bytes]]:
    """Every entry at and below `root` (links not followed): mode, size, mtime and content or link target."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        data = os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b""
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return out


def readonly_prefix(dot_git: Path) -> list[str]:
    """A command prefix that runs the kernel with `dot_git` bind-mounted read-only (root only)."""
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return []
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(dot_git)]


class Env:
    def __init__(self, root: Path, kernel: Kernel, spaces: dict[str, Path]) -> None:
        self.root = root
        self.kernel = kernel
        self.spaces = spaces
        self.sleeps: dict[str, str] = {}
        self.before: dict[str, Any] = {}

    def tool(self, name: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = run_tool(self.spaces[name], *args, timeout=120)
        if ok:
            assert done.returncode == 0, (
                f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
            )
        return done

    def submit(self, name: str, *, launch: bool = False) -> str:
        report = self.root / f"report-{name}.md"
        report.write_text(f"# {name}\n")
        if launch:
            self.tool(name, "launch", "--name", "train", "--", "sh", "-c", "cat result.txt")
        self.tool(name, "submit", "--report", str(report))
        accepted = json.loads(self.tool(name, "sleep", "--json").stdout)
        assert accepted["type"] == "accepted", accepted
        return str(accepted["id"])

    def wake(self, name: str) -> dict[str, Any]:
        sid = self.sleeps[name]
        wake = json.loads(self.tool(name, "wait", sid, "--json", "--timeout", "120").stdout)
        assert wake["id"] == sid
        return wake  # type: ignore[no-any-return]

    def repo(self, name: str) -> Path:
        return self.kernel.state / "runs" / "repos" / f"{workspace_key(self.spaces[name].resolve())}.git"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("gitboundary")
    # same-seeds: a measurement could be reused, so the twin's own base run shows it is bound to its workspace
    kernel = Kernel(root, '[local]\nseconds_per_minute = 1.0\n[verdicts]\nreuse_base = "same-seeds"\n')
    spaces = {n: make_ws(root, n, "twins" if n in ("forged", "twin") else n) for n in SPACES}
    forge_loose(spaces["pending"], "result.txt", FORGED)  # before enrollment: the base cannot be taken
    for ws in spaces.values():
        kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4", *CONTRACT)
    e = Env(root, kernel, spaces)

    # reflog: the planted reflogs and the ref directory point outside the workspace.
    outside = root / "outside"
    (outside / "refdir").mkdir(parents=True)
    (outside / "bashrc").write_text("# the kernel user's shell start-up\n")
    ws = spaces["reflog"]
    key = workspace_key(ws.resolve())
    git(ws, "config", "user.name", HOSTILE_NAME % (root / "PWNED"))
    logs = ws / ".git" / "logs" / "refs" / "syscall" / key
    logs.mkdir(parents=True, exist_ok=True)  # (an older kernel made it)
    for ref in ("base", *map(str, range(6))):
        (logs / ref).unlink(missing_ok=True)
        (logs / ref).symlink_to(outside / "bashrc")
    shutil.rmtree(ws / ".git" / "refs" / "syscall", ignore_errors=True)
    (ws / ".git" / "refs" / "syscall").symlink_to(outside / "refdir")

    # forged / packed: the base blob is rewritten in place after enrollment, as a loose object / inside a pack.
    forge_loose(spaces["forged"], "result.txt", FORGED)
    forge_packed(spaces["packed"], "result.txt", FORGED)

    # sealed: links everywhere in .git, a planted lock, and .git read-only to the kernel.
    ws = spaces["sealed"]
    dot = ws / ".git"
    git(ws, "pack-refs", "--all")
    for name in ("objects", "logs", "refs", "packed-refs"):
        moved = outside / f"sealed-{name}"
        shutil.move(str(dot / name), moved)
        (dot / name).symlink_to(moved)
    (dot / "index.lock").write_text("planted by the agent\n")
    prefix = readonly_prefix(dot)
    if not prefix and os.geteuid() != 0:
        for p in [dot, *dot.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode & ~0o222)
    e.before = {"sealed": fingerprint(dot), "outside": fingerprint(outside)}

    kernel.start(prefix=prefix)
    try:
        for name in spaces:
            (spaces[name] / "result.txt").write_text(WORSE)
        e.sleeps["reflog"] = e.submit("reflog", launch=True)
        e.sleeps["forged"] = e.submit("forged")
        e.sleeps["packed"] = e.submit("packed")
        e.sleeps["sealed"] = e.submit("sealed", launch=True)
        yield e
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        for p in [dot, *dot.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)


def test_a_planted_reflog_symlink_and_a_hostile_name_write_nothing_outside(env: Env) -> None:
    wake = env.wake("reflog")
    assert wake["verdict"]["outcome"] == "not_improved"
    assert {t["launch"]: t["stdout_tail"] for t in wake["tasks"]}["train"] == WORSE
    assert (env.root / "outside" / "bashrc").read_text() == "# the kernel user's shell start-up\n"
    assert list((env.root / "outside" / "refdir").iterdir()) == []
    assert not (env.root / "PWNED").exists()
    assert fingerprint(env.root / "outside") == env.before["outside"]


def test_a_base_blob_rewritten_in_place_is_measured_true_here_and_in_a_twin(env: Env) -> None:
    v = env.wake("forged")["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"]) == ("not_improved", 0.5, 0.4)
    assert not v["baseline_reused"]
    # The twin has the same base tree and contract: its baseline is its own, never the other's.
    env.sleeps["twin"] = env.submit("twin")
    v = env.wake("twin")["verdict"]
    assert (v["outcome"], v["base_value"], v["baseline_reused"]) == ("not_improved", 0.5, False)


def test_a_base_blob_rewritten_in_place_inside_a_pack_is_measured_true(env: Env) -> None:
    v = env.wake("packed")["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"]) == ("not_improved", 0.5, 0.4)
    assert not v["baseline_reused"]


def test_a_base_that_cannot_be_taken_intact_refuses_the_submit_at_no_cost(env: Env) -> None:
    ws = env.spaces["pending"]
    before = json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]
    report = env.root / "report-pending.md"
    report.write_text("# pending\n")
    env.tool("pending", "submit", "--report", str(report))
    done = env.tool("pending", "sleep", ok=False)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "snapshot.failed" in out
    assert "'result.txt'" in out
    assert "does not hash to its id" in out
    assert json.loads((ws / ".syscall" / "budget.json").read_text())["budget"] == before


def test_a_read_only_git_full_of_links_is_left_byte_for_byte_unchanged(env: Env) -> None:
    wake = env.wake("sealed")
    assert wake["verdict"]["outcome"] == "not_improved"
    assert {t["launch"]: t["stdout_tail"] for t in wake["tasks"]}["train"] == WORSE

    # Let the release of the snapshot happen too, then compare.
    def released() -> bool:
        out = subprocess.run(
            ["git", "--git-dir", str(env.repo("sealed")), "for-each-ref", "refs/snapshots"],
            capture_output=True,
            text=True,
        )
        return out.stdout == ""

    wait_for(released, 20, "the snapshot to be released")
    assert fingerprint(env.spaces["sealed"] / ".git") == env.before["sealed"]
    assert fingerprint(env.root / "outside") == env.before["outside"]


def test_a_forged_packed_object_or_linked_objects_refuse_a_rebase(env: Env) -> None:
    ws = env.spaces["twin"]
    (ws / "result.txt").write_text(BASE)
    git(ws, "commit", "-q", "-am", "touch", "--allow-empty")
    (ws / "note.txt").write_text("n\n")
    git(ws, "add", "note.txt")
    git(ws, "commit", "-q", "-m", "a note")
    forge_packed(ws, "note.txt", "N\n")
    bad = env.kernel.cli("rebase", str(ws), "HEAD", check=False)
    assert bad.returncode == 1
    assert "'note.txt'" in bad.stderr, bad.stderr
    assert "does not hash to its id" in bad.stderr
    # .git/objects swapped for a symlink: never followed.
    dot = ws / ".git"
    shutil.move(str(dot / "objects"), env.root / "twin-objects")
    (dot / "objects").symlink_to(env.root / "twin-objects")
    bad = env.kernel.cli("rebase", str(ws), "HEAD", check=False)
    assert bad.returncode == 1
    assert ".git/objects is a symlink" in bad.stderr, bad.stderr


def test_an_object_replaced_between_sleep_and_job_start_changes_nothing(
    tmp_path: Path, bwrap_available: None
) -> None:
    kernel = Kernel(tmp_path, "[local]\nseconds_per_minute = 1.0\n")
    ws = make_ws(tmp_path, "swap")
    kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4")
    (ws / "train.py").write_text("print('the snapshot')\n")
    request = {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "launches": [{"name": "run", "command": "cat train.py", "minutes": 1}],
    }
    try:
        proc = kernel.start(env={"SYSCALL_KERNEL_CRASH_AT": "snapshot"})
        put_request(ws, "s1", request)
        assert proc.wait(60) == -9  # killed right after the snapshot was recorded
        kernel.kill()
        # While the kernel is down the agent rewrites the file and every object it could reach.
        (ws / "train.py").write_text("print('forged')\n")
        for pack in (ws / ".git" / "objects" / "pack").glob("pack-*"):
            pack.unlink()
        blob = b"print('the snapshot')\n"
        oid = (
            subprocess.run(
                ["git", "hash-object", "--stdin"], input=blob, cwd=ws, capture_output=True, check=True
            )
            .stdout.decode()
            .strip()
        )
        target = ws / ".git" / "objects" / oid[:2] / oid[2:]
        target.parent.mkdir(exist_ok=True)
        forged = b"print('forged')\n"
        target.write_bytes(zlib.compress(b"blob %d\0" % len(forged) + forged))
        kernel.start()
        wake_path = ws / ".syscall" / "wakes"
        wait_for(lambda: list(wake_path.glob("*.json")), 60, "the wake")
        [w] = [json.loads(p.read_text()) for p in wake_path.glob("*.json")]
        [t] = w["tasks"]
        assert (t["state"], t["stdout_tail"]) == ("COMPLETED", "print('the snapshot')\n")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def test_an_older_kernels_refs_are_reported_once_and_its_bases_re_imported_through_the_verified_path(
    tmp_path: Path, bwrap_available: None
) -> None:
    """The state an older kernel left: bases recorded in the store but held only under `refs/syscall/` of the
    agents' repositories (no kernel repository yet). One workspace's base object was since rewritten in place."""
    kernel = Kernel(tmp_path, "[local]\nseconds_per_minute = 1.0\n")
    good, bad = make_ws(tmp_path, "good"), make_ws(tmp_path, "bad")
    for ws in (good, bad):
        kernel.enroll(ws, *CONTRACT)
        key = workspace_key(ws.resolve())
        shutil.rmtree(kernel.state / "runs" / "repos" / f"{key}.git")
        git(ws, "update-ref", f"refs/syscall/{key}/base", "HEAD")
        git(ws, "update-ref", f"refs/syscall/{key}/3", "HEAD")
    forge_loose(bad, "result.txt", FORGED)
    before = {ws.name: fingerprint(ws / ".git") for ws in (good, bad)}
    try:
        kernel.start()  # the upgrade runs once the workspaces are served
        kernel.wait_log("event=legacy_refs_ignored", 60, count=2)
        kernel.wait_log("event=submit_base_held", 60)
        kernel.wait_log("event=submit_base_unheld", 60)
        log = kernel.log_text()
        assert log.count("event=legacy_refs_ignored") == 2, log
        assert f"refs/syscall/{workspace_key(good.resolve())}/3" in log
        assert log.count("event=submit_base_held") == 1
        assert "event=submit_base_unheld" in log
        assert "does not hash to its id" in log
        assert kernel.stop() == 0
        kernel.start()  # said once: not again at the next start
        kernel.wait_log("event=submit_base_unheld", 60, count=2)
        assert kernel.log_text().count("event=legacy_refs_ignored") == 2
        e = Env(tmp_path, kernel, {"good": good, "bad": bad})
        for ws in (good, bad):
            (ws / "result.txt").write_text(WORSE)
        e.sleeps["good"] = e.submit("good")
        v = e.wake("good")["verdict"]
        assert (v["outcome"], v["base_value"]) == ("not_improved", 0.5)
        report = tmp_path / "r.md"
        report.write_text("r\n")
        e.tool("bad", "submit", "--report", str(report))
        refused = e.tool("bad", "sleep", ok=False)
        assert refused.returncode == 3
        assert "snapshot.failed" in refused.stdout + refused.stderr
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    # The old refs are left as they were: never followed, never deleted.
    assert {ws.name: fingerprint(ws / ".git") for ws in (good, bad)} == before


def twin_reuses_the_first_baseline(e: Env) -> None:
    """ "one" measures its baseline; its twin "two" (the same base) reuses that measurement."""
    e.sleeps["one"] = e.submit("one")
    assert e.wake("one")["verdict"]["baseline_reused"] is False
    e.sleeps["two"] = e.submit("two")
    v = e.wake("two")["verdict"]
    assert (v["outcome"], v["base_value"], v["baseline_reused"]) == ("not_improved", 0.5, True)


def test_with_share_baselines_a_twin_reuses_the_measurement(tmp_path: Path, bwrap_available: None) -> None:
    """The operator's opt-in, `[defaults.submit] share_baselines = true` (off by default: see the twin above)."""
    kernel = Kernel(
        tmp_path,
        "[defaults.submit]\nshare_baselines = true\n[local]\nseconds_per_minute = 1.0\n"
        '[verdicts]\nreuse_base = "same-seeds"\n',
    )
    one, two = make_ws(tmp_path, "one", "same"), make_ws(tmp_path, "two", "same")
    for ws in (one, two):
        kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4", *CONTRACT)
        (ws / "result.txt").write_text(WORSE)
    try:
        kernel.start()
        twin_reuses_the_first_baseline(Env(tmp_path, kernel, {"one": one, "two": two}))
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def test_share_baselines_turned_on_by_a_sighup_holds_for_the_next_submits(
    tmp_path: Path, bwrap_available: None
) -> None:
    """A reload reaches the submit's plan: the kernel starts with baselines private (the default), SIGHUP turns
    `share_baselines` on, and the twin's submit then reuses the first workspace's measurement. (The submit
    evaluation used to keep the config it was built with: the reload said `changed=defaults.share_baselines`
    and the twin measured its baseline again.)"""
    kernel = Kernel(tmp_path, '[local]\nseconds_per_minute = 1.0\n[verdicts]\nreuse_base = "same-seeds"\n')
    one, two = make_ws(tmp_path, "one", "same"), make_ws(tmp_path, "two", "same")
    for ws in (one, two):
        kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4", *CONTRACT)
        (ws / "result.txt").write_text(WORSE)
    try:
        proc = kernel.start()
        kernel.config.write_text(kernel.config.read_text() + "[defaults.submit]\nshare_baselines = true\n")
        proc.send_signal(signal.SIGHUP)
        kernel.wait_log("event=reloaded", 10)
        assert "changed=defaults.share_baselines" in kernel.log_text()
        twin_reuses_the_first_baseline(Env(tmp_path, kernel, {"one": one, "two": two}))
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def test_a_sleep_snapshotted_by_an_older_kernel_is_refused_at_no_cost(
    tmp_path: Path, bwrap_available: None
) -> None:
    """Stopped between snapshot and submit, then upgraded: the snapshot is not in the kernel's repository (the
    old kernel kept it in the agent's .git), so the sleep is refused and refunded rather than run from there."""
    kernel = Kernel(tmp_path, "[local]\nseconds_per_minute = 1.0\n")
    ws = make_ws(tmp_path, "upgraded")
    kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4")
    (ws / "result.txt").write_text(
        WORSE
    )  # (a snapshot equal to the base would be in the kernel's repository)
    budget = json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]
    request = {
        "protocol": 1,
        "id": "u1",
        "type": "sleep",
        "launches": [{"name": "run", "command": "cat result.txt", "minutes": 1, "gpus": 1}],
    }
    try:
        proc = kernel.start(env={"SYSCALL_KERNEL_CRASH_AT": "snapshot"})
        put_request(ws, "u1", request)
        assert proc.wait(60) == -9
        kernel.kill()
        shutil.rmtree(kernel.state / "runs" / "repos" / f"{workspace_key(ws.resolve())}.git")
        kernel.start()
        answer = wait_for(lambda: read_answer(ws, "u1"), 60, "the answer")
        assert answer["type"] == "rejected", answer
        assert answer["error"]["code"] == "snapshot.failed"
        assert "older kernel" in answer["error"]["message"]
        wait_for(
            lambda: json.loads((ws / ".syscall" / "budget.json").read_text())["budget"] == budget,
            30,
            "the refund",
        )
        assert list((ws / ".syscall" / "wakes").glob("*.json")) == []
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
