"""The stop reason of a run: one spelling, as a user sets the budget, wherever a run says why it stops."""

from __future__ import annotations

import dataclasses

import pytest

from transformer_mt.config import TrainConfig
from transformer_mt.train.budget import Budget, stop_reason


@pytest.mark.parametrize(
    ("change", "key", "text"),
    [
        ({"max_minutes": 60.0}, "max_minutes", "max_minutes=60"),  # a YAML 60 is the float 60.0
        ({"max_minutes": 60}, "max_minutes", "max_minutes=60"),
        ({"max_minutes": 0.5}, "max_minutes", "max_minutes=0.5"),
        ({"max_minutes": 1e6}, "max_minutes", "max_minutes=1000000"),
        ({"max_updates": 100}, "max_updates", "max_updates=100"),
        ({"max_epochs": 3}, "max_epochs", "max_epochs=3"),
        ({"patience": 2}, "patience", "patience=2"),
    ],
)
def test_a_stop_reason_reads_as_the_user_sets_it(change, key, text):
    assert stop_reason(dataclasses.replace(TrainConfig(), **change), key) == text


def test_the_log_line_s_bound_is_the_stop_reason_of_the_same_budget():
    """The log line's bound (`Budget.bound`) and the end record's stop reason spell a time budget alike."""
    tc = dataclasses.replace(TrainConfig(), max_updates=0, max_minutes=60.0)
    budget = Budget(tc, horizon=0, minutes_before=30.0, start=0.0, clock=lambda: 0.0)
    assert budget.bound(10) == stop_reason(tc, "max_minutes") == "max_minutes=60"
    tc = dataclasses.replace(tc, max_updates=100, max_minutes=0.0)
    assert Budget(tc, horizon=100, minutes_before=0.0, start=0.0, clock=lambda: 0.0).bound(10) == "max_updates=100"
