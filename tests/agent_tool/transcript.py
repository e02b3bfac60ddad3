"""Print a full agent session with the `syscall` tool against the fake kernel (for docs/agent-guide.md).

    .venv/bin/python tests/agent_tool/transcript.py [PYTHON]

Runs the installed copy of the tool (`python3 .syscall/syscall ...`) from inside a temporary workspace with
PYTHON (default: this interpreter), while a driver thread plays the cluster: it ends the sleep's tasks a moment
apart, leaving a result file for the artifact the agent named. Every command and its output is printed as an
agent would see it, with the exit code when it is not 0.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tool_fake_kernel import FakeKernel

from channel.messages import EvalContract, Policy


def session(python: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        fk = FakeKernel(ws, policy=Policy(submit=EvalContract(command="python eval.py", metric="val_acc")))
        (ws / "notes").mkdir()
        (ws / "notes" / "report.md").write_text("Lower lr (3e-4) with warmup; see out/curve.json.\n")

        def sh(cmd: str, show: str | None = None) -> None:
            argv = shlex.split(cmd)
            if argv[0] == "python3":
                argv[0] = python
            r = subprocess.run(argv, cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            print(f"$ {show or cmd}")
            print(r.stdout.rstrip("\n"))
            if r.returncode:
                print(f"[exit {r.returncode}]")
            print()

        def cluster() -> None:
            deadline = time.monotonic() + 60
            while fk.current() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            fk.sleeps[-1].tasks[
                1
            ].printing = "epoch 1 val_acc 0.81\nepoch 2 val_acc 0.83\nepoch 3 val_acc 0.84\n"
            time.sleep(1.5)
            fk.finish(
                "sweep",
                0,
                elapsed_s=61.8,
                stdout='epoch 1 val_acc 0.84\nepoch 2 val_acc 0.88\n{"lr": 3e-4, "val_acc": 0.88}\n',
                files={"out/curve.json": b'{"val_acc": [0.84, 0.88]}\n'},
            )
            time.sleep(1.0)
            fk.finish(
                "sweep",
                1,
                state="OUT_OF_MEMORY",
                exit_code=None,
                elapsed_s=12.3,
                stdout="epoch 1\n",
            )
            time.sleep(1.0)
            fk.finish("baseline", 0, elapsed_s=58.0, stdout='epoch 1\n{"val_acc": 0.86}\n')

        with fk.running():
            driver = threading.Thread(target=cluster, daemon=True)
            tool = "python3 .syscall/syscall"
            sh(f"{tool} --help")
            sh(f"{tool} launch --help")
            sh(f"{tool} status")
            sh(
                f"{tool} launch --name sweep --minutes 20 --gpus 1 --array 2 --why 'does a lower lr help' "
                "--artifact out/curve.json -- python train.py --lr 3e-4 --batch 64"
            )
            sh(f"{tool} launch --name Baseline --minutes 20 -- python train.py --lr 1e-3")
            sh(f"{tool} launch --name baseline --minutes 300 -- python train.py --lr 1e-3")
            sh(f"{tool} launch --name baseline --minutes 20 -- 'python train.py --lr 1e-3 | tee base.log'")
            sh(f"{tool} submit --report notes/report.md")
            sh(f"{tool} status")
            driver.start()
            sh(f"{tool} sleep --note 'lr sweep vs baseline'")
            sh(f"{tool} tail sweep/1 --lines 2")
            sh(f"{tool} wait --every 0.5")
            sh("cat .syscall/results/1/sweep/0/out/curve.json")
            sh(f"{tool} history")
            sh(f"{tool} queue")
            sh(f"{tool} budget")
            sh(f"{tool} cancel")
            sh(f"{tool} launch --nmae eval -- python eval.py")
            sh(f"{tool} launch --name eval --artifact 'out/*.json' -- python eval.py")
            driver.join(timeout=30)


if __name__ == "__main__":
    session(sys.argv[1] if len(sys.argv) > 1 else sys.executable)
