"""The published patterns (spec 1.3.1) mean the same in every common regex engine, searched or matched whole.

`kernel.json` publishes `id_pattern` and `name_pattern` for clients to validate with whatever engine they have.
`^...$` would not do: Python's and Oniguruma's (jq's) `$` also match before a final newline, and Oniguruma's
`^` after any newline. Each engine here judges the same values; they must all agree with the protocol's rule.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from channel import limits as L

# (value, is it an id, is it a launch name)
CASES = [
    ("a", True, True),
    ("0-x", True, True),
    ("a" * 32, True, True),
    ("a" * 33, True, False),
    ("a" * 64, True, False),
    ("a" * 65, False, False),
    ("", False, False),
    ("-a", False, False),
    ("A", False, False),
    ("a\n", False, False),
    ("\na", False, False),
    ("x\nabc", False, False),
    ("abc\nx", False, False),
    ("a b", False, False),
    ("é", False, False),
]
PATTERNS = {"id": (L.ID_PATTERN, 1), "name": (L.NAME_PATTERN, 2)}


def _expected(which: str) -> list[bool]:
    return [bool(case[PATTERNS[which][1]]) for case in CASES]


@pytest.mark.parametrize("which", sorted(PATTERNS))
def test_python_search_and_fullmatch(which: str) -> None:
    pattern = PATTERNS[which][0]
    assert [re.search(pattern, v) is not None for v, *_ in CASES] == _expected(which)
    assert [re.fullmatch(pattern, v) is not None for v, *_ in CASES] == _expected(which)


@pytest.mark.parametrize("which", sorted(PATTERNS))
def test_jq_oniguruma(which: str) -> None:
    jq = shutil.which("jq")
    if jq is None:
        pytest.skip("jq is not installed")
    values = json.dumps([v for v, *_ in CASES])
    out = subprocess.run(
        [jq, "-c", "--arg", "p", PATTERNS[which][0], "map(test($p))"],
        input=values,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == _expected(which)


@pytest.mark.parametrize("which", sorted(PATTERNS))
def test_pcre_grep(which: str) -> None:
    grep = shutil.which("grep")
    assert grep is not None
    got = []
    for value, *_ in CASES:
        # -z: the value is one NUL-terminated record, so grep does not split it at its newlines
        r = subprocess.run([grep, "-qzP", PATTERNS[which][0]], input=value.encode() + b"\0", check=False)
        assert r.returncode in (0, 1), "grep -P is not available"
        got.append(r.returncode == 0)
    assert got == _expected(which)


@pytest.mark.parametrize("which", sorted(PATTERNS))
def test_ecma_262(which: str) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = "const [p, vs] = JSON.parse(process.argv[1]); console.log(JSON.stringify(vs.map(v => new RegExp(p, 'u').test(v))))"
    arg = json.dumps([PATTERNS[which][0], [v for v, *_ in CASES]])
    out = subprocess.run([node, "-e", script, arg], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == _expected(which)


def test_caret_dollar_would_not_do() -> None:
    """Why the lookarounds: the `^...$` form lets a trailing newline through in Python's search."""
    assert re.search(r"^[a-z0-9][a-z0-9-]{0,63}$", "a\n") is not None
    assert re.search(L.ID_PATTERN, "a\n") is None
