"""`syscall-conformance client`: our tool passes; clients that write in place or use a bad id are caught."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tests.testenv import ROOT

TOOL = ROOT / "tool" / "syscall.py"
FAKE = ROOT / "tests" / "conformance" / "fake_client.py"


def conformance(command: str, junit: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = ["client", "--run", command, "--timeout", f"{timeout:g}", "--junit", str(junit)]
    return subprocess.run(
        [sys.executable, "-m", "spec.conformance.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )


def cases(junit: Path) -> dict[str, str | None]:
    """testcase name -> failure message (None when it passed or was not run)."""
    out: dict[str, str | None] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        out[case.attrib["name"]] = None if failure is None else failure.attrib["message"]
    return out


def test_our_tool_passes_the_client_suite(tmp_path: Path) -> None:
    tool = f"{shlex.quote(sys.executable)} {shlex.quote(str(TOOL))}"
    command = "; ".join(
        [
            f"{tool} status --timeout 0.2",
            f"{tool} launch --name train --minutes 5 --why 'lr 3e-4' -- python train.py --lr 3e-4",
            f"{tool} launch --name eval --array 2 --artifact out/metrics.json -- python eval.py",
            f"{tool} sleep --timeout 0.2 --note 'first try'",
            f"{tool} history --timeout 0.2",
            f"{tool} queue --timeout 0.2",
            f"{tool} cancel train --timeout 0.2",
        ]
    )
    junit = tmp_path / "junit.xml"
    out = conformance(command, junit)
    assert out.returncode == 0, out.stdout + out.stderr
    got = cases(junit)
    assert not [n for n, why in got.items() if why is not None]
    committed = {n.split(":")[0] for n in got if n.endswith(": temp, then rename")}
    assert len(committed) == 5, out.stdout  # status, sleep, history, queue, cancel


NAME = "1764460800000-0badc0de.json"


@pytest.mark.parametrize(
    ("flaw", "caught"),
    [
        ("in-place", {f"{NAME}: temp, then rename": "written in place"}),
        ("bad-id", {"R1.json: id well formed": "is not <id>.json with an id matching"}),
        ("reuse-id", {f"{NAME}: never reused for other content": "2 arrivals brought 2 different contents"}),
        (
            "recommit-invalid",
            {
                f"{NAME} (arrival 2): accepted by stages 1-4": "request.type.unknown at $.type",
                f"{NAME} (arrival 2): valid against schema/v1/request.json": "does not validate",
                f"{NAME}: never reused for other content": "2 arrivals brought 2 different contents",
            },
        ),
        ("strict-reader", {"the client committed a request": "which a client MUST ignore: section 1.5"}),
        (
            "wait-forever",
            {"the client bounds its wait when no kernel answers": "still running at the 5 s limit"},
        ),
    ],
)
def test_a_broken_client_is_caught_with_the_check_named(
    flaw: str, caught: dict[str, str], tmp_path: Path
) -> None:
    junit = tmp_path / "junit.xml"
    out = conformance(
        f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} --flaw {flaw}", junit, timeout=5
    )
    assert out.returncode == 1, out.stdout
    failed = {n: why for n, why in cases(junit).items() if why is not None}
    assert set(failed) == set(caught), out.stdout
    for check, words in caught.items():
        assert words in (failed[check] or ""), failed[check]


def test_the_correct_fake_client_passes(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    out = conformance(f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))}", junit)
    assert out.returncode == 0, out.stdout


def test_a_client_that_writes_nothing_does_not_pass(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    out = conformance("true", junit)
    assert out.returncode == 1
    assert (cases(junit)["the client committed a request"] or "").startswith(
        "no file was committed to requests/"
    )


def test_a_client_that_hangs_is_killed_at_the_limit(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "spec.conformance.cli", "client", "--run", "sleep 600", "--timeout", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "killed after the 1 s limit" in out.stdout
    assert "the client bounds its wait when no kernel answers" in out.stdout


def test_a_client_leaving_a_daemon_does_not_stall_the_run(tmp_path: Path) -> None:
    # a daemon in its own session keeps the command's output open and escapes the process-group kill: the runner
    # must not wait for it (it ends by itself after 90 s)
    junit = tmp_path / "junit.xml"
    command = f"setsid sleep 90 & {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))}"
    out = subprocess.run(
        [sys.executable, "-m", "spec.conformance.cli", "client", "--run", command, "--junit", str(junit)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert out.returncode == 0, out.stdout
