"""Telling an agent its contract changed: the next answer or wake the kernel writes to a workspace carries what of
its contract changed since the last one (kernel.core.contract, spec 7.4).

`told` runs in the store transaction that records the answer or the wake (their exact bytes), and records the
contract told in that same transaction: a kernel killed before the commit tells it with the next answer or wake,
one killed after it writes (or replays) the recorded bytes, so each change is told once, never lost. A
workspace never told anything is told nothing (its agent reads kernel.json): the contract then is recorded.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kernel.core import contract
from kernel.core.config import Config
from kernel.core.records import WorkspaceRow
from kernel.io.store import Store

M = TypeVar("M", bound=msgspec.Struct)


def told(store: Store, cfg: Config, ws: WorkspaceRow, msg: M) -> M:
    """(in a store transaction) `msg`, an answer or wake to `ws` (read in this transaction), with what of its
    contract changed since the last one told; the contract now recorded as told."""
    now = contract.encoded(contract.contract_now(ws.policy, cfg))
    before = store.contract_told(ws.key)
    if before == now:
        return msg
    store.set_contract_told(ws.key, now)
    notice = contract.notice(before, now)
    return msg if notice is None else msgspec.structs.replace(msg, contract_changed=notice)
