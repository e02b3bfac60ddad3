"""Results of a conformance run: the table a person reads, JUnit XML for CI, and the exit code. Pure."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from xml.etree import ElementTree as ET


class Status(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NOT_RUN = "not run"


@dataclass(frozen=True, slots=True)
class Result:
    """One vector or behavioural check: where the protocol says it (`section`), what it is, and how it went."""

    section: str
    name: str
    status: Status
    why: str
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL


def passed(section: str, name: str, why: str, seconds: float = 0.0) -> Result:
    return Result(section, name, Status.PASS, why, seconds)


def failed(section: str, name: str, why: str, seconds: float = 0.0) -> Result:
    return Result(section, name, Status.FAIL, why, seconds)


def not_run(section: str, name: str, why: str) -> Result:
    return Result(section, name, Status.NOT_RUN, why)


def exit_code(results: Iterable[Result]) -> int:
    """0 only when something ran and everything that ran passed; 1 otherwise."""
    counts = Counter(r.status for r in results)
    return 0 if counts[Status.PASS] and not counts[Status.FAIL] else 1


def summary(results: list[Result]) -> str:
    counts = Counter(r.status for r in results)
    verdict = "CONFORMS (for everything that ran)" if exit_code(results) == 0 else "DOES NOT CONFORM"
    if not counts[Status.PASS] and not counts[Status.FAIL]:
        verdict = "NOTHING RAN"
    return f"{counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, {counts[Status.NOT_RUN]} not run: {verdict}"


def render_table(results: list[Result], *, only_problems: bool = False, width: int = 180) -> str:
    """A fixed-width table: section, vector or check, status, why (cut to fit `width`)."""
    rows = [r for r in results if not only_problems or r.status is not Status.PASS]
    sec_w = max([len("section"), *(len(r.section) for r in rows)])
    name_w = min(52, max([len("vector or check"), *(len(r.name) for r in rows)]))
    stat_w = len("not run")
    why_w = max(20, width - sec_w - name_w - stat_w - 6)
    lines = [
        f"{'section':<{sec_w}}  {'vector or check':<{name_w}}  {'status':<{stat_w}}  why",
        f"{'-' * sec_w}  {'-' * name_w}  {'-' * stat_w}  {'-' * min(why_w, 40)}",
    ]
    for r in rows:
        why = " ".join(r.why.split())
        if len(why) > why_w:
            why = why[: why_w - 3] + "..."
        name = r.name if len(r.name) <= name_w else r.name[: name_w - 3] + "..."
        lines.append(f"{r.section:<{sec_w}}  {name:<{name_w}}  {r.status.value:<{stat_w}}  {why}")
    lines.append("")
    lines.append(summary(results))
    return "\n".join(lines) + "\n"


def render_junit(results: list[Result], suite: str) -> bytes:
    """JUnit XML: one testcase per result (classname: the spec section), failures and skips marked."""
    counts = Counter(r.status for r in results)
    root = ET.Element(
        "testsuite",
        name=suite,
        tests=str(len(results)),
        failures=str(counts[Status.FAIL]),
        skipped=str(counts[Status.NOT_RUN]),
        errors="0",
        time=f"{sum(r.seconds for r in results):.3f}",
    )
    for r in results:
        case = ET.SubElement(
            root, "testcase", classname=f"section {r.section}", name=r.name, time=f"{r.seconds:.3f}"
        )
        if r.status is Status.FAIL:
            ET.SubElement(case, "failure", message=_xml_safe(r.why)).text = _xml_safe(r.why)
        elif r.status is Status.NOT_RUN:
            ET.SubElement(case, "skipped", message=_xml_safe(r.why))
        else:
            ET.SubElement(case, "system-out").text = _xml_safe(r.why)
    xml: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return xml + b"\n"


def _xml_safe(text: str) -> str:
    """XML 1.0 cannot carry most control characters; kernel-written text might hold them."""
    return "".join(c if c in "\t\n\r" or _xml_char(c) else "?" for c in text)


def _xml_char(c: str) -> bool:
    return " " <= c < "\ud800" or "\ue000" <= c < "\ufffe" or c >= "\U00010000"
