"""End to end: `submit` through the installed tool, a real kernel process, the local backend and the bwrap jail.

One kernel serves every case (one workspace each, enrolled with its eval contract before the kernel starts).
Every workspace commits `eval.sh` (prints the seed it was given, then `result.txt`) as its base; a candidate
changes `result.txt` or `eval.sh` in its working tree, which the sleep's snapshot captures. The sleeps of the
independent cases are all started by the fixture, so their evaluations run side by side; each test then waits for
its own wake. The operator's `on_verdict` hook copies each payload into a directory and fails (exit 7) when the
report asks it to.
"""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, git, put_request, run_tool, wait_for, wake_md

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_tool"))
from mcp_wire import RawClient  # the raw MCP client of the tool tests

from channel.paths import workspace_key
from kernel.core.evaluate import seed_commitment

pytestmark = pytest.mark.bwrap

EVAL_SH = 'echo "seed=${EVAL_SEED:-none}"\ncat result.txt\n'
BASE = '{"score": 0.5}\n'
CONTRACT = ("--eval-command", "sh eval.sh", "--metric", "score")

# name -> (extra enroll flags, base result.txt, candidate files written into the working tree)
CASES: dict[str, tuple[tuple[str, ...], str, dict[str, str]]] = {
    "improve": (("--eval-gpus", "1"), BASE, {"result.txt": '{"score": 0.9}\n'}),
    "worse": ((), BASE, {"result.txt": '{"score": 0.4}\n'}),
    "unchanged": (("--eval-gpus", "1"), BASE, {}),
    "unchanged-launch": (("--eval-gpus", "1"), BASE, {}),
    "crash": ((), BASE, {"eval.sh": "echo boom >&2\nexit 3\n"}),
    "nan": ((), BASE, {"result.txt": '{"score": NaN}\n'}),
    "trailing": ((), BASE, {"result.txt": '{"score": 0.8}\n{"epoch": 3}\n{"loss": 1.25, "note": "x"}\n'}),
    "floor": (("--min-delta", "0.2"), '{"score": 0.1}\n', {"result.txt": '{"score": 0.3}\n'}),
    "hookfail": ((), BASE, {"result.txt": '{"score": 0.6}\n'}),
    "reuse": (("--eval-gpus", "1"), BASE, {"result.txt": '{"score": 0.6}\n'}),
    "mcp": (("--repeats", "5"), BASE, {"result.txt": '{"score": 0.7}\n'}),
}
STARTED_BY_FIXTURE = tuple(n for n in CASES if n not in ("reuse", "mcp"))

HOOK_SH = """f=$(mktemp -p {dir} verdict.XXXXXX)
cat > "$f"
pwd > "$f.cwd"
env > "$f.env"
if grep -q fail-the-hook "$f"; then echo "refusing on purpose" >&2; exit 7; fi
"""


