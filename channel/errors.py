"""The stable error codes of the protocol.

A code is a dotted name that clients may branch on; the message beside it is for the model and may change.
Every code the kernel or the decoder can produce is registered here with the `spec/PROTOCOL.md` section that
defines it, so the spec's error table and the conformance vectors can be checked against this one list.
"""

from __future__ import annotations

from typing import Final, NamedTuple


class Code(NamedTuple):
    section: str
    meaning: str


CODES: Final[dict[str, Code]] = {
    # 4.1 the file
    "request.too_large": Code("4.1", "the request file is larger than the request size limit"),
    "request.invalid_utf8": Code("4.1", "the request file is not valid UTF-8"),
    "request.unreadable": Code("4.1", "the request is not a regular, singly-linked file the kernel can read"),
    # 4.2 JSON
    "json.syntax": Code("4.2", "the file is not one well-formed JSON document"),
    "json.duplicate_key": Code("4.2", "an object repeats a key"),
    "json.non_finite": Code("4.2", "NaN, Infinity or -Infinity appears (not JSON)"),
    "json.number_out_of_range": Code(
        "4.2", "an integer outside the signed 64-bit range, or a number that overflows a 64-bit float"
    ),
    "json.too_deep": Code("4.2", "objects and arrays are nested deeper than the depth limit"),
    "request.lone_surrogate": Code("4.2", "a string escapes half of a UTF-16 surrogate pair"),
    # 4.3 shape
    "request.not_object": Code("4.3", "the document is not a JSON object"),
    "request.type.missing": Code("4.3", "the object has no `type`"),
    "request.type.unknown": Code("4.3", "`type` names no request verb"),
    "request.protocol.unsupported": Code("4.3", "`protocol` is not a version this kernel speaks"),
    "request.id.invalid": Code("4.3", "`id` does not match the id pattern"),
    "request.id.mismatch": Code("4.3", "`id` differs from the file name's stem"),
    "field.unknown": Code("4.3", "a key the protocol does not define"),
    "field.missing": Code("4.3", "a required key is absent"),
    "field.type": Code(
        "4.3", "a value has the wrong JSON type (a bool is not an integer, 1.0 is not an integer)"
    ),
    # 4.4 sleep and launches
    "sleep.launches.too_many": Code("4.4", "more launches than the per-sleep limit"),
    "sleep.note.too_long": Code("4.4", "the note is longer than its limit"),
    "sleep.wake_on.invalid": Code(
        "4.4", "wake_on names no wake condition, or is not `all` in a sleep that carries a submit"
    ),
    "sleep.wake_on.out_of_range": Code("4.4", "wake_on's count is below 1 or above the sleep's task count"),
    "sleep.rest.invalid": Code("4.4", "rest is not `run` or `cancel`, or is `cancel` with wake_on `all`"),
    "launch.name.invalid": Code("4.4", "a launch name does not match the name pattern"),
    "launch.name.duplicate": Code("4.4", "two launches of one sleep share a name"),
    "launch.command.empty": Code("4.4", "the command is empty or only whitespace"),
    "launch.command.too_long": Code("4.4", "the command is longer than its limit"),
    "launch.command.invalid": Code("4.4", "the command contains a NUL or other control character"),
    "launch.minutes.out_of_range": Code("4.4", "minutes outside the protocol's bounds"),
    "launch.gpus.out_of_range": Code("4.4", "gpus outside the protocol's bounds"),
    "launch.mem_mb.out_of_range": Code("4.4", "mem_mb outside the protocol's bounds"),
    "launch.cpus.out_of_range": Code("4.4", "cpus outside the protocol's bounds"),
    "launch.array.out_of_range": Code("4.4", "array width outside 1..array limit"),
    "launch.concurrency.out_of_range": Code("4.4", "concurrency outside 0..array"),
    "launch.artifacts.too_many": Code("4.4", "more artifact paths than the limit"),
    "launch.artifact.too_long": Code("4.4", "an artifact path is longer than its limit"),
    "launch.artifact.invalid": Code("4.4", "an artifact path is not a plain relative path inside the tree"),
    "launch.why.too_long": Code("4.4", "`why` is longer than its limit"),
    "launch.why.multiline": Code("4.4", "`why` is not one line of printable text"),
    "launch.sweep.too_many": Code("4.4", "a sweep has more keys than the limit"),
    "launch.sweep.key.invalid": Code("4.4", "a sweep key does not match the key pattern, or is reserved"),
    "launch.sweep.key.duplicate": Code("4.4", "a key is swept twice in one launch"),
    "launch.sweep.values.empty": Code("4.4", "a sweep key has no values"),
    "launch.sweep.values.too_many": Code("4.4", "a sweep key has more values than the array limit"),
    "launch.sweep.value.invalid": Code("4.4", "a sweep value does not match the value pattern"),
    "launch.sweep.value.duplicate": Code("4.4", "a sweep key has one value (or one number) twice"),
    "launch.sweep.too_large": Code("4.4", "the sweep's grid has more tasks than the array limit"),
    "launch.sweep.array_mismatch": Code("4.4", "array differs from the size of the sweep's grid"),
    "launch.rank.invalid": Code("4.4", "rank is not a metric key, or the launch has one task"),
    # 4.5 submit
    "submit.report.empty": Code("4.5", "the submit report is empty"),
    "submit.report.too_long": Code("4.5", "the submit report is longer than its limit"),
    "submit.eval_minutes.out_of_range": Code("4.5", "eval_minutes outside the protocol's bounds"),
    # 4.6 other verbs
    "cancel.launches.too_many": Code("4.6", "more names than a cancel may carry"),
    "cancel.name.invalid": Code("4.6", "a name to cancel does not match the name pattern"),
    "history.limit.out_of_range": Code("4.6", "history limit outside 1..history limit"),
    "history.metric.invalid": Code("4.6", "the metric is not a metric key"),
    "tail.launch.invalid": Code("4.6", "the launch to tail does not match the name pattern"),
    "tail.task.out_of_range": Code("4.6", "the task to tail is outside 0..array maximum - 1"),
    "tail.lines.out_of_range": Code("4.6", "lines to tail outside 1..tail lines maximum"),
    "status.sleep.invalid": Code("4.6", "the sleep to show is not a sleep id"),
    "cancel.sleep.invalid": Code("4.6", "the sleep to cancel is not a sleep id"),
    "tail.sleep.invalid": Code("4.6", "the sleep to tail is not a sleep id"),
    # 5 policy (the workspace's ceilings, published in kernel.json)
    "policy.minutes": Code("5", "minutes above the workspace's maximum"),
    "policy.gpus": Code("5", "gpus above the workspace's maximum"),
    "policy.mem_mb": Code("5", "mem_mb above the workspace's maximum"),
    "policy.cpus": Code("5", "cpus above the workspace's maximum"),
    "policy.submit_disabled": Code("5", "the workspace has no evaluation contract, so submit is unavailable"),
    "policy.eval_minutes": Code("5", "eval_minutes above the workspace's maximum"),
    "policy.concurrent_gpus": Code(
        "5", "one task of each GPU launch of the sleep at once needs more GPUs than max_concurrent_gpus"
    ),
    "policy.verb_disabled": Code("5", "the verb is not enabled for this workspace"),
    # 6 kernel state and budget
    "request.id.reused": Code("6", "the id was used before with different content"),
    "sleep.in_progress": Code(
        "6",
        "the workspace already has max_sleeps_in_flight sleeps in flight, a submit in flight (with a submit), "
        "or sleeps in flight whose GPUs leave too few of max_concurrent_gpus (with GPUs)",
    ),
    "budget.launches": Code("6", "not enough launches left in the budget"),
    "budget.sleeps": Code("6", "no sleeps left in the budget"),
    "budget.submits_per_day": Code(
        "6",
        "the workspace had as many submits accepted in the last 24 hours as its policy's max_submits_per_day",
    ),
    "budget.gpu_hours": Code("6", "not enough GPU-hours left for what the launches reserve"),
    "status.unknown_sleep": Code("6", "the sleep to show is not one of this workspace's"),
    "cancel.no_sleep": Code("6", "there is no sleep in flight to cancel (or the one named has woken)"),
    "cancel.which_sleep": Code("6", "several sleeps are in flight and the cancel names none of them"),
    "cancel.unknown_sleep": Code("6", "the sleep to cancel is not one of this workspace's"),
    "cancel.unknown_launch": Code("6", "a name to cancel is not a launch of the sleep"),
    "tail.no_sleep": Code("6", "the workspace has no sleep whose task could be tailed"),
    "tail.unknown_sleep": Code("6", "the sleep to tail is not one of this workspace's"),
    "tail.unknown_task": Code("6", "the launch or task to tail is not one of the sleep's"),
    "snapshot.failed": Code("6", "the workspace could not be snapshotted (its git repository is unusable)"),
    "snapshot.too_large": Code(
        "6",
        "the workspace has more unignored files, bytes or directory depth than the kernel's snapshot limits; "
        "nothing ran and nothing was charged",
    ),
    "environment.failed": Code(
        "6",
        "the workspace's uv.lock could not be turned into an environment (uv's message says why); nothing ran "
        "(a refusal, or the error of a wake whose build failed after the sleep was accepted, refunded)",
    ),
    "environment.lock_outdated": Code(
        "6",
        "uv.lock does not satisfy pyproject.toml (uv's own check); run `uv lock`; nothing ran and nothing was "
        "charged",
    ),
    "backend.refused": Code(
        "6", "the scheduler refused the job for good (e.g. an invalid partition or GPU request); nothing ran"
    ),
}


def section_of(code: str) -> str:
    return CODES[code].section
