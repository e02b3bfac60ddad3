"""End to end over MCP: the official MCP Python SDK client drives `python3.8 .syscall/syscall mcp` in a workspace
enrolled with a real kernel process (local backend, bwrap jail, an evaluation contract for submit).

One session does what an agent would: list the tools (schemas checked, limits from kernel.json), status, a
refused launch, a launch, sleep with wait (progress notifications seen), read the wake again, a long job whose
wait the client cancels (the job keeps running) and then cancels for real, and a submit with its verdict.
With SYSCALL_MCP_TRANSCRIPT=FILE the session is written to FILE as the agent saw it (for docs and notes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from kernelproc import Kernel, git, wait_for
from mcp import Client, StdioServerParameters

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

TOOLS = [
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


@pytest.fixture(scope="module")
def workspace(
    tmp_path_factory: pytest.TempPathFactory, bwrap_available: None
) -> Iterator[tuple[Kernel, Path]]:
    tmp = tmp_path_factory.mktemp("mcp")
    kernel = Kernel(tmp, 'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\n')
    ws = tmp / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "eval.sh").write_text("cat result.txt\n")
    (ws / "result.txt").write_text('{"score": 0.5}\n')
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    kernel.enroll(
        ws, "--sleeps", "10", "--gpu-hours", "4", "--eval-command", "sh eval.sh", "--metric", "score"
    )
    kernel.start()
    try:
        yield kernel, ws
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


class Session:
    """Calls tools through the SDK client and keeps a transcript of what the agent saw."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.log: list[str] = []
        self.progress: list[tuple[float, str | None]] = []  # what the last call heard

    async def call(self, name: str, arguments: dict[str, Any], **kw: Any) -> Any:
        progress: list[tuple[float, str | None]] = []

        async def heard(value: float, total: float | None, message: str | None) -> None:
            progress.append((value, message))

        result = await self.client.call_tool(name, arguments, progress_callback=heard, **kw)
        self.log.append(f"> tools/call {name} {json.dumps(arguments)}")
        for value, message in progress:
            self.log.append(f"  (progress {value:g}: {message})")
        flag = "  [isError]" if result.is_error else ""
        self.log.append(f"< {flag}\n" + "\n".join(getattr(c, "text", "") for c in result.content))
        self.progress = progress
        return result


def kernel_limits(ws: Path) -> dict[str, Any]:
    return json.loads((ws / ".syscall" / "kernel.json").read_text())  # type: ignore[no-any-return]