class Env:
    def __init__(self, tmp: Path, kernel: Kernel, spaces: dict[str, Path], hooks: Path) -> None:
        self.tmp = tmp
        self.kernel = kernel
        self.spaces = spaces
        self.hooks = hooks
        self.sleeps: dict[str, str] = {}

    def tool(self, name: str, *args: str) -> str:
        done = run_tool(self.spaces[name], *args, timeout=120)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
        return done.stdout

    def start_submit(self, name: str, report: str) -> str:
        """Stage a submit with `report` and sleep (without waiting); returns the sleep id."""
        path = self.tmp / "reports" / f"{name}-{len(self.sleeps)}.md"
        path.parent.mkdir(exist_ok=True)
        path.write_text(report)
        self.tool(name, "submit", "--report", str(path))
        accepted = json.loads(self.tool(name, "sleep", "--json"))
        assert accepted["type"] == "accepted", accepted
        return str(accepted["id"])

    def wake(self, name: str, sleep_id: str | None = None) -> dict[str, Any]:
        sid = sleep_id or self.sleeps[name]
        wake = json.loads(self.tool(name, "wait", sid, "--json", "--timeout", "90"))
        assert wake["id"] == sid
        return wake  # type: ignore[no-any-return]

    def md(self, name: str, sleep_id: str) -> str:
        return wake_md(self.spaces[name], sleep_id)

    def stored(self, name: str) -> list[tuple[int, str, bytes, str, str]]:
        db = sqlite3.connect(f"file:{self.kernel.state / 'state.sqlite'}?mode=ro", uri=True)
        try:
            rows = db.execute(
                "SELECT seq, outcome, verdict, report, hook_status FROM eval_verdicts WHERE workspace=? "
                "ORDER BY seq",
                (workspace_key(self.spaces[name].resolve()),),
            ).fetchall()
        finally:
            db.close()
        return rows

    def plans(self, name: str) -> list[tuple[list[int], str]]:
        """The private seeds and base tree of each submit, as the operator reads them in the records."""
        db = sqlite3.connect(f"file:{self.kernel.state / 'state.sqlite'}?mode=ro", uri=True)
        try:
            rows = db.execute(
                "SELECT seeds, base_tree FROM eval_plans WHERE workspace=? ORDER BY seq",
                (workspace_key(self.spaces[name].resolve()),),
            ).fetchall()
        finally:
            db.close()
        return [(json.loads(r[0]), r[1]) for r in rows]

    def hook_payloads(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.hooks.glob("verdict.??????"))]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("submit")
    hooks = tmp / "hooks"
    hooks.mkdir()
    (tmp / "hook.sh").write_text(HOOK_SH.format(dir=hooks))
    kernel = Kernel(
        tmp,
        f'jail = "bwrap"\non_verdict = "sh {tmp / "hook.sh"}"\non_verdict_timeout_seconds = 20\n'
        # the `reuse` case: a stored base measurement stands in, on its own seeds
        '[local]\nseconds_per_minute = 1.0\n[verdicts]\nreuse_base = "same-seeds"\n',
    )
    spaces: dict[str, Path] = {}
    for name, (flags, base, _) in CASES.items():
        ws = tmp / "spaces" / name
        ws.mkdir(parents=True)
        git(ws, "init", "-q")
        (ws / "eval.sh").write_text(EVAL_SH)
        (ws / "result.txt").write_text(base)
        (ws / "README").write_text(f"workspace {name}\n")
        git(ws, "add", "-A")
        git(ws, "commit", "-q", "-m", "base")
        kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4", *CONTRACT, *flags)
        spaces[name] = ws
    kernel.start()
    e = Env(tmp, kernel, spaces, hooks)
    try:
        for name in STARTED_BY_FIXTURE:
            for rel, text in CASES[name][2].items():
                (spaces[name] / rel).write_text(text)
            if name in ("worse", "unchanged-launch"):  # a launch staged with the submit runs alongside
                e.tool(name, "launch", "--name", "train", "--", "sh", "-c", "echo trained")
            report = "please fail-the-hook" if name == "hookfail" else f"# {name}\nwhat I changed and why\n"
            e.sleeps[name] = e.start_submit(name, report)
        yield e
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def tasks_of(wake: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["launch"]: t for t in wake["tasks"]}


def charged_exactly_the_tasks_shown(wake: dict[str, Any], gpu_hours_before: float) -> None:
    """Each task shown used 1 GPU for its elapsed whole seconds; nothing else was charged or is still reserved."""
    used = sum(math.ceil(t["elapsed_s"]) for t in wake["tasks"] if t["state"] not in ("REUSED", "SKIPPED"))
    before_s = round(gpu_hours_before * 3600)  # budgets are whole GPU-seconds, shown rounded to 6 places
    assert wake["budget"]["gpu_hours"] == round((before_s - used) / 3600, 6)
    assert wake["budget"]["reserved_gpu_hours"] == 0


