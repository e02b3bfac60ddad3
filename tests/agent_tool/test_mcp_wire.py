"""`syscall mcp` on the wire: a golden JSON-RPC transcript, revision negotiation, and hostile input.

The server is the installed copy of the tool (`.syscall/syscall mcp`) under each supported Python, spoken to
byte for byte over its stdin/stdout, in a workspace answered by the fake kernel. The golden transcript
(tests/agent_tool/golden/mcp_transcript.jsonl) is every message of a session with the values that change from
run to run replaced; `SYSCALL_UPDATE_GOLDEN=1` rewrites it (then read the diff).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from mcp_wire import INIT_PARAMS, RawClient, normalize
from tool_fake_kernel import FakeKernel

from channel.messages import EnvironmentBuild, ErrorInfo

GOLDEN = Path(__file__).resolve().parent / "golden" / "mcp_transcript.jsonl"
VERBS = [
    "status",
    "budget",
    "env",
    "launch",
    "submit",
    "unstage",
    "sleep",
    "wait",
    "cancel",
    "queue",
    "history",
    "tail",
]


@pytest.fixture
def client(kernel: FakeKernel, python: str) -> Iterator[RawClient]:
    c = RawClient(python, kernel.tool)
    try:
        yield c
    finally:
        c.kill()


def _error(msg: dict[str, Any]) -> tuple[Any, int]:
    assert "result" not in msg, msg
    return msg["id"], msg["error"]["code"]


# --- the golden transcript ------------------------------------------------------------------------------------


def test_golden_transcript(kernel: FakeKernel, python: str) -> None:
    c = RawClient(python, kernel.tool)
    try:
        c.handshake()
        c.request("ping")
        c.request("tools/list")
        c.call("status", {})
        c.call("env", {})
        c.call("launch", {"name": "train", "command": "python train.py --lr 3e-4", "gpus": 1, "why": "lr"})
        c.call("launch", {"name": "long", "command": "python train.py", "minutes": 999})
        c.call("unstage", {"names": ["nope"]})
        c.call("submit", {"report": "better"})
        c.call("sleep", {"note": "first"})
        kernel.finish("train", 0, elapsed_s=61.5, stdout="val_acc 0.88\n")
        c.call("wait", {})
        c.call("cancel", {})
        c.call("history", {"limit": 5})
        c.call("queue")
        c.call("budget", {})
        c.call("bogus", {})
        c.request("resources/list")
        c.request("server/discover", {})
        assert c.close() == 0
    finally:
        c.kill()
    # Every result that is not an error matches its tool's outputSchema (as the SDK client checks).
    listed = next(m for m in c.received if m.get("id") == 3)["result"]["tools"]
    schemas = {t["name"]: t["outputSchema"] for t in listed}
    called = {m["id"]: m["params"]["name"] for m in c.sent if m.get("method") == "tools/call"}
    checked = 0
    for m in c.received:
        if m.get("id") in called and "result" in m and not m["result"]["isError"]:
            jsonschema.validate(m["result"]["structuredContent"], schemas[called[m["id"]]])
            checked += 1
    assert checked == 8  # status, env, launch, sleep, wait, history, queue, budget
    # An MCP caller has no shell: what a result tells it to do next names a tool, never a command line.
    texts = [
        c["text"]
        for m in c.received
        if m.get("id") in called and "result" in m
        for c in m["result"]["content"]
    ]
    assert any("the `sleep` tool" in t for t in texts), texts
    assert not [t for t in texts if ".syscall/syscall " in t or "`syscall " in t], texts
    lines = [json.dumps({"send": m}, sort_keys=True) for m in c.sent]
    lines += [json.dumps({"recv": normalize(m)}, sort_keys=True) for m in c.received]
    text = "\n".join(lines) + "\n"
    if os.environ.get("SYSCALL_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"{GOLDEN} is missing; SYSCALL_UPDATE_GOLDEN=1 writes it"
    want = GOLDEN.read_text().splitlines()
    got = text.splitlines()
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        assert json.loads(g) == json.loads(w), (
            f"message {i} differs from {GOLDEN.name}; if the change is intended, "
            "SYSCALL_UPDATE_GOLDEN=1 rewrites the file (then read its diff)"
        )
    assert len(got) == len(want), (
        f"{GOLDEN.name} has {len(want)} messages; SYSCALL_UPDATE_GOLDEN=1 rewrites it"
    )


def test_transcript_shapes(client: RawClient) -> None:
    """What the golden file pins, said as properties (so a reader of a failure sees what broke)."""
    init = client.handshake()["result"]
    assert init["protocolVersion"] == "2025-11-25"
    assert init["capabilities"] == {"tools": {"listChanged": False}}
    assert client.request("ping") == {"jsonrpc": "2.0", "id": 2, "result": {}}
    listed = client.request("tools/list")
    tools = listed["result"]["tools"]
    assert [t["name"] for t in tools] == VERBS
    # A model reads the whole listing at every session's start: it stays within 6 KiB on the wire (it was
    # 12.4 KB, ~3.1k tokens, for the same 12 tools).
    assert len(json.dumps(listed, separators=(",", ":"))) <= 6 * 1024
    for t in tools:
        jsonschema.Draft202012Validator.check_schema(t["inputSchema"])
        jsonschema.Draft202012Validator.check_schema(t["outputSchema"])
        assert t["inputSchema"]["type"] == "object"
        assert t["outputSchema"]["type"] == "object"
        assert "Example: " + t["name"] in t["description"]
    launch = next(t for t in tools if t["name"] == "launch")["inputSchema"]
    assert launch["required"] == ["name", "command"]
    assert launch["properties"]["minutes"]["maximum"] == 240  # the policy's ceiling, from kernel.json
    assert launch["properties"]["command"]["maxLength"] == 2000  # kernel.json limits
    refused = client.call("launch", {"name": "x", "command": "true", "minutes": 999})["result"]
    assert refused["isError"] is True
    assert refused["structuredContent"]["error"]["code"] == "policy.minutes"
    assert refused["structuredContent"]["error"]["path"] == "$.launches[0].minutes"
    assert "policy.minutes at $.launches[0].minutes" in refused["content"][0]["text"]


def test_schemas_follow_kernel_json(tmp_path: Path, python: str) -> None:
    from channel.messages import Policy

    fk = FakeKernel(tmp_path / "ws", policy=Policy(max_minutes=60, max_gpus=2))
    c = RawClient(python, fk.tool)
    try:
        tools = {t["name"]: t for t in c.request("tools/list")["result"]["tools"]}
        props = tools["launch"]["inputSchema"]["properties"]
        assert (props["minutes"]["maximum"], props["gpus"]["maximum"]) == (60, 2)
        assert tools["submit"]["inputSchema"]["properties"]["eval_minutes"]["maximum"] == 60
    finally:
        c.kill()


# --- revisions ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "answered"),
    [
        ("2025-11-25", "2025-11-25"),
        ("2025-06-18", "2025-06-18"),
        ("2026-07-28", "2025-11-25"),  # the per-request era: this server negotiates down
        ("2024-11-05", "2025-11-25"),
        ("banana", "2025-11-25"),
    ],
)
def test_revision_negotiation(client: RawClient, asked: str, answered: str) -> None:
    got = client.request("initialize", {**INIT_PARAMS, "protocolVersion": asked})
    assert got["result"]["protocolVersion"] == answered


def test_discover_is_not_found_so_a_2026_client_falls_back(client: RawClient) -> None:
    got = client.request(
        "server/discover", {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}
    )
    assert _error(got) == (1, -32601)
    assert client.handshake()["result"]["protocolVersion"] == "2025-11-25"


def test_initialize_without_a_revision_is_invalid_params(client: RawClient) -> None:
    assert _error(client.request("initialize", {"capabilities": {}})) == (1, -32602)


# --- hostile input -------------------------------------------------------------------------------------------


def _next_is_ping_answer(c: RawClient) -> None:
    c.send({"jsonrpc": "2.0", "id": "after", "method": "ping"})
    assert c.recv() == {"jsonrpc": "2.0", "id": "after", "result": {}}


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"{not json\n", -32700),
        (b"\xff\xfe{}\n", -32700),  # not UTF-8
        (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"x": NaN}}\n', -32700),
        # nesting past the parser's recursion (named: as its test id, 200 KB of brackets would be in every
        # process's PYTEST_CURRENT_TEST, past the kernel's limit on one environment string)
        pytest.param(b"[" * 100_000 + b"]" * 100_000 + b"\n", -32700, id="nested-100000-deep"),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]\n', -32600),  # batches are gone since 2025-06-18
        (b'"ping"\n', -32600),
        (b'{"id": 1, "method": "ping"}\n', -32600),  # no jsonrpc member
        (b'{"jsonrpc": "2.0", "id": null, "method": "ping"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": true, "method": "ping"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": 1, "method": 7}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1]}\n', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {}}\n', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": 5}}\n', -32602),
        (
            b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "status", "arguments": []}}\n',
            -32602,
        ),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "rm -rf"}}\n', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "sampling/createMessage", "params": {}}\n', -32601),
    ],
)
def test_malformed_messages_get_the_protocols_error(client: RawClient, data: bytes, code: int) -> None:
    client.write(data)
    got = client.recv()
    assert got["error"]["code"] == code, got
    assert got["error"]["message"]
    _next_is_ping_answer(client)


def test_an_oversized_line_is_refused_without_being_kept(client: RawClient) -> None:
    client.write(
        b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"x": "' + b"a" * (3 << 20) + b'"}}\n'
    )
    got = client.recv()
    assert _error(got) == (None, -32600)
    assert "longer than 1048576 bytes" in got["error"]["message"]
    _next_is_ping_answer(client)


def test_notifications_and_responses_are_never_answered(client: RawClient) -> None:
    client.write(b'{"jsonrpc": "2.0", "method": "notifications/whatever", "params": {}}\n')
    client.write(b'{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 99}}\n')
    client.write(b'{"jsonrpc": "2.0", "id": 5, "result": {}}\n')
    client.write(b"\n\r\n")
    _next_is_ping_answer(client)


@pytest.mark.parametrize(
    ("tool", "arguments", "code", "path"),
    [
        ("sleep", {"wait": "yes"}, "argument.type", "arguments.wait"),
        ("sleep", {"timeout_s": -1}, "argument.out_of_range", "arguments.timeout_s"),
        ("sleep", {"timeout_s": 1e300}, "argument.out_of_range", "arguments.timeout_s"),
        ("sleep", {"note": 5}, "field.type", "$.note"),
        ("wait", {"sleep_id": ["x"]}, "argument.type", "arguments.sleep_id"),
        ("status", {"verbose": True}, "argument.unknown", "arguments.verbose"),
        ("unstage", {"names": "train"}, "argument.type", "arguments.names"),
        ("launch", {"name": "a", "command": ["ls"]}, "field.type", "$.launches[0].command"),
        ("launch", {"name": "a", "command": "ls", "gpus": True}, "field.type", "$.launches[0].gpus"),
        ("launch", {"name": "a", "command": "ls", "minutes": None}, "field.type", "$.launches[0].minutes"),
        ("launch", {"name": "a", "command": "ls", "shell": "bash"}, "field.unknown", "$.launches[0].shell"),
        ("launch", {"command": "ls"}, "field.missing", "$.launches[0].name"),
        ("launch", {"name": "a", "command": "ls", "artifacts": ["../x"]}, "launch.artifact.invalid",
         "$.launches[0].artifacts[0]"),
        ("cancel", {"names": "a"}, "field.type", "$.launches"),
        ("history", {"limit": 0}, "history.limit.out_of_range", "$.limit"),
        ("history", {"limit": "5"}, "field.type", "$.limit"),
        ("submit", {"report": "r", "eval_minutes": 5}, "policy.submit_disabled", "$.submit"),
    ],
)  # fmt: skip
def test_wrong_arguments_are_refusals_with_code_and_path(
    client: RawClient, kernel: FakeKernel, tool: str, arguments: dict[str, Any], code: str, path: str
) -> None:
    result = client.call(tool, arguments)["result"]
    assert result["isError"] is True
    assert result["structuredContent"]["type"] == "refused_locally"
    assert (result["structuredContent"]["error"]["code"], result["structuredContent"]["error"]["path"]) == (
        code,
        path,
    )
    assert f"{code} at {path}" in result["content"][0]["text"]
    assert not [p for p in (kernel.channel / "requests").iterdir()], "a refusal wrote a request"


def test_a_kernel_rejection_is_an_error_result_with_its_code(client: RawClient, kernel: FakeKernel) -> None:
    kernel.reject_next["sleep"] = ErrorInfo(code="budget.sleeps", message="no sleeps left", path=None)
    result = client.call("sleep", {})["result"]
    assert result["isError"] is True
    assert result["structuredContent"]["type"] == "rejected"
    assert result["structuredContent"]["error"]["code"] == "budget.sleeps"
    assert "the kernel rejected request" in result["content"][0]["text"]


def _sleep_with_one_running_task(c: RawClient, kernel: FakeKernel) -> str:
    assert c.call("launch", {"name": "job", "command": "true"})["result"]["isError"] is False
    accepted = c.call("sleep", {})["result"]
    assert accepted["isError"] is False, accepted
    return str(accepted["structuredContent"]["answer"]["id"])


def test_wait_sends_progress_and_returns_the_wake(client: RawClient, kernel: FakeKernel) -> None:
    client.handshake()
    sleep_id = _sleep_with_one_running_task(client, kernel)
    client.send(
        {
            "jsonrpc": "2.0",
            "id": "w",
            "method": "tools/call",
            "params": {"name": "wait", "arguments": {}, "_meta": {"progressToken": "tok"}},
        }
    )
    first = client.recv()
    assert first["method"] == "notifications/progress"
    assert first["params"]["progressToken"] == "tok"
    assert f"Waiting for sleep {sleep_id}" in first["params"]["message"]
    kernel.finish("job", 0, elapsed_s=2.0)
    second = client.recv()
    assert second["method"] == "notifications/progress"
    assert second["params"]["progress"] > first["params"]["progress"]
    assert "job[0] COMPLETED" in second["params"]["message"]
    done = client.recv()
    assert done["id"] == "w"
    assert done["result"]["structuredContent"]["id"] == sleep_id
    assert "(The wake is kept at .syscall/wakes/" in done["result"]["content"][0]["text"]


def test_wait_sends_progress_for_each_step_of_the_environment_build(
    client: RawClient, kernel: FakeKernel
) -> None:
    """The build the tasks wait for, from the progress file: a notification as it begins and once it is built."""
    client.handshake()
    sleep_id = _sleep_with_one_running_task(client, kernel)
    sha = "ab" * 32
    kernel.building(
        EnvironmentBuild(lock_sha256=sha, state="building", started_at="2026-12-03T10:00:00.000Z")
    )
    client.send(
        {
            "jsonrpc": "2.0",
            "id": "w",
            "method": "tools/call",
            "params": {"name": "wait", "arguments": {}, "_meta": {"progressToken": "tok"}},
        }
    )
    begun = client.recv()
    assert begun["method"] == "notifications/progress"
    assert begun["params"]["message"].startswith(
        f"Environment: building the environment for uv.lock (sha256 {sha[:12]}) since 2026-12-03T10:00:00.000Z;"
    ), begun
    assert f"Waiting for sleep {sleep_id}" in client.recv()["params"]["message"]
    kernel.building(EnvironmentBuild(lock_sha256=sha, state="ready", started_at="2026-12-03T10:00:00.000Z"))
    built = client.recv()
    assert built["params"]["message"] == (
        f"Environment: the environment for uv.lock (sha256 {sha[:12]}) is built; the tasks are being submitted."
    ), built
    kernel.finish("job", 0, elapsed_s=2.0)
    assert "job[0] COMPLETED" in client.recv()["params"]["message"]
    assert client.recv()["id"] == "w"


def test_cancelling_a_wait_stops_the_wait_never_the_job(client: RawClient, kernel: FakeKernel) -> None:
    client.handshake()
    _sleep_with_one_running_task(client, kernel)
    client.send(
        {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "wait", "arguments": {}}}
    )
    deadline = time.monotonic() + 10
    while not kernel.requests_of("status") and time.monotonic() < deadline:  # the wait is polling
        time.sleep(0.02)
    client.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 9}})
    _next_is_ping_answer(client)  # and no response to the cancelled call came before it
    assert client.nothing_within(0.5)
    current = kernel.current()
    assert current is not None
    assert current.tasks[0].state == "RUNNING"
    assert not kernel.requests_of("cancel")
    assert not list((kernel.channel / "requests").iterdir())  # the wait's own status question was withdrawn


def test_calls_in_flight_are_bounded(client: RawClient, kernel: FakeKernel) -> None:
    _sleep_with_one_running_task(client, kernel)
    for i in range(4):
        client.send({"jsonrpc": "2.0", "id": f"w{i}", "method": "tools/call", "params": {"name": "wait"}})
    busy = client.call("status", {})["result"]
    assert busy["isError"] is True
    assert busy["structuredContent"]["type"] == "busy"
    for i in range(4):
        client.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": f"w{i}"}})
    deadline = time.monotonic() + 10
    while True:
        status = client.call("status", {})["result"]
        if not status["isError"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status["isError"] is False


def test_eof_during_a_wait_exits_cleanly_and_leaves_the_job(client: RawClient, kernel: FakeKernel) -> None:
    _sleep_with_one_running_task(client, kernel)
    client.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "wait"}})
    time.sleep(0.3)
    started = time.monotonic()
    assert client.close(timeout=15) == 0
    assert time.monotonic() - started < 10
    current = kernel.current()
    assert current is not None
    assert current.tasks[0].state == "RUNNING"
    assert not kernel.requests_of("cancel")


def test_a_client_that_never_reads_gets_a_bounded_server(kernel: FakeKernel, python: str) -> None:
    env = {**os.environ, "SYSCALL_MCP_STALL_S": "2"}
    # Nobody reads this server's stdout: the answers to a flood of pings pile up where it cannot write them.
    proc = subprocess.Popen(
        [python, str(kernel.tool), "mcp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None

    def flood() -> None:
        ping = b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}\n'
        try:
            for _ in range(20_000):
                proc.stdin.write(ping)  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            pass

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    try:
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        writer.join(10)
        stderr = proc.stderr.read() if proc.stderr else b""
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
    assert rc == 1
    assert b"the client has read nothing for 2 s; exiting." in stderr


def test_parallel_calls_that_change_the_staging_lose_nothing(client: RawClient, kernel: FakeKernel) -> None:
    """A model may call launch several times at once: each call's launch is staged (and reported) exactly once."""
    for n in range(6):
        assert client.call("unstage", {})["result"]["isError"] is False
        for i in range(4):
            arguments = {"name": f"job{i}", "command": f"echo {i}"}
            client.send(
                {
                    "jsonrpc": "2.0",
                    "id": f"{n}-{i}",
                    "method": "tools/call",
                    "params": {"name": "launch", "arguments": arguments},
                }
            )
        answers = [client.recv() for _ in range(4)]
        assert all(a["result"]["isError"] is False for a in answers), answers
        staged = json.loads((kernel.channel / "staged.json").read_text())
        assert sorted(x["name"] for x in staged["launches"]) == ["job0", "job1", "job2", "job3"], n