async def session(ws: Path, py38: str, kernel: Kernel) -> list[str]:
    params = StdioServerParameters(command=py38, args=[str(ws / ".syscall" / "syscall"), "mcp"], cwd=str(ws))
    async with Client(params) as client:
        s = Session(client)
        # the SDK probes the 2026-07-28 `server/discover`, is told "method not found", and falls back
        assert client.protocol_version == "2025-11-25"
        server = client.server_info
        assert server is not None
        s.log.append(
            f"(connected: protocol {client.protocol_version}, server {server.name} {server.version})"
        )

        listed = await client.list_tools()
        tools = {t.name: t for t in listed.tools}
        assert list(tools) == TOOLS
        info = kernel_limits(ws)
        for t in listed.tools:
            jsonschema.Draft202012Validator.check_schema(t.input_schema)
            assert t.output_schema is not None
            jsonschema.Draft202012Validator.check_schema(t.output_schema)
        launch_props = tools["launch"].input_schema["properties"]
        assert launch_props["command"]["maxLength"] == info["limits"]["command_max_chars"]
        assert launch_props["minutes"]["maximum"] == info["policy"]["max_minutes"]
        # the listing stays within 6 KiB: the name's rule is in words; the tool checks the pattern itself
        assert "pattern" not in launch_props["name"]
        assert "a-z 0-9 -, <= 32" in launch_props["name"]["description"]
        s.log.append("> tools/list\n< " + ", ".join(tools))

        status = await s.call("status", {})
        assert not status.is_error
        assert status.structured_content["answer"]["type"] == "status"
        assert "submit available" in status.content[0].text

        env = await s.call("env", {})
        assert not env.is_error, env.content[0].text
        assert env.structured_content["jobenv"] is not None  # the kernel wrote .syscall/jobenv.json
        assert "What a job of this workspace sees" in env.content[0].text

        refused = await s.call("launch", {"name": "Train", "command": "python train.py"})
        assert refused.is_error
        assert refused.structured_content["error"]["code"] == "launch.name.invalid"
        assert refused.structured_content["error"]["path"] == "$.launches[0].name"
        assert not (ws / ".syscall" / "staged.json").exists()

        staged = await s.call(
            "launch",
            {
                "name": "hello",
                "command": "sleep 2; echo hello-from-mcp; mkdir -p out; echo '{\"ok\": 1}' > out/r.json",
                "minutes": 5,
                "artifacts": ["out/r.json"],
                "why": "does the MCP path run a job",
            },
        )
        assert not staged.is_error
        assert staged.structured_content["launches"][0]["name"] == "hello"

        slept = await s.call("sleep", {"note": "first MCP sleep", "wait": True, "timeout_s": 120})
        assert not slept.is_error, slept.content[0].text
        answer, wake = slept.structured_content["answer"], slept.structured_content["wake"]
        assert answer["type"] == "accepted"
        assert wake["id"] == answer["id"]
        assert [t["state"] for t in wake["tasks"]] == ["COMPLETED"]
        assert "hello-from-mcp" in slept.content[0].text
        messages = [m for _, m in s.progress]
        assert any(m and m.startswith("Waiting for sleep " + answer["id"]) for m in messages), messages
        assert any(m and "hello[0] COMPLETED" in m for m in messages), messages
        values = [v for v, _ in s.progress]
        assert values == sorted(set(values))
        delivered = ws / ".syscall" / "results" / str(answer["sleep_seq"]) / "hello" / "out" / "r.json"
        assert json.loads(delivered.read_text()) == {"ok": 1}

        again = await s.call("wait", {"sleep_id": answer["id"]})
        assert not again.is_error
        assert again.structured_content["id"] == answer["id"]
        assert "# Wake: sleep " + answer["id"] in again.content[0].text

        await s.call("launch", {"name": "long", "command": "echo long-started; sleep 120", "minutes": 10})
        long_sleep = await s.call("sleep", {"note": "to be cancelled"})
        assert not long_sleep.is_error
        long_id = long_sleep.structured_content["answer"]["id"]
        with anyio.move_on_after(3):  # the client gives up on the wait: it sends notifications/cancelled
            await client.call_tool("wait", {})
            raise AssertionError("the wait returned before the job ended")
        s.log.append("> tools/call wait {}\n  (the client cancelled this call after 3 s: no result)")
        still = await s.call("status", {})
        assert still.structured_content["answer"]["sleep"]["id"] == long_id
        assert [t["state"] for t in still.structured_content["answer"]["sleep"]["tasks"]] == ["RUNNING"]
        tail = await s.call("tail", {"launch": "long"})
        assert not tail.is_error, tail.content[0].text
        assert tail.structured_content["type"] == "tail"
        assert "long-started" in tail.content[0].text
        cancelled = await s.call("cancel", {"names": ["long"]})
        assert not cancelled.is_error
        assert cancelled.structured_content["type"] == "cancelled"
        assert [j["launch"] for j in cancelled.structured_content["cancelled"]] == ["long"]
        woke = await s.call("wait", {"timeout_s": 60})
        assert [t["state"] for t in woke.structured_content["tasks"]] == ["CANCELLED"]

        (ws / "result.txt").write_text('{"score": 0.75}\n')
        submitted = await s.call("submit", {"report": "Raised the score to 0.75.", "eval_minutes": 30})
        assert not submitted.is_error
        verdict = await s.call("sleep", {"note": "submit", "wait": True, "timeout_s": 180})
        assert not verdict.is_error, verdict.content[0].text
        v = verdict.structured_content["wake"]["verdict"]
        assert (v["outcome"], v["base_value"], v["candidate_value"]) == ("improved", 0.5, 0.75)
        assert "## Submit verdict: improved" in verdict.content[0].text

        history = await s.call("history", {"limit": 3})
        assert len(history.structured_content["sleeps"]) == 3
        budget = await s.call("budget", {})
        assert budget.structured_content["budget"]["sleeps"] == 7
        return s.log


def test_an_agent_session_through_the_official_sdk(workspace: tuple[Kernel, Path], py38: str) -> None:
    kernel, ws = workspace
    log = anyio.run(session, ws, py38, kernel)
    wait_for(lambda: not list((ws / ".syscall" / "requests").glob("*.json")), 10, "no request left behind")
    out = os.environ.get("SYSCALL_MCP_TRANSCRIPT")
    if out:
        Path(out).write_text("\n".join(log) + "\n")