def test_an_improving_change_is_improved_with_both_values_a_private_seed_and_the_charge(env: Env) -> None:
    wake = env.wake("improve")
    v = wake["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["delta"]) == ("improved", 0.5, 0.9, 0.4)
    assert (v["metric"], v["direction"], v["failed_side"], v["baseline_reused"]) == (
        "score",
        "higher",
        None,
        False,
    )
    # No `score` stage and nothing protected: the candidate's own code printed the number.
    assert v["trusted"] is False
    assert "seed" not in v
    # The operator's records hold the seed; the verdict holds only its commitment, which they reproduce.
    [(seeds, base_tree)] = env.plans("improve")
    assert len(seeds) == 1
    seed = seeds[0]
    assert v["seed_commitment"] == seed_commitment(seeds, base_tree)
    # The same private seed reached both sides through EVAL_SEED, but what a run printed of it is blanked.
    tasks = tasks_of(wake)
    assert set(tasks) == {"submit-base", "submit-candidate"}
    assert tasks["submit-base"]["stdout_tail"] == 'seed=[seed]\n{"score": 0.5}\n'
    assert tasks["submit-candidate"]["stdout_tail"] == 'seed=[seed]\n{"score": 0.9}\n'
    assert "evaluation run of the base" in tasks["submit-base"]["hint"]
    assert v["base_commit"] != v["candidate_commit"]
    # 1 GPU per side for what it used (whole seconds), the rest of 2 x 30 minutes refunded.
    charged_exactly_the_tasks_shown(wake, 4.0)
    assert (wake["budget"]["launches"], wake["budget"]["sleeps"]) == (
        100,
        9,
    )  # a submit costs a sleep, no launch
    md = env.md("improve", wake["id"])
    assert "## Submit verdict: improved (self-reported)" in md
    assert "Self-reported:" in md
    assert f"Seed commitment: sha256 {v['seed_commitment']}" in md
    # A run with nothing more to say is a row of the runs table, its tails in the JSON wake only.
    assert "### submit-" not in md
    assert f"| submit-candidate[0] | COMPLETED | 0 | {tasks['submit-candidate']['elapsed_s']:.1f} s |" in md
    assert "seed=" not in md
    [(_, outcome, stored, report, hook)] = env.stored("improve")
    assert (outcome, report, hook) == ("improved", "# improve\nwhat I changed and why\n", "ok")
    assert json.loads(stored) == v
    # The contract is shown to the agent; the seed nowhere: not in kernel.json, the wake, status or history.
    policy = json.loads((env.spaces["improve"] / ".syscall" / "kernel.json").read_text())["policy"]
    assert policy["submit"]["command"] == "sh eval.sh"
    shown = [json.dumps(policy), json.dumps(wake), md, env.tool("improve", "status", "--json")]
    shown.append(env.tool("improve", "history", "--json"))
    for text in shown:
        assert str(seed) not in text


def test_a_worse_change_is_not_improved(env: Env) -> None:
    v = env.wake("worse")["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["delta"]) == (
        "not_improved",
        0.5,
        0.4,
        -0.1,
    )


def test_an_unchanged_tree_runs_and_charges_nothing_not_even_the_sleep(env: Env) -> None:
    wake = env.wake("unchanged")
    v = wake["verdict"]
    assert v["outcome"] == "unchanged"
    assert v["base_value"] is None
    # Both sides are shown as SKIPPED (not run, not charged), never CANCELLED.
    assert sorted((t["launch"], t["state"]) for t in wake["tasks"]) == [
        ("submit-base", "SKIPPED"),
        ("submit-candidate", "SKIPPED"),
    ]
    assert (wake["budget"]["gpu_hours"], wake["budget"]["reserved_gpu_hours"]) == (4.0, 0.0)
    assert wake["budget"]["sleeps"] == 10  # the sleep that carried only the submit was refunded too
    md = env.md("unchanged", wake["id"])
    assert "nothing was run or charged, the sleep included" in md
    # One row per side, no section per run, and no claim of tails where no run had one.
    assert md.startswith(f"# Wake: sleep {wake['id']} (#1): no task ran; 2 SKIPPED (not run)\n")
    assert "### submit-" not in md
    assert "| submit-base[0] | SKIPPED |" in md
    assert "tails" not in md.lower()


def test_an_unchanged_tree_with_a_launch_charges_the_sleep_and_the_launch_only(env: Env) -> None:
    wake = env.wake("unchanged-launch")
    assert wake["verdict"]["outcome"] == "unchanged"
    assert sorted((t["launch"], t["state"]) for t in wake["tasks"]) == [
        ("submit-base", "SKIPPED"),
        ("submit-candidate", "SKIPPED"),
        ("train", "COMPLETED"),
    ]
    assert (wake["budget"]["sleeps"], wake["budget"]["launches"]) == (9, 99)
    assert wake["budget"]["gpu_hours"] == 4.0
    md = env.md("unchanged-launch", wake["id"])
    assert "the evaluation was not run; the sleep's own launches ran and were charged as usual" in md
    assert "nothing was run or charged" not in md


def test_a_candidate_whose_eval_crashes_fails_on_the_candidate_side(env: Env) -> None:
    wake = env.wake("crash")
    v = wake["verdict"]
    assert (v["outcome"], v["failed_side"], v["base_value"]) == ("failed", "candidate", None)
    assert "exited with code 3" in v["reason"]
    assert tasks_of(wake)["submit-candidate"]["stderr_tail"] == "boom\n"


def test_a_candidate_printing_nan_fails(env: Env) -> None:
    v = env.wake("nan")["verdict"]
    assert (v["outcome"], v["failed_side"]) == ("failed", "candidate")
    assert "not a finite number" in v["reason"]


def test_the_metric_line_followed_by_other_json_lines_counts(env: Env) -> None:
    v = env.wake("trailing")["verdict"]
    assert (v["outcome"], v["candidate_value"]) == ("improved", 0.8)


def test_a_floor_exactly_met_is_improved(env: Env) -> None:
    v = env.wake("floor")["verdict"]
    # 0.3 - 0.1 is 0.19999999999999998 in binary floats; the kernel compares the printed decimals.
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["min_delta"]) == (
        "improved",
        0.1,
        0.3,
        0.2,
    )


