"""The tool's local validation agrees with the kernel's decoder: same codes, same JSON paths.

The tool cannot import `channel/` (it runs on any Python >= 3.8 with the standard library only), so it carries
its own copy of the rules. Three checks keep the copies together: every conformance vector the tool could meet
(spec/vectors/v1), a differential property test against `channel.decode` on generated near-valid requests, and
the limits and defaults the tool hard-codes compared with `channel.limits` and `channel.messages`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from channel import limits as L
from channel.decode import RequestError, artifact_path_problem, check_policy, decode_request
from channel.errors import CODES
from channel.lifecycle import TERMINAL_TASK_STATES
from channel.messages import VERBS, Limits, Policy, Rejected
from tool import syscall as tool

VECTOR_DIR = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "v1"
IN_CI = os.environ.get("CI", "").lower() == "true"
# The file and JSON stages judge bytes the tool never writes: its requests are json.dumps of plain objects.
NOT_FROM_OBJECTS = {c for c, info in CODES.items() if info.section in ("4.1", "4.2")} - {"request.too_large"}
# Codes that need the kernel's state (section 6): no local check can know them.
KERNEL_STATE = {c for c, info in CODES.items() if info.section == "6"}


def kernel_outcome(obj: Any, stem: str, policy: dict[str, Any] | None) -> tuple[str, str | None] | None:
    """What the real decoder (then check_policy) says about the bytes the tool would write for `obj`."""
    result = decode_request(tool.encode_request(obj), stem)
    if isinstance(result, Rejected):
        return (result.error.code, result.error.path)
    if policy is not None:
        try:
            check_policy(result, msgspec.convert(policy, Policy))
        except RequestError as err:
            return (err.code, err.path)
    return None


def tool_outcome(obj: Any, stem: str, policy: dict[str, Any] | None) -> tuple[str, str | None] | None:
    refusal = tool.validate_request(obj, msgspec.structs.asdict(Limits()), policy, stem=stem)
    return None if refusal is None else (refusal[0], refusal[2])


# --- the conformance vectors -----------------------------------------------------------------------------


def _vectors() -> list[dict[str, Any]]:
    return [v for f in sorted(VECTOR_DIR.glob("*.json")) for v in json.loads(f.read_text("utf-8"))["vectors"]]


def _as_object(v: dict[str, Any]) -> tuple[bool, Any]:
    """(True, the request object) when the tool could hold it as a plain object, else (False, None)."""
    if "request" in v:
        return True, v["request"]
    if "request_base64" in v:
        return False, None  # raw bytes: encodings, BOMs, truncation
    try:
        return True, json.loads(v["request_text"])
    except (ValueError, RecursionError):
        return False, None


def producible(v: dict[str, Any]) -> bool:
    ok, _ = _as_object(v)
    error = v["expect"].get("error")
    if error and error["code"] == "request.too_large" and "request" not in v:
        return False  # padded text: the size is the file's, not the object's
    return ok and not (error and (error["code"] in NOT_FROM_OBJECTS or error["code"] in KERNEL_STATE))


def test_vectors_are_present() -> None:
    if not list(VECTOR_DIR.glob("*.json")):
        if IN_CI:
            pytest.fail(f"no vectors in {VECTOR_DIR}")
        pytest.skip(f"no vectors in {VECTOR_DIR} yet")
    assert sum(producible(v) for v in _vectors()) >= 100


@pytest.mark.parametrize("vector", [v for v in _vectors() if producible(v)], ids=lambda v: v["name"])
def test_vector_parity(vector: dict[str, Any]) -> None:
    _, obj = _as_object(vector)
    refusal = tool.validate_request(obj, None, vector.get("policy"), stem=vector["stem"])
    expect = vector["expect"]
    if "error" in expect:
        assert refusal is not None, f"{vector['name']}: the tool accepts what the kernel rejects"
        assert (refusal[0], refusal[2]) == (expect["error"]["code"], expect["error"]["path"]), vector["name"]
    else:
        assert refusal is None, f"{vector['name']}: the tool refuses a valid request: {refusal}"


# Runs under the interpreter being tested: imports the tool file by path and judges each vector.
_JUDGE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("syscall_tool", sys.argv[1])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
out = {}
for v in json.load(sys.stdin):
    r = tool.validate_request(v["obj"], None, v["policy"], stem=v["stem"])
    out[v["name"]] = None if r is None else [r[0], r[2]]
json.dump(out, sys.stdout)
"""


