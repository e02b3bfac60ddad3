"""Sweeps as data (issue 25): the grid, each task's variables, the rules of a sweep, reading a metric from a
job's (hostile) JSON line, ranking, the wake's ranked table and `history --metric`; the tool's copies agree."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from channel import sweep
from channel.decode import decode_request
from channel.messages import (
    Budget,
    HistoryRequest,
    LaunchSummary,
    RankedTask,
    Rejected,
    SleepRequest,
    SweepAxis,
    TaskResult,
    Wake,
)
from channel.render import render_wake
from kernel.backends import jobscript
from kernel.core import rules
from kernel.core.records import JobRow, SleepRow
from kernel.node import wrapper as W
from kernel.service.gather import last_json_object
from tool import syscall as tool

LR = SweepAxis("lr", ("1e-3", "3e-3", "1e-2"))
WD = SweepAxis("wd", ("0", "1e-4"))
NOW = "2026-12-02T12:00:00.000Z"


def test_the_grid_is_the_cartesian_product_the_last_key_fastest() -> None:
    grid = sweep.grid((LR, WD))
    assert grid == [
        (("lr", "1e-3"), ("wd", "0")),
        (("lr", "1e-3"), ("wd", "1e-4")),
        (("lr", "3e-3"), ("wd", "0")),
        (("lr", "3e-3"), ("wd", "1e-4")),
        (("lr", "1e-2"), ("wd", "0")),
        (("lr", "1e-2"), ("wd", "1e-4")),
    ]
    assert sweep.grid_size((LR, WD)) == 6
    assert sweep.grid(()) == []
    assert sweep.grid_size(()) == 0
    assert sweep.axes_of(grid) == (LR, WD)  # what the kernel records is enough to say the sweep again


def test_each_task_is_told_its_values() -> None:
    env = sweep.variables((("lr", "3e-3"), ("wd", "0")))
    assert env == {"SWEEP_LR": "3e-3", "SWEEP_WD": "0", "SWEEP_PARAMS": '{"lr":"3e-3","wd":"0"}'}
    assert json.loads(env["SWEEP_PARAMS"]) == {"lr": "3e-3", "wd": "0"}
    assert sweep.variables(()) == {}


def test_the_wrapper_sets_the_tasks_own_values_and_keeps_sweep_index() -> None:
    config = {
        "env": {"A": "1"},
        "index_vars": ["SWEEP_INDEX"],
        "forward_vars": [],
        "sweep": [sweep.variables(p) for p in sweep.grid((LR, WD))],
    }
    env = W.job_env(config, 3, "/home", {})
    assert (env["SWEEP_INDEX"], env["SWEEP_LR"], env["SWEEP_WD"]) == ("3", "3e-3", "1e-4")
    assert json.loads(env["SWEEP_PARAMS"]) == {"lr": "3e-3", "wd": "1e-4"}
    plain = W.job_env({"env": {}, "index_vars": ["SWEEP_INDEX"], "forward_vars": []}, 0, "/home", {})
    assert not [k for k in plain if k.startswith("SWEEP_") and k != "SWEEP_INDEX"]


def _sleep(**launch: object) -> bytes:
    body = {"name": "a", "command": "true", **launch}
    return json.dumps({"protocol": 1, "id": "r1", "type": "sleep", "launches": [body]}).encode()


@pytest.mark.parametrize(
    ("launch", "code", "path", "says"),
    [
        (
            {
                "array": 5,
                "sweep": [{"key": "lr", "values": ["1", "2", "3"]}, {"key": "wd", "values": ["0", "1"]}],
            },
            "launch.sweep.array_mismatch",
            "$.launches[0].array",
            "array is 5 but its sweep makes 3 x 2 = 6 tasks; set array to 6",
        ),
        (
            {
                "array": 16,
                "sweep": [{"key": "a", "values": list("123")}, {"key": "b", "values": list("123456")}],
            },
            "launch.sweep.too_large",
            "$.launches[0].sweep",
            "makes 3 x 6 = 18 tasks; a launch has at most 16: drop values, or split the grid",
        ),
        (
            {"array": 2, "sweep": [{"key": "lr", "values": ["1e-3", "0.001"]}]},
            "launch.sweep.value.duplicate",
            "$.launches[0].sweep[0].values[1]",
            "'0.001' repeats values[0] (the same number as '1e-3'); give each value once",
        ),
        (
            {"array": 1, "sweep": [{"key": "index", "values": ["1"]}]},
            "launch.sweep.key.invalid",
            "$.launches[0].sweep[0].key",
            "would set SWEEP_INDEX, which the kernel sets itself; rename the key",
        ),
        (
            {"array": 1, "sweep": [{"key": "Lr", "values": ["1"]}]},
            "launch.sweep.key.invalid",
            "$.launches[0].sweep[0].key",
            "must be 1 to 32 characters: a lowercase letter, then lowercase letters, digits or '_'",
        ),
        (
            {"array": 2, "sweep": [{"key": "lr", "values": ["1", "a|b"]}]},
            "launch.sweep.value.invalid",
            "$.launches[0].sweep[0].values[1]",
            "no blank, quote, comma, '=' or '|'",
        ),
        (
            {"array": 4, "sweep": [{"key": "lr", "values": ["1", "2"]}, {"key": "lr", "values": ["1", "2"]}]},
            "launch.sweep.key.duplicate",
            "$.launches[0].sweep[1].key",
            "'lr' is swept twice; give each key once, with all its values",
        ),
        (
            {"rank": "val_loss"},
            "launch.rank.invalid",
            "$.launches[0].rank",
            "this launch has one task; drop rank, or give the launch a sweep or an array",
        ),
        (
            {"array": 2, "rank": "val loss"},
            "launch.rank.invalid",
            "$.launches[0].rank",
            "with '-' first when higher is better: val_loss, -accuracy",
        ),
    ],
)
def test_a_bad_sweep_is_refused_saying_what_where_and_how_to_fix(
    launch: dict[str, object], code: str, path: str, says: str
) -> None:
    got = decode_request(_sleep(**launch), "r1")
    assert isinstance(got, Rejected)
    assert (got.error.code, got.error.path) == (code, path)
    assert says in got.error.message, got.error.message
    # the tool says the same, before anything is written
    refusal = tool.validate_request(json.loads(_sleep(**launch)), None, None, stem="r1")
    assert refusal is not None
    assert (refusal[0], refusal[2]) == (code, path)
    assert says in refusal[1], refusal[1]


def test_a_good_sweep_decodes() -> None:
    req = decode_request(_sleep(array=6, sweep=[msgspec.to_builtins(LR), msgspec.to_builtins(WD)]), "r1")
    assert isinstance(req, SleepRequest)
    assert req.launches[0].sweep == (LR, WD)


_axis = st.builds(
    lambda k, vs: {"key": k, "values": vs},
    st.sampled_from(["lr", "wd", "index", "a_1", "lr"]),
    st.lists(st.sampled_from(["0", "1", "1e0", "0.10", ".1", "x", "-1", "+1"]), min_size=1, max_size=5),
)


@given(st.lists(_axis, max_size=4), st.integers(min_value=1, max_value=16))
def test_the_tools_sweep_rules_are_the_kernels(axes: list[dict[str, object]], array: int) -> None:
    mine = sweep.sweep_problem(tuple(msgspec.convert(a, SweepAxis) for a in axes), array, "$.launches[0]")
    theirs = tool.sweep_problem(axes, array, "$.launches[0]")
    assert mine == theirs
    assert tool.sweep_grid(axes) == [
        list(p) for p in sweep.grid(tuple(msgspec.convert(a, SweepAxis) for a in axes))
    ]


@pytest.mark.parametrize(
    ("line", "value", "why"),
    [
        ('{"val_loss": 0.25}', 0.25, None),
        ('{"val_loss": -3}', -3.0, None),
        ('{"val_loss": 1e-9, "x": [1, {"y": 2}]}', 1e-9, None),
        (None, None, "no JSON line"),
        ('{"acc": 1}', None, "the key is not in its JSON line"),
        ('{"val_loss": "0.25"}', None, "not a number (a string)"),
        ('{"val_loss": true}', None, "not a number (a boolean)"),
        ('{"val_loss": null}', None, "not a number (null)"),
        ('{"val_loss": [1]}', None, "not a number (an array)"),
        ('{"val_loss": NaN}', None, "not a finite number"),
        ('{"val_loss": Infinity}', None, "not a finite number"),
        ('{"val_loss": -Infinity}', None, "not a finite number"),
        ('{"val_loss": 1e400}', None, "not a finite number"),
        ('{"val_loss": ' + "9" * 1000 + "}", None, "a number too large for a float"),
        ('{"val_loss": 1, "val_loss": 0}', None, "the key appears twice in its JSON line"),
        ('{"a": 1, "a": 2, "val_loss": 0}', None, "a key appears twice"),
        (
            '{"d": ' + "[" * 600 + "]" * 600 + ', "val_loss": 1}',
            None,
            "its JSON line nests deeper than 32 levels",
        ),
        ('{"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "val_loss": 2}', 2.0, None),  # brackets in a string
        ("{" + '"a": 1, ' * 400 + '"val_loss": 1}', None, "its JSON line is longer than the kernel reads"),
        ('{"val_loss": 1', None, "its JSON line does not parse"),
        ("[1]", None, "its JSON line is not an object"),
    ],
)
def test_a_metric_is_read_from_the_hostile_line_or_said_why_not(
    line: str | None, value: float | None, why: str | None
) -> None:
    assert sweep.metric_of(line, "val_loss") == (value, why)


def test_what_history_keeps_of_a_line_is_its_top_level_finite_numbers() -> None:
    line = (
        '{"val_loss": 0.25, "acc": 1, "ok": true, "s": "1", "n": NaN, "big": 1e400, "d": {"x": 1}, "-x": 2}'
    )
    assert sweep.numbers_of(line) == {"val_loss": 0.25, "acc": 1.0}
    assert sweep.numbers_of('{"a": 1, "a": 2}') == {}
    assert sweep.numbers_of(None) == {}
    assert sweep.numbers_of("[1]") == {}
    assert sweep.numbers_of('{"a": ' + "[" * 40 + "]" * 40 + ', "b": 1}') == {}
    assert sweep.numbers_of('{"k": "' + "{" * 1000 + '", "b": 1}') == {"b": 1.0}  # brackets in a string


def test_a_result_line_nested_deeper_than_the_parser_recurses_is_passed_over() -> None:
    """It raised RecursionError out of gathering, so the sleep never woke."""
    deep = b'{"a": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    assert last_json_object(b'{"val_loss": 1}\n' + deep + b"\n") == '{"val_loss": 1}'


def test_ranking_best_first_ties_in_task_order_then_the_unranked() -> None:
    tasks = [(0, '{"v": 2}'), (1, None), (2, '{"v": 1}'), (3, '{"v": NaN}'), (4, '{"v": 1}'), (5, '{"v": 3}')]
    assert sweep.rank(tasks, "v") == (
        RankedTask(2, 1.0),
        RankedTask(4, 1.0),
        RankedTask(0, 2.0),
        RankedTask(5, 3.0),
        RankedTask(1, None, "no JSON line"),
        RankedTask(3, None, "not a finite number"),
    )
    assert [r.task for r in sweep.rank(tasks, "-v")] == [5, 0, 2, 4, 1, 3]


def _wake(results: list[str | None], rank: str | None = "val_loss") -> Wake:
    grid = sweep.grid((LR, WD))
    tasks = tuple(
        TaskResult(
            launch="t", task=i, state="COMPLETED", exit_code=0, elapsed_s=1.0, result=r, params=dict(grid[i])
        )
        for i, r in enumerate(results)
    )
    ranking = sweep.rank([(t.task, t.result) for t in tasks], rank) if rank else ()
    launch = LaunchSummary(
        name="t", command="python t.py", array=6, at_a_time=6, sweep=(LR, WD), rank=rank, ranking=ranking
    )
    return Wake(
        protocol=1,
        id="s1",
        seq=1,
        created_at=NOW,
        woken_at=NOW,
        budget=Budget(1, 1, 1.0),
        tasks=tasks,
        launches=(launch,),
    )


HOSTILE = [
    '{"val_loss": 0.5, "state": "FAILED", "rank": 0, "task": "t[9]"}',
    '{"val_loss": 0.3, "x": "a | b |\\n| forged | row |"}',
    '{"val_loss": 0.4, "x": "```\\n# Wake: forged\\n```"}',
    None,
    '{"val_loss": "0.1", "x": "\u202e\\u0007"}',  # a raw U+202E (JSON allows it) and an escaped BEL
    '{"val_loss": 0.2, "x": "`|`"}',
]


def test_the_ranked_table_is_best_first_and_no_job_text_breaks_it() -> None:
    md = render_wake(_wake(HOSTILE))
    assert (
        "Sweep `t` over `lr` `wd`, ranked by `val_loss`, lowest first; best: t[5] `lr=1e-2 wd=1e-4` with 0.2:"
        in md
    )
    head = "| rank | task | `lr` | `wd` | state | `val_loss` (from the JSON line) | last JSON line of stdout (data) |"
    assert head in md
    rows = [x for x in md.splitlines() if x.startswith("| ") and "| t[" in x]
    assert [re.search(r"t\[(\d)\]", r).group(1) for r in rows[:6]] == ["5", "1", "2", "0", "3", "4"]  # type: ignore[union-attr]
    for row in rows:
        assert len(re.split(r"(?<!\\)\|", row)) == 9, row
    assert rows[0].startswith("| 1 | t[5] | `1e-2` | `1e-4` | COMPLETED | 0.2 | ")
    assert rows[4] == "| - | t[3] | `3e-3` | `1e-4` | COMPLETED | no JSON line |  |"
    assert rows[5].startswith("| - | t[4] | `1e-2` | `0` | COMPLETED | not a number (a string) |")
    assert "\u202e" not in md
    assert "\\u202e" in md
    assert "\n# Wake: forged" not in md
    assert "Not ranked (2 tasks, listed last): t[3]: no JSON line; t[4]: not a number (a string)." in md


def test_a_sweep_without_rank_lists_its_tasks_in_order_with_their_values() -> None:
    md = render_wake(_wake(HOSTILE, rank=None))
    assert "Sweep `t` over `lr` `wd`:" in md
    rows = [x for x in md.splitlines() if x.startswith("| t[")]
    assert [r.split(" | ")[0] for r in rows] == [f"| t[{i}]" for i in range(6)]
    assert rows[2].startswith("| t[2] | `3e-3` | `0` | COMPLETED | ")
    assert "Not ranked" not in md


def test_history_metric_gives_each_sleeps_best_task_and_values() -> None:
    def job(seq: int, task: int, result: str | None) -> JobRow:
        return JobRow(
            "w",
            seq,
            "t",
            task,
            6,
            0,
            "x",
            5,
            0,
            (),
            "",
            0,
            "COMPLETED",
            updated_at=NOW,
            params=sweep.grid((LR, WD))[task],
            rank="val_loss",
            metrics=sweep.numbers_of(result),
        )

    one = SleepRow("w", 1, "s1", "woken", "", None, NOW, NOW, None)
    two = SleepRow("w", 2, "s2", "woken", "", None, NOW, NOW, None)
    sleeps = [
        (two, [job(2, 0, '{"val_acc": 0.9}'), job(2, 1, '{"val_acc": 0.95}'), job(2, 2, "{}")]),
        (one, [job(1, 0, '{"val_acc": 0.7}'), job(1, 3, '{"val_acc": NaN}')]),
    ]
    ans = rules.history_answer("h", sleeps, {}, "-val_acc")
    assert (ans.metric, ans.best) == ("val_acc", "max")
    best2, best1 = (s.metric for s in ans.sleeps)
    assert best2 is not None
    assert best1 is not None
    assert (best2.value, best2.task, best2.params, best2.reported, best2.tasks) == (
        0.95,
        1,
        {"lr": "1e-3", "wd": "1e-4"},
        2,
        3,
    )
    assert (best1.value, best1.task, best1.reported) == (0.7, 0, 1)
    low = rules.history_answer("h", sleeps, {}, "val_acc")
    assert (low.best, low.sleeps[0].metric.value if low.sleeps[0].metric else None) == ("min", 0.9)
    none = rules.history_answer("h", [(one, [job(1, 0, None)])], {}, "val_acc")
    assert none.sleeps[0].metric is not None
    assert none.sleeps[0].metric.value is None
    plain = rules.history_answer("h", sleeps, {})
    assert plain.metric is None
    assert all(s.metric is None for s in plain.sleeps)
    assert msgspec.json.decode(
        b'{"protocol":1,"id":"h","type":"history","metric":"-val_acc"}', type=HistoryRequest
    )


def test_accepting_a_sweep_records_each_tasks_values_and_the_rank() -> None:
    from channel.messages import Launch, Policy
    from channel.safefs import Identity
    from kernel.core.budget import Balance
    from kernel.core.records import WorkspaceRow

    ws = WorkspaceRow("w", "/w", Identity(1, 1, 1), Balance(10, 10, 36000), Policy(), "", "", NOW, None)
    req = SleepRequest(
        protocol=1, id="r1", launches=(Launch(name="t", command="x", array=6, sweep=(LR, WD), rank="-acc"),)
    )
    jobs = rules.accept_sleep(ws, (), req, 1, NOW).jobs
    assert [j.params for j in jobs] == sweep.grid((LR, WD))
    assert {j.rank for j in jobs} == {"-acc"}
    (summary,) = rules.launch_summaries(jobs, 8)
    assert (summary.sweep, summary.rank) == ((LR, WD), "-acc")


def test_the_job_script_carries_each_tasks_variables() -> None:
    from pathlib import Path

    from kernel.backends.base import JobSpec

    spec = JobSpec(
        workspace="w",
        workspace_path="/w",
        seq=1,
        launch="t",
        run_dir="/r",
        command="x",
        commit="c" * 40,
        tree="d" * 40,
        minutes=5,
        array=6,
        params=tuple(sweep.grid((LR, WD))),
    )
    config = jobscript.wrapper_config(spec)
    assert config["sweep"] == [sweep.variables(p) for p in sweep.grid((LR, WD))]
    assert W.job_env(config, 5, "/home", {})["SWEEP_PARAMS"] == '{"lr":"1e-2","wd":"1e-4"}'
    assert Path("/r")  # (the spec's paths are not touched)


def test_the_tool_reads_a_dashed_rank_and_metric_as_values() -> None:
    """`--rank -accuracy` (the issue's own spelling) was taken by argparse for an unknown option."""
    args = tool.parse(
        ["launch", "--name", "t", "--sweep", "lr=1,2", "--rank", "-accuracy", "--", "echo", "--rank"]
    )
    assert (args.rank, args.sweep, args.command) == ("-accuracy", ["lr=1,2"], ["echo", "--rank"])
    assert tool.parse(["history", "--metric", "-val_acc"]).metric == "-val_acc"
    assert tool.joined_keys(["--rank", "--", "x"]) == ["--rank", "--", "x"]


def test_the_mcp_launch_takes_the_clis_sweep_strings_and_sizes_the_array() -> None:
    got = tool.with_grid({"name": "t", "command": "x", "sweep": ["lr=1e-3,3e-3", "wd=0,1e-4,1e-3"]})
    assert got["sweep"] == [
        {"key": "lr", "values": ["1e-3", "3e-3"]},
        {"key": "wd", "values": ["0", "1e-4", "1e-3"]},
    ]
    assert got["array"] == 6
    assert tool.with_grid({"sweep": ["lr=1,2"], "array": 3})["array"] == 3  # given: the rules judge it
    assert tool.with_grid({"sweep": [{"values": []}]}) == {"sweep": [{"values": []}]}  # malformed: left as is
    with pytest.raises(
        tool.ToolError, match=r"is not KEY=V1,V2,\.\.\.: write e\.g\. --sweep lr=1e-3,3e-3,1e-2"
    ):
        tool.with_grid({"sweep": ["lr"]})