def test_the_hook_gets_each_verdict_and_a_failing_hook_loses_nothing(env: Env) -> None:
    wake = env.wake("hookfail")
    assert wake["verdict"]["outcome"] == "improved"
    env.wake("improve")

    def payloads() -> dict[str, dict[str, Any]] | None:
        got = {p["sleep"]: p for p in env.hook_payloads()}
        return got if {env.sleeps["improve"], wake["id"]} <= set(got) else None

    got = wait_for(payloads, 30, "the hook's payloads")
    sent = got[env.sleeps["improve"]]
    assert sent["verdict"] == env.wake("improve")["verdict"]
    assert sent["report"] == "# improve\nwhat I changed and why\n"
    assert sent["path"] == str(env.spaces["improve"].resolve())
    cwd = next(env.hooks.glob("verdict.??????.cwd")).read_text().strip()
    assert cwd == str(env.kernel.state)
    hook_env = next(env.hooks.glob("verdict.??????.env")).read_text()
    assert "SYSCALL" not in hook_env
    assert "HOME=" not in hook_env
    # The failing hook is logged and recorded; the verdict stays in the wake and in the store.
    env.kernel.wait_log("event=on_verdict_failed", 30)
    wait_for(lambda: env.stored("hookfail")[0][4] != "pending", 30, "the hook's status")
    [(_, outcome, _, report, hook)] = env.stored("hookfail")
    assert (outcome, report) == ("improved", "please fail-the-hook")
    assert hook.startswith("failed: exit status 7: refusing on purpose")


