"""The vectors of `spec/vectors/v1` (section 14.2): loading them, placing them in a live channel, judging answers.

Pure: bytes and parsed JSON in, verdicts out. The in-process test of the reference decoder
(tests/conformance/test_vectors.py) and the black-box kernel runner (`kernel_mode`) load vectors through here.

A live kernel remembers every id it answered (section 3.3), and almost every vector uses the stem `r1`, so the
runner gives each vector a fresh id (`run_id`) and rewrites the vector's bytes for it (`placed_bytes`): every JSON
string token equal to the stem (the request's own `"id"` value; no vector uses its stem elsewhere) becomes the new
id, and a longer id is paid for with the vector's trailing whitespace padding so that the size-limit vectors keep
their exact size. A body id that differs from the stem (`id-mismatch`, `id-uppercase`, ...) is left as it is,
so the fault the vector carries stays the same fault.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final

import msgspec

from channel import limits as L
from channel.errors import CODES
from channel.messages import VERBS, Answer, Policy, Rejected
from spec import VECTOR_DIR, VECTOR_SCHEMA
from spec.conformance.reading import decode_open

# The answer type a valid request of each verb gets (section 7.1): `accepted` and `cancelled`, else the verb's
# own name. Verbs come from the protocol's messages, so a verb added there is picked up here.
ANSWER_TYPE: Final[dict[str, str]] = {
    str(v): {"sleep": "accepted", "cancel": "cancelled"}.get(v, v) for v in VERBS
}
_NAME_RE: Final = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_ID_RE: Final = re.compile(L.ID_PATTERN)
_WHITESPACE: Final = b" \t\r\n"
# Stems at least this long are replaced by a fresh id of the same length (the length may be the point of the
# vector: `id-length-at-limit`); shorter stems used by one vector only keep their value (`id-one-character`).
_SAME_LENGTH_FROM: Final = 16


@cache
def sections() -> tuple[str, ...]:
    """The sections a vector may name, as vectors/vector.schema.json lists them (it grows with the vectors)."""
    schema = json.loads(VECTOR_SCHEMA.read_text("utf-8"))
    return tuple(schema["$defs"]["vector"]["properties"]["section"]["enum"])


class VectorFileError(Exception):
    """A vector file that is not as section 14.2 says; the message names the file, the vector and the member."""


@dataclass(frozen=True, slots=True)
class Expect:
    """A vector's expected outcome: `verb` for a valid request, else the error `code` and `path`."""

    verb: str | None
    code: str | None = None
    path: str | None = None

    def describe(self) -> str:
        if self.verb is not None:
            return f"a valid {self.verb} request ({ANSWER_TYPE[self.verb]})"
        return f"rejected {self.code} at {shown_path(self.path)}"


@dataclass(frozen=True, slots=True)
class Vector:
    name: str
    section: str
    description: str
    stem: str
    data: bytes
    expect: Expect
    # the vector's policy as given (omitted members at their defaults); None: the vector carries none
    policy: Policy | None
    file: str

    def outcome(self) -> dict[str, Any]:
        """The `expect` member as the vector file spells it."""
        if self.expect.verb is not None:
            return {"type": self.expect.verb}
        return {"error": {"code": self.expect.code, "path": self.expect.path}}


def vector_files(directory: Path = VECTOR_DIR) -> list[Path]:
    return sorted(directory.glob("*.json"))


def load_vectors(directory: Path = VECTOR_DIR) -> list[Vector]:
    """Every vector of every file in `directory`, in file order. Raises VectorFileError naming what is wrong."""
    files = vector_files(directory)
    if not files:
        raise VectorFileError(f"{directory}: no vector files (*.json); is the spec package installed whole?")
    vectors = [v for f in files for v in load_file(f)]
    seen: dict[str, str] = {}
    for v in vectors:
        if v.name in seen:
            raise VectorFileError(f"{v.file}: vector name {v.name!r} is used again (first in {seen[v.name]})")
        seen[v.name] = v.file
    return vectors


def load_file(path: Path) -> list[Vector]:
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise VectorFileError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"vectors"} or not isinstance(doc["vectors"], list):
        raise VectorFileError(f'{path}: must be {{"vectors": [...]}} (section 14.2)')
    return [parse_vector(raw, f"{path.name}[{i}]") for i, raw in enumerate(doc["vectors"])]


