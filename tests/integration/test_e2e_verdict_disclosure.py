"""End to end (issue 26): repeated submits through the tool, a real kernel, the local backend and bwrap, under the
default `reuse_base = "never"` with `disclosure = "ladder"` and a per-day bound on submits.

The workspace's base prints nothing itself (`command` is `sh eval.sh`, which prints a line of its own); the
operator's scorer reads `result.txt` from each side's tree and prints it as the metric (0.5 in the base). Three
consecutive submits (0.6, 0.62, 0.9) each draw fresh seeds and measure their base anew, and the wake shows only
what the ladder discloses while the operator's `history --verdicts` keeps the exact values; a fourth submit the
same day is refused. Under `disclosure = "thresholdout"` the sides' own output is the public estimate, and a
contract whose sign test cannot pass is refused at enrollment.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, git, run_tool, wake_md

from channel.paths import workspace_key
from kernel.core.evaluate import seed_commitment

pytestmark = pytest.mark.bwrap

SCORE_PY = """import json, os
print(json.dumps({"score": json.load(open(os.path.join(os.environ["EVAL_TREE"], "result.txt")))["score"]}))
"""
CONFIG = (
    'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\n[defaults]\nmax_submits_per_day = 3\n'
    '[verdicts]\ndisclosure = "ladder"\nladder_step = 0.05\n'
)


def tool(ws: Path, *args: str) -> str:
    done = run_tool(ws, *args, timeout=120)
    assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
    return done.stdout


def submit(ws: Path, tmp: Path, value: float) -> dict[str, Any]:
    (ws / "result.txt").write_text(json.dumps({"score": value}) + "\n")
    report = tmp / f"report-{value}.md"
    report.write_text(f"# try {value}\n")
    tool(ws, "submit", "--report", str(report))
    accepted = json.loads(tool(ws, "sleep", "--json"))
    assert accepted["type"] == "accepted", accepted
    wake: dict[str, Any] = json.loads(tool(ws, "wait", accepted["id"], "--json", "--timeout", "120"))
    return wake


def setup(tmp_path: Path, files: dict[str, str]) -> tuple[Path, Path]:
    """(workspace, private score data): the workspace's base commit holds `files` and result.txt at 0.5."""
    private = tmp_path / "private"
    private.mkdir()
    (private / "score.py").write_text(SCORE_PY)
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    for name, text in {**files, "result.txt": '{"score": 0.5}\n'}.items():
        (ws / name).write_text(text)
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    return ws, private


def test_three_submits_draw_fresh_seeds_show_only_the_ladder_and_a_fourth_is_refused(
    tmp_path: Path, bwrap_available: None
) -> None:
    ws, private = setup(tmp_path, {"eval.sh": 'echo \'{"note": "the candidate runs"}\'\n'})
    kernel = Kernel(tmp_path, CONFIG)
    kernel.enroll(
        ws,
        "--sleeps",
        "10",
        "--gpu-hours",
        "4",
        "--eval-command",
        "sh eval.sh",
        "--metric",
        "score",
        "--score-command",
        "python3 $SCORE_DATA/score.py",
        "--score-data",
        str(private),
    )
    try:
        kernel.start()
        contract = tool(ws, "submit", "--help")
        wakes = [submit(ws, tmp_path, v) for v in (0.6, 0.62, 0.9)]
        (ws / "result.txt").write_text('{"score": 0.95}\n')
        report = tmp_path / "fourth.md"
        report.write_text("# fourth\n")
        tool(ws, "submit", "--report", str(report))
        fourth = run_tool(ws, "sleep", "--json", timeout=120)
        history = kernel.cli("history", "--verdicts", "--json").stdout
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()

    assert "seeds: fresh private seeds for every submit, on both sides" in contract
    assert "disclosure: ladder, step 0.05" in contract
    assert "limit: at most 3 submits accepted in any 24 hours (max_submits_per_day)." in contract

    # Fresh seeds on both sides for every submit: three different commitments, each base measured anew.
    verdicts = [w["verdict"] for w in wakes]
    commitments = [v["seed_commitment"] for v in verdicts]
    assert len(set(commitments)) == 3, commitments
    db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        plans = db.execute(
            "SELECT seeds, base_tree, decision FROM eval_plans WHERE workspace=? ORDER BY seq",
            (workspace_key(ws.resolve()),),
        ).fetchall()
    finally:
        db.close()
    assert [p[2] for p in plans] == ["run", "run", "run"]
    assert [seed_commitment(json.loads(p[0]), p[1]) for p in plans] == commitments
    for w in wakes:
        assert sorted((t["launch"], t["state"]) for t in w["tasks"]) == [
            ("submit-base", "COMPLETED"),
            ("submit-candidate", "COMPLETED"),
        ]
        assert w["verdict"]["baseline_reused"] is False
        assert w["verdict"]["seeds_from_seq"] is None

    # The ladder: a new best by a step is shown rounded to the step; anything else shows nothing new.
    shown = [
        (v["outcome"], v["delta"], v["best_so_far"], v["base_value"], v["candidate_value"]) for v in verdicts
    ]
    assert shown == [
        ("improved", 0.1, 0.1, None, None),
        ("not_improved", None, 0.1, None, None),
        ("improved", 0.4, 0.4, None, None),
    ]
    md = "".join(wake_md(ws, w["id"]) + json.dumps(w) for w in wakes)
    assert "0.62" not in md
    assert "Disclosure: ladder (step 0.05)" in md
    assert "Not shown better than the best so far (0.1) by at least 0.05" in md
    assert "Seeds: drawn fresh for this submit; both sides ran on them." in md

    # The operator's history keeps the exact values.
    exact = [json.loads(line)["verdict"] for line in history.splitlines()]
    assert [json.loads(line)["shown"] for line in history.splitlines()] == verdicts
    assert [(v["outcome"], v["base_value"], v["candidate_value"]) for v in exact] == [
        ("improved", 0.5, 0.6),
        ("improved", 0.5, 0.62),
        ("improved", 0.5, 0.9),
    ]
    assert [v["seed_commitment"] for v in exact] == commitments

    # The fourth submit of the day is refused, saying when the next can be; nothing was charged for it.
    assert fourth.returncode != 0
    assert "budget.submits_per_day" in fourth.stdout + fourth.stderr
    assert "at most 3 submits accepted in any 24 hours" in fourth.stdout + fourth.stderr