def test_a_baseline_is_reused_only_while_everything_that_determines_it_is_the_same(env: Env) -> None:
    ws = env.spaces["reuse"]
    (ws / "result.txt").write_text('{"score": 0.6}\n')
    first = env.wake("reuse", env.start_submit("reuse", "first"))
    assert (first["verdict"]["outcome"], first["verdict"]["baseline_reused"]) == ("improved", False)
    assert set(tasks_of(first)) == {"submit-base", "submit-candidate"}
    charged_exactly_the_tasks_shown(first, 4.0)

    (ws / "result.txt").write_text('{"score": 0.7}\n')
    second = env.wake("reuse", env.start_submit("reuse", "second"))
    v = second["verdict"]
    assert (v["outcome"], v["baseline_reused"], v["base_value"], v["candidate_value"]) == (
        "improved",
        True,
        0.5,
        0.7,
    )
    # The base did not run and was not charged: it shows as REUSED, not CANCELLED; the seeds are the first's.
    assert {n: t["state"] for n, t in tasks_of(second).items()} == {
        "submit-base": "REUSED",
        "submit-candidate": "COMPLETED",
    }
    plans = env.plans("reuse")
    assert plans[1] == plans[0]
    assert v["seed_commitment"] == first["verdict"]["seed_commitment"]
    charged_exactly_the_tasks_shown(second, first["budget"]["gpu_hours"])
    md = env.md("reuse", second["id"])
    assert "(reused measurement)" in md
    # It says plainly that the candidate was compared on the first submit's seeds.
    assert (first["verdict"]["seeds_from_seq"], v["seeds_from_seq"]) == (None, first["seq"])
    assert f"Compared on the seeds of submit #{first['seq']}:" in md
    assert "drawn fresh" not in md
    assert "Seeds: drawn fresh for this submit; both sides ran on them." in env.md("reuse", first["id"])

    # The operator changes the eval command: the stored baseline no longer applies.
    env.kernel.enroll(ws, "--eval-command", "sh eval.sh --v2", "--metric", "score", "--eval-gpus", "1")
    third = env.wake("reuse", env.start_submit("reuse", "third"))
    assert (third["verdict"]["baseline_reused"], third["verdict"]["base_value"]) == (False, 0.5)
    assert set(tasks_of(third)) == {"submit-base", "submit-candidate"}
    charged_exactly_the_tasks_shown(third, second["budget"]["gpu_hours"])
    assert [r[1] for r in env.stored("reuse")] == ["improved", "improved", "improved"]


@pytest.mark.slurm
def test_a_submit_on_slurm_is_judged_like_on_the_local_backend(
    tmp_path: Path, slurm_conf: Path, bwrap_available: None
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "eval.sh").write_text(EVAL_SH)
    (ws / "result.txt").write_text('{"metric": "score", "value": 2.5}\n')
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    kernel = Kernel(tmp_path, 'backend = "slurm"\njail = "bwrap"\n[slurm]\npoll_seconds = 1.0\n')
    kernel.enroll(ws, "--eval-command", "sh eval.sh", "--metric", "score", "--direction", "lower")
    e = Env(tmp_path, kernel, {"ws": ws}, tmp_path)
    try:
        kernel.start(env={"SLURM_CONF": str(slurm_conf)})
        (ws / "result.txt").write_text('{"metric": "score", "value": 2.25}\n')
        wake = e.wake("ws", e.start_submit("ws", "lower loss"))
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    v = wake["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["delta"]) == ("improved", 2.5, 2.25, -0.25)
    tasks = tasks_of(wake)
    assert all(t["job_id"] for t in tasks.values())
    assert tasks["submit-candidate"]["stdout_tail"].startswith("seed=[seed]\n")


@pytest.mark.parametrize("step", ["snapshot", "submit", "gathered"])
def test_a_kernel_killed_during_a_submit_gives_one_verdict_one_hook_call_and_an_exact_charge(
    tmp_path: Path, step: str, bwrap_available: None
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "eval.sh").write_text(EVAL_SH)
    (ws / "result.txt").write_text(BASE)
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (tmp_path / "hook.sh").write_text(HOOK_SH.format(dir=hooks))
    kernel = Kernel(tmp_path, f'jail = "bwrap"\non_verdict = "sh {tmp_path / "hook.sh"}"\n')
    kernel.enroll(ws, "--gpu-hours", "4", *CONTRACT, "--eval-gpus", "1")
    (ws / "result.txt").write_text('{"score": 0.75}\n')
    request = {"protocol": 1, "id": "k1", "type": "sleep", "submit": {"report": "crash me"}}
    try:
        proc = kernel.start(env={"SYSCALL_KERNEL_CRASH_AT": step})
        put_request(ws, "k1", request)
        assert proc.wait(60) == -9
        kernel.kill()  # reaped already: closes its log
        kernel.start()
        e = Env(tmp_path, kernel, {"ws": ws}, hooks)
        wake = e.wake("ws", "k1")
        wait_for(lambda: e.stored("ws")[0][4] != "pending", 30, "the hook")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    v = wake["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"]) == ("improved", 0.5, 0.75)
    assert set(tasks_of(wake)) == {"submit-base", "submit-candidate"}
    charged_exactly_the_tasks_shown(wake, 4.0)
    [(_, outcome, _, report, hook)] = e.stored("ws")
    assert (outcome, report, hook) == ("improved", "crash me", "ok")
    assert [p["sleep"] for p in e.hook_payloads()] == ["k1"]


