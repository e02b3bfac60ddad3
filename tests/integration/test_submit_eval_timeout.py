"""A submit's evaluation run that hits its walltime is told so in terms of the submit's `eval_minutes`, not the
launch's "walltime you declared" (no launch declared it): a real kernel, the local backend (`seconds_per_minute =
1.0`: a minute of walltime is a second), the agent's tool, `jail = "none"`."""

from __future__ import annotations

import json
from pathlib import Path

from kernelproc import Kernel, make_workspace, run_tool


def test_an_evaluation_run_past_its_walltime_gets_the_hint_of_the_submits_eval_minutes(
    tmp_path: Path,
) -> None:
    ws = make_workspace(tmp_path / "ws", {"result.txt": "0.5\n"})
    kernel = Kernel(tmp_path, 'jail = "none"\n[local]\nseconds_per_minute = 1.0\n')
    kernel.enroll(ws, "--sleeps", "5", "--gpu-hours", "1", "--eval-command", "sleep 300", "--metric", "score")
    (ws / "result.txt").write_text("0.6\n")  # a candidate that differs from the base: both sides run
    report = tmp_path / "report.md"
    report.write_text("# slow\n")
    try:
        kernel.start()
        for args in (("submit", "--report", str(report), "--minutes", "2"), ("sleep",)):
            done = run_tool(ws, *args, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
        done = run_tool(ws, "wait", "--json", "--timeout", "120", timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    wake = json.loads(done.stdout)
    assert {(t["launch"], t["state"]) for t in wake["tasks"]} == {
        ("submit-base", "TIMEOUT"),
        ("submit-candidate", "TIMEOUT"),
    }
    md = (ws / ".syscall" / "wakes" / f"{wake['id']}.md").read_text()
    assert "walltime you declared" not in md
    assert (
        "the operator's eval command; stopped for running past its walltime of 2 minutes (the submit's "
        "`eval_minutes`, else the contract's) once the backend enforced it" in md
    ), md
