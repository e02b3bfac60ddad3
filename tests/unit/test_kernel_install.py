"""The tool-refresh note says what changed between two copies of the tool."""

from __future__ import annotations

from kernel.io.install import ToolSource, news, summarize

OLD = b"""VERSION = "1.0"
sub.add_parser("status")
p.add_argument("--json")
p.add_argument("--old-flag")
"""
NEW = b"""VERSION = "1.1"
sub.add_parser("status")
sub.add_parser("budget")
p.add_argument("--json")
p.add_argument("--timeout")
"""


def test_summary_reads_version_verbs_and_flags() -> None:
    s = summarize(NEW)
    assert s.version == "1.1"
    assert s.verbs == {"status", "budget"}
    assert s.flags == {"--json", "--timeout"}


def test_news_lists_what_is_new_and_gone() -> None:
    note = news(OLD, NEW)
    assert "From version 1.0" in note
    assert "to 1.1" in note
    assert "New verbs: `budget`" in note
    assert "New options: `--timeout`" in note
    assert "Removed options: `--old-flag`" in note


def test_verbs_through_a_helper_and_the_real_tool() -> None:
    src = b'p = _sub(\n    subs,\n    common,\n    "launch",\n    "Stage a job.")\np = _sub(subs, common, "queue", "x")\n'
    assert summarize(src).verbs == {"launch", "queue"}
    real = summarize(ToolSource.bundled().data)
    assert {"launch", "sleep", "status", "cancel", "queue", "history"} <= real.verbs
    assert "--json" in real.flags


def test_news_for_a_first_install() -> None:
    assert "Installed version 1.1" in news(None, NEW)