def test_vector_parity_under_each_python(python: str) -> None:
    cases = []
    for v in _vectors():
        if producible(v):
            cases.append(
                {"name": v["name"], "obj": _as_object(v)[1], "policy": v.get("policy"), "stem": v["stem"]}
            )
    r = subprocess.run(
        [python, "-c", _JUDGE, str(Path(tool.__file__).resolve())],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(r.stdout)
    for v in _vectors():
        if producible(v):
            error = v["expect"].get("error")
            assert got[v["name"]] == (None if error is None else [error["code"], error["path"]]), v["name"]


def test_every_locally_checkable_code_is_covered_by_a_vector() -> None:
    covered = {v["expect"]["error"]["code"] for v in _vectors() if producible(v) and "error" in v["expect"]}
    wanted = {c for c, info in CODES.items() if info.section in ("4.3", "4.4", "4.5", "4.6", "5")}
    assert wanted - covered == set()


# --- a differential property test against the decoder -------------------------------------------------------

NAMES = st.sampled_from(["a", "train", "x-1", "Bad", "-x", "a" * 32, "a" * 33, "", "a\n", "é", "a b"])
TEXT = st.sampled_from(["", " ", "ok", "a\tb", "a\nb", "a\rb", "\x85", "\u2028", "x" * 201, "~/x", "/abs"])
INTS = st.sampled_from([-1, 0, 1, 2, 3, 16, 17, 64, 65, 240, 241, 10080, 10081, 2**63, True, 1.0, None, "1"])
ARTIFACT = st.sampled_from(["out/a.json", "", "a//b", "../x", "./x", "a\\b", "~x", "/x", "a\x85b", "a" * 501])
ANY = st.one_of(NAMES, TEXT, INTS, st.just([]), st.just({}))


def _launch() -> st.SearchStrategy[dict[str, Any]]:
    fields = {
        "name": NAMES,
        "command": st.one_of(TEXT, st.just("python train.py"), st.just("x" * 2001)),
        "minutes": INTS,
        "gpus": INTS,
        "array": INTS,
        "concurrency": INTS,
        "artifacts": st.one_of(st.lists(ARTIFACT, max_size=9), ANY),
        "why": TEXT,
        "bogus": ANY,
    }
    return st.dictionaries(st.sampled_from(list(fields)), st.none(), min_size=0, max_size=9).flatmap(
        lambda keys: st.fixed_dictionaries(
            {"name": NAMES, "command": st.just("true")} | {k: fields[k] for k in keys}
        )
    )


def _request() -> st.SearchStrategy[dict[str, Any]]:
    sleep = st.fixed_dictionaries(
        {"protocol": st.just(1), "id": st.just("r1"), "type": st.just("sleep")},
        optional={
            "launches": st.one_of(st.lists(_launch(), max_size=9), ANY),
            "submit": st.one_of(
                st.none(),
                st.fixed_dictionaries({"report": TEXT}, optional={"eval_minutes": INTS, "x": ANY}),
                ANY,
            ),
            "note": TEXT,
        },
    )
    cancel = st.fixed_dictionaries(
        {"protocol": st.just(1), "id": st.just("r1"), "type": st.just("cancel")},
        optional={"launches": st.one_of(st.lists(NAMES, max_size=33), ANY)},
    )
    history = st.fixed_dictionaries(
        {"protocol": st.just(1), "id": st.just("r1"), "type": st.just("history")}, optional={"limit": INTS}
    )
    other = st.fixed_dictionaries(
        {
            "protocol": st.sampled_from([1, 2, True, "1"]),
            "id": st.sampled_from(["r1", "R1", "r1\n", 5]),
            "type": st.sampled_from(["status", "queue", "nope", 3]),
        },
        optional={"extra": ANY},
    )
    return st.one_of(sleep, sleep, cancel, history, other)


POLICIES = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "max_minutes": st.sampled_from([1, 60, 240]),
            "max_gpus": st.sampled_from([0, 2, 8]),
            "submit": st.sampled_from([None, {"command": "python eval.py", "metric": "acc"}]),
            "verbs": st.sampled_from([list(VERBS), ["sleep", "status"], []]),
        },
    ),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=_request(), policy=POLICIES)
def test_tool_and_decoder_agree(obj: dict[str, Any], policy: dict[str, Any] | None) -> None:
    assert tool_outcome(obj, "r1", policy) == kernel_outcome(obj, "r1", policy)


