"""The reference decoder against the language-neutral vectors of spec/vectors/v1 (spec section 14).

Every vector runs through `channel.decode.decode_request` (and `check_policy` when it carries a policy) and must
give exactly the expected request type, or the expected code AND path. Valid requests re-encoded by the Structs
must validate against the published JSON Schema, and every decoder code of CODES must be exercised by a vector.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from channel.decode import RequestError, check_policy, decode_request
from channel.errors import CODES
from channel.messages import Policy, Rejected, Request, encode
from spec import SPEC_DIR, VECTOR_DIR
from spec.conformance.vectors import Vector, load_vectors, vector_files

SPEC = SPEC_DIR
VECTOR_FILES = vector_files()
# Codes no vector can express: they concern the file object (its type, links, readability), not its bytes.
NOT_EXPRESSIBLE = {"request.unreadable": "4.1.3: a FIFO, symlink or hardlinked file is not a byte string"}


def _load(path: Path) -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["vectors"]
    return vectors


@cache
def loaded() -> dict[str, Vector]:
    """The vectors as the conformance runner loads them (spec.conformance.vectors), by name."""
    return {v.name: v for v in load_vectors()}


@cache
def all_vectors() -> list[dict[str, Any]]:
    return [v for f in VECTOR_FILES for v in _load(f)]


def request_bytes(v: dict[str, Any]) -> bytes:
    return loaded()[v["name"]].data


def run(v: dict[str, Any]) -> Request | Rejected:
    """What a conforming decoder answers for vector `v`: the request, or the Rejected."""
    result = decode_request(request_bytes(v), v["stem"])
    if "policy" in v and not isinstance(result, Rejected):
        try:
            check_policy(result, msgspec.convert(v["policy"], Policy))
        except RequestError as err:
            return Rejected(protocol=1, id=v["stem"], error=err.info())
    return result


def outcome(result: Request | Rejected) -> dict[str, Any]:
    if isinstance(result, Rejected):
        return {"error": {"code": result.error.code, "path": result.error.path}}
    return {"type": result.__struct_config__.tag}


@cache
def _schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SPEC / name).read_text(encoding="utf-8"))
    return schema


def test_vector_files_exist() -> None:
    assert len(VECTOR_FILES) >= 5, f"expected vector files in {VECTOR_DIR}"
    assert len(all_vectors()) >= 100


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.name)
def test_vector_file_matches_vector_schema(path: Path) -> None:
    schema = _schema("vectors/vector.schema.json")
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = sorted(
        jsonschema.Draft202012Validator(schema).iter_errors(json.loads(path.read_text("utf-8"))), key=str
    )
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5])


def test_the_runner_loads_every_vector_as_written() -> None:
    assert [v["name"] for v in all_vectors()] == list(loaded())
    for raw in all_vectors():
        assert loaded()[raw["name"]].outcome() == raw["expect"]
        assert (loaded()[raw["name"]].policy is None) == ("policy" not in raw)


def test_vector_names_are_unique() -> None:
    names = [v["name"] for v in all_vectors()]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"vector names used twice: {dupes}"


@pytest.mark.parametrize("vector", all_vectors(), ids=lambda v: v["name"])
def test_vector(vector: dict[str, Any]) -> None:
    got = outcome(run(vector))
    assert got == vector["expect"], f"{vector['name']} ({vector['description']})"


@pytest.mark.parametrize(
    "vector", [v for v in all_vectors() if "type" in v["expect"]], ids=lambda v: v["name"]
)
def test_valid_vector_reencodes_to_schema_valid_json(vector: dict[str, Any]) -> None:
    req = run(vector)
    assert not isinstance(req, Rejected)
    reencoded = encode(req)
    jsonschema.validate(json.loads(reencoded), _schema("schema/v1/request.json"))
    # and the canonical encoding decodes to the same request
    assert decode_request(reencoded, vector["stem"]) == req


def test_every_decoder_code_has_a_vector() -> None:
    expected = {c for c, info in CODES.items() if info.section.startswith("4.") or info.section == "5"}
    covered = {v["expect"]["error"]["code"] for v in all_vectors() if "error" in v["expect"]}
    unknown = covered - set(CODES)
    assert not unknown, (
        f"vectors expect codes that are not registered in channel/errors.py: {sorted(unknown)}"
    )
    missing = expected - covered - set(NOT_EXPRESSIBLE)
    assert not missing, f"codes without a vector: {sorted(missing)}"


def test_vectors_cover_every_verb_valid_and_invalid() -> None:
    valid = {v["expect"]["type"] for v in all_vectors() if "type" in v["expect"]}
    assert valid == {"sleep", "cancel", "status", "queue", "history", "tail"}
