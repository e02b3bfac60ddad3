"""A small client for testing the conformance runner: commits one status request into $SYSCALL_CHANNEL.

    python tests/conformance/fake_client.py [--flaw in-place|bad-id]

Correct by default (section 3.1: `.<id>.tmp`, then rename). Flaws: `in-place` writes `requests/<id>.json`
directly; `bad-id` commits under an id that does not match the id pattern (`R1`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flaw", choices=("none", "in-place", "bad-id"), default="none")
    args = ap.parse_args()
    requests = os.path.join(os.environ["SYSCALL_CHANNEL"], "requests")
    rid = "R1" if args.flaw == "bad-id" else "1764460800000-0badc0de"
    data = json.dumps({"protocol": 1, "id": rid, "type": "status"}).encode()
    final = os.path.join(requests, rid + ".json")
    if args.flaw == "in-place":
        with open(final, "xb") as f:
            f.write(data)
        return 0
    tmp = os.path.join(requests, "." + rid + ".tmp")
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
