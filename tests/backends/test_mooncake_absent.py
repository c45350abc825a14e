"""The Mooncake backend's memory of keys just answered absent (no master needed)."""

from __future__ import annotations

import pytest

import kvflow.backends.mooncake.absent as absent
from kvflow.backends.mooncake.absent import RecentAbsence


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(absent.time, "monotonic", lambda: now[0])
    return now


def test_an_absent_answer_serves_one_put_within_its_freshness(clock: list[float]) -> None:
    recent = RecentAbsence(fresh_s=10.0)
    recent.note(["a", "b", "c"], [False, True, False])
    clock[0] += 10.0
    assert recent.take(["a", "b", "x"]) == [True, False, False]
    assert recent.take(["a"]) == [False]  # used once
    clock[0] += 0.5
    assert recent.take(["c"]) == [False]  # 10.5 s old


def test_a_later_present_answer_overrides(clock: list[float]) -> None:
    recent = RecentAbsence()
    recent.note(["a"], [False])
    recent.note(["a"], [True])
    assert recent.take(["a"]) == [False]


def test_the_oldest_answers_are_dropped_beyond_the_limit(clock: list[float]) -> None:
    recent = RecentAbsence(limit=2)
    recent.note(["a", "b"], [False, False])
    clock[0] += 1
    recent.note(["a"], [False])  # asked again: now the newest
    recent.note(["c"], [False])
    assert recent.take(["a", "b", "c"]) == [True, False, True]
