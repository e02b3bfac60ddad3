"""Parity: every conformance vector's request, sent through MCP `tools/call`, is refused or accepted exactly as
the CLI's checks and the kernel's decoder do, with the same code and JSON path.

A request maps onto tool calls the way an agent would make it: `unstage` (a clean slate), one `launch` per
launch object (its members are the tool's arguments, unchanged), `submit` with the submit object, then `sleep`
with the note; the other verbs' tools map their arguments onto request members as the server's table says
(`McpTool.request`: `cancel`'s `names` are `launches`, `history`'s `limit` is `limit`). The tool
writes `protocol`, `id` and `type` itself, so a vector whose request differs from the tool's in those (or that
adds top-level members, or whose `launches` is not an array) has no tool-call form; every such vector is listed
by `test_what_has_no_tool_call_form`. A launch or submit that is not a JSON object cannot be a call's arguments:
the server answers it with JSON-RPC -32602 (a refusal, as the decoder's is).

Each policy the vectors use is a workspace of the fake kernel (its kernel.json carries the policy); vectors
without a policy, which the decoder judges without the policy stage, get a workspace whose policy allows
everything the decoder does.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from mcp_wire import RawClient
from test_tool_validation import VECTOR_DIR, kernel_outcome, producible
from tool_fake_kernel import FakeKernel

from channel import limits as L
from channel.errors import CODES
from channel.messages import EvalContract, Policy
from tool import syscall as tool

# What the decoder allows when no policy stage runs: the protocol's own ceilings, submit available.
OPEN_POLICY = Policy(
    max_minutes=L.MINUTES_CEILING,
    max_gpus=L.GPUS_CEILING,
    max_concurrent_gpus=L.GPUS_CEILING,
    max_mem_mb=L.MEM_MB_CEILING,
    max_cpus=L.CPUS_CEILING,
    submit=EvalContract(command="python eval.py", metric="accuracy"),
)
KERNEL_STATE = {c for c, info in CODES.items() if info.section == "6"}
ID_RE = re.compile(L.ID_PATTERN)
# verb -> the tool that writes its request (from the server's own table, so a new verb's tool is picked up)
BY_VERB = {t.name: t for t in tool.MCP_TOOLS if t.request is not None}

Outcome = tuple[str, str | None] | str | None  # (code, path), "jsonrpc -32602", or None (accepted)


def _vectors() -> list[dict[str, Any]]:
    return [v for f in sorted(VECTOR_DIR.glob("*.json")) for v in json.loads(f.read_text("utf-8"))["vectors"]]


def _request(v: dict[str, Any]) -> Any:
    return v["request"] if "request" in v else json.loads(v["request_text"])


def tool_calls(v: dict[str, Any]) -> list[tuple[str, Any]] | None:
    """The tool calls that make `v`'s request, or None when the request has no tool-call form."""
    obj = _request(v)
    if not isinstance(obj, dict) or not {"protocol", "id", "type"} <= set(obj):
        return None
    verb = obj["type"]
    if type(obj["protocol"]) is not int or obj["protocol"] != 1 or not isinstance(verb, str):
        return None
    if verb not in BY_VERB or not isinstance(obj["id"], str) or not ID_RE.search(obj["id"]):
        return None
    if obj["id"] != v["stem"]:
        return None
    fields = {k: val for k, val in obj.items() if k not in ("protocol", "id", "type")}
    members = {member: arg for arg, member in (BY_VERB[verb].request or {}).items()}
    if verb == "sleep":
        members.update({"launches": "launch", "submit": "submit"})
    if not set(fields) <= set(members):
        return None
    if verb == "sleep":
        launches = fields.get("launches", [])
        if not isinstance(launches, list):
            return None
        calls: list[tuple[str, Any]] = [("unstage", {})]
        calls += [("launch", launch) for launch in launches]
        if fields.get("submit") is not None:
            calls.append(("submit", fields["submit"]))
        # the sleep's own members (note, wake_on, rest) are the `sleep` tool's arguments
        own = {members[k]: val for k, val in fields.items() if k not in ("launches", "submit")}
        calls.append(("sleep", own))
        return calls
    return [(verb, {members[k]: val for k, val in fields.items()})]


def expected(v: dict[str, Any]) -> tuple[str, str | None] | None:
    error = v["expect"].get("error")
    return None if error is None else (error["code"], error["path"])


def mcp_outcome(c: RawClient, calls: list[tuple[str, Any]]) -> tuple[Outcome, int]:
    """The first refusal among `calls` and its index: (code, path) or "jsonrpc -32602"; None when the kernel's
    decoder took the request."""
    for i, (name, arguments) in enumerate(calls):
        msg = c.request("tools/call", {"name": name, "arguments": arguments})
        if "error" in msg:
            return "jsonrpc {}".format(msg["error"]["code"]), i
        result = msg["result"]
        if not result["isError"]:
            continue
        content = result["structuredContent"]
        error = content.get("error") if isinstance(content, dict) else None
        assert isinstance(error, dict), f"{name}: an error result without a protocol error: {result}"
        if content["type"] == "rejected" and error["code"] in KERNEL_STATE:
            return (
                None,
                i,
            )  # decoded and within policy; the kernel's state said no (e.g. a sleep is in progress)
        return (error["code"], error["path"]), i
    return None, len(calls)


