"""The decoder: valid requests round-trip, hostile input only ever yields a registered code, messages stay short.

The spec's case-by-case expectations live in spec/vectors (tests/conformance); this module adds properties over
generated input and the decoder's helpers.
"""

from __future__ import annotations

import json
import string
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from channel import limits as L
from channel.decode import (
    ECHO_MAX_CHARS,
    RequestError,
    artifact_path_problem,
    check_policy,
    decode_request,
    is_valid_id,
    parse_request,
)
from channel.errors import CODES
from channel.messages import (
    CancelRequest,
    EvalContract,
    HistoryRequest,
    Launch,
    Policy,
    QueueRequest,
    Rejected,
    Request,
    SleepRequest,
    StatusRequest,
    Submit,
    encode,
)

# --- strategies for valid requests -------------------------------------------------------------------------

ids = st.from_regex(r"\A[a-z0-9][a-z0-9-]{0,63}\Z")
names = st.from_regex(r"\A[a-z0-9][a-z0-9-]{0,31}\Z")
# any character but surrogates (not encodable) and the control characters (Cc) a command may not hold
command_chars = st.characters(exclude_categories=("Cs", "Cc"), include_characters="\t\n")
commands = st.text(command_chars, min_size=1, max_size=L.COMMAND_MAX_CHARS).filter(
    lambda s: s.strip(" \t\n") != ""
)
line_chars = st.characters(exclude_categories=("Cs", "Cc"), exclude_characters="\u2028\u2029")
path_parts = st.text(line_chars.filter(lambda c: c not in "/\\*?["), min_size=1, max_size=20).filter(
    lambda p: p not in (".", "..")
)
artifact_paths = (
    st.lists(path_parts, min_size=1, max_size=5)
    .map("/".join)
    .filter(
        lambda p: not p.startswith("~") and len(p) <= L.ARTIFACT_MAX_CHARS and p not in ("stdout", "stderr")
    )
)
any_text = st.text(st.characters(exclude_categories=("Cs",)))


@st.composite
def launches(draw: st.DrawFn, name: str) -> Launch:
    array = draw(st.integers(1, L.ARRAY_MAX))
    return Launch(
        name=name,
        command=draw(commands),
        minutes=draw(st.integers(L.MINUTES_MIN, L.MINUTES_CEILING)),
        gpus=draw(st.integers(0, L.GPUS_CEILING)),
        array=array,
        concurrency=draw(st.integers(0, array)),
        artifacts=tuple(draw(st.lists(artifact_paths, max_size=L.MAX_ARTIFACTS))),
        why=draw(st.text(line_chars, max_size=L.WHY_MAX_CHARS)),
    )


@st.composite
def sleeps(draw: st.DrawFn) -> SleepRequest:
    launch_names = draw(st.lists(names, max_size=L.MAX_LAUNCHES, unique=True))
    submit = draw(
        st.none()
        | st.builds(
            Submit,
            report=any_text.filter(bool).map(lambda s: s[: L.REPORT_MAX_CHARS]),
            eval_minutes=st.none() | st.integers(L.MINUTES_MIN, L.MINUTES_CEILING),
        )
    )
    return SleepRequest(
        protocol=1,
        id=draw(ids),
        launches=tuple(draw(launches(n)) for n in launch_names),
        submit=submit,
        note=draw(any_text.map(lambda s: s[: L.NOTE_MAX_CHARS])),
    )


requests: st.SearchStrategy[Request] = st.one_of(
    sleeps(),
    st.builds(
        CancelRequest,
        protocol=st.just(1),
        id=ids,
        launches=st.lists(names, max_size=L.CANCEL_MAX_NAMES).map(tuple),
    ),
    st.builds(StatusRequest, protocol=st.just(1), id=ids),
    st.builds(QueueRequest, protocol=st.just(1), id=ids),
    st.builds(HistoryRequest, protocol=st.just(1), id=ids, limit=st.integers(1, L.HISTORY_MAX)),
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=20,
)

slow = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_registered(result: Request | Rejected, stem: str) -> None:
    if isinstance(result, Rejected):
        assert result.error.code in CODES
        assert CODES[result.error.code].section[0] == "4", result.error
        assert result.id == stem
        assert result.error.message


# --- properties --------------------------------------------------------------------------------------------


@slow
@given(requests)
def test_valid_requests_round_trip(req: Request) -> None:
    assert decode_request(encode(req), req.id) == req


