"""What a tool call costs an agent over MCP, against the command line, with a real kernel answering.

A real kernel process (local backend) serves one enrolled workspace. The bench times, per sample, from the
call's first byte to its result: `ping` over MCP, `tools/call status` over MCP (a request through the channel
to the kernel and back), `tools/call launch` (local validation and a staging write), and as the baseline the
command line `python3 .syscall/syscall status` (a new interpreter for every call, as an agent without MCP pays).
Prints one JSON object per scenario.

    .venv/bin/python bench/mcp_calls.py [--samples N] [--python PYTHON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "agent_tool"))

from kernelproc import Kernel, git_workspace  # noqa: E402
from mcp_wire import RawClient  # noqa: E402


def summary(name: str, samples: list[float], python: str) -> dict[str, object]:
    ms = sorted(s * 1000 for s in samples)
    return {
        "scenario": name,
        "python": python,
        "samples": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
        "max_ms": round(ms[-1], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs the tool")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kernel = Kernel(Path(tmp))
        ws = git_workspace(Path(tmp) / "ws")
        kernel.enroll(ws, "--launches", str(10 * args.samples))
        kernel.start()
        tool = ws / ".syscall" / "syscall"
        client = RawClient(args.python, tool)
        try:
            client.handshake()
            for name, method, params in (
                ("mcp ping", "ping", None),
                ("mcp tools/call status", "tools/call", {"name": "status", "arguments": {}}),
            ):
                client.request(method, params)  # warm up
                samples = []
                for _ in range(args.samples):
                    t0 = time.perf_counter()
                    client.request(method, params)
                    samples.append(time.perf_counter() - t0)
                print(json.dumps(summary(name, samples, args.python)))
            samples = []
            for i in range(args.samples):
                if i % 8 == 0:
                    client.call("unstage", {})
                t0 = time.perf_counter()
                got = client.call("launch", {"name": f"job{i % 8}", "command": "true"})
                samples.append(time.perf_counter() - t0)
                assert got["result"]["isError"] is False, got
            print(json.dumps(summary("mcp tools/call launch", samples, args.python)))
            samples = []
            for _ in range(max(20, args.samples // 5)):
                t0 = time.perf_counter()
                subprocess.run([args.python, str(tool), "status"], cwd=ws, capture_output=True, check=True)
                samples.append(time.perf_counter() - t0)
            print(json.dumps(summary("baseline: command line status", samples, args.python)))
        finally:
            client.close()
            kernel.stop()


if __name__ == "__main__":
    main()
