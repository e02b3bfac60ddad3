"""A workspace's contract and what of it changed: the one place that computes both.

The contract is what `kernel.json` publishes for the agent to work under: `limits` (the protocol's and the
operator's), `policy`, `verbs`, `submit_trusted` and `submit_verdicts` (spec 9.1). The operator changes it with a
reload (SIGHUP), a restart with another config, or `enroll` with other overrides; the kernel tells the agent in
the next answer or wake it writes to the workspace (spec 7.4), comparing the contract now with the one it last
told (kept in the store as `encoded` bytes, recorded in the transaction that records that answer or wake).

Pure: `contract_of` from its parts, `notice` from the told and current bytes. The reference tool prints its own
notice (of `kernel.json` against what it last read) in the same words: `change_text` and `notice_text` are
mirrored there (tool/syscall.py `contract_text`), and a test holds the two to the same output.
"""

from __future__ import annotations

import json
from typing import Any, Final

import msgspec

from channel.messages import (
    VERBS,
    ContractChange,
    ContractChanged,
    Limits,
    Policy,
    VerdictRules,
)
from kernel.core.config import Config
from kernel.core.evaluate import is_trusted

# The changes a notice's text names (the JSON carries every one) and the characters of each value it shows.
SHOWN: Final = 8
VALUE_CHARS: Final = 60


class Contract(msgspec.Struct, frozen=True):
    """The members of `kernel.json` that make the workspace's contract, as `kernel.json` has them."""

    limits: Limits
    policy: Policy
    verbs: tuple[str, ...]
    submit_trusted: bool | None
    submit_verdicts: VerdictRules | None


def published_limits(cfg: Config | None) -> Limits:
    """The protocol's limits with the operator's: `log_max_bytes` and the `[snapshot]` limits (the defaults
    without a config)."""
    if cfg is None:
        return Limits()
    return Limits(
        log_max_bytes=cfg.log_max_bytes,
        snapshot_max_files=cfg.snapshot.max_files,
        snapshot_max_bytes=cfg.snapshot.max_bytes,
        snapshot_max_depth=cfg.snapshot.max_depth,
    )


def contract_of(
    policy: Policy, *, jail: str, limits: Limits | None = None, verdicts: VerdictRules | None = None
) -> Contract:
    """The contract of a workspace with `policy`; `jail` (the config's) decides, with the eval contract, whether
    its verdicts are trusted, `verdicts` is the config's `[verdicts]`."""
    return Contract(
        limits=Limits() if limits is None else limits,
        policy=policy,
        verbs=VERBS,
        submit_trusted=None if policy.submit is None else is_trusted(policy.submit, jail),
        submit_verdicts=None if policy.submit is None else verdicts or VerdictRules(),
    )


def contract_now(policy: Policy, cfg: Config) -> Contract:
    """The contract `kernel.json` publishes for `policy` under the running config."""
    return contract_of(policy, jail=cfg.jail, limits=published_limits(cfg), verdicts=cfg.verdicts)


_encoder: Final = msgspec.json.Encoder()


def encoded(c: Contract) -> bytes:
    """The bytes the store keeps of a contract told (the same contract always encodes the same)."""
    return _encoder.encode(c)


def changes(old: Any, new: Any, prefix: str = "") -> list[ContractChange]:
    """Each value that differs, by dotted key, in `new`'s order and then the keys only `old` has; objects are
    compared member by member, anything else (an array, a number, an object against null) as one value."""
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[ContractChange] = []
        for k in [*new, *(k for k in old if k not in new)]:
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(ContractChange(key=key, new=new[k]))
            elif k not in new:
                out.append(ContractChange(key=key, old=old[k]))
            else:
                out += changes(old[k], new[k], key)
        return out
    return [ContractChange(key=prefix, old=old, new=new)]


def value_text(v: Any) -> str:
    """A value as a notice shows it: its JSON, cut to VALUE_CHARS; `(none)` where the contract had no such key."""
    if v is msgspec.UNSET:
        return "(none)"
    text = json.dumps(v, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."


def change_text(c: ContractChange) -> str:
    """`policy.max_minutes 60 -> 30`."""
    return f"{c.key} {value_text(c.old)} -> {value_text(c.new)}"


def changes_text(found: list[ContractChange]) -> str:
    """The first SHOWN changes, `; `-separated, and how many more there are."""
    shown = "; ".join(change_text(c) for c in found[:SHOWN])
    more = len(found) - SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def notice_text(found: list[ContractChange]) -> str:
    return f"This workspace's contract changed since the kernel's last answer or wake here: {changes_text(found)}."


def notice(told: bytes | None, now: bytes) -> ContractChanged | None:
    """What to tell with the next answer or wake, given the contract last told (None: never: nothing is told,
    the agent reads kernel.json) and the contract now (both `encoded`); None when nothing changed."""
    if told is None or told == now:
        return None
    found = changes(msgspec.json.decode(told), msgspec.json.decode(now))
    if not found:  # the same contract encoded otherwise (members reordered by another release)
        return None
    return ContractChanged(text=notice_text(found), changes=tuple(found))