@pytest.mark.parametrize("depth", [17, 900])
def test_arguments_nested_too_deep_are_the_decoders_refusal(client: RawClient, depth: int) -> None:
    why = "[" * depth + "]" * depth
    line = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "launch", '
    line += '"arguments": {"name": "a", "command": "true", "why": ' + why + "}}}\n"
    client.write(line.encode())
    result = client.recv()["result"]
    assert result["isError"] is True
    assert result["structuredContent"]["error"]["code"] == "json.too_deep"
    assert result["structuredContent"]["error"]["path"] is None


def test_a_staging_file_nested_past_the_parser_is_corrupt_not_a_crash(
    client: RawClient, kernel: FakeKernel
) -> None:
    (kernel.channel / "staged.json").write_text("[" * 100_000 + "]" * 100_000)
    refused = client.call("launch", {"name": "a", "command": "true"})["result"]
    assert refused["isError"] is True
    assert "staged.json is corrupt" in refused["content"][0]["text"]
    assert "unstage" in refused["content"][0]["text"]
    cleared = client.call("unstage", {})["result"]
    assert cleared["isError"] is False
    assert cleared["structuredContent"]["launches"] == []
    assert client.call("launch", {"name": "a", "command": "true"})["result"]["isError"] is False


# --- what a result costs: structuredContent within 16 KiB --------------------------------------------------------


