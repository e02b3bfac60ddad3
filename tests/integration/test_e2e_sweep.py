"""End to end: sweeps as data (issue 25), through the installed tool and a real kernel process (local backend,
bwrap jail).

- `launch --sweep wd=0,1e-4 --sweep lr=1e-3,3e-3,1e-2 --rank val_loss` runs the 2 x 3 grid: each task is told
  its values (`SWEEP_WD`, `SWEEP_LR`, `SWEEP_PARAMS`, `SWEEP_INDEX` kept) and prints JSON lines; the wake's
  ranked table lists every task's values and last JSON line, best first, the tasks without a value after, said
  so. The tasks' output is hostile: a last line that tries to break the table (`|`, a newline escape, keys named
  like its columns), NaN, a line nested far deeper than a parser recurses, bytes that are not UTF-8.
- a second sleep ranked highest first, then `history --metric` across both sleeps, per sleep its best value and
  which task and values gave it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, wake_md

pytestmark = pytest.mark.bwrap

# Each task prints a few JSON lines and its metrics last; task 4 (lr=3e-3, wd=1e-4) and task 5 make the last
# line hostile, task 2 has no number for the key, task 3 prints a line nested 5000 deep after its metrics.
TRAIN = r"""
import json, os, sys
p = json.loads(os.environ["SWEEP_PARAMS"])
i = int(os.environ["SWEEP_INDEX"])
lr, wd = float(os.environ["SWEEP_LR"]), float(os.environ["SWEEP_WD"])
loss = round(abs(lr - 3e-3) * 100 + wd * 1000 + 0.25, 6)
print(json.dumps({"step": 1, "val_loss": 9.0}))
out = {"val_loss": loss, "acc": round(1 - loss, 6), "params": p, "index": i, "lr": lr, "wd": wd}
if i == 2:
    out["val_loss"] = "n/a"
if i == 4:
    out = {"val_loss": loss, "state": "COMPLETED | 0 | 0.0 s |\n| x", "task": "`evil`", "rank": 1}
sys.stdout.flush()
if i == 5:
    sys.stdout.write('{"val_loss": NaN, "x": "\\u202e\\u001b[2K"}\n')
else:
    print(json.dumps(out))
if i == 3:
    sys.stdout.write('{"deep": ' + "[" * 5000 + "]" * 5000 + "}\n")
    sys.stdout.buffer.write(b"\xff\xfe not utf-8\n")
"""


class Env:
    def __init__(self, kernel: Kernel, ws: Path) -> None:
        self.kernel = kernel
        self.ws = ws

    def tool(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(self.ws / ".syscall" / "syscall"), *args],
            cwd=self.ws,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *args: str, timeout: float = 120) -> str:
        done = self.tool(*args, timeout=timeout)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-2000:]}"
        return done.stdout


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("sweep")
    kernel = Kernel(tmp, 'jail = "bwrap"\n')
    ws = make_workspace(tmp / "spaces" / "sw", {"train.py": TRAIN})
    kernel.enroll(ws, "--launches", "20", "--sleeps", "10", "--gpu-hours", "4")
    kernel.start()
    try:
        yield Env(kernel, ws)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def sleep_wake(env: Env) -> tuple[dict[str, Any], str]:
    """Sleep on what is staged; the wake's JSON and its markdown."""
    wake = json.loads(env.ok("sleep", "--wait", "--json", "--timeout", "240", timeout=300))
    return wake, wake_md(env.ws, wake["id"])


GRID = [(wd, lr) for wd in ("0", "1e-4") for lr in ("1e-3", "3e-3", "1e-2")]


def loss_of(wd: str, lr: str) -> float:
    return round(abs(float(lr) - 3e-3) * 100 + float(wd) * 1000 + 0.25, 6)


