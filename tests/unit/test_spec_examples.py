"""spec/examples/ is one exchange, staging to wake: every file valid against its schema, and all of them agreeing."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
import msgspec
import pytest

from channel.decode import RequestError, check_policy, decode_request
from channel.messages import Accepted, Budget, BudgetFile, KernelInfo, ProgressFile, SleepRequest, Wake
from channel.render import render_wake
from spec import EXAMPLE_DIR, SCHEMA_DIR
from tool import syscall as tool

RID = "1764460800000-3fa9c2d1"
SCHEMA_OF = {
    "kernel.json": "kernel.json",
    "budget.json": "budget.json",
    "budget-after.json": "budget.json",
    "request.json": "request.json",
    "answer-accepted.json": "answer.json",
    "answer-rejected.json": "answer.json",
    "wake.json": "wake.json",
    "progress.json": "progress.json",
}


@cache
def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMA_DIR / name).read_text("utf-8"))
    return loaded


def example(name: str) -> bytes:
    return (EXAMPLE_DIR / name).read_bytes()


def test_every_example_is_listed_and_checked() -> None:
    files = {p.name for p in EXAMPLE_DIR.iterdir()} - {"README.md"}
    assert files == set(SCHEMA_OF) | {"staged.json", "wake.md"}
    readme = example("README.md").decode()
    for name in files:
        assert f"]({name})" in readme, f"examples/README.md does not show {name}"


@pytest.mark.parametrize("name", sorted(SCHEMA_OF))
def test_example_validates_against_its_schema(name: str) -> None:
    errors = list(
        jsonschema.Draft202012Validator(schema(SCHEMA_OF[name])).iter_errors(json.loads(example(name)))
    )
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].absolute_path)}"


def test_the_request_is_what_the_tool_writes_from_the_staging_and_the_decoder_accepts() -> None:
    staged = json.loads(example("staged.json"))
    request = example("request.json")
    obj = {
        "protocol": 1,
        "id": RID,
        "type": "sleep",
        "launches": staged["launches"],
        "submit": staged["submit"],
        "note": json.loads(request)["note"],
    }
    assert tool.encode_request(obj) == request
    decoded = decode_request(request, RID)
    assert isinstance(decoded, SleepRequest)
    check_policy(decoded, msgspec.json.decode(example("kernel.json"), type=KernelInfo).policy)


def _charge(budget: Budget, req: SleepRequest) -> Budget:
    gpu_hours = sum(x.gpus * x.array * x.minutes / 60 for x in req.launches)
    return Budget(
        launches=budget.launches - len(req.launches),
        sleeps=budget.sleeps - 1,
        gpu_hours=budget.gpu_hours - gpu_hours,
        reserved_gpu_hours=budget.reserved_gpu_hours + gpu_hours,
    )


def test_answer_wake_and_budgets_agree() -> None:
    req = decode_request(example("request.json"), RID)
    assert isinstance(req, SleepRequest)
    before = msgspec.json.decode(example("budget.json"), type=BudgetFile).budget
    ans = msgspec.json.decode(example("answer-accepted.json"), type=Accepted)
    assert ans.id == RID
    assert _close(ans.budget, _charge(before, req)), (ans.budget, _charge(before, req))
    tasks = {(x.name, k) for x in req.launches for k in range(x.array)}
    assert {(j.launch, j.task) for j in ans.jobs} == tasks
    wake = msgspec.json.decode(example("wake.json"), type=Wake)
    assert (wake.id, wake.seq, wake.note) == (RID, ans.sleep_seq, req.note)
    assert {(t.launch, t.task) for t in wake.tasks} == tasks
    assert {t.job_id for t in wake.tasks} == {j.job_id for j in ans.jobs}
    assert wake.snapshot is not None
    used_h = sum((t.elapsed_s or 0) / 3600 for t in wake.tasks)  # one GPU each
    reserved = ans.budget.reserved_gpu_hours
    assert wake.refunded_gpu_hours == pytest.approx(reserved - used_h, abs=1e-4)
    after = msgspec.json.decode(example("budget-after.json"), type=BudgetFile).budget
    assert after == wake.budget
    assert after.gpu_hours == pytest.approx(ans.budget.gpu_hours + wake.refunded_gpu_hours, abs=1e-4)
    assert after.reserved_gpu_hours == 0
    for t in wake.tasks:
        for a in t.artifacts:
            assert a.delivered.startswith(f"results/{wake.seq}/{t.launch}/{t.task}/"), a.delivered


def _close(a: Budget, b: Budget) -> bool:
    return (a.launches, a.sleeps) == (b.launches, b.sleeps) and all(
        abs(x - y) < 1e-9
        for x, y in ((a.gpu_hours, b.gpu_hours), (a.reserved_gpu_hours, b.reserved_gpu_hours))
    )


def test_the_markdown_wake_is_what_the_reference_renders() -> None:
    wake = msgspec.json.decode(example("wake.json"), type=Wake)
    assert example("wake.md").decode() == render_wake(wake), "regenerate spec/examples/wake.md from wake.json"


def test_the_refusal_is_the_decoders() -> None:
    rejected = json.loads(example("answer-rejected.json"))
    req = json.loads(example("request.json"))
    req["id"] = rejected["id"]
    req["launches"][0]["minutes"] = 300
    policy = msgspec.json.decode(example("kernel.json"), type=KernelInfo).policy
    decoded = decode_request(json.dumps(req).encode(), rejected["id"])
    assert isinstance(decoded, SleepRequest)
    with pytest.raises(RequestError) as err:
        check_policy(decoded, policy)
    got = {"code": err.value.code, "message": err.value.message, "path": err.value.path}
    assert got == rejected["error"]


def test_the_progress_file_is_the_sleep_in_flight() -> None:
    """The progress example decodes as the kernel's Struct and shows the wake's sleep before it woke: the same
    id, seq and job ids; the task that had ended as the wake reports it, the other still running."""
    progress = msgspec.json.decode(example("progress.json"), type=ProgressFile)
    wake = msgspec.json.decode(example("wake.json"), type=Wake)
    assert (progress.id, progress.seq) == (wake.id, wake.seq)
    assert [(t.launch, t.task, t.job_id) for t in progress.tasks] == [
        (t.launch, t.task, t.job_id) for t in wake.tasks
    ]
    ended = {(t.launch, t.task): t for t in progress.tasks if t.state != "RUNNING"}
    for t in wake.tasks:
        if (t.launch, t.task) in ended:
            got = ended[(t.launch, t.task)]
            assert (got.state, got.exit_code, got.elapsed_s) == (t.state, t.exit_code, t.elapsed_s)
    assert wake.created_at < progress.updated_at < wake.woken_at