def test_a_wake_over_16_kib_is_cut_in_structured_content_and_the_text_says_what_and_where(
    client: RawClient, kernel: FakeKernel
) -> None:
    """A 16-task sweep whose every task printed ~3.9 KB: the wake's JSON is ~70 KB, which an MCP client would
    put whole in the model's context (before: structuredContent was the whole wake, whatever its size)."""
    client.handshake()
    schemas = {t["name"]: t["outputSchema"] for t in client.request("tools/list")["result"]["tools"]}
    launched = client.call("launch", {"name": "grid", "command": "python train.py", "array": 16})
    assert launched["result"]["isError"] is False, launched
    sleep_id = client.call("sleep", {})["result"]["structuredContent"]["answer"]["id"]
    chatty = "".join(f"epoch {e} loss {1 / (e + 1):.6f} lr 0.001 grad_norm 1.2345\n" for e in range(80))[
        -3900:
    ]
    for i in range(16):
        kernel.finish("grid", i, stdout=chatty + f'{{"val_loss": 0.{i:02d}}}\n')
    result = client.call("wait", {"sleep_id": sleep_id})["result"]
    assert result["isError"] is False, result
    structured = result["structuredContent"]
    assert len(json.dumps(structured, separators=(",", ":")).encode()) <= 16 * 1024
    jsonschema.validate(structured, schemas["wait"])
    assert len(structured["tasks"]) == 16  # what was cut is the tails, not the tasks
    assert {t["stdout_tail"] for t in structured["tasks"]} == {""}
    assert structured["tasks"][3]["result"] == '{"val_loss": 0.03}'
    text = result["content"][0]["text"]
    assert (
        "(structuredContent is cut to 16 KiB: every task's stdout_tail and stderr_tail are blanked; the whole "
        f"wake is .syscall/wakes/{sleep_id}.json.)"
    ) in text
    whole = json.loads((kernel.channel / "wakes" / f"{sleep_id}.json").read_text())
    assert whole["tasks"][3]["stdout_tail"].endswith('{"val_loss": 0.03}\n')