def test_a_ranked_2x3_sweep_and_history_across_sleeps(env: Env) -> None:
    refused = env.tool("launch", "--name", "t", "--array", "4", "--sweep", "a=1,2", "--", "true")
    assert refused.returncode == 2
    assert "the grid makes 2 = 2 tasks and sets the array itself; drop --array" in refused.stderr
    bad = env.tool("launch", "--name", "t", "--sweep", "a=1,1e0", "--", "true")
    assert bad.returncode == 2
    assert "launch.sweep.value.duplicate" in bad.stderr + bad.stdout
    assert "$.launches[0].sweep[0].values[1]" in bad.stderr + bad.stdout
    assert "--sweep" in bad.stderr + bad.stdout  # the hint names the flag to fix

    staged = env.ok(
        *("launch", "--name", "grid", "--minutes", "5"),
        *("--sweep", "wd=0,1e-4", "--sweep", "lr=1e-3,3e-3,1e-2", "--rank", "val_loss"),
        *("--", "python3", "train.py"),
    )
    assert "sweep wd=0,1e-4 x lr=1e-3,3e-3,1e-2" in env.ok("status")
    assert "Staged launch 'grid'" in staged
    wake, md = sleep_wake(env)

    # every task was told its values, SWEEP_INDEX kept: the task echoes them in its JSON line
    tasks = {t["task"]: t for t in wake["tasks"]}
    assert sorted(tasks) == list(range(6))
    for i, (wd, lr) in enumerate(GRID):
        assert tasks[i]["params"] == {"wd": wd, "lr": lr}
        assert tasks[i]["state"] == "COMPLETED", tasks[i]
        if i in (0, 1, 3):
            line = json.loads(tasks[i]["result"])
            assert (line["params"], line["index"]) == ({"wd": wd, "lr": lr}, i)
            assert (line["lr"], line["wd"]) == (float(lr), float(wd))
    # the line nested 5000 deep is not a result (and did not stop the gather): the metrics line before it is
    assert json.loads(tasks[3]["result"])["val_loss"] == loss_of(*GRID[3])

    (launch,) = wake["launches"]
    assert launch["sweep"] == [
        {"key": "wd", "values": ["0", "1e-4"]},
        {"key": "lr", "values": ["1e-3", "3e-3", "1e-2"]},
    ]
    assert launch["rank"] == "val_loss"
    ranked = [(r["task"], r["value"]) for r in launch["ranking"] if r["value"] is not None]
    assert ranked == sorted(((i, loss_of(*GRID[i])) for i in (0, 1, 3, 4)), key=lambda x: (x[1], x[0]))
    assert ranked[0][0] == 1  # lr=3e-3, wd=0
    assert [(r["task"], r["unranked"]) for r in launch["ranking"] if r["value"] is None] == [
        (2, "not a number (a string)"),
        (5, "not a finite number"),
    ]

    # the markdown: the ranked table, best first, its rows intact whatever the tasks printed
    assert (
        "Sweep `grid` over `wd` `lr`, ranked by `val_loss`, lowest first; best: grid[1] `wd=0 lr=3e-3`" in md
    )
    rows = [line for line in md.splitlines() if line.startswith("| ") and "grid[" in line]
    assert [re.search(r"grid\[(\d)\]", r).group(1) for r in rows] == ["1", "4", "0", "3", "2", "5"]  # type: ignore[union-attr]
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row)
        assert len(cells) == 9, row  # 7 columns between the bars: nothing job-written added one
    assert rows[0].startswith("| 1 | grid[1] | `0` | `3e-3` | COMPLETED | 0.25 |")
    assert rows[4].startswith("| - | grid[2] | `0` | `1e-2` | COMPLETED | not a number (a string) |")
    assert (
        "Not ranked (2 tasks, listed last): grid[2]: not a number (a string); grid[5]: not a finite number."
        in md
    )
    assert "\\|" in rows[1]
    assert "\\n" in rows[1]
    assert "\x1b" not in md
    assert "\u202e" not in md
    assert '`{"val_loss": NaN, "x": "\\u202e\\u001b[2K"}`' in rows[5]  # as printed, JSON escapes and all

    # a second sleep, ranked highest first by accuracy
    env.ok(
        *("launch", "--name", "fine", "--minutes", "5"),
        *("--sweep", "wd=0", "--sweep", "lr=2e-3,3e-3", "--rank", "-acc"),
        *("--", "python3", "train.py"),
    )
    wake2, md2 = sleep_wake(env)
    (fine,) = wake2["launches"]
    assert [r["task"] for r in fine["ranking"]] == [1, 0]  # lr=3e-3 is the more accurate
    assert "ranked by `acc`, highest first; best: fine[1] `wd=0 lr=3e-3`" in md2

    hist = json.loads(env.ok("history", "--metric", "val_loss", "--json"))
    assert (hist["metric"], hist["best"]) == ("val_loss", "min")
    by_seq = {s["seq"]: s["metric"] for s in hist["sleeps"]}
    assert by_seq[1] == {
        "reported": 4,
        "tasks": 6,
        "value": 0.25,
        "launch": "grid",
        "task": 1,
        "params": {"wd": "0", "lr": "3e-3"},
    }
    assert by_seq[2]["value"] == 0.25
    assert by_seq[2]["task"] == 1
    assert by_seq[2]["reported"] == 2
    acc = json.loads(env.ok("history", "--metric", "-acc", "--limit", "1", "--json"))
    assert [s["seq"] for s in acc["sleeps"]] == [2]  # bounded by --limit, newest first
    assert (acc["best"], acc["sleeps"][0]["metric"]["value"]) == ("max", 0.75)
    text = env.ok("history", "--metric", "-acc")
    assert "acc (highest): 0.75 by fine[1] wd=0 lr=3e-3 (2 of 2 tasks reported it)" in text
    assert "acc (highest): 0.75 by grid[1] wd=0 lr=3e-3 (4 of 6 tasks reported it)" in text
    refused = env.tool("history", "--metric", "val loss")
    assert refused.returncode == 2
    assert "history.metric.invalid" in refused.stderr + refused.stdout
