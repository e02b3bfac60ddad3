"""Issue 13: budget.json is written from the channel I/O pool (the pipeline) and from the heavy pool (a wake),
which do not order their calls with each other; an older balance must never land after a newer one.

The race, made deterministic with the test-only hang points (kernel.io.crash.hang_point): a sleep's `accepted`
is delivered with the balance read when the sleep was dispatched (its GPU time reserved). A's channel I/O hangs
just before that delivery; meanwhile its job ends and the wake (heavy pool, not hung) writes the settled balance
(nothing reserved). When the channel answers again, the old kernel wrote the older balance over it: budget.json
showed GPU time still reserved after the wake, until the next charge.

`jail = "none"`: the job waits for a file outside its tree (the jail has its own tests).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kernelproc import Kernel, git_workspace, put_request, read_answer, wait_for


def budget(ws: Path) -> dict[str, Any]:
    return json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]  # type: ignore[no-any-return]


def hang_at(hang: Path, text: str) -> None:
    tmp = hang.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, hang)  # the hang point never reads a half-written file


def test_an_older_balance_never_replaces_the_wakes(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\npoll_seconds = 0.2\n')
    a = git_workspace(tmp_path / "a")
    k.enroll(a)
    go = tmp_path / "go"
    hang = tmp_path / "hang"
    k.start(env={"SYSCALL_KERNEL_HANG_CHANNEL": str(hang)})
    try:
        # The sleep is recorded (GPU time reserved, budget.json written), then its dispatch waits.
        hang_at(hang, f"launches {a.resolve()}")
        launch = {
            "name": "train",
            "command": f"while [ ! -e {go} ]; do sleep 0.05; done; echo a > out.txt",
            "minutes": 10,
            "gpus": 1,
            "artifacts": ["out.txt"],
        }
        put_request(a, "sa", {"protocol": 1, "id": "sa", "type": "sleep", "launches": [launch]})
        k.wait_log("event=hang_injected step=launches", 30)
        reserved = budget(a)
        assert reserved["reserved_gpu_hours"] > 0

        # The dispatch goes on; the delivery of `accepted` (balance read after the submit) hangs.
        hang_at(hang, f"channel {a.resolve()}")
        k.wait_log("event=hang_injected step=channel", 30)
        assert read_answer(a, "sa") is None

        # The job ends; the wake writes the settled balance.
        go.touch()
        wait_for((a / ".syscall" / "wakes" / "sa.json").exists, 30, "A's wake")
        settled = wait_for(
            lambda: b if (b := budget(a))["reserved_gpu_hours"] == 0 else None, 10, "the settled budget"
        )

        # The channel answers again: `accepted` is delivered, and the older balance stays out.
        hang.unlink()
        answer = wait_for(lambda: read_answer(a, "sa"), 30, "A's accepted")
        assert answer["type"] == "accepted"
        k.wait_log("event=woken", 15)
        assert budget(a) == settled, "an older balance (GPU time still reserved) replaced the wake's"
        assert k.stop() == 0
        assert budget(a) == settled
    finally:
        hang.unlink(missing_ok=True)
        go.touch()
        k.ensure_stopped()
