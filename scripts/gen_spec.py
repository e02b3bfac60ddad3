"""Regenerate the parts of `spec/` that are derived from `channel/`.

- `spec/schema/v1/*.json`: JSON Schema (draft 2020-12) of every message, from the msgspec Structs.
- the blocks of `spec/PROTOCOL.md` between `<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->`:
  `limits` (channel.limits), `codes` (channel.errors.CODES) and `lifecycle` (channel.lifecycle.render_tables()).

Run `.venv/bin/python scripts/gen_spec.py` after changing any of those; `--check` exits 1 (writing nothing) when
a committed file differs, which is what tests/unit/test_spec_sync.py asserts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Final

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from channel import limits as L  # noqa: E402
from channel.errors import CODES  # noqa: E402
from channel.lifecycle import render_tables  # noqa: E402
from channel.messages import (  # noqa: E402
    Answer,
    BudgetFile,
    JobEnvFile,
    KernelInfo,
    ProgressFile,
    Request,
    Wake,
)

SPEC = ROOT / "spec" / "PROTOCOL.md"
SCHEMA_DIR = ROOT / "spec" / "schema" / "v1"
REGENERATE = ".venv/bin/python scripts/gen_spec.py"
SCHEMA_BASE = "https://syscall-kernel.invalid/spec/schema/v1/"

# What a client reads is open (spec 1.5): a client MUST ignore members and values it does not know, so these schemas
# allow unknown members and any string where the Structs list the values known today. What a client writes (a
# request) stays closed: the kernel refuses what it does not know (`field.unknown`).
KERNEL_WRITTEN: Final = (
    "answer.json",
    "wake.json",
    "progress.json",
    "kernel.json",
    "budget.json",
    "jobenv.json",
)

SCHEMAS: dict[str, tuple[Any, str]] = {
    "request.json": (Request, "A request file, `requests/<id>.json` (agent -> kernel)."),
    "answer.json": (Answer, "An answer file, `answers/<id>.json` (kernel -> agent)."),
    "wake.json": (Wake, "A wake, `wakes/<sleep-id>.json` (kernel -> agent)."),
    "progress.json": (
        ProgressFile,
        "A sleep's progress, `results/<seq>/progress.json` (kernel -> agent), rewritten as its tasks change.",
    ),
    "kernel.json": (KernelInfo, "`kernel.json`: the kernel, its limits and the workspace's policy."),
    "budget.json": (BudgetFile, "`budget.json`: the workspace's remaining budget."),
    "jobenv.json": (
        JobEnvFile,
        "`jobenv.json`: what a job of the workspace sees (interpreter, GPUs, limits...).",
    ),
}

# What each protocol limit bounds. Every public name in channel.limits must appear here (the sync test checks).
LIMIT_DOCS: dict[str, str] = {
    "PROTOCOL_VERSION": "the protocol version; `protocol` in every message",
    "REQUEST_MAX_BYTES": "size of a request file, in bytes",
    "JSON_MAX_DEPTH": "nesting of objects and arrays in a request (the top-level object is depth 1)",
    "ID_PATTERN": "a request id (and so a request file's stem)",
    "NAME_PATTERN": "a launch name",
    "EVAL_LAUNCH_NAMES": "names of a submit's evaluation runs: no launch of a sleep with a submit may take one",
    "MAX_LAUNCHES": "launches in one sleep",
    "COMMAND_MAX_CHARS": "a launch's `command`, in characters",
    "MINUTES_MIN": "smallest `minutes` / `eval_minutes`",
    "MINUTES_DEFAULT": "`minutes` when omitted",
    "MINUTES_CEILING": "largest `minutes` / `eval_minutes` any policy may allow",
    "GPUS_CEILING": "largest `gpus` any policy may allow",
    "MEM_MB_MIN": "smallest `mem_mb` (a launch's memory per task, in MB)",
    "MEM_MB_CEILING": "largest `mem_mb` any policy may allow",
    "CPUS_CEILING": "largest `cpus` (a launch's CPUs per task) any policy may allow",
    "ARRAY_MAX": "largest `array` (tasks of one launch)",
    "MAX_ARTIFACTS": "artifact paths of one launch",
    "ARTIFACT_MAX_CHARS": "one artifact path, in characters",
    "WHY_MAX_CHARS": "a launch's `why`, in characters",
    "NOTE_MAX_CHARS": "a sleep's `note`, in characters",
    "REPORT_MAX_CHARS": "a submit's `report`, in characters",
    "REPEATS_MAX": "`repeats` of an eval contract: pairs per submit (operator-set)",
    "PROTECTED_MAX": "patterns in an eval contract's `protected` (operator-set)",
    "PROTECTED_MAX_CHARS": "one `protected` pattern, in characters",
    "PATH_MAX_CHARS": "an eval contract's `score_data` path, in characters",
    "CANCEL_MAX_NAMES": "names in one `cancel`",
    "WAKE_ON_CONDITIONS": "a sleep's `wake_on` besides a count: every task ended, the first failure, the first end",
    "WAKE_ON_MAX": "largest count of a sleep's `wake_on` (a sleep's own bound is its task count)",
    "REST_CHOICES": "a sleep's `rest`: what an early wake does with the tasks still running",
    "HISTORY_MAX": "largest `limit` of `history`",
    "HISTORY_DEFAULT": "`limit` of `history` when omitted",
    "SWEEP_MAX_KEYS": "keys (axes) of one launch's `sweep`",
    "SWEEP_KEY_PATTERN": "a sweep key (the task's variable is `SWEEP_<KEY>`, upper-cased)",
    "SWEEP_RESERVED_KEYS": "sweep keys refused: their variables are the kernel's own (`SWEEP_INDEX`, `SWEEP_PARAMS`)",
    "SWEEP_VALUE_PATTERN": "one value of a sweep key",
    "METRIC_KEY_PATTERN": "a launch's `rank` and `history`'s `metric`: a key of the last JSON line, `-` first when higher is better",
    "TAIL_MAX_BYTES": "each stdout/stderr tail in a wake, in bytes (whole lines; kernel-written)",
    "TAIL_MAX_LINES": "each stdout/stderr tail in a wake, in lines (kernel-written)",
    "RESULT_MAX_CHARS": "a task's `result` (the last JSON-object line of its stdout), in characters",
    "TAIL_VERB_DEFAULT_LINES": "`lines` of `tail` when omitted",
    "TAIL_VERB_MAX_LINES": "largest `lines` of `tail`",
    "TAIL_VERB_MAX_BYTES": "the text of a `tail` answer, in bytes (whole lines; kernel-written)",
    "LOG_MAX_BYTES": "default `log_max_bytes`: the most of each stdout/stderr delivered into `results/`",
    "SNAPSHOT_MAX_FILES": "default `snapshot_max_files`: unignored files a snapshot may hold (else `snapshot.too_large`)",
    "SNAPSHOT_MAX_BYTES": "default `snapshot_max_bytes`: the unignored files' bytes in all (else `snapshot.too_large`)",
    "SNAPSHOT_MAX_DEPTH": "default `snapshot_max_depth`: path components of an unignored file (else `snapshot.too_large`)",
    "POLICY_MAX_MINUTES": "default policy: `max_minutes`",
    "POLICY_MAX_GPUS": "default policy: `max_gpus` and `max_concurrent_gpus`",
    "POLICY_MAX_MEM_MB": "default policy: `max_mem_mb`",
    "POLICY_MAX_CPUS": "default policy: `max_cpus`",
    "POLICY_MAX_SLEEPS_IN_FLIGHT": "default policy: `max_sleeps_in_flight` (sleeps a workspace may have in flight)",
    "SLEEPS_IN_FLIGHT_CEILING": "largest `max_sleeps_in_flight` any policy may allow",
    "BUDGET_LAUNCHES": "default budget: launches of a newly enrolled workspace",
    "BUDGET_SLEEPS": "default budget: sleeps of a newly enrolled workspace",
    "BUDGET_GPU_HOURS": "default budget: GPU-hours of a newly enrolled workspace",
}

SECTION_TITLES = {
    "4.1": "the file",
    "4.2": "JSON",
    "4.3": "shape",
    "4.4": "sleep and launches",
    "4.5": "submit",
    "4.6": "other verbs",
    "5": "policy",
    "6": "kernel state and budget",
}

_BLOCK_RE = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[a-z]+) -->\n).*?(<!-- END GENERATED: (?P=name) -->)", re.S
)


def limit_names() -> list[str]:
    return [n for n in vars(L) if n.isupper() and not n.startswith("_")]


def render_limits() -> str:
    lines = ["| name | value | bounds |", "|---|---|---|"]
    for name in limit_names():
        value = getattr(L, name)
        lines.append(f"| `{name}` | `{value}` | {LIMIT_DOCS[name]} |")
    return "\n".join(lines) + "\n"


def _section_key(section: str) -> tuple[int, ...]:
    return tuple(int(p) for p in section.split("."))


def render_codes() -> str:
    lines = ["| code | section | meaning |", "|---|---|---|"]
    for code, c in sorted(CODES.items(), key=lambda kv: _section_key(kv[1].section)):
        lines.append(f"| `{code}` | {c.section} ({SECTION_TITLES[c.section]}) | {c.meaning} |")
    return "\n".join(lines) + "\n"


def generated_blocks() -> dict[str, str]:
    return {"limits": render_limits(), "codes": render_codes(), "lifecycle": render_tables()}


def render_spec(text: str) -> str:
    """`text` with every generated block rewritten. Raises if a block is missing."""
    blocks = generated_blocks()
    seen: set[str] = set()

    def sub(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in blocks:
            raise SystemExit(f"{SPEC}: unknown generated block {name!r}")
        seen.add(name)
        return m.group(1) + blocks[name] + m.group(3)

    out = _BLOCK_RE.sub(sub, text)
    if missing := set(blocks) - seen:
        raise SystemExit(f"{SPEC}: missing generated blocks {sorted(missing)}")
    return out


def open_schema(node: Any, *, tag: str | None = None) -> Any:
    """`node` with every `additionalProperties: false` dropped and every closed `enum` of strings turned into
    any string (the known values kept as `examples`), except the union's tag `tag`: an answer's `type` follows
    from the request's verb, so a new one comes only with a new verb."""
    if isinstance(node, list):
        return [open_schema(v, tag=tag) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "additionalProperties" and value is False:
            continue
        if key == "properties":
            out[key] = {
                prop: sub if prop == tag else open_schema(sub, tag=tag) for prop, sub in value.items()
            }
            continue
        out[key] = open_schema(value, tag=tag)
    if "enum" in out and all(isinstance(v, str) for v in out["enum"]):
        known = out.pop("enum")
        out = {"type": "string", "examples": known, **out}
        note = "known values are listed in examples; a client MUST accept any other string (spec 1.5)"
        out["description"] = f"{out['description']} ({note})" if "description" in out else note
    return out


def render_schema(name: str) -> str:
    tp, description = SCHEMAS[name]
    body = msgspec.json.schema(tp)
    if name in KERNEL_WRITTEN:
        body = open_schema(body, tag=body.get("discriminator", {}).get("propertyName"))
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_BASE + name,
        "$comment": f"generated from channel/messages.py by {REGENERATE}; do not edit",
        "description": description,
        **body,
    }
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def expected_files() -> dict[Path, str]:
    files = {SCHEMA_DIR / name: render_schema(name) for name in SCHEMAS}
    files[SPEC] = render_spec(SPEC.read_text(encoding="utf-8"))
    return files


def outdated() -> list[Path]:
    """Files whose committed content differs from what this script generates."""
    return [p for p, text in expected_files().items() if not p.exists() or p.read_text("utf-8") != text]


def main() -> int:
    ap = argparse.ArgumentParser(description="Regenerate spec/ from channel/.")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything is outdated")
    args = ap.parse_args()
    if args.check:
        stale = outdated()
        for p in stale:
            print(f"outdated: {p.relative_to(ROOT)}", file=sys.stderr)
        if stale:
            print(f"regenerate with: {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
    for path, text in expected_files().items():
        if not path.exists() or path.read_text("utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
