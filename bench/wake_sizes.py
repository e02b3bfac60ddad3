"""What a submit's wake costs the agent to read: bytes of the markdown wake, and of an MCP result.

A real kernel process (local backend, no jail, `seconds_per_minute = 1`) serves two workspaces with an eval
contract of `--repeats 5` (a submit runs 10 evaluation runs) and `--repeats 3`. The bench makes one submit that
changes the tree (10 runs), one `unchanged` submit (6 SKIPPED runs), and the first again over MCP (`submit`, then
`sleep` with wait: true: the result's text and its structuredContent), besides the `tools/list` result. Prints
one JSON object per measure (bytes; JSON measured compact, as the server sends it).

    .venv/bin/python bench/wake_sizes.py [--dump DIR]   # DIR: the wakes and the MCP result, to read
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "agent_tool"))

from kernelproc import Kernel, git, run_tool  # noqa: E402
from mcp_wire import RawClient  # noqa: E402

EVAL_SH = 'echo "seed=${EVAL_SEED:-none}"\necho "epoch 1 loss 0.9"\ncat result.txt\n'


def workspace(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    (path / "eval.sh").write_text(EVAL_SH)
    (path / "result.txt").write_text('{"score": 0.5}\n')
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "base")
    return path


def tool(ws: Path, *args: str) -> str:
    done = run_tool(ws, *args, timeout=180)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def submit_wake(ws: Path, report: Path) -> bytes:
    tool(ws, "submit", "--report", str(report))
    wake = json.loads(tool(ws, "sleep", "--wait", "--json", "--timeout", "170"))
    return (ws / ".syscall" / "wakes" / f"{wake['id']}.md").read_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", type=Path, help="write the wakes and the MCP result into this directory")
    args = ap.parse_args()

    def dump(name: str, data: bytes) -> None:
        if args.dump is not None:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / name).write_bytes(data)

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        kernel = Kernel(base, 'jail = "none"\n[local]\nseconds_per_minute = 1.0\n')
        ten = workspace(base / "ten")
        six = workspace(base / "six")
        contract = ("--eval-command", "sh eval.sh", "--metric", "score", "--sleeps", "10")
        kernel.enroll(ten, *contract, "--repeats", "5")
        kernel.enroll(six, *contract, "--repeats", "3", "--confidence", "0.875")
        kernel.start()
        try:
            report = base / "report.md"
            report.write_text("raised the score\n")
            (ten / "result.txt").write_text('{"score": 0.6}\n')
            md = submit_wake(ten, report)
            dump("ten.md", md)
            print(json.dumps({"measure": "wake.md of a 10-run submit", "bytes": len(md)}))
            md = submit_wake(six, report)
            dump("unchanged.md", md)
            print(
                json.dumps({"measure": "wake.md of an unchanged submit (6 runs SKIPPED)", "bytes": len(md)})
            )
            (ten / "result.txt").write_text('{"score": 0.7}\n')
            client = RawClient(sys.executable, ten / ".syscall" / "syscall")
            try:
                client.handshake()
                listed = client.request("tools/list")["result"]
                size = len(json.dumps(listed, separators=(",", ":")))
                print(json.dumps({"measure": "MCP tools/list result", "bytes": size}))
                got = client.call("submit", {"report": "raised the score again"})
                assert got["result"]["isError"] is False, got
                got = client.request(
                    "tools/call",
                    {"name": "sleep", "arguments": {"wait": True, "timeout_s": 170}},
                    timeout=180,
                )
                result = got["result"]
                assert result["isError"] is False, result
                text = "".join(c["text"] for c in result["content"])
                structured = json.dumps(result["structuredContent"], separators=(",", ":"))
                dump("mcp-text.md", text.encode())
                dump("mcp-structured.json", structured.encode())
                print(
                    json.dumps({"measure": "MCP sleep result of a 10-run submit: text", "bytes": len(text)})
                )
                print(
                    json.dumps(
                        {
                            "measure": "MCP sleep result of a 10-run submit: structuredContent",
                            "bytes": len(structured),
                        }
                    )
                )
            finally:
                client.close()
        finally:
            kernel.stop()


if __name__ == "__main__":
    main()
