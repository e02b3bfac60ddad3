"""What of a contract changed (kernel.core.contract): the kernel's notice, and the tool's words for the same."""

from __future__ import annotations

import msgspec

from channel.messages import ContractChange, EvalContract, Policy
from kernel.core import contract as C
from kernel.core.config import parse
from tool import syscall as T

CFG = parse("", "<test>")


def enc(policy: Policy) -> bytes:
    return C.encoded(C.contract_now(policy, CFG))


def test_nothing_is_told_first_or_when_nothing_changed() -> None:
    now = enc(Policy(max_minutes=30))
    assert C.notice(None, now) is None
    assert C.notice(now, now) is None


def test_each_changed_value_is_named_with_its_old_and_new_value() -> None:
    before, after = Policy(max_minutes=60, max_gpus=2), Policy(max_minutes=30, max_gpus=1)
    told = C.notice(enc(before), enc(after))
    assert told is not None
    assert told.changes == (
        ContractChange(key="policy.max_minutes", old=60, new=30),
        ContractChange(key="policy.max_gpus", old=2, new=1),
    )
    assert told.text == (
        "This workspace's contract changed since the kernel's last answer or wake here: "
        "policy.max_minutes 60 -> 30; policy.max_gpus 2 -> 1."
    )


def test_a_contract_given_is_one_change_and_its_verdict_rules_appear() -> None:
    told = C.notice(enc(Policy()), enc(Policy(submit=EvalContract(command="python eval.py", metric="acc"))))
    assert told is not None
    keys = [c.key for c in told.changes]
    assert keys == ["policy.submit", "submit_trusted", "submit_verdicts"]
    assert told.changes[0].old is None
    assert "policy.submit null -> {" in told.text


def test_a_key_the_told_contract_lacks_is_shown_as_none_and_absent_in_the_json() -> None:
    now = enc(Policy())
    older = msgspec.json.decode(now)
    del older["limits"]["log_max_bytes"]  # as a kernel before that limit recorded it
    told = C.notice(msgspec.json.encode(older), now)
    assert told is not None
    [change] = told.changes
    assert change.old is msgspec.UNSET
    assert b'"old"' not in msgspec.json.encode(change)
    assert told.text.endswith(f"limits.log_max_bytes (none) -> {CFG.log_max_bytes}.")


def test_many_changes_name_eight_and_count_the_rest() -> None:
    found = [ContractChange(key=f"k{i}", old=i, new=i + 1) for i in range(11)]
    assert C.changes_text(found).endswith("k7 7 -> 8; and 3 more")


def test_the_tool_says_each_change_in_the_kernel_s_words() -> None:
    """The tool's own notice (kernel.json against what it last read) and the kernel's name a change alike."""
    long = {"command": "x" * 100}
    for key, old, new in [("policy.max_minutes", 60, 30), ("policy.submit", None, long), ("v", "é", [1, 2])]:
        assert T.contract_change_text(key, old, new) == C.change_text(
            ContractChange(key=key, old=old, new=new)
        )
    assert T.contract_change_text("k", T.CONTRACT_ABSENT, 1) == C.change_text(ContractChange(key="k", new=1))
    assert T.contract_changes({"a": {"b": 1}}, {"a": {"b": 2}}) == [("a.b", 1, 2)]
    assert C.changes({"a": {"b": 1}}, {"a": {"b": 2}}) == [ContractChange(key="a.b", old=1, new=2)]
