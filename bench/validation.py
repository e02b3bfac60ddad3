"""Validation throughput: decode + validate a typical sleep request on one core.

Prints one JSON object. The figure is requests per second over the median batch (and the best batch), measured
in-process with the decoder warmed up; the machine is shared, so the median of many batches is the honest one.
Target (docs/benchmarks.md): >= 50,000 requests/s.

    .venv/bin/python bench/validation.py [--batches N] [--batch-size N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import msgspec

from channel.decode import check_policy, decode_request
from channel.messages import Policy, Rejected, SleepRequest

REQUEST_ID = "1764460800000-3fa9c2d1"
TYPICAL = {
    "protocol": 1,
    "id": REQUEST_ID,
    "type": "sleep",
    "launches": [
        {
            "name": "train-lr",
            "command": "python train.py --lr 3e-4",
            "minutes": 30,
            "gpus": 1,
            "array": 4,
            "concurrency": 2,
            "artifacts": ["out/curve.json"],
            "why": "does a lower lr help",
        }
    ],
    "submit": None,
    "note": "compare against yesterday's sweep",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=5000)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):  # one core, as the target says
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    data = msgspec.json.encode(TYPICAL)
    policy = Policy()

    def once() -> None:
        req = decode_request(data, REQUEST_ID)
        if isinstance(req, Rejected):
            raise SystemExit(f"the typical request was rejected: {req.error}")
        check_policy(req, policy)

    first = decode_request(data, REQUEST_ID)
    assert isinstance(first, SleepRequest), first
    for _ in range(2000):  # warm up
        once()
    rates = []
    for _ in range(args.batches):
        t0 = time.perf_counter()
        for _ in range(args.batch_size):
            once()
        rates.append(args.batch_size / (time.perf_counter() - t0))
    print(
        json.dumps(
            {
                "scenario": "validation",
                "request_bytes": len(data),
                "batches": args.batches,
                "batch_size": args.batch_size,
                "requests_per_s_median": round(statistics.median(rates)),
                "requests_per_s_best": round(max(rates)),
                "us_per_request_median": round(1e6 / statistics.median(rates), 2),
                "target_requests_per_s": 50_000,
                "python": platform.python_version(),
                "msgspec": msgspec.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
