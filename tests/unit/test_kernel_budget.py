"""Budget arithmetic is exact integers; refusals say what is short and charge nothing."""

from __future__ import annotations

import pytest

from channel.decode import RequestError
from channel.messages import Launch
from kernel.core.budget import Balance, charge_sleep, gpu_hours, gpu_seconds, refund_sleep, release


def L(name: str, gpus: int = 1, minutes: int = 30, array: int = 1) -> Launch:
    return Launch(name=name, command="true", gpus=gpus, minutes=minutes, array=array)


def test_gpu_hours_round_trip_exactly() -> None:
    assert gpu_seconds(1.5) == 5400
    assert gpu_hours(5400) == 1.5
    assert gpu_seconds(0.1) * 3 == gpu_seconds(0.3)
    with pytest.raises(ValueError, match="negative"):
        gpu_seconds(-1)


def test_charge_counts_launches_not_array_tasks_and_reserves_gpu_time() -> None:
    b = Balance(launches=10, sleeps=3, gpu_s=gpu_seconds(10))
    after = charge_sleep(b, (L("a", gpus=2, minutes=30, array=4), L("b", gpus=0)))
    assert (after.launches, after.sleeps) == (8, 2)
    assert after.reserved_gpu_s == 2 * 30 * 60 * 4
    assert after.gpu_s + after.reserved_gpu_s == b.gpu_s
    assert after.to_message().reserved_gpu_hours == 4.0


def test_checkpoint_costs_one_sleep_only() -> None:
    after = charge_sleep(Balance(1, 1, 0), ())
    assert after == Balance(1, 0, 0)


@pytest.mark.parametrize(
    ("balance", "launches", "code"),
    [
        (Balance(5, 0, 10**6), (), "budget.sleeps"),
        (Balance(1, 5, 10**6), (L("a"), L("b")), "budget.launches"),
        (Balance(5, 5, 1799), (L("a", gpus=1, minutes=30),), "budget.gpu_hours"),
    ],
)
def test_refusals_name_what_is_short(balance: Balance, launches: tuple[Launch, ...], code: str) -> None:
    with pytest.raises(RequestError) as info:
        charge_sleep(balance, launches)
    assert info.value.code == code


def test_exactly_the_last_gpu_second_can_be_spent() -> None:
    after = charge_sleep(Balance(5, 5, 1800), (L("a", gpus=1, minutes=30),))
    assert after.gpu_s == 0


def test_release_refunds_what_was_not_used_and_refund_undoes_a_charge() -> None:
    b = Balance(10, 3, 7200)
    charged = charge_sleep(b, (L("a", gpus=1, minutes=60),))
    assert release(charged, 3600, 600) == Balance(9, 2, 6600, 0)
    assert release(charged, 3600, 10**9) == Balance(9, 2, 3600, 0)
    assert refund_sleep(charged, 1, 3600) == b
    with pytest.raises(ValueError, match="only 3600"):
        release(charged, 3601, 0)


def test_a_balance_never_goes_negative() -> None:
    with pytest.raises(ValueError, match="negative"):
        Balance(-1, 0, 0)
