"""Table tests for job ids, the squeue/sacct commands and their parsers, on golden text.

The squeue goldens were captured from the throwaway Slurm 22.05 cluster (scripts/slurm-cluster) with
`squeue -h -r -t all -o '%i|%A|%F|%K|%T|%r'`; the sacct goldens follow Slurm's documented `-P` output.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kernel.backends.slurm import (
    JobId,
    SacctRow,
    SlurmOutputError,
    SqueueRow,
    clusters_args,
    parse_job_id,
    parse_sacct,
    parse_squeue,
    read_sacct,
    read_squeue,
    sacct_argv,
    scancel_argv,
    squeue_argv,
    squeue_by_name_argv,
)
from kernel.backends.slurm.query import (
    MAX_ID_LIST_CHARS,
    SQUEUE_FORMAT,
    parse_elapsed,
    parse_exit_code,
    parse_state,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123", JobId("123")),
        ("123_4", JobId("123", (4,))),
        ("123_[2-7%2]", JobId("123", (2, 3, 4, 5, 6, 7), throttle=2)),
        ("123_[1,3,5-6]", JobId("123", (1, 3, 5, 6))),
        ("123_[1,3,5-6%4]", JobId("123", (1, 3, 5, 6), throttle=4)),
        ("123_[0]", JobId("123", (0,))),
        ("123+1", JobId("123", het_offset=1)),
        ("123;west", JobId("123", cluster="west")),
        ("123_4;west", JobId("123", (4,), cluster="west")),
        ("67108865_[0-1]", JobId("67108865", (0, 1))),
        (" 9 ", JobId("9")),
    ],
)
def test_parse_job_id_every_form(text: str, expected: JobId) -> None:
    assert parse_job_id(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "abc", "123_", "123_[]", "123_[3-1]", "123_[1,,2]", "123_[a]", "_4", "123_4_5", "123;", "1 2"],
)
def test_parse_job_id_refuses_garbage(text: str) -> None:
    with pytest.raises(SlurmOutputError, match=r"job id|range"):
        parse_job_id(text)


def test_parse_job_id_refuses_absurd_expansions() -> None:
    with pytest.raises(SlurmOutputError, match="more than"):
        parse_job_id("1_[0-9999999]")


# --- squeue ------------------------------------------------------------------------------------------------


def test_squeue_argv_batches_every_id_once() -> None:
    argv = squeue_argv(["12", "9", "12", "100"])
    assert argv == ["squeue", "-h", "-r", "-t", "all", "-o", SQUEUE_FORMAT, "-j", "9,12,100"]


def test_squeue_argv_falls_back_to_all_my_jobs_past_the_argv_limit() -> None:
    ids = [str(10_000_000 + i) for i in range(MAX_ID_LIST_CHARS // 8)]
    argv = squeue_argv(ids)
    assert argv[-1] == "--me"
    assert "-j" not in argv
    assert all(len(a) < 131072 for a in argv)


@pytest.mark.parametrize(("ids", "message"), [([], "no job ids"), (["12", "12_3"], "12_3"), (["-1"], "-1")])
def test_squeue_argv_refuses_bad_ids(ids: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        squeue_argv(ids)


# Captured from the real cluster: an array of 4 with %2 (two running, two throttled), a finished single job, a
# cancelled one, a launch failure, and an array not yet split (without -r it shows as a range).
REAL_SQUEUE = """\
5|5|5|N/A|CANCELLED|None
1_2|1|1|2|PENDING|JobArrayTaskLimit
1_3|1|1|3|PENDING|JobArrayTaskLimit
1_0|2|1|0|RUNNING|None
1_1|3|1|1|RUNNING|None
2|2|2|N/A|FAILED|JobLaunchFailure
6_[0-5%2]|6|6|0-5%2|PENDING|None
4|4|4|N/A|RUNNING|None
"""


def test_parse_real_squeue() -> None:
    entries = parse_squeue(REAL_SQUEUE)
    assert entries[("1", 0)] == SqueueRow("2", "1", 0, "RUNNING", "None")
    assert entries[("1", 2)] == SqueueRow("1", "1", 2, "PENDING", "JobArrayTaskLimit")
    assert entries[("5", None)].state == "CANCELLED"
    assert entries[("2", None)].reason == "JobLaunchFailure"
    assert {k for k in entries if k[0] == "6"} == {("6", k) for k in range(6)}
    assert {entries[("6", k)].state for k in range(6)} == {"PENDING"}
    assert len(entries) == 4 + 3 + 6


def test_parse_squeue_multi_cluster_headers_and_odd_reasons() -> None:
    text = (
        "CLUSTER: west\n"
        "10_[1,3,5-6]|10|10|1,3,5-6|PENDING|ReqNodeNotAvail, UnavailableNodes:n[1-2]\n"
        "CLUSTER: east\n"
        "10|10|10|N/A|RUNNING|None\n"
        "11|11|11|N/A|PENDING|weird|reason\n"
    )
    entries = parse_squeue(text)
    assert entries[("10", 5)].cluster == "west"
    assert entries[("10", 5)].reason == "ReqNodeNotAvail, UnavailableNodes:n[1-2]"
    assert ("10", 4) not in entries
    assert entries[("10", None)].cluster == "east"
    assert entries[("11", None)].reason == "weird|reason"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5|5|5|N/A|RUNNING\n", "5 fields"),
        ("x|5|5|N/A|RUNNING|None\n", "job id"),
        ("5|x|5|N/A|RUNNING|None\n", "%A or %F"),
        ("5|5|5|N/A||None\n", "bad state"),
        ("5|5|5|N/A|RUN NING|None\n", "bad state"),
    ],
)
def test_parse_squeue_refuses_garbage(text: str, message: str) -> None:
    with pytest.raises(SlurmOutputError, match=message):
        parse_squeue(text)


@pytest.mark.parametrize(
    ("rc", "stdout", "stderr", "ids", "known", "n"),
    [
        # The single-id pitfall: one unknown id exits 1; that job has left the queue.
        (1, "", "slurm_load_jobs error: Invalid job id specified\n", ["7"], True, 0),
        # Two or more unknown ids exit 0 with the same message.
        (0, "", "slurm_load_jobs error: Invalid job id specified\n", ["7", "8"], True, 0),
        (0, "4|4|4|N/A|RUNNING|None\n", "", ["4", "8"], True, 1),
        # "Invalid job id" with several ids and a failure exit is not the pitfall: unknown.
        (1, "", "slurm_load_jobs error: Invalid job id specified\n", ["7", "8"], False, 0),
        # A controller that does not answer says nothing about any job.
        (
            1,
            "",
            "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n",
            ["4"],
            False,
            0,
        ),
        (1, "", "slurm_load_jobs error: Socket timed out on send/recv operation\n", ["4", "5"], False, 0),
        (-9, "", "", ["4"], False, 0),
        # Garbled output is not an empty queue.
        (0, "garbage\n", "", ["4"], False, 0),
    ],
)
def test_read_squeue(rc: int, stdout: str, stderr: str, ids: list[str], known: bool, n: int) -> None:
    result = read_squeue(rc, stdout, stderr, ids)
    assert (result.known, len(result.entries)) == (known, n)
    if not known:
        assert result.detail


# --- sacct -------------------------------------------------------------------------------------------------


def test_sacct_argv_always_has_a_start_time() -> None:
    argv = sacct_argv(["31", "4"], datetime(2026, 11, 30, 1, 2, 3))
    assert argv[:6] == ["sacct", "-X", "-P", "-n", "-j", "4,31"]
    assert argv[6:8] == ["-S", "2026-11-30T01:02:03"]
    assert argv[8] == "-o"
    assert argv[9].split(",")[:5] == ["JobIDRaw", "JobID", "State", "ExitCode", "Elapsed"]


def test_sacct_argv_converts_aware_times_to_local_time() -> None:
    aware = datetime(2026, 11, 30, 1, 2, 3, tzinfo=UTC)
    assert sacct_argv(["1"], aware)[7] == aware.astimezone().strftime("%Y-%m-%dT%H:%M:%S")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("COMPLETED", ("COMPLETED", None)),
        ("CANCELLED by 0", ("CANCELLED", 0)),
        ("CANCELLED by 1000", ("CANCELLED", 1000)),
        ("CANCELLED+", ("CANCELLED", None)),
        ("OUT_OF_MEMORY", ("OUT_OF_MEMORY", None)),
        (" NODE_FAIL ", ("NODE_FAIL", None)),
    ],
)
def test_parse_state(text: str, expected: tuple[str, int | None]) -> None:
    assert parse_state(text) == expected


@pytest.mark.parametrize("text", ["", "cancelled", "CANCELLED by", "CANCELLED by root", "RUN NING"])
def test_parse_state_refuses_garbage(text: str) -> None:
    with pytest.raises(SlurmOutputError, match="state"):
        parse_state(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0:0", (0, 0)),
        ("1:0", (1, 0)),
        ("0:125", (0, 125)),
        ("0:9", (0, 9)),
        ("255:0", (255, 0)),
        ("", (None, None)),
    ],
)
def test_parse_exit_code(text: str, expected: tuple[int | None, int | None]) -> None:
    assert parse_exit_code(text) == expected


@pytest.mark.parametrize("text", ["0", "a:b", "1:", ":1", "-1:0"])
def test_parse_exit_code_refuses_garbage(text: str) -> None:
    with pytest.raises(SlurmOutputError, match="ExitCode"):
        parse_exit_code(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("00:00:00", 0.0),
        ("00:01:05", 65.0),
        ("12:34", 754.0),
        ("01:02:03", 3723.0),
        ("1-00:00:00", 86400.0),
        ("3-04:05:06", 3 * 86400 + 4 * 3600 + 5 * 60 + 6.0),
        ("00:01.500", 1.5),
        ("INVALID", None),
        ("UNLIMITED", None),
        ("Unknown", None),
        ("", None),
    ],
)
def test_parse_elapsed(text: str, expected: float | None) -> None:
    assert parse_elapsed(text) == expected


@pytest.mark.parametrize("text", ["1", "a:b", "1-2", "1:2:3:4"])
def test_parse_elapsed_refuses_garbage(text: str) -> None:
    with pytest.raises(SlurmOutputError, match="duration"):
        parse_elapsed(text)


SACCT = """\
100|100|COMPLETED|0:0|00:00:12|2026-11-30T01:00:00|2026-11-30T01:00:12|n1
102|101_0|OUT_OF_MEMORY|0:125|00:03:01|2026-11-30T01:00:00|2026-11-30T01:03:01|n1
103|101_1|FAILED|0:125|00:03:01|2026-11-30T01:00:00|2026-11-30T01:03:01|n2
101|101_2|TIMEOUT|0:0|1-00:05:00|2026-11-29T01:00:00|2026-11-30T01:05:00|n2
101|101_[3-4%2]|CANCELLED by 0|0:0|00:00:00|None|2026-11-30T01:06:00|None assigned
104|104|CANCELLED by 1000|0:15|00:00:30|2026-11-30T01:00:00|2026-11-30T01:00:30|n1
105|105|NODE_FAIL|0:0|00:10:00|2026-11-30T01:00:00|2026-11-30T01:10:00|n3
106|106|PREEMPTED|0:0|00:10:00|2026-11-30T01:00:00|2026-11-30T01:10:00|n3
107|107|FAILED|2:0|00:00:01|2026-11-30T01:00:00|2026-11-30T01:00:01|n1
"""


def test_parse_sacct_golden() -> None:
    e = parse_sacct(SACCT)
    assert e[("100", None)] == SacctRow(
        "100", "100", None, "COMPLETED", None, 0, 0, 12.0, "2026-11-30T01:00:00", "2026-11-30T01:00:12", "n1"
    )
    assert (e[("101", 0)].state, e[("101", 0)].signal, e[("101", 0)].job_id_raw) == (
        "OUT_OF_MEMORY",
        125,
        "102",
    )
    assert e[("101", 2)].elapsed_s == 86400 + 300
    assert (e[("101", 3)].state, e[("101", 3)].cancelled_by) == ("CANCELLED", 0)
    assert e[("101", 4)].cancelled_by == 0
    assert (e[("104", None)].cancelled_by, e[("104", None)].signal) == (1000, 15)
    assert e[("107", None)].exit_status == 2
    assert len(e) == 10


def test_parse_sacct_last_row_of_a_requeued_job_wins() -> None:
    text = "200|200|REQUEUED|0:0|00:01:00|a|b|n1\n200|200|COMPLETED|0:0|00:02:00|c|d|n1\n"
    assert parse_sacct(text)[("200", None)].state == "COMPLETED"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("100|100|COMPLETED|0:0|00:00:12\n", "5 fields"),
        ("x|100|COMPLETED|0:0|00:00:12|a|b|n\n", "JobIDRaw"),
        ("100|100|done|0:0|00:00:12|a|b|n\n", "state"),
        ("100|100|COMPLETED|0|00:00:12|a|b|n\n", "ExitCode"),
        ("100|100|COMPLETED|0:0|soon|a|b|n\n", "duration"),
    ],
)
def test_parse_sacct_refuses_garbage(text: str, message: str) -> None:
    with pytest.raises(SlurmOutputError, match=message):
        parse_sacct(text)


@pytest.mark.parametrize(
    ("rc", "stdout", "stderr", "status", "n"),
    [
        (0, SACCT, "", "ok", 10),
        (0, "", "", "ok", 0),
        # A cluster without slurmdbd (the throwaway one here): its own outcome, not an error and not "gone".
        (1, "", "Slurm accounting storage is disabled\n", "disabled", 0),
        (1, "", "sacct: error: Problem talking to the database: Connection refused\n", "unknown", 0),
        (0, "nonsense\n", "", "unknown", 0),
    ],
)
def test_read_sacct(rc: int, stdout: str, stderr: str, status: str, n: int) -> None:
    result = read_sacct(rc, stdout, stderr)
    assert (result.status, len(result.entries)) == (status, n)


def test_queries_name_the_cluster_when_sbatch_named_one() -> None:
    since = datetime(2026, 1, 2, 3, 4, 5)
    assert squeue_argv(["7"], clusters=["c2"])[:3] == ["squeue", "-M", "c2"]
    assert squeue_argv(["7"], clusters=[])[1] == "-h"
    assert sacct_argv(["7"], since, clusters=["b", "a", "b"])[1:3] == ["-M", "a,b"]
    assert clusters_args(None) == []
    with pytest.raises(ValueError, match="not a Slurm cluster name"):
        clusters_args(["a b"])


def test_scancel_argv_names_the_cluster_the_job_was_placed_on() -> None:
    assert scancel_argv(["123"]) == ["scancel", "123"]
    assert scancel_argv(["123_4", "123_7"], clusters=["gpu"]) == ["scancel", "-M", "gpu", "123_4", "123_7"]
    for bad in ([], ["12;rm"], ["-u"], ["123_"], ["123_[1-3]"]):
        with pytest.raises(ValueError, match=r"job id|at least one"):
            scancel_argv(bad)


def test_squeue_by_name_argv_is_one_query_for_every_name() -> None:
    argv = squeue_by_name_argv(["sk-a-1-x", "sk-a-1-y"])
    assert argv[:5] == ["squeue", "-h", "-t", "all", "--me"]
    assert argv[-1] == "--name=sk-a-1-x,sk-a-1-y"
    for bad in ([], ["a,b"], ["a|b"], [""]):
        with pytest.raises(ValueError, match=r"job name|at least one"):
            squeue_by_name_argv(bad)
