"""`syscall-conformance kernel` against real kernels: ours passes every vector and check; broken ones are caught.

Our kernel hosts one workspace per policy the vectors need (a kernel's policy comes from its config, so one
kernel process per policy), all enrolled with a budget of 0 launches, so no vector's sleep runs a job; the
policy workspaces also get 0 sleeps (only the main one takes the checkpoint). The broken kernels are
tests/conformance/fake_kernel.py with one --flaw each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from kernelproc import Kernel, git_workspace

from spec.conformance import kernel_mode
from spec.conformance.report import Result, Status, render_table
from spec.conformance.vectors import load_vectors
from tests.testenv import ROOT

FAKE = ROOT / "tests" / "conformance" / "fake_kernel.py"
EVAL = ("--eval-command", "python eval.py", "--metric", "accuracy")
# name -> ([defaults] lines, whether a second workspace with an eval contract is enrolled on it)
POLICIES: dict[str, tuple[str, bool]] = {
    "main": ("", True),
    "m60": ("max_minutes = 60", True),
    "m20": ("max_minutes = 20", False),
    "g2": ("max_gpus = 2", False),
    "m1g0": ("max_minutes = 1\nmax_gpus = 0", False),
    "no-queue": ('verbs = ["sleep", "cancel", "status", "history"]', False),
    "no-sleep": ('verbs = ["status", "queue", "history"]', False),
    "status-only": ('verbs = ["status"]', False),
}


def listing(ws: Path) -> dict[str, bytes | None]:
    """Every name under the channel with its content (kernel.json, budget.json and the tool excepted)."""
    ch = ws / ".syscall"
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(ch):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(ch))
            if rel in ("budget.json",):
                continue
            out[rel] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


@pytest.fixture
def our_kernels(tmp_path: Path) -> Iterator[dict[str, Path]]:
    kernels: list[Kernel] = []
    places: dict[str, Path] = {}
    try:
        for name, (defaults, with_submit) in POLICIES.items():
            k = Kernel(
                tmp_path, f'jail = "none"\nrescan_seconds = 5\n[defaults]\n{defaults}\n', name=f"k-{name}"
            )
            kernels.append(k)
            ws = git_workspace(tmp_path / f"ws-{name}")
            sleeps = () if name == "main" else ("--sleeps", "0")
            k.enroll(ws, "--launches", "0", *sleeps)
            places[name] = ws
            if with_submit:
                sub = git_workspace(tmp_path / f"ws-{name}-submit")
                k.enroll(sub, "--launches", "0", "--sleeps", "0", *EVAL)
                places[f"{name}-submit"] = sub
            k.start(wait_ready=False)
        for k in kernels:
            k.wait_log("event=ready", 60)
        yield places
    finally:
        for k in kernels:
            k.ensure_stopped()


def by_name(results: list[Result]) -> dict[str, Result]:
    return {r.name: r for r in results}


@pytest.mark.slow
def test_our_kernel_passes_the_whole_kernel_suite(our_kernels: dict[str, Path]) -> None:
    before = {n: listing(ws) for n, ws in our_kernels.items()}
    main = our_kernels.pop("main")
    opts = kernel_mode.Options(workspace=main, policy_workspaces=tuple(our_kernels.items()), deadline=10.0)
    results = kernel_mode.KernelRun(opts).run()
    table = render_table(results)
    print(table)
    problems = [r for r in results if r.status is not Status.PASS]
    assert not problems, render_table(problems)
    names = by_name(results)
    assert {v.name for v in load_vectors()} <= set(names)
    for check in kernel_mode.BEHAVIOURS:
        assert names[check[1]].status is Status.PASS
    # the runner leaves every channel as it found it (budget.json aside: the checkpoint was charged), but for the
    # kernel's answers and wakes to its requests: a client never writes into answers/ or wakes/ (2.4)
    our_kernels["main"] = main
    for n, ws in our_kernels.items():
        after = listing(ws)
        assert {k: v for k, v in after.items() if k in before[n]} == before[n]
        assert {k.split("/")[0] for k in set(after) - set(before[n])} <= {"answers", "wakes"}


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spec.conformance.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(flaw: str) -> Path:
        ws = tmp_path / f"ws-{flaw}"
        ws.mkdir()
        proc = subprocess.Popen(
            [sys.executable, str(FAKE), str(ws), "--flaw", flaw], stdout=subprocess.PIPE, cwd=ROOT
        )
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        return ws

    yield start
    for p in procs:
        p.kill()
        p.wait(30)
        if p.stdout is not None:
            p.stdout.close()


def failures(junit: Path) -> dict[str, str]:
    """vector or check -> why, for every failed testcase of the JUnit report."""
    root = ET.parse(junit).getroot()
    return {
        case.attrib["name"]: failure.attrib["message"]
        for case in root.iter("testcase")
        for failure in case.iter("failure")
    }


# flaw -> checks that must fail (by name), and the words their reason must carry
CAUGHT = {
    "accept-all": {
        "json-trailing-comma": "got a `accepted` answer",
        "launch-command-empty": "got a `accepted` answer",
        "valid-pretty-printed": "expected a valid history request",
    },
    "follow-symlink": {
        "a symlinked request is refused, never followed": "the kernel read it through the link",
        "a symlink to a file inside the channel is refused, never followed": "read it through the link",
        "a hardlinked request is refused, never read": "",
    },
    "in-place": {"answers and wakes arrive atomically": "incomplete answer was read"},
    "keep-requests": {"answered requests are removed": "still in requests/"},
    "fence-short": {"the markdown wake fences agent text": "not the whole content of any fenced block"},
    "no-escape": {
        "the markdown wake escapes control characters": "unescaped control characters U+001B, U+000D"
    },
    "no-lock": {"the kernel holds the channel's flock while it serves": "does not hold the channel's lock"},
    "answer-temps": {"in-flight temp files are neither read nor answered": "was written for the in-flight"},
    "answer-junk": {
        "badly named requests are removed unanswered, never echoed": "echoes a bad request name",
    },
    "follow-inner-symlink": {
        "a symlink to a file inside the channel is refused, never followed": "inner-target.tmp: the kernel read it",
    },
    "follow-replaced": {
        "a replaced requests/ stops service": "was written for a request in the replaced requests/"
    },
    "quote-all": {"messages quote at most 64 characters of the request": "quote more than 64 characters"},
    "protocol-2": {
        'every answer, wake and channel file carries "protocol": 1': 'carries "protocol": 2, not 1'
    },
    "bad-timestamps": {
        "timestamps are RFC 3339 UTC with milliseconds": 'budget.json $.updated_at = "yesterday"',
    },
    "charge-refused": {
        "a refused sleep charges nothing": "refused launch.name.duplicate, yet the budget went"
    },
    "regenerate-read-only": {
        "replay after a state change: the stored answer byte for byte": "not the recorded",
    },
    "stage6-paths": {
        "stage-6 refusals carry the code and path of section 6.3": "tail.unknown_task at null, not "
        "tail.unknown_task at $.launch",
    },
    "record-unread": {
        "a request refused unread leaves its id free": "got request.id.reused at $.id: the refused file was",
    },
    "blocked-drop": {
        "a blocked answer waits; later requests are answered meanwhile": "was removed while its answer could not",
        # removed with no answer: a client waiting on the removal (15.2) takes it for answered
        "a request leaves requests/ only after its answer arrived": "1 left requests/ before their answer",
    },
    "blocked-no-retry": {
        "a blocked answer waits; later requests are answered meanwhile": "the kernel did not try again",
    },
    "blocked-stall": {
        "a blocked answer waits; later requests are answered meanwhile": "the blocked answer held up the workspace",
    },
    "remove-first": {
        "a request leaves requests/ only after its answer arrived": "left requests/ before their answer arrived",
        # its blocked request is removed too, before the answer that cannot be written
        "a blocked answer waits; later requests are answered meanwhile": "was removed while its answer could not",
    },
    "unlink-answer": {
        "no answer is removed while its request is queued": "was removed while its request was in requests/",
    },
    "prune-wakes": {
        "answers to sleeps and the last sleep's wake are kept": "of the workspace's last sleep (seq ",
    },
}


@pytest.mark.parametrize("flaw", sorted(CAUGHT))
def test_a_broken_kernel_is_caught_with_the_check_named(fake: object, flaw: str, tmp_path: Path) -> None:
    ws = fake(flaw)  # type: ignore[operator]
    junit = tmp_path / "junit.xml"
    # A kernel that accepts everything writes no wake: the runner would wait out 60 s for each it expects.
    waits = ["--wake-deadline", "20"] if flaw == "accept-all" else []
    out = run_cli("kernel", "--workspace", str(ws), "--deadline", "3", *waits, "--junit", str(junit))
    assert out.returncode == 1, out.stdout + out.stderr
    failed = failures(junit)
    for check, words in CAUGHT[flaw].items():
        assert check in failed, f"{check} should fail for {flaw}:\n{out.stdout}"
        assert words in failed[check], failed[check]
    if flaw != "accept-all":
        assert set(failed) == set(CAUGHT[flaw]), f"only the broken MUST should fail:\n{out.stdout}"


def test_the_correct_fake_kernel_passes(fake: object, tmp_path: Path) -> None:
    ws = fake("none")  # type: ignore[operator]
    out = run_cli("kernel", "--workspace", str(ws), "--deadline", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 failed" in out.stdout
    # --only: that section's vectors, plus the prerequisites (kernel.json, budget.json, a first answer)
    junit = tmp_path / "only.xml"
    out = run_cli("kernel", "--workspace", str(ws), "--only", "4.2", "--junit", str(junit))
    assert out.returncode == 0, out.stdout
    sections = {c.attrib["classname"] for c in ET.parse(junit).getroot().iter("testcase")}
    assert sections == {"section 4.2", "section 9.1", "section 9.2", "section 7.1"}
    assert len([v for v in load_vectors() if v.section == "4.2"]) + 3 == len(list(ET.parse(junit).getroot()))


def test_a_kernel_that_adds_members_conforms(fake: object) -> None:
    """Section 1.5: a member protocol 1 does not define, in every object of every answer, wake, kernel.json and
    budget.json, is what a later kernel may write; the runner reads as a client and ignores it."""
    ws = fake("future")  # type: ignore[operator]
    out = run_cli("kernel", "--workspace", str(ws), "--deadline", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 failed" in out.stdout
    assert b"x_conformance_future" in (ws / ".syscall" / "kernel.json").read_bytes()
    # a client never writes where section 2.4 forbids it: the answers and wakes to the runner's requests stay
    assert len(os.listdir(ws / ".syscall" / "answers")) > 100
    assert sorted(os.listdir(ws / ".syscall" / "wakes"))


def test_a_silent_kernel_ends_the_run_within_deadlines(fake: object, tmp_path: Path) -> None:
    ws = fake("silent")  # type: ignore[operator]
    before = listing(ws)
    junit = tmp_path / "junit.xml"
    out = run_cli("kernel", "--workspace", str(ws), "--deadline", "1", "--junit", str(junit), timeout=60)
    assert out.returncode == 1
    assert "no answer to" in failures(junit)["the kernel answers a request"]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert (
        len([c for c in cases if c.find("skipped") is not None])
        == len(load_vectors()) + len(kernel_mode.BEHAVIOURS) - 1
    )  # every vector and every other check is reported not run, none silently left out
    assert listing(ws) == before, "the runner withdrew its unanswered request"


def test_a_workspace_without_a_channel_is_a_usage_error(tmp_path: Path) -> None:
    out = run_cli("kernel", "--workspace", str(tmp_path))
    assert out.returncode == 2
    assert "has no .syscall/ channel; enroll it first" in out.stderr
