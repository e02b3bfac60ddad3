"""The Structs: strict, frozen, tagged as the spec says, and round-tripping through their canonical encoding."""

from __future__ import annotations

import inspect
import json
import typing

import msgspec
import pytest

from channel import limits as L
from channel import messages as M
from channel.lifecycle import (
    LIVE_TASK_STATES,
    NOT_RUN_TASK_STATES,
    SLEEP_TRANSITIONS,
    TASK_TRANSITIONS,
    TERMINAL_TASK_STATES,
    sleep_states,
)
from channel.render import HINTS

STRUCTS = [
    obj
    for _, obj in inspect.getmembers(M, inspect.isclass)
    if issubclass(obj, msgspec.Struct) and obj.__module__ == M.__name__ and not obj.__name__.startswith("_")
]

BUDGET = M.Budget(launches=99, sleeps=49, gpu_hours=97.5, reserved_gpu_hours=2.0)
TASK = M.TaskResult(
    launch="train",
    task=0,
    state="COMPLETED",
    job_id="123_0",
    exit_code=0,
    elapsed_s=61.5,
    stdout_tail="loss 0.1\n",
    artifacts=(
        M.Artifact(path="out/a.json", delivered="results/1/train/0/out/a.json", size=3, sha256="0" * 64),
    ),
    skipped=(M.SkippedArtifact(path="big.bin", reason="larger than the artifact size cap"),),
)
ANSWERS: list[M.Answer] = [
    M.Accepted(
        protocol=1, id="r1", sleep_seq=1, jobs=(M.JobRef(launch="train", task=0, job_id="7"),), budget=BUDGET
    ),
    M.Rejected(protocol=1, id="r1", error=M.ErrorInfo(code="json.syntax", message="bad")),
    M.StatusAnswer(
        protocol=1,
        id="r1",
        kernel=M.KernelRef(name="syscall-kernel", version="0.1.0"),
        budget=BUDGET,
        sleep=M.SleepView(id="s1", seq=1, state="running", created_at="2026-11-30T12:00:00.000Z"),
    ),
    M.QueueAnswer(
        protocol=1,
        id="r1",
        jobs=(
            M.QueueEntry(mine=True, workspace="w", launch="a", task=0, state="PENDING", minutes=30, gpus=0),
        ),
    ),
    M.HistoryAnswer(
        protocol=1,
        id="r1",
        sleeps=(
            M.HistoryEntry(
                id="s1",
                seq=1,
                state="woken",
                created_at="2026-11-30T12:00:00.000Z",
                launches=(M.HistoryLaunch(name="a", array=2, states=("COMPLETED", "FAILED")),),
            ),
        ),
    ),
    M.Cancelled(protocol=1, id="r1", sleep="s1", cancelled=(M.JobRef(launch="a", task=1),), budget=BUDGET),
    M.TailAnswer(
        protocol=1,
        id="r1",
        sleep="s1",
        launch="train",
        task=0,
        state="RUNNING",
        stream="stdout",
        text="epoch 3\n",
        lines=1,
        size=24,
        cut=True,
        job_id="7",
    ),
]


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_every_struct_is_frozen_and_strict(struct: type[msgspec.Struct]) -> None:
    assert struct.__struct_config__.frozen, struct
    assert struct.__struct_config__.forbid_unknown_fields, struct


def test_request_tags_are_the_verbs() -> None:
    assert tuple(t.__struct_config__.tag for t in M.REQUEST_TYPES) == M.VERBS
    assert typing.get_args(M.Verb) == M.VERBS
    assert typing.get_args(M.Request) == M.REQUEST_TYPES


def test_answer_tags() -> None:
    tags = {t.__struct_config__.tag for t in M.ANSWER_TYPES}
    assert tags == {"accepted", "rejected", "status", "queue", "history", "cancelled", "tail"}
    assert {type(a) for a in ANSWERS} == set(M.ANSWER_TYPES)


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: type(a).__name__)
def test_answers_round_trip(answer: M.Answer) -> None:
    data = M.encode(answer)
    assert data.endswith(b"\n")
    assert b"\n" not in data[:-1], "the canonical encoding is one compact line"
    assert json.loads(data)["type"] == answer.__struct_config__.tag
    assert msgspec.json.decode(data, type=M.Answer) == answer