def request_so_far(v: dict[str, Any], calls: list[tuple[str, Any]], upto: int) -> dict[str, Any]:
    """The sleep request the tool checks at call `upto`: what the calls before it staged, with that call's."""
    obj = _request(v)
    req: dict[str, Any] = {"protocol": 1, "id": v["stem"], "type": "sleep", "launches": [], "submit": None}
    for name, arguments in calls[1 : upto + 1]:
        if name == "launch":
            req["launches"].append(arguments)
        elif name == "submit":
            req["submit"] = arguments
    req["note"] = obj.get("note", "") if calls[upto][0] == "sleep" else ""
    if calls[upto][0] == "sleep":
        req.update({k: obj[k] for k in ("wake_on", "rest") if k in obj})
    return req


def _policy_key(v: dict[str, Any]) -> str:
    return json.dumps(v.get("policy"), sort_keys=True)


VECTORS = [v for v in _vectors() if producible(v)]
MAPPED = [v for v in VECTORS if tool_calls(v) is not None]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[FakeKernel, RawClient]]]:
    """One fake-kernel workspace and one `syscall mcp` per policy the vectors use."""
    made: dict[str, tuple[FakeKernel, RawClient]] = {}
    stack = []
    try:
        for key in sorted({_policy_key(v) for v in MAPPED}):
            raw = json.loads(key)
            policy = OPEN_POLICY if raw is None else msgspec.convert(raw, Policy)
            fk = FakeKernel(tmp_path_factory.mktemp("parity") / "ws", policy=policy)
            cm = fk.running()
            cm.__enter__()
            stack.append(cm)
            c = RawClient(sys.executable, fk.tool)
            c.handshake()
            made[key] = (fk, c)
        yield made
    finally:
        for _, c in made.values():
            c.kill()
        for cm in stack:
            cm.__exit__(None, None, None)


@pytest.mark.parametrize("vector", MAPPED, ids=lambda v: v["name"])
def test_vector_through_tools_call(
    vector: dict[str, Any], servers: dict[str, tuple[FakeKernel, RawClient]]
) -> None:
    _, c = servers[_policy_key(vector)]
    calls = tool_calls(vector)
    assert calls is not None
    got, at = mcp_outcome(c, calls)
    want = expected(vector)
    if vector["name"].startswith("order-") and _request(vector)["type"] == "sleep":
        # Faults of several stages: a request built over several calls is refused at the call that brings the
        # first fault, exactly as the decoder refuses the sleep that call would make.
        assert want is not None
        assert got is not None, f"{vector['name']}: the tools accepted a request the decoder refuses"
        assert got == kernel_outcome(request_so_far(vector, calls, at), vector["stem"], vector.get("policy"))
        return
    # The CLI's checks (the same function the MCP tools run) say the same about the request itself.
    cli = tool.validate_request(_request(vector), None, vector.get("policy"), stem=vector["stem"])
    assert (None if cli is None else (cli[0], cli[2])) == want
    if got == "jsonrpc -32602":
        assert want is not None, f"{vector['name']}: the server refused what the decoder accepts"
        launches = _request(vector).get("launches", [])
        not_objects = [x for x in launches if not isinstance(x, dict)]
        submit = _request(vector).get("submit")
        assert not_objects or not isinstance(submit, (dict, type(None))), vector["name"]
        return
    assert got == want, vector["name"]


def test_most_vectors_have_a_tool_call_form() -> None:
    # 154 of the 190 vectors a plain object can carry (56 valid, 98 faulty) when this was written
    assert len(MAPPED) >= 150, len(MAPPED)
    assert sum(expected(v) is None for v in MAPPED) >= 50
    assert sum(expected(v) is not None for v in MAPPED) >= 95


def test_what_has_no_tool_call_form() -> None:
    """Only faults in what the tool writes itself (protocol, id, type, the top-level members) are left out."""
    for v in VECTORS:
        if tool_calls(v) is not None:
            continue
        obj = _request(v)
        want = expected(v)
        assert want is not None, (
            f"{v['name']}: a valid request the MCP tools cannot make (a verb without a tool? its McpTool entry "
            "in tool/syscall.py MCP_TOOLS needs request={argument: member})"
        )
        code, path = want
        own = (
            path in (None, "$", "$.protocol", "$.id", "$.type", "$.launches")
            or code in ("field.unknown", "request.too_large", "request.lone_surrogate", "json.too_deep")
            or code.startswith(("request.", "json."))
        )
        assert own, f"{v['name']}: {code} at {path} has no tool-call form: {str(obj)[:200]}"
