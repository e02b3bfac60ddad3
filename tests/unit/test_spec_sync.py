"""The committed spec (generated sections and JSON Schemas) must match what channel/ generates."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from channel import limits as L
from channel.errors import CODES
from channel.messages import Limits

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec" / "PROTOCOL.md"


@pytest.fixture(scope="module")
def gen_spec() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_spec", ROOT / "scripts" / "gen_spec.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_spec"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_spec_and_schemas_are_up_to_date(gen_spec: ModuleType) -> None:
    stale = [str(p.relative_to(ROOT)) for p in gen_spec.outdated()]
    assert not stale, f"{', '.join(stale)} outdated, regenerate with: .venv/bin/python scripts/gen_spec.py"


def test_regeneration_restores_an_edited_block(gen_spec: ModuleType) -> None:
    text = SPEC.read_text("utf-8")
    tampered = text.replace("| `request.too_large` |", "| `request.too_big` |")
    assert tampered != text
    assert gen_spec.render_spec(tampered) == text


def test_a_missing_generated_block_is_an_error(gen_spec: ModuleType) -> None:
    text = SPEC.read_text("utf-8")
    without = re.sub(r"<!-- BEGIN GENERATED: codes -->.*?<!-- END GENERATED: codes -->", "", text, flags=re.S)
    with pytest.raises(SystemExit, match="missing generated blocks"):
        gen_spec.render_spec(without)


def test_every_limit_is_documented(gen_spec: ModuleType) -> None:
    names = set(gen_spec.limit_names())
    assert names == set(gen_spec.LIMIT_DOCS), "describe every channel.limits constant in scripts/gen_spec.py"


def test_every_code_section_is_a_spec_heading(gen_spec: ModuleType) -> None:
    text = SPEC.read_text("utf-8")
    for section in sorted({c.section for c in CODES.values()}):
        assert section in gen_spec.SECTION_TITLES, section
        heading = rf"^### {re.escape(section)} " if "." in section else rf"^## {re.escape(section)}\. "
        assert re.search(heading, text, re.M), f"spec/PROTOCOL.md has no section {section}"


def test_published_limits_are_the_protocol_limits() -> None:
    """kernel.json publishes `Limits()`: its defaults must be the constants the decoder enforces."""
    for field, value in zip(Limits.__struct_fields__, Limits.__struct_defaults__, strict=True):
        assert getattr(L, field.upper()) == value, field


def test_the_request_schema_carries_the_limits() -> None:
    import json

    schema = json.loads((ROOT / "spec" / "schema" / "v1" / "request.json").read_text("utf-8"))
    launch = schema["$defs"]["Launch"]["properties"]
    assert launch["command"]["maxLength"] == L.COMMAND_MAX_CHARS
    assert launch["name"]["pattern"] == L.NAME_PATTERN
    assert launch["array"]["maximum"] == L.ARRAY_MAX
    assert schema["$defs"]["SleepRequest"]["properties"]["launches"]["maxItems"] == L.MAX_LAUNCHES
    assert set(schema["discriminator"]["mapping"]) == {
        "sleep",
        "cancel",
        "status",
        "queue",
        "history",
        "tail",
    }


# --- the document set: PROTOCOL.md (the core) and its companions -------------------------------------------

DOCS = ("PROTOCOL.md", "KERNEL.md", "TOOL.md", "CONFORMANCE.md")
_REF = re.compile(r"\b(PROTOCOL|KERNEL|TOOL|CONFORMANCE)\.md\)? (?:sections? )?((?:K?\d+)(?:\.\d+)*)")


def _numbered(text: str) -> set[str]:
    """Every section or paragraph number the document defines: headings and paragraphs that start with one."""
    found = set(re.findall(r"^#{2,3} (K?\d+(?:\.\d+)*)\.?[ ]", text, re.M))
    found |= set(re.findall(r"^(K?\d+(?:\.\d+)+)\. ", text, re.M))
    return found


@pytest.mark.parametrize("name", DOCS)
def test_every_document_has_a_revision_and_its_changes(name: str) -> None:
    text = (ROOT / "spec" / name).read_text("utf-8")
    m = re.search(r"^Revision: (\d+) \((\d{4}-\d{2}-\d{2})\)\.", text, re.M)
    assert m, f"spec/{name} has no 'Revision: N (YYYY-MM-DD).' line"
    changes = text[text.rindex("Changes") :]
    assert f"Revision {m.group(1)} ({m.group(2)})" in changes, (
        f"spec/{name}: its changes do not list revision {m[1]}"
    )


def test_references_between_the_documents_resolve() -> None:
    numbered = {name: _numbered((ROOT / "spec" / name).read_text("utf-8")) for name in DOCS}
    broken = []
    for name in DOCS:
        for doc, number in _REF.findall((ROOT / "spec" / name).read_text("utf-8")):
            target = f"{doc}.md"
            # a reference to a section resolves to its heading or to a paragraph under it
            if number not in numbered[target] and not any(
                n.startswith(number + ".") for n in numbered[target]
            ):
                broken.append(f"{name}: {target} {number}")
    assert not broken, broken


def test_moved_sections_leave_a_pointer_and_keep_their_numbers() -> None:
    core = (ROOT / "spec" / "PROTOCOL.md").read_text("utf-8")
    for number, doc in (
        ("10.3", "KERNEL.md"),
        ("11", "KERNEL.md"),
        ("12", "TOOL.md"),
        ("14.4", "CONFORMANCE.md"),
    ):
        assert number in _numbered((ROOT / "spec" / doc).read_text("utf-8")), f"{doc} lacks {number}"
        assert re.search(rf"{doc}\]\({doc}\) sections? {re.escape(number)}\b", core), (
            f"no pointer to {doc} {number}"
        )
