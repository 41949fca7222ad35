"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest

from engine.speculative import SpeculativeDecoder


@pytest.fixture
def open_cost_gate(monkeypatch):
    """Speculation's cost gate pinned open (a drafted step costs what a plain one does), so
    which drafts are made follows from acceptance alone, never from this host's timings
    (engine/draft_length.py); the gate itself is tested with given step times."""
    monkeypatch.setattr(SpeculativeDecoder, "cost_ratio", property(lambda self: 1.0))
