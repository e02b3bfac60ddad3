"""`syscall-conformance`: certify a kernel or a client of the syscall channel protocol (spec/CONFORMANCE.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from channel import release
from spec.conformance import client_mode, kernel_mode
from spec.conformance.report import Result, exit_code, render_junit, render_table
from spec.conformance.vectors import VectorFileError

EXIT_USAGE = 2

DESCRIPTION = """\
Certify an implementation of the syscall channel protocol, black-box, by files only.

  kernel   drive a RUNNING kernel through an enrolled workspace: every vector of spec/vectors/v1 (written
           as a request, its answer's type, code and path checked) and the behavioural MUSTs observable
           from the channel: kernel.json and budget.json (9.1, 9.2); replay and id reuse, also after a
           state change, and a request refused unread leaving its id free (3.3); the channel's flock
           (2.5); a checkpoint wake written once, fenced and escaped (8.1, 8.3); refusals charging
           nothing (4.0.1); stage-6 codes and paths (6); hostile request files (2.3, 4.1); temps and
           badly named files (3.1); a blocked answer (3.5: the runner makes answers/<id>.json a
           directory, as an agent can); the answers to sleeps and the last sleep's wake kept, and no
           answer removed while its request is queued (2.7); a request removed only after its answer
           arrived (15.2); a replaced requests/ (2.3); removal (3.4); atomic writes (2.4); "protocol": 1
           (1.5), timestamps (7.3) and quoting (4.0.3) of every message read. Vectors that need a policy
           run in a workspace whose kernel.json policy matches (--workspace-for-policy); those that
           cannot be placed are "not run".
  client   run a client command in a scratch channel where no kernel answers and check every request
           file it commits, at every arrival (temp name then rename, a well-formed id,
           schema/v1/request.json, stages 1-4, an id never reused for other bytes), that it writes nothing
           kernel-owned (2.4), and that it ends by itself before --timeout (15.3: it bounds its wait).

Exit status: 0 when something ran and everything that ran passed; 1 otherwise; 2 for bad usage.
What each check does: spec/CONFORMANCE.md section 14.4 (what conforming means: spec/PROTOCOL.md section 14);
how to run it: docs/conformance.md."""


def _policy_ws(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=WORKSPACE (e.g. short-walltime=/srv/ws-60min)"
        )
    return name, Path(path)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give between 0 and 3600 seconds")
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="syscall-conformance",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=release.describe("%(prog)s"))
    sub = ap.add_subparsers(dest="mode", required=True, metavar="{kernel,client}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--junit", type=Path, metavar="FILE", help="also write the results as JUnit XML")
    common.add_argument("--problems-only", action="store_true", help="list only failed and not-run rows")
    k = sub.add_parser(
        "kernel",
        parents=[common],
        help="certify a running kernel through enrolled workspaces",
        description="Drive a running kernel through an enrolled workspace. Use a workspace dedicated to this: "
        "the runner commits sleeps (a checkpoint; vectors' sleeps, which a budget of 0 launches keeps from "
        "running jobs) and spends a few sleeps of its budget. Of the places a client may not write (2.4) it "
        "touches one: a directory answers/<id>.json for an id of its own, made and removed again (the 3.5 "
        "check, an obstacle an agent can make).",
    )
    k.add_argument("--workspace", type=Path, required=True, metavar="WS", help="an enrolled workspace")
    k.add_argument(
        "--workspace-for-policy",
        type=_policy_ws,
        action="append",
        default=[],
        metavar="NAME=WS",
        help="another enrolled workspace, for the vectors whose policy its kernel.json publishes (repeatable)",
    )
    k.add_argument(
        "--only", metavar="SECTION", help="run only the vectors and checks of SECTION (e.g. 4.2, 3)"
    )
    k.add_argument(
        "--deadline", type=_seconds, default=10.0, metavar="S", help="seconds to wait for each answer (10)"
    )
    k.add_argument(
        "--wake-deadline", type=_seconds, default=60.0, metavar="S", help="seconds to wait for a wake (60)"
    )
    k.add_argument("-v", "--verbose", action="store_true", help="print each result as it comes")
    c = sub.add_parser(
        "client",
        parents=[common],
        help="certify a client by the request files it writes",
        description="Run CMD with `sh -c` in a scratch workspace whose channel is $SYSCALL_CHANNEL "
        "($SYSCALL_WORKSPACE is the workspace) and check every request it commits. No kernel answers there: "
        "give the client a timeout of its own shorter than --timeout, since a command still running at "
        "--timeout fails 15.3 (a client bounds every wait).",
    )
    c.add_argument("--run", required=True, metavar="CMD", help="the client command")
    c.add_argument(
        "--timeout",
        type=_seconds,
        default=60.0,
        metavar="S",
        help="kill the command after S seconds, failing 15.3 (60)",
    )
    c.add_argument("--keep", action="store_true", help="keep the scratch directory (its path is printed)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        results = _kernel(args) if args.mode == "kernel" else _client(args)
    except VectorFileError as exc:
        print(f"syscall-conformance: bad vector file: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"syscall-conformance: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(render_table(results, only_problems=args.problems_only))
    if args.junit is not None:
        args.junit.write_bytes(render_junit(results, f"syscall-conformance {args.mode}"))
    return exit_code(results)


class UsageError(Exception):
    pass


def _kernel(args: argparse.Namespace) -> list[Result]:
    for label, ws in [("--workspace", args.workspace), *args.workspace_for_policy]:
        if not (ws / ".syscall").is_dir():
            raise UsageError(
                f"{label}: {ws} has no .syscall/ channel; enroll it first (e.g. `syscall-kernel enroll {ws}`)"
            )
    opts = kernel_mode.Options(
        workspace=args.workspace,
        policy_workspaces=tuple(args.workspace_for_policy),
        only=args.only,
        deadline=args.deadline,
        wake_deadline=args.wake_deadline,
    )
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else (lambda _: None)
    return kernel_mode.KernelRun(opts, progress).run()


def _client(args: argparse.Namespace) -> list[Result]:
    results, output = client_mode.run_client(
        client_mode.Options(command=args.run, timeout=args.timeout, keep=args.keep)
    )
    sys.stdout.write(output.rstrip() + "\n\n")
    return results


if __name__ == "__main__":
    sys.exit(main())