def test_what_the_tool_accepts_the_decoder_accepts() -> None:
    obj = {
        "protocol": 1,
        "id": "r1",
        "type": "sleep",
        "launches": [
            {"name": "a", "command": "python -c 'print(1)'", "minutes": 30, "gpus": 1, "array": 4,
             "concurrency": 2, "artifacts": ["out/a.json"], "why": "why not"}
        ],
        "submit": None,
        "note": "",
    }  # fmt: skip
    assert tool_outcome(obj, "r1", {}) is None
    assert kernel_outcome(obj, "r1", {}) is None


# --- what the tool hard-codes --------------------------------------------------------------------------------


def test_limits_and_defaults_match_the_protocol_core() -> None:
    assert msgspec.structs.asdict(Limits()) == tool.DEFAULT_LIMITS
    policy = json.loads(msgspec.json.encode(Policy()))
    assert policy == tool.DEFAULT_POLICY
    assert (tool.MINUTES_MIN, tool.MINUTES_CEILING, tool.GPUS_CEILING) == (
        L.MINUTES_MIN,
        L.MINUTES_CEILING,
        L.GPUS_CEILING,
    )
    assert (tool.CANCEL_MAX_NAMES, tool.HISTORY_MAX, tool.HISTORY_DEFAULT) == (
        L.CANCEL_MAX_NAMES,
        L.HISTORY_MAX,
        L.HISTORY_DEFAULT,
    )
    assert (tool.TAIL_DEFAULT_LINES, tool.TAIL_MAX_LINES) == (
        L.TAIL_VERB_DEFAULT_LINES,
        L.TAIL_VERB_MAX_LINES,
    )
    assert tool.PROTOCOL == L.PROTOCOL_VERSION
    assert tuple(tool.REQUEST_TYPES) == VERBS
    assert tool.TERMINAL_STATES == TERMINAL_TASK_STATES


@pytest.mark.parametrize(
    "path",
    [
        "a",
        "out/x.json",
        "/a",
        "~a",
        "a\\b",
        "a\x00b",
        "a\tb",
        "a\x85b",
        "a//b",
        "a/",
        "./a",
        "a/..",
        "é/ü",
        "a b",
    ],
)
def test_artifact_rules_match(path: str) -> None:
    assert tool.artifact_path_problem(path) == artifact_path_problem(path)


def test_ids_are_unique_sortable_and_valid(tmp_path: Path) -> None:
    for sub in ("requests", "answers"):
        (tmp_path / sub).mkdir()
    ch = tool.Channel(str(tmp_path))
    before = int(time.time() * 1000)
    ids = [ch.new_id() for _ in range(2000)]
    after = int(time.time() * 1000)
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(L.ID_PATTERN, i) and re.fullmatch(r"\d{13}-[0-9a-f]{8}", i) for i in ids)
    stamps = [int(i.split("-")[0]) for i in ids]
    assert stamps == sorted(stamps)
    assert before <= stamps[0]
    assert stamps[-1] <= after


def test_request_file_is_committed_whole(tmp_path: Path) -> None:
    for sub in ("requests", "answers"):
        (tmp_path / sub).mkdir()
    ch = tool.Channel(str(tmp_path))
    obj = {"protocol": 1, "id": ch.new_id(), "type": "status"}
    ch.write_request(obj)
    assert os.listdir(tmp_path / "requests") == [obj["id"] + ".json"]
    data = (tmp_path / "requests" / (obj["id"] + ".json")).read_bytes()
    assert data == tool.encode_request(obj)
    assert not isinstance(decode_request(data, obj["id"]), Rejected)


def test_base64_vectors_are_the_only_skipped_encodings() -> None:
    skipped = [v for v in _vectors() if not _as_object(v)[0]]
    for v in skipped:
        if "request_text" in v:
            with pytest.raises((ValueError, RecursionError)):
                json.loads(v["request_text"])
        else:
            assert base64.b64decode(v["request_base64"])


def test_request_writer_never_opens_an_existing_name(tmp_path: Path) -> None:
    for sub in ("requests", "answers"):
        (tmp_path / sub).mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    ch = tool.Channel(str(tmp_path))
    obj = {"protocol": 1, "id": ch.new_id(), "type": "status"}
    planted = tmp_path / "requests" / f".{obj['id']}.tmp"
    planted.symlink_to(victim)
    with pytest.raises(tool.ToolError) as err:
        ch.write_request(obj)
    assert err.value.exit_code == tool.EXIT_NO_KERNEL
    assert victim.read_text() == "keep me"
    assert planted.is_symlink()  # not ours: left alone
    assert not (tmp_path / "requests" / f"{obj['id']}.json").exists()