def test_wake_and_channel_files_round_trip() -> None:
    wake = M.Wake(
        protocol=1,
        id="s1",
        seq=3,
        created_at="2026-11-30T12:00:00.000Z",
        woken_at="2026-11-30T12:05:00.000Z",
        budget=BUDGET,
        tasks=(TASK,),
        verdict=M.Verdict(
            outcome="improved", metric="acc", direction="higher", base_value=0.5, candidate_value=0.6
        ),
        refunded_gpu_hours=0.25,
    )
    info = M.KernelInfo(
        protocol=1,
        kernel=M.KernelRef(name="syscall-kernel", version="0.1.0"),
        workspace="ws-0123456789",
        limits=M.Limits(),
        policy=M.Policy(submit=M.EvalContract(command="python eval.py", metric="acc")),
        verbs=M.VERBS,
        tool_sha256="f" * 64,
    )
    budget = M.BudgetFile(protocol=1, budget=BUDGET, updated_at="2026-11-30T12:05:00.000Z")
    for msg in (wake, info, budget):
        assert msgspec.json.decode(M.encode(msg), type=type(msg)) == msg


def test_unknown_fields_are_refused_everywhere() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(b'{"launches":1,"sleeps":1,"gpu_hours":1,"extra":1}', type=M.Budget)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(b'{"max_minutes":1,"sudo":true}', type=M.Policy)


def test_structs_are_immutable() -> None:
    with pytest.raises(AttributeError):
        BUDGET.launches = 5  # type: ignore[misc]


def test_policy_defaults_and_verbs() -> None:
    p = M.Policy()
    assert (p.max_minutes, p.max_gpus, p.submit, p.verbs) == (
        L.POLICY_MAX_MINUTES,
        L.POLICY_MAX_GPUS,
        None,
        M.VERBS,
    )
    assert p.max_minutes <= L.MINUTES_CEILING
    assert p.max_gpus <= L.GPUS_CEILING
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"verbs": ["sleep", "rm"]}, M.Policy)


def test_limits_defaults_are_the_constants() -> None:
    limits = msgspec.to_builtins(M.Limits())
    assert limits == {name: getattr(L, name.upper()) for name in M.Limits.__struct_fields__}


def test_launch_defaults_are_the_documented_ones() -> None:
    launch = M.Launch(name="a", command="x")
    assert (launch.minutes, launch.gpus, launch.array, launch.concurrency, launch.artifacts, launch.why) == (
        L.MINUTES_DEFAULT,
        0,
        1,
        0,
        (),
        "",
    )
    assert M.HistoryRequest(protocol=1, id="r1").limit == L.HISTORY_DEFAULT


def test_task_states_agree_with_the_lifecycle_and_the_hints() -> None:
    states = set(typing.get_args(M.TaskState))
    targets = set().union(*TASK_TRANSITIONS.values())
    assert targets == TERMINAL_TASK_STATES | {"RUNNING"}
    assert states == TERMINAL_TASK_STATES | {"PENDING", "RUNNING"}
    assert set(HINTS) <= TERMINAL_TASK_STATES
    assert {s for (s, _) in TASK_TRANSITIONS} == LIVE_TASK_STATES == {"PENDING", "RUNNING"}
    assert {"PENDING", "RUNNING"}.isdisjoint(TERMINAL_TASK_STATES)
    assert {"REUSED", "SKIPPED"} == NOT_RUN_TASK_STATES


def test_sleep_states_agree_with_the_lifecycle() -> None:
    assert set(typing.get_args(M.SleepState)) == set(sleep_states())
    assert set(sleep_states()) == {s for (s, _) in SLEEP_TRANSITIONS} | set(SLEEP_TRANSITIONS.values())