@slow
@given(requests)
def test_valid_requests_round_trip_through_pretty_json(req: Request) -> None:
    """Another client's encoder (indentation, escaped non-ASCII) yields the same request."""
    text = json.dumps(msgspec.to_builtins(req), indent=2, ensure_ascii=True)
    assert decode_request(text.encode(), req.id) == req


def _objects(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        return [value, *(o for v in value.values() for o in _objects(v))]
    if isinstance(value, list):
        return [o for v in value for o in _objects(v)]
    return []


@slow
@given(requests, st.data(), st.booleans())
def test_a_repeated_key_anywhere_is_refused(req: Request, data: st.DataObject, pretty: bool) -> None:
    """Whatever the object and the key, and whatever the spacing, a repeated key never slips through."""
    doc = msgspec.to_builtins(req)
    target = data.draw(st.sampled_from([o for o in _objects(doc) if o]))
    key = data.draw(st.sampled_from(sorted(target)))
    marker = "__repeat_here__"
    target[marker] = target[key]
    text = json.dumps(doc, indent=2 if pretty else None, ensure_ascii=data.draw(st.booleans()))
    text = text.replace(json.dumps(marker), json.dumps(key), 1)
    assert _code(text, req.id) == ("json.duplicate_key", None)


@slow
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    assert_registered(decode_request(data, "r1"), "r1")


@slow
@given(json_values)
def test_arbitrary_json_never_raises(value: Any) -> None:
    data = json.dumps(value).encode()
    assert_registered(decode_request(data, "r1"), "r1")


@slow
@given(requests, st.data())
def test_a_mutated_request_is_rejected_with_a_registered_code(req: Request, data: st.DataObject) -> None:
    """Replace one member of a valid request (at any level) with any JSON value."""
    doc: dict[str, Any] = msgspec.to_builtins(req)
    target: dict[str, Any] = doc
    launches_ = doc.get("launches")
    if launches_ and isinstance(launches_[0], dict) and data.draw(st.booleans()):
        target = launches_[0]
    key = data.draw(st.sampled_from([*target, "extra"]))
    target[key] = data.draw(json_values)
    assert_registered(decode_request(json.dumps(doc).encode(), req.id), req.id)


@slow
@given(st.text(min_size=ECHO_MAX_CHARS + 1, max_size=3000), st.integers(0, 6))
def test_messages_never_echo_much_of_the_request(payload: str, where: int) -> None:
    req: dict[str, Any] = {"protocol": 1, "id": "r1", "type": "sleep"}
    if where == 0:
        req[payload] = 1  # an unknown member
    elif where == 1:
        req["type"] = payload
    elif where == 2:
        req["id"] = payload
    elif where == 3:
        req["launches"] = [{"name": payload, "command": "x"}]
    elif where == 4:
        req["launches"] = [{"name": "a", "command": "x", "artifacts": ["ok", payload]}]
    elif where == 5:
        req["launches"] = [{"name": "a", "command": "x", "why": payload}]
    else:
        req["launches"] = [{"name": "a", "command": "x", "unknown": {payload: payload}}]
    texts = [json.dumps(req), json.dumps(req).replace('"id"', f'"{json.dumps(payload)[1:-1]}":1,"id"', 1)]
    for text in texts:
        result = decode_request(text.encode("utf-8", "surrogatepass"), "r1")
        if isinstance(result, Rejected):
            err = result.error
            # 64 quoted characters are at most 768 once escaped (a surrogate pair is 12); the rest is ours
            assert len(err.message) <= 1000, err
            assert err.path is None or len(err.path) <= 120, err
            shown = err.message + (err.path or "")
            # no 65-character stretch of the payload, as written or JSON-escaped, reaches the answer
            for i in range(0, len(payload) - ECHO_MAX_CHARS, 7):
                stretch = payload[i : i + ECHO_MAX_CHARS + 1]
                assert stretch not in shown
                assert json.dumps(stretch)[1:-1] not in shown


# --- the JSON stage ----------------------------------------------------------------------------------------


def _code(data: bytes | str, stem: str = "r1") -> tuple[str, str | None]:
    result = decode_request(data.encode() if isinstance(data, str) else data, stem)
    assert isinstance(result, Rejected), result
    return result.error.code, result.error.path


def test_nesting_that_fills_the_size_limit_is_too_deep_not_a_crash() -> None:
    half = L.REQUEST_MAX_BYTES // 2
    assert _code("[" * half + "]" * half) == ("json.too_deep", None)
    assert _code('{"a":' * (half // 6) + "1" + "}" * (half // 6)) == ("json.too_deep", None)


@pytest.mark.parametrize("number", ["9223372036854775808", "-9223372036854775809", "1" * 4301, "1e309"])
def test_a_number_out_of_range_wins_over_any_shape_fault(number: str) -> None:
    text = f'{{"protocol":1,"id":"WRONG","type":"nope","x":{number}}}'
    assert _code(text) == ("json.number_out_of_range", None)


def test_a_number_out_of_range_in_a_non_object_wins_over_not_object() -> None:
    assert _code("[18446744073709551616]") == ("json.number_out_of_range", None)


def test_the_long_number_is_not_echoed_whole() -> None:
    result = decode_request(('{"x":' + "9" * 5000 + "}").encode(), "r1")
    assert isinstance(result, Rejected)
    assert "9" * 65 not in result.error.message


def test_an_unknown_key_with_backticks_is_named_exactly() -> None:
    assert _code('{"protocol":1,"id":"r1","type":"status","a`b":1}') == ("field.unknown", '$["a`b"]')


# --- rules and helpers -------------------------------------------------------------------------------------


def test_the_rejection_is_addressed_to_the_stem() -> None:
    result = decode_request(b"{", "abc-1")
    assert isinstance(result, Rejected)
    assert (result.id, result.protocol) == ("abc-1", 1)


def test_parse_request_raises_what_decode_request_answers() -> None:
    with pytest.raises(RequestError) as info:
        parse_request(b'{"protocol":1,"id":"r2","type":"status"}', "r1")
    assert (info.value.code, info.value.path) == ("request.id.mismatch", "$.id")
    assert info.value.info().code == "request.id.mismatch"


def test_request_error_refuses_an_unregistered_code() -> None:
    with pytest.raises(AssertionError):
        RequestError("no.such.code", "x")


@pytest.mark.parametrize(
    ("stem", "ok"),
    [
        ("a", True),
        ("1764460800000-3fa9c2d1", True),
        ("a" * 64, True),
        ("a" * 65, False),
        ("", False),
        ("-a", False),
        ("A", False),
        ("a\n", False),
        ("a.json", False),
        (".a", False),
    ],
)
def test_is_valid_id(stem: str, ok: bool) -> None:
    assert is_valid_id(stem) is ok


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("out/curve.json", None),
        ("a/.b/..c", None),
        ("/abs", "absolute"),
        ("~user/x", "'~'"),
        ("a\\b", "backslash"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("a//b", "empty parts"),
        ("a/", "naming a directory"),
        ("out/run/", "tar czf out/run.tgz out/run"),
        ("a//", "empty parts"),
        ("../", "empty parts"),
        ("", "empty parts"),
        ("a/./b", "'.' or '..'"),
        ("..", "'.' or '..'"),
        ("out/*.json", "glob"),
        ("run?.log", "glob"),
        ("run[0].log", "glob"),
        ("stdout", "delivers the job's own stdout"),
        ("stderr", "delivers the job's own stderr"),
        ("logs/stdout", None),
    ],
)
def test_artifact_path_problem(path: str, problem: str | None) -> None:
    reason = artifact_path_problem(path)
    if problem is None:
        assert reason is None
    else:
        assert reason is not None
        assert problem in reason


def _sleep(**launch: Any) -> SleepRequest:
    return SleepRequest(protocol=1, id="r1", launches=(Launch(name="a", command="x", **launch),))


def test_check_policy_accepts_what_the_policy_allows() -> None:
    policy = Policy(
        max_minutes=60, max_gpus=2, max_mem_mb=2048, max_cpus=4, submit=EvalContract(command="e", metric="m")
    )
    check_policy(_sleep(minutes=60, gpus=2, mem_mb=2048, cpus=4), policy)
    # Asking for neither is the site's default, whatever the ceilings.
    check_policy(_sleep(), Policy(max_mem_mb=16, max_cpus=1))
    check_policy(StatusRequest(protocol=1, id="r1"), Policy(verbs=("status",)))


@pytest.mark.parametrize(
    ("req", "policy", "code"),
    [
        (_sleep(minutes=61), Policy(max_minutes=60), "policy.minutes"),
        (_sleep(gpus=3), Policy(max_gpus=2), "policy.gpus"),
        (_sleep(mem_mb=2049), Policy(max_mem_mb=2048), "policy.mem_mb"),
        (_sleep(cpus=5), Policy(max_cpus=4), "policy.cpus"),
        (SleepRequest(protocol=1, id="r1", submit=Submit(report="r")), Policy(), "policy.submit_disabled"),
        (
            SleepRequest(protocol=1, id="r1", submit=Submit(report="r", eval_minutes=61)),
            Policy(max_minutes=60, submit=EvalContract(command="e", metric="m")),
            "policy.eval_minutes",
        ),
        (QueueRequest(protocol=1, id="r1"), Policy(verbs=("sleep", "status")), "policy.verb_disabled"),
        (HistoryRequest(protocol=1, id="r1"), Policy(verbs=()), "policy.verb_disabled"),
    ],
)
def test_check_policy_refuses(req: Request, policy: Policy, code: str) -> None:
    with pytest.raises(RequestError) as info:
        check_policy(req, policy)
    assert info.value.code == code
    assert CODES[code].section == "5"


def test_error_messages_name_the_fix() -> None:
    """Spot-check that messages tell a model what to do, not just what failed."""
    data = json.dumps(
        {"protocol": 1, "id": "r1", "type": "sleep", "launches": [{"name": "a", "command": "x" * 2001}]}
    )
    result = decode_request(data.encode(), "r1")
    assert isinstance(result, Rejected)
    assert str(L.COMMAND_MAX_CHARS) in result.error.message
    assert "shorten" in result.error.message
    result = decode_request(b'{"protocol":1,"id":"r1","type":"slep"}', "r1")
    assert isinstance(result, Rejected)
    assert all(v in result.error.message for v in ("sleep", "cancel", "status", "queue", "history"))


def test_whitespace_and_printable_ascii_commands_survive() -> None:
    cmd = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    req = SleepRequest(protocol=1, id="r1", launches=(Launch(name="a", command=cmd),))
    assert decode_request(encode(req), "r1") == req


@pytest.mark.parametrize(
    ("launch", "policy", "code", "path", "message"),
    [
        (
            {"mem_mb": 9000},
            Policy(max_mem_mb=8192),
            "policy.mem_mb",
            "$.launches[1].mem_mb",
            "$.launches[1].mem_mb is 9000 (MB per task); this workspace allows at most 8192 (kernel.json "
            "policy.max_mem_mb): ask for 8192 or less",
        ),
        (
            {"cpus": 9},
            Policy(max_cpus=8),
            "policy.cpus",
            "$.launches[1].cpus",
            "$.launches[1].cpus is 9 (per task); this workspace allows at most 8 (kernel.json policy.max_cpus): "
            "ask for 8 or fewer",
        ),
    ],
)
def test_a_resource_over_the_ceiling_is_refused_naming_the_path_the_ceiling_and_the_fix(
    launch: dict[str, int], policy: Policy, code: str, path: str, message: str
) -> None:
    req = SleepRequest(
        protocol=1, id="r1", launches=(Launch(name="a", command="x"), Launch(name="b", command="x", **launch))
    )
    with pytest.raises(RequestError) as info:
        check_policy(req, policy)
    assert (info.value.code, info.value.path, info.value.message) == (code, path, message)


@pytest.mark.parametrize(
    ("member", "value", "code", "message"),
    [
        (
            "mem_mb",
            15,
            "launch.mem_mb.out_of_range",
            "$.launches[0].mem_mb is out of range; it must be >= 16",
        ),
        (
            "mem_mb",
            L.MEM_MB_CEILING + 1,
            "launch.mem_mb.out_of_range",
            f"$.launches[0].mem_mb is out of range; it must be <= {L.MEM_MB_CEILING}",
        ),
        ("cpus", 0, "launch.cpus.out_of_range", "$.launches[0].cpus is out of range; it must be >= 1"),
        ("mem_mb", "8G", "field.type", "$.launches[0].mem_mb must be an integer or null, got a string"),
    ],
)
def test_a_resource_outside_the_protocols_bounds_is_refused_with_its_path(
    member: str, value: object, code: str, message: str
) -> None:
    body = {
        "protocol": 1,
        "id": "r1",
        "type": "sleep",
        "launches": [{"name": "a", "command": "x", member: value}],
    }
    got = decode_request(json.dumps(body).encode(), "r1")
    assert isinstance(got, Rejected)
    assert (got.error.code, got.error.path, got.error.message) == (code, f"$.launches[0].{member}", message)
