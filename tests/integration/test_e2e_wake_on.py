"""End to end: `sleep --wake-on` (issue 25), through the installed tool and a real kernel process (local backend,
bwrap jail).

A sweep whose first task fails fast while another sleeps wakes early, listing the one still running; `status`,
`tail` and the next sleep treat the early-woken sleep as what it is (woken early, a task still running, in
flight); `wait SLEEP-ID` then delivers the rest. `--rest cancel` stops the others and wakes once. `first-exit`
and a count N wake early too. A hostile agent's values (N huge, negative, a string, a float, an array, too many)
are refused with the code and path the spec gives, nothing charged; tasks that all fail at once wake the sleep
once (and deliver a rest at most once); a cancel racing the early wake leaves one early wake and one rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, put_request, wait_answer, wait_for
from test_e2e_sweep import Env as SweepEnv

pytestmark = pytest.mark.bwrap

# A task of the sweep `mode`: `fail...` fails at once, `slow...` prints a JSON line, writes out.txt and sleeps,
# `ok...` prints a JSON line and ends (a sweep's values are distinct: `slow,slow2`).
WORK = r"""
import json, os, sys, time
mode = os.environ["SWEEP_MODE"]
if mode.startswith("fail"):
    print("boom", file=sys.stderr)
    sys.exit(3)
print(json.dumps({"acc": 0.5 if mode.startswith("slow") else 0.7}), flush=True)
with open("out.txt", "w") as f:
    f.write(mode + " started\n")
if mode.startswith("slow"):
    time.sleep(float(os.environ.get("SLOW_S", "12")))
    print(json.dumps({"acc": 0.9}))
