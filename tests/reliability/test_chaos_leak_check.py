"""The chaos leak check fails when a process cannot be asked (reliability/chaos.py
account_leaks, reliability/chaos_cluster.py ChaosCluster.leaked_blocks): an unreachable
coordinator or a worker it lists as not live is an unknown count, never 0 leaked blocks."""

from __future__ import annotations

import urllib.error

from reliability import chaos
from reliability.chaos_cluster import ChaosCluster


def _row(by_worker: dict) -> chaos.Row:
    row = chaos.Row("s", faults=1, affected=1, correct=1, recover_s=1.0)
    chaos.account_leaks(row, by_worker)
    return row


def test_an_unasked_process_fails_the_row_and_shows_in_the_table():
    clean = _row({"decode-0": 0, "prefill-0": 0})
    assert clean.ok and clean.leaked_blocks == 0 and clean.unasked == []
    leaked = _row({"decode-0": 3, "prefill-0": 0})
    assert not leaked.ok and leaked.leaked_blocks == 3
    for unknown in ({"coordinator": None}, {"coordinator": -1}, {"decode-0": 0, "prefill-0": None}, {}):
        row = _row(unknown)
        assert not row.ok and row.leaked_blocks == 0 and row.unasked, unknown
    row = _row({"decode-0": 2, "coordinator": None})
    assert row.leaked_text == "2 + ? (coordinator not asked)"
    table = chaos.table([clean, row])
    assert "| 2 + ? (coordinator not asked) |" in table and "| 2 + ? | max" in table


def _cluster(answers) -> ChaosCluster:
    cluster = object.__new__(ChaosCluster)  # no processes: only the coordinator's answers
    replies = iter(answers)

    def workers():
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    cluster.workers = workers
    return cluster


def test_leaked_blocks_names_who_could_not_be_asked():
    down = _cluster([urllib.error.URLError("refused")] * 1000)
    assert down.leaked_blocks(0.0) == {"coordinator": None}
    dead = {"worker_id": "decode-0", "alive": False, "num_blocks": 8, "num_free_blocks": 8}
    live = {"worker_id": "prefill-0", "alive": True, "num_blocks": 8, "num_free_blocks": 6}
    assert _cluster([[dead, live]]).leaked_blocks(0.0) == {"decode-0": None, "prefill-0": 2}
    # An answer with every pool full ends the wait at once, after an unreachable spell.
    full = dict(live, num_free_blocks=8)
    assert _cluster([OSError("reset"), [full]]).leaked_blocks(30.0) == {"prefill-0": 0}