def test_thresholdout_shows_the_public_estimate_until_the_private_departs_then_spends_its_budget(
    tmp_path: Path, bwrap_available: None
) -> None:
    """The sides' own `command` prints the public estimate (from `public.txt`); the scorer the private value."""
    ws, private = setup(tmp_path, {"eval.sh": "cat public.txt\n", "public.txt": '{"score": 0.5}\n'})
    kernel = Kernel(
        tmp_path,
        'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\n[verdicts]\ndisclosure = "thresholdout"\n'
        "thresholdout_threshold = 0.05\nthresholdout_noise = 0.001\nthresholdout_budget = 1\n",
    )
    flags = (
        "--eval-command",
        "sh eval.sh",
        "--metric",
        "score",
        "--score-command",
        "python3 $SCORE_DATA/score.py",
    )
    # a contract that can never pass is refused at enrollment, with what would work
    refused = kernel.cli(
        "enroll", str(ws), *flags, "--score-data", str(private), "--repeats", "3", check=False
    )
    assert refused.returncode != 0
    assert "1/8 = 0.125, above 1 - confidence = 0.05; use repeats >= 5" in refused.stdout + refused.stderr
    # a bootstrap over too few pairs is enrolled, with a warning (the next enrollment replaces the contract)
    weak = kernel.cli(
        "enroll", str(ws), *flags, "--score-data", str(private), "--repeats", "4", "--test", "bootstrap"
    )
    assert "warning: the bootstrap over repeats = 4 pairs at confidence 0.95 has too few pairs" in weak.stdout
    kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4", *flags, "--score-data", str(private))
    try:
        kernel.start()
        shown = []
        for public, result in ((0.61, 0.6), (0.5, 0.9), (0.5, 0.95)):
            (ws / "public.txt").write_text(json.dumps({"score": public}) + "\n")
            shown.append(submit(ws, tmp_path, result)["verdict"])
        history = kernel.cli("history", "--verdicts").stdout
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    # close to the private gain (0.1): the public estimate (0.11) and its outcome, nothing spent
    first, second, third = shown
    assert (first["outcome"], first["private_disclosed"], first["budget_left"]) == ("improved", False, 1)
    assert first["delta"] == pytest.approx(0.11)
    # the private gain (0.4) departs from the public (0): disclosed with noise, the one disclosure spent
    assert (second["outcome"], second["private_disclosed"], second["budget_left"]) == ("improved", True, 0)
    assert second["delta"] == pytest.approx(0.4, abs=0.05)
    assert second["delta"] != 0.4
    # budget spent: nothing disclosed
    assert (third["outcome"], third["delta"], third["budget_left"]) == ("not_improved", None, 0)
    for v in shown:
        assert (v["disclosure"], v["base_value"], v["candidate_value"], v["pairs"]) == (
            "thresholdout",
            None,
            None,
            [],
        )
    # the operator's history has the exact values
    assert ": improved: base 0.5, candidate 0.6, delta 0.1" in history
    assert (
        ": improved: base 0.5, candidate 0.95, delta 0.45; the agent was shown (thresholdout): not_improved\n"
        in (history)
    )
