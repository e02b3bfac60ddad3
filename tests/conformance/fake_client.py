"""A small client for testing the conformance runner: commits one status request into $SYSCALL_CHANNEL.

    python tests/conformance/fake_client.py [--flaw in-place|bad-id|reuse-id|recommit-invalid]

Correct by default (section 3.1: `.<id>.tmp`, then rename). Flaws: `in-place` writes `requests/<id>.json`
directly; `bad-id` commits under an id that does not match the id pattern (`R1`); `reuse-id` commits the id a
second time with other (valid) bytes, a history request (section 3.2); `recommit-invalid` commits it a second time
with bytes no kernel accepts (an unknown type). Each second commit comes 100 ms after the first (the runner reads
every arrival as inotify reports it, a few milliseconds later).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

FLAWS = ("none", "in-place", "bad-id", "reuse-id", "recommit-invalid")
SECOND = {"reuse-id": {"type": "history", "limit": 1}, "recommit-invalid": {"type": "launch"}}


def commit(requests: str, rid: str, data: bytes) -> None:
    tmp = os.path.join(requests, "." + rid + ".tmp")
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(requests, rid + ".json"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flaw", choices=FLAWS, default="none")
    args = ap.parse_args()
    requests = os.path.join(os.environ["SYSCALL_CHANNEL"], "requests")
    rid = "R1" if args.flaw == "bad-id" else "1764460800000-0badc0de"
    data = json.dumps({"protocol": 1, "id": rid, "type": "status"}).encode()
    if args.flaw == "in-place":
        with open(os.path.join(requests, rid + ".json"), "xb") as f:
            f.write(data)
        return 0
    commit(requests, rid, data)
    if args.flaw in SECOND:
        time.sleep(0.1)
        commit(requests, rid, json.dumps({"protocol": 1, "id": rid, **SECOND[args.flaw]}).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
