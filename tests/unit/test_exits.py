"""kernel.core.exits: the one exit kind -> state table covers every kind a wrapper or backend writes."""

from __future__ import annotations

from channel.lifecycle import TaskEvent
from kernel.backends import jobscript
from kernel.backends.slurm import backend as slurm
from kernel.core import exits
from kernel.node import wrapper as W


def _kinds(module: object) -> set[str]:
    return {v for k, v in vars(module).items() if k.startswith("KIND_") and isinstance(v, str)}


def test_every_written_kind_has_a_row() -> None:
    written = _kinds(W) | _kinds(jobscript) | _kinds(slurm) | {k for _, k in slurm.KIND_OF_STATE.values()}
    missing = written - set(exits.KINDS)
    assert not missing, f"exit kinds without a row in kernel.core.exits.KINDS: {sorted(missing)}"


def test_only_exit_zero_is_success() -> None:
    assert exits.outcome("exited", 0, None).state == "COMPLETED"
    for kind in exits.KINDS:
        assert exits.outcome(kind, 1, None).state != "COMPLETED", kind
    unknown = exits.outcome("from-a-newer-wrapper", 0, "SIGKILL")
    assert (unknown.event, unknown.state, unknown.hint) == (TaskEvent.FINISH, "FAILED", exits.HINT_WRAPPER)


def test_signal_names_become_numbers_only_where_kept() -> None:
    assert exits.outcome("signaled", 137, "SIGKILL").signal == 9
    assert exits.outcome("signaled", 137, "SIGKILL").hint == "the command was killed by SIGKILL"
    assert exits.outcome("exited", 3, "SIGKILL").signal is None
    assert exits.outcome("lost", None, "SIGNOPE").signal is None