def test_the_base_survives_rewritten_history_and_gc_and_a_rebase_measures_afresh(
    tmp_path: Path, bwrap_available: None
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "eval.sh").write_text(EVAL_SH)
    (ws / "result.txt").write_text(BASE)
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws, capture_output=True, text=True).stdout.strip()
    kernel = Kernel(tmp_path, 'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\n')
    kernel.enroll(ws, "--gpu-hours", "4", *CONTRACT)
    # The agent rewrites history so that nothing of its own reaches the base, and collects the garbage.
    (ws / "result.txt").write_text('{"score": 0.6}\n')
    git(ws, "commit", "-q", "--amend", "-am", "rewritten")
    git(ws, "reflog", "expire", "--expire=now", "--all")
    git(ws, "gc", "-q", "--prune=now")
    (ws / "result.txt").write_text('{"score": 0.9}\n')
    e = Env(tmp_path, kernel, {"ws": ws}, tmp_path)
    try:
        kernel.start()
        first = e.wake("ws", e.start_submit("ws", "after a rewrite"))
        # The operator moves the base to the rewritten HEAD: nothing of the old base is reused.
        moved = kernel.cli("rebase", str(ws))
        assert "no longer reused" in moved.stdout
        second = e.wake("ws", e.start_submit("ws", "after the rebase"))
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    v = first["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["base_commit"]) == (
        "improved",
        0.5,
        0.9,
        base,
    )
    assert tasks_of(first)["submit-base"]["stdout_tail"] == f"seed=[seed]\n{BASE}"
    w = second["verdict"]
    assert (w["outcome"], w["base_value"], w["candidate_value"], w["baseline_reused"]) == (
        "improved",
        0.6,
        0.9,
        False,
    )
    assert w["base_commit"] != base
    # A new seed for every submit that measures the base: the commitments differ.
    assert w["seed_commitment"] != v["seed_commitment"]
    assert tasks_of(second)["submit-candidate"]["stdout_tail"] == 'seed=[seed]\n{"score": 0.9}\n'


def test_a_ten_run_submit_over_mcp_is_at_most_3_kb_of_text(env: Env) -> None:
    """Over MCP a 10-run submit's `sleep` result is the wake (one row per side for its runs, no section per
    run), with neither the job of each run nor a line per run's end in its text (6.3 KB before; each end went
    as a progress notification, and the job ids are in structuredContent)."""
    ws = env.spaces["mcp"]
    for rel, text in CASES["mcp"][2].items():
        (ws / rel).write_text(text)
    client = RawClient(sys.executable, ws / ".syscall" / "syscall")
    try:
        client.handshake()
        assert client.call("submit", {"report": "raised the score"})["result"]["isError"] is False
        got = client.request(
            "tools/call",
            {"name": "sleep", "arguments": {"wait": True, "timeout_s": 90}, "_meta": {"progressToken": 1}},
            timeout=120,
        )
    finally:
        client.close()
    result = got["result"]
    assert result["isError"] is False, result
    text = "".join(c["text"] for c in result["content"])
    wake = result["structuredContent"]["wake"]
    assert wake["verdict"]["outcome"] == "improved"
    assert len(wake["tasks"]) == 10
    assert len(text.encode()) <= 3072, f"{len(text.encode())} bytes:\n{text}"
    assert "### submit-" not in text
    assert "(1/10 done)" not in text  # sent as progress, not repeated in the result
    assert "evaluation of the base: 5 jobs submitted (ids in structuredContent answer.jobs)" in text
    ended = [m for m in client.received if m.get("method") == "notifications/progress"]
    assert any("(10/10 done)" in m["params"]["message"] for m in ended), ended
    assert len(json.dumps(result["structuredContent"]).encode()) <= 16 * 1024
