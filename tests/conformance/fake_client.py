"""A small client for testing the conformance runner: commits one status request into $SYSCALL_CHANNEL.

    python tests/conformance/fake_client.py [--flaw in-place|bad-id|reuse-id|recommit-invalid|strict-reader|wait-forever]

Correct by default (section 3.1: `.<id>.tmp`, then rename). Flaws: `in-place` writes `requests/<id>.json`
directly; `bad-id` commits under an id that does not match the id pattern (`R1`); `reuse-id` commits the id a
second time with other (valid) bytes, a history request (section 3.2); `recommit-invalid` commits it a second time
with bytes no kernel accepts (an unknown type); `strict-reader` reads kernel.json and gives up on a member it does
not know (section 1.5 says a client ignores it); `wait-forever` waits for the answer without a bound (section 15.3
says a client bounds every wait). Each second commit comes 100 ms after the first (the runner reads
every arrival as inotify reports it, a few milliseconds later).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

FLAWS = ("none", "in-place", "bad-id", "reuse-id", "recommit-invalid", "strict-reader", "wait-forever")
# the members of kernel.json `limits` in protocol 1 as this client was written (spec/schema/v1/kernel.json)
KNOWN_LIMITS = {
    "request_max_bytes", "json_max_depth", "id_pattern", "name_pattern", "max_launches", "command_max_chars",
    "minutes_default", "minutes_min", "minutes_ceiling", "gpus_ceiling", "array_max", "max_artifacts",
    "artifact_max_chars", "why_max_chars", "note_max_chars", "report_max_chars", "cancel_max_names",
    "history_max", "history_default", "tail_verb_default_lines", "tail_verb_max_lines", "tail_verb_max_bytes",
    "log_max_bytes", "snapshot_max_files", "snapshot_max_bytes", "snapshot_max_depth",
}  # fmt: skip
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
    with open(os.path.join(os.environ["SYSCALL_CHANNEL"], "kernel.json"), encoding="utf-8") as f:
        limits = json.load(f)["limits"]
    if args.flaw == "strict-reader" and set(limits) - KNOWN_LIMITS:
        print("kernel.json: unknown member in limits", file=sys.stderr)
        return 1
    rid = "R1" if args.flaw == "bad-id" else "1764460800000-0badc0de"
    data = json.dumps({"protocol": 1, "id": rid, "type": "status"}).encode()
    if args.flaw == "in-place":
        with open(os.path.join(requests, rid + ".json"), "xb") as f:
            f.write(data)
        return 0
    commit(requests, rid, data)
    answer = os.path.join(os.environ["SYSCALL_CHANNEL"], "answers", rid + ".json")
    while args.flaw == "wait-forever" and not os.path.exists(answer):
        time.sleep(0.05)
    if args.flaw in SECOND:
        time.sleep(0.1)
        commit(requests, rid, json.dumps({"protocol": 1, "id": rid, **SECOND[args.flaw]}).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