_MEMBERS: Final = {
    "name",
    "section",
    "description",
    "stem",
    "request",
    "request_text",
    "request_base64",
    "policy",
    "expect",
}


def parse_vector(raw: Any, where: str) -> Vector:
    """One vector from its parsed JSON (the rules of vectors/vector.schema.json), or VectorFileError."""

    def bad(member: str, problem: str) -> VectorFileError:
        return VectorFileError(f"{where}: `{member}` {problem} (see vectors/vector.schema.json)")

    if not isinstance(raw, dict):
        raise VectorFileError(f"{where}: a vector must be an object")
    unknown = sorted(set(raw) - _MEMBERS)
    if unknown:
        raise bad(unknown[0], "is not a vector member")
    for member in ("name", "section", "description", "stem", "expect"):
        if member not in raw:
            raise bad(member, "is missing")
    name, section, stem = raw["name"], raw["section"], raw["stem"]
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(name) > 80:
        raise bad("name", "must match ^[a-z0-9][a-z0-9-]*$ (at most 80 characters)")
    where = f"{where} ({name})"
    if section not in sections():
        raise bad("section", f"must be one of {', '.join(sections())}")
    if not isinstance(raw["description"], str) or not raw["description"]:
        raise bad("description", "must be a non-empty string")
    if not isinstance(stem, str) or not _ID_RE.fullmatch(stem):
        raise bad("stem", f"must match {L.ID_PATTERN}")
    given = [m for m in ("request", "request_text", "request_base64") if m in raw]
    if len(given) != 1:
        raise bad("request", "must be given as exactly one of request, request_text, request_base64")
    if "request" in raw:
        data = json.dumps(raw["request"], separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    elif "request_text" in raw:
        if not isinstance(raw["request_text"], str):
            raise bad("request_text", "must be a string")
        try:
            data = raw["request_text"].encode("utf-8")
        except UnicodeEncodeError:
            raise bad("request_text", "holds a lone surrogate; use request_base64") from None
    else:
        try:
            data = base64.b64decode(raw["request_base64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise bad("request_base64", "must be standard base64") from None
    policy = None
    if "policy" in raw:
        try:
            policy = msgspec.convert(raw["policy"], Policy)
        except msgspec.ValidationError as exc:
            raise bad("policy", f"is not a policy as in kernel.json: {exc}") from None
    return Vector(
        name=name,
        section=section,
        description=raw["description"],
        stem=stem,
        data=data,
        expect=_parse_expect(raw["expect"], bad),
        policy=policy,
        file=where.split("[", 1)[0],
    )


def _parse_expect(raw: Any, bad: Any) -> Expect:
    if isinstance(raw, dict) and set(raw) == {"type"}:
        if raw["type"] not in ANSWER_TYPE:
            raise bad("expect.type", f"must be one of {', '.join(ANSWER_TYPE)}")
        return Expect(verb=raw["type"])
    if isinstance(raw, dict) and set(raw) == {"error"} and isinstance(raw["error"], dict):
        err = raw["error"]
        if set(err) != {"code", "path"}:
            raise bad("expect.error", "must have exactly `code` and `path`")
        if err["code"] not in CODES:
            raise bad("expect.error.code", f"{err['code']!r} is not a code of section 13")
        if err["path"] is not None and not (isinstance(err["path"], str) and err["path"].startswith("$")):
            raise bad("expect.error.path", "must be null or a path starting with $")
        return Expect(verb=None, code=err["code"], path=err["path"])
    raise bad("expect", 'must be {"type": VERB} or {"error": {"code": ..., "path": ...}}')


# --- placing a vector in a live channel ------------------------------------------------------------------


def run_id(vector: Vector, token: str, index: int, shared_stems: frozenset[str]) -> str:
    """The id vector number `index` is committed under in this run (`token`: 8 lowercase hex digits).

    Unique per run; of the stem's length when the stem is long (so length-boundary vectors stay on their
    boundary); the stem itself when it is short and used by this vector only (its value is the point).
    """
    if len(vector.stem) >= _SAME_LENGTH_FROM:
        base = f"c{token}{index:05d}"
        return base + "a" * (len(vector.stem) - len(base))
    if vector.stem not in shared_stems:
        return vector.stem
    return f"c{token}-{index}"


def shared_stems(vectors: list[Vector]) -> frozenset[str]:
    stems = [v.stem for v in vectors]
    return frozenset(s for s in stems if stems.count(s) > 1)


def placed_bytes(vector: Vector, new_id: str) -> bytes:
    """The vector's bytes with its stem replaced by `new_id` (see the module docstring)."""
    if new_id == vector.stem:
        return vector.data
    old, new = f'"{vector.stem}"'.encode(), f'"{new_id}"'.encode()
    out = vector.data.replace(old, new)
    grown = len(out) - len(vector.data)
    if grown > 0:
        pad = len(out) - len(out.rstrip(_WHITESPACE))
        out = out[: len(out) - min(grown, pad)]
    return out


PolicyKey = tuple[int, int, int, int, frozenset[str], int | None, int]


def policy_key(policy: Policy) -> PolicyKey:
    """What section 5.1 refuses by: a workspace whose policy has the same key gives a vector its outcome.

    `network` never refuses a request (5.2); of an evaluation contract only its presence
    (`policy.submit_disabled`) and its runs' `gpus` (`policy.concurrent_gpus`) matter.
    """
    return (
        policy.max_minutes,
        policy.max_gpus,
        policy.max_mem_mb,
        policy.max_cpus,
        frozenset(policy.verbs),
        None if policy.submit is None else policy.submit.gpus,
        policy.max_concurrent_gpus,
    )


def describe_policy(policy: Policy) -> str:
    mm, mg, mem, cpus, verbs, submit, mcg = policy_key(policy)
    shown = ",".join(v for v in ANSWER_TYPE if v in verbs)
    evals = "no" if submit is None else f"yes (runs of {submit} GPUs)" if submit else "yes"
    return (
        f"max_minutes={mm} max_gpus={mg} max_concurrent_gpus={mcg} max_mem_mb={mem} max_cpus={cpus} "
        f"verbs={shown} submit={evals}"
    )


# --- judging an answer -----------------------------------------------------------------------------------


def shown_path(path: str | None) -> str:
    """An error path as the spec writes it: `null` when there is none."""
    return "null" if path is None else path


def decode_answer(data: bytes) -> tuple[Any, str | None]:
    """The answer Struct, or None and why `data` is not an answer of schema/v1/answer.json."""
    try:
        return decode_open(data, Answer), None
    except msgspec.DecodeError as exc:
        return None, f"not a valid answer (schema/v1/answer.json): {exc}"


def judge(vector: Vector, answer: bytes, rid: str) -> tuple[bool, str]:
    """Whether a kernel's `answer` to `vector` (committed as `rid`) is the expected one, and why.

    A valid vector passes with the answer of its verb, or with a refusal from a stage the vector does not cover:
    stage 6 (kernel state, budget) always, stage 5 (policy) when the vector carries no policy. Either proves the
    request got through the stages the vector is about (section 4.0.1: the earliest fault is reported).
    `request.id.reused` is recognised before decoding, so it never counts as such a proof.
    """
    ans, problem = decode_answer(answer)
    if ans is None:
        return False, problem or "not an answer"
    if ans.id != rid:
        return False, f"the answer's id is {ans.id!r}, not {rid!r}"
    tag = ans.__struct_config__.tag
    exp = vector.expect
    if exp.verb is None:
        if not isinstance(ans, Rejected):
            return False, f"expected {exp.describe()}, got a `{tag}` answer"
        got = (ans.error.code, ans.error.path)
        if got != (exp.code, exp.path):
            return (
                False,
                f"expected {exp.code} at {shown_path(exp.path)}, got {got[0]} at {shown_path(got[1])}",
            )
        return True, f"{exp.code} at {shown_path(exp.path)}"
    want = ANSWER_TYPE[exp.verb]
    if tag == want:
        return True, want
    if isinstance(ans, Rejected):
        code = ans.error.code
        if code in CODES and code != "request.id.reused":
            section = CODES[code].section
            if section == "6" or (section == "5" and vector.policy is None):
                stage = 6 if section == "6" else 5
                return True, f"{want} or a later-stage refusal: got {code} (stage {stage})"
        return False, f"expected {exp.describe()}, got rejected {code} at {shown_path(ans.error.path)}"
    return False, f"expected {exp.describe()}, got a `{tag}` answer"