def test_a_result_small_enough_is_not_cut(client: RawClient, kernel: FakeKernel) -> None:
    client.handshake()
    sleep_id = _sleep_with_one_running_task(client, kernel)
    kernel.finish("job", 0, stdout="done\n")
    result = client.call("wait", {"sleep_id": sleep_id})["result"]
    assert result["structuredContent"]["tasks"][0]["stdout_tail"] == "done\n"
    assert "structuredContent is cut" not in result["content"][0]["text"]


def test_a_long_list_is_cut_from_its_end_and_the_text_names_it() -> None:
    from types import SimpleNamespace

    from tool import syscall as tool

    sleeps = [{"id": f"s{i}", "note": "n" * 400, "launches": []} for i in range(100)]
    ch = SimpleNamespace(show=lambda *parts: ".syscall/" + "/".join(parts))
    cut, said = tool._fit_structured({"type": "history", "sleeps": sleeps}, ch)  # type: ignore[arg-type]
    assert len(json.dumps(cut, separators=(",", ":")).encode()) <= tool.MCP_STRUCTURED_MAX
    kept = len(cut["sleeps"])
    assert 0 < kept < 100
    assert cut["sleeps"] == sleeps[:kept]  # the newest first, as the answer had them
    assert said == (
        f"(structuredContent is cut to 16 KiB: sleeps keeps its first {kept} of 100 items; the whole answer is "
        "not kept: ask for less.)"
    )
    small = {"type": "history", "sleeps": sleeps[:3]}
    assert tool._fit_structured(small, ch) == (small, None)  # type: ignore[arg-type]


def test_a_changed_contract_is_announced_once_over_mcp(client: RawClient, kernel: FakeKernel) -> None:
    client.handshake()
    assert "contract" not in client.call("budget", {})["result"]["content"][0]["text"]
    path = kernel.channel / "kernel.json"
    info = json.loads(path.read_text())
    info["policy"]["max_gpus"] = 2
    path.with_name(".k.tmp").write_text(json.dumps(info))
    path.with_name(".k.tmp").rename(path)
    text = client.call("budget", {})["result"]["content"][0]["text"]
    assert text.startswith(
        "Note: this workspace's contract in .syscall/kernel.json changed since this tool last read it: "
        "policy.max_gpus 8 -> 2 (the `status` tool shows it as it is now).\n"
    ), text
    assert "contract" not in client.call("budget", {})["result"]["content"][0]["text"]