"""


class Env(SweepEnv):
    """The sweep tests' tool runner, with this module's readers."""

    def wake(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.ws / ".syscall" / "wakes" / name).read_bytes())
        return data

    def budget(self) -> dict[str, Any]:
        got: dict[str, Any] = json.loads(self.ok("budget", "--json"))
        return got


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("wakeon")
    kernel = Kernel(tmp, 'jail = "bwrap"\n')
    ws = make_workspace(tmp / "spaces" / "wo", {"work.py": WORK})
    kernel.enroll(ws, "--launches", "40", "--sleeps", "30", "--gpu-hours", "4", "--max-sleeps-in-flight", "2")
    kernel.start()
    try:
        yield Env(kernel, ws)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def stage(env: Env, name: str, modes: str, *extra: str) -> None:
    env.ok(
        "launch",
        "--name",
        name,
        "--minutes",
        "5",
        "--sweep",
        f"mode={modes}",
        *extra,
        "--",
        "python3",
        "work.py",
    )


def test_first_failure_wakes_early_and_wait_delivers_the_rest(env: Env) -> None:
    stage(env, "grid", "fail,slow", "--rank", "-acc", "--artifact", "out.txt")
    early = json.loads(env.ok("sleep", "--wake-on", "first-failure", "--wait", "--json", "--timeout", "120"))
    sid = early["id"]
    wakes = env.ws / ".syscall" / "wakes"
    # The early wake came while the slow task still ran: it lists it, and its rest is not there yet.
    assert (early["part"], early["wake_on"], early["rest"]) == ("early", "first-failure", "run")
    assert (early["trigger"]["launch"], early["trigger"]["task"]) == ("grid", 0)
    states = {t["task"]: t["state"] for t in early["tasks"]}
    assert states[0] == "FAILED"
    assert states[1] in ("PENDING", "RUNNING")
    assert [(r["launch"], r["task"]) for r in early["rest_tasks"]] == [("grid", 1)]
    assert not (wakes / f"{sid}.rest.json").exists()
    md = (wakes / f"{sid}.md").read_text()
    assert md.startswith(f"# Early wake: sleep {sid} (#")
    assert "Not ended yet, left running (`rest` run): grid[1]" in md
    assert f"`syscall wait {sid}` (the MCP `wait` with this sleep_id) waits for it and prints it" in md
    assert "### grid[1]" not in md  # a task still running has no section of its own
    assert early["budget"]["reserved_gpu_hours"] == 0  # no GPUs here; the charge is the launch and the sleep

    # Every answer says what is true of it: woken early, one task still running, in flight.
    status = json.loads(env.ok("status", "--json"))["answer"]
    assert status["sleep"]["id"] == sid
    assert status["sleep"]["state"] in ("early_gathered", "early_woken")
    assert status["sleep"]["wake_on"] == "first-failure"
    assert [b["id"] for b in status["in_flight"]] == [sid]
    assert (
        f"Sleep {sid} (#{early['seq']}) woke early at {early['woken_at']} (wake_on first-failure): 1/2 tasks done"
        in (env.ok("status"))
    )
    wait_for(lambda: '{"acc": 0.5}' in env.ok("tail", "grid/1", "--sleep", sid), 60, "the slow task's line")

    # The next sleep is committed the moment the early wake is read: it is accepted (two may fly here), and
    # a third is refused naming the early-woken one as what it is (its task still runs: it is in flight).
    stage(env, "hold", "slow")
    second = json.loads(env.ok("sleep", "--json"))
    assert second["type"] == "accepted"
    env.ok("launch", "--name", "third", "--", "true")
    third = env.tool("sleep")
    assert third.returncode == 3, third.stdout + third.stderr
    assert "already 2 sleeps in flight (max_sleeps_in_flight 2)" in third.stderr
    assert f"'{sid}' (seq {early['seq']}; woke early, 1 task of it still running)" in third.stderr
    assert "wakes/<id>.rest.md" in third.stderr
    env.ok("unstage")

    # `wait SLEEP-ID` now waits for the rest and prints it.
    out = env.ok("wait", sid, "--timeout", "120", timeout=180)
    assert (
        f"# Rest of sleep {sid} (#{early['seq']}): every task has ended: 1 of 2 tasks completed, 1 FAILED"
        in out
    )
    assert f"(The wake is kept at .syscall/wakes/{sid}.rest.md.)" in out
    rest = env.wake(f"{sid}.rest.json")
    assert rest["part"] == "rest"
    assert [(t["task"], t["state"]) for t in rest["tasks"]] == [(0, "FAILED"), (1, "COMPLETED")]
    assert rest["tasks"][0] == early["tasks"][0]
    assert rest["tasks"][1]["result"] == '{"acc": 0.9}'
    [ranking] = [x["ranking"] for x in rest["launches"] if x["name"] == "grid"]
    assert [r["task"] for r in ranking] == [1, 0]  # every task ranked in the rest's wake, the best first
    assert "### grid[0]" not in out  # its tail was the early wake's
    assert "### grid[1]" not in out  # completed: routine
    history = json.loads(env.ok("history", "--json"))
    assert next(s for s in history["sleeps"] if s["id"] == sid)["state"] == "woken"
    # Both wakes shown: a `wait` without an id shows the other sleep's, and nothing of this one is left.
    assert f"# Wake: sleep {second['id']}" in env.ok("wait", "--timeout", "120", timeout=180)
    assert sid not in json.loads((env.ws / ".syscall" / "staged.json").read_text())["rest_unread"]


def test_rest_cancel_stops_the_others_and_wakes_once(env: Env) -> None:
    stage(env, "stop", "fail,slow,slow2", "--artifact", "out.txt")
    before = env.budget()["budget"]
    wake = json.loads(
        env.ok(
            "sleep", "--wake-on", "first-failure", "--rest", "cancel", "--wait", "--json", "--timeout", "120"
        )
    )
    sid = wake["id"]
    assert (wake["part"], wake["rest"]) == ("whole", "cancel")
    assert [(t["task"], t["state"]) for t in wake["tasks"]] == [
        (0, "FAILED"),
        (1, "CANCELLED"),
        (2, "CANCELLED"),
    ]
    assert [r["task"] for r in wake["rest_tasks"]] == [1, 2]
    for t in wake["tasks"][1:]:
        assert all(a["partial"] for a in t["artifacts"])
    assert not (env.ws / ".syscall" / "wakes" / f"{sid}.rest.json").exists()
    md = (env.ws / ".syscall" / "wakes" / f"{sid}.md").read_text()
    assert "were cancelled (`rest` cancel)" in md
    assert "Nothing of this sleep runs any more." in md
    after = env.budget()["budget"]
    assert (after["launches"], after["sleeps"]) == (before["launches"] - 1, before["sleeps"] - 1)
    assert after["reserved_gpu_hours"] == 0
    # `wait SLEEP-ID` has no rest to wait for: it prints the one wake at once.
    assert f"# Wake: sleep {sid}" in env.ok("wait", sid, "--timeout", "30")


def test_first_exit_and_a_count_wake_early(env: Env) -> None:
    stage(env, "first", "ok,slow")
    a = json.loads(env.ok("sleep", "--wake-on", "first-exit", "--json"))["id"]
    stage(env, "count", "ok,ok2,slow")
    b = json.loads(env.ok("sleep", "--wake-on", "2", "--json"))["id"]
    wakes = env.ws / ".syscall" / "wakes"
    wait_for(lambda: (wakes / f"{a}.md").exists() and (wakes / f"{b}.md").exists(), 120, "both early wakes")
    ea, eb = env.wake(f"{a}.json"), env.wake(f"{b}.json")
    assert (ea["part"], ea["trigger"]["task"], ea["tasks"][0]["state"]) == ("early", 0, "COMPLETED")
    assert [r["task"] for r in ea["rest_tasks"]] == [1]
    assert eb["part"] == "early"
    assert eb["wake_on"] == 2
    assert sorted(t["task"] for t in eb["tasks"] if t["state"] == "COMPLETED") == [0, 1]
    assert [r["task"] for r in eb["rest_tasks"]] == [2]
    assert "Woke on `wake_on` 2 (once 2 tasks had ended)" in (wakes / f"{b}.md").read_text()
    # `wait` without an id shows the early wakes not shown yet, then the rests
    shown = [env.ok("wait", "--timeout", "120", timeout=180) for _ in range(4)]
    heads = sorted(line.split(" (#")[0] for x in shown for line in x.splitlines() if line.startswith("# "))
    assert heads == sorted(
        [
            f"# Early wake: sleep {a}",
            f"# Early wake: sleep {b}",
            f"# Rest of sleep {a}",
            f"# Rest of sleep {b}",
        ]
    )
    # After an early wake, what is left to show is named as what it is: a rest wake.
    after_early = [x for x in shown if x.lstrip().startswith("# Early wake")]
    assert any(
        f"the rest wake of your sleep {a}" in x or f"the rest wake of your sleep {b}" in x
        for x in after_early
    )
    assert not any("your sleep the rest of" in x for x in shown)
    for sid in (a, b):
        rest = env.wake(f"{sid}.rest.json")
        assert all(t["state"] == "COMPLETED" for t in rest["tasks"])


def test_a_hostile_agent_s_wake_on_is_refused_and_costs_nothing(env: Env) -> None:
    stage(env, "h", "ok,slow")
    before = env.budget()["budget"]
    for value, words in (
        ("0", "count must be at least 1"),
        ("-3", "count must be at least 1"),
        ("5", "$.wake_on is 5 but the sleep has 2 tasks"),
        ("129", "above 128"),
        ("9" * 40, "(40 digits) is above the tasks any sleep can have"),
        ("1.5", "is not a wake condition"),
        ("first-fail", "is not a wake condition"),
    ):
        done = env.tool("sleep", "--wake-on", value)
        assert done.returncode == 2, (value, done.stdout, done.stderr)
        assert words in done.stderr, (value, done.stderr)
    assert "invalid choice: 'kept'" in env.tool("sleep", "--wake-on", "1", "--rest", "kept").stderr
    assert "sleep.rest.invalid" in env.tool("sleep", "--rest", "cancel").stderr
    # A hand-written request gets the kernel's own refusal, with the spec's code and path.
    launches = [{"name": "h", "command": "true", "array": 2}]
    for i, (value, code) in enumerate(
        (
            (2**62, "sleep.wake_on.out_of_range"),
            (3, "sleep.wake_on.out_of_range"),
            ("3", "sleep.wake_on.invalid"),
            (1.5, "field.type"),
            ([1], "field.type"),
            (None, "field.type"),
        )
    ):
        rid = f"hostile-{i}"
        put_request(
            env.ws, rid, {"protocol": 1, "id": rid, "type": "sleep", "launches": launches, "wake_on": value}
        )
        ans = wait_answer(env.ws, rid, 30)
        assert (ans["type"], ans["error"]["code"], ans["error"]["path"]) == ("rejected", code, "$.wake_on"), (
            value
        )
    assert env.budget()["budget"] == before
    env.ok("unstage")


def test_tasks_that_all_fail_at_once_wake_the_sleep_once(env: Env) -> None:
    stage(env, "all", "fail,fail2,fail3,fail4")
    first = json.loads(env.ok("sleep", "--wake-on", "first-failure", "--wait", "--json", "--timeout", "120"))
    sid = first["id"]
    wakes = env.ws / ".syscall" / "wakes"
    if first["part"] == "early":  # a task's end reached the kernel after the first's: its rest comes once
        wait_for((wakes / f"{sid}.rest.json").exists, 60, "the rest")
        final = env.wake(f"{sid}.rest.json")
    else:
        final = first
    assert [t["state"] for t in final["tasks"]] == ["FAILED"] * 4

    def mine() -> list[str]:
        return [x for x in env.kernel.log_text().splitlines() if f"id={sid} " in x]

    wait_for(lambda: any("event=woken " in x for x in mine()), 30, "woken")  # just after the files
    lines = mine()
    assert sum("event=gathered_early " in x for x in lines) == (1 if first["part"] == "early" else 0)
    assert sum("event=gathered " in x for x in lines) == 1
    assert sum("event=woken " in x for x in lines) == 1


def test_a_cancel_racing_the_early_wake_leaves_one_early_wake_and_one_rest(env: Env) -> None:
    stage(env, "race", "fail,slow,slow2")
    sid = json.loads(env.ok("sleep", "--wake-on", "first-failure", "--json"))["id"]
    cancel = env.tool("cancel", "--sleep", sid, "--json")  # at once: before, at or after the early wake
    assert cancel.returncode in (0, 3), cancel.stdout + cancel.stderr
    wakes = env.ws / ".syscall" / "wakes"
    wait_for((wakes / f"{sid}.json").exists, 60, "the first wake")
    first = env.wake(f"{sid}.json")
    if first["part"] == "early":
        wait_for((wakes / f"{sid}.rest.json").exists, 60, "the rest")
        final = env.wake(f"{sid}.rest.json")
    else:
        final = first
    assert all(t["state"] in ("FAILED", "CANCELLED") for t in final["tasks"]), final["tasks"]

    def state() -> str:
        return str(json.loads(env.ok("status", "--sleep", sid, "--json"))["answer"]["sleep"]["state"])

    wait_for(lambda: state() == "woken", 30, "woken")
    assert env.budget()["budget"]["reserved_gpu_hours"] == 0
    log = env.kernel.log_text()
    assert sum(1 for line in log.splitlines() if "event=woken " in line and f"id={sid} " in line) == 1
    assert sum(1 for line in log.splitlines() if "event=woken_early " in line and f"id={sid} " in line) <= 1
