"""Prefix-aware placement (coordinator/placement.py): the cost of load against cached-prefix
overlap, on worker snapshots alone."""

from __future__ import annotations

import pytest

from coordinator import placement
from coordinator.convert import WorkerLoad
from coordinator.placement import Prompt, choose_decode, choose_prefill, decode_cost, place
from coordinator.registry import WorkerSnapshot
from common.block_hash import block_hashes

BS = 16
PROMPT = list(range(1000, 1640))  # 640 tokens: 40 blocks, 39 of them cacheable
SHORT = dict(prefill_threshold=64, default_budget=512)


def cached(prompt, blocks, block_size=BS):
    """The hashes a worker publishes after caching the first `blocks` blocks of `prompt`."""
    return frozenset(block_hashes(prompt[:blocks * block_size], block_size))


def worker(wid, role="decode", blocks=1000, used=0, running=0, queued=0, hashes=frozenset(),
           layout="L", backend="zmq", assigned=0, assigned_tokens=0, block_size=BS, budget=512,
           token_s=0.0, released=0, released_requests=0):
    load = WorkerLoad(num_blocks=blocks, num_free_blocks=blocks - used, num_running=running,
                      queued_prefill_tokens=queued, max_num_batched_tokens=budget,
                      block_size=block_size, prefill_token_seconds=token_s, cached_hashes=hashes)
    return WorkerSnapshot(wid, role, backend, layout, load, assigned, assigned_tokens, released,
                          released_requests)


def decode_id(ws, prompt=PROMPT):
    return choose_decode(ws, Prompt(prompt))[0].worker_id


# ---- overlap -----------------------------------------------------------------------------------

def test_overlap_counts_leading_blocks_only_and_never_the_last_token():
    prompt = Prompt(PROMPT)
    assert prompt.overlap(worker("d", hashes=cached(PROMPT, 32))) == 32
    assert prompt.overlap(worker("d")) == 0
    # Blocks 1..9 without block 0 are no prefix (chain hashes: each names its whole prefix).
    tail = frozenset(block_hashes(PROMPT[:10 * BS], BS)[1:])
    assert prompt.overlap(worker("d", hashes=tail)) == 0
    # The same tokens at another position hash differently.
    shifted = cached([7] * BS + PROMPT, 10)
    assert prompt.overlap(worker("d", hashes=shifted)) == 0
    # A prompt of exactly two blocks, both cached: the last token is always computed, so the
    # second block is not served from the cache.
    two = PROMPT[:2 * BS]
    assert Prompt(two).overlap(worker("d", hashes=cached(two, 2))) == 1
    assert Prompt(two).cacheable_blocks(BS) == 1


def test_prompt_is_hashed_once_per_block_size_and_only_when_someone_caches(monkeypatch):
    calls = []

    def counting(ids, bs, salt=b""):
        calls.append(bs)
        return block_hashes(ids, bs, salt)

    monkeypatch.setattr(placement, "block_hashes", counting)
    cold = [worker("d1"), worker("d2"), worker("p1", "prefill"), worker("p2", "prefill")]
    place(cold, PROMPT, **SHORT)
    assert calls == []
    ws = [worker("d1", hashes=cached(PROMPT, 4)), worker("d2", hashes=cached(PROMPT, 8)),
          worker("d3", hashes=cached(PROMPT, 2, 32), block_size=32),
          worker("p1", "prefill", hashes=cached(PROMPT, 3)),
          worker("p2", "prefill", hashes=cached(PROMPT, 1))]
    got = place(ws, PROMPT, **SHORT)
    assert sorted(calls) == [16, 32]
    assert (got.decode.worker_id, got.overlap_blocks) == ("d2", 8)
    assert (got.prefill.worker_id, got.prefill_overlap_blocks) == ("p1", 3)


def test_workers_of_another_block_size_are_matched_with_their_own():
    d32 = worker("d32", block_size=32, hashes=cached(PROMPT, 15, 32))
    d16 = worker("d16", hashes=cached(PROMPT, 20))  # 320 tokens against d32's 480
    prompt = Prompt(PROMPT)
    assert prompt.overlap(d32) == 15 and prompt.overlap(d16) == 20
    assert decode_id([d16, d32]) == "d32"


# ---- the decode worker -----------------------------------------------------------------------

def test_overlap_wins_over_a_small_load_difference():
    hot = worker("d1", used=60, running=3, hashes=cached(PROMPT, 32))
    cold = worker("d2", used=20, running=1)
    got = place([cold, hot, worker("p1", "prefill")], PROMPT, **SHORT)
    assert got.decode.worker_id == "d1" and got.overlap_blocks == 32
    assert got.prefill.worker_id == "p1"
    assert got.reason == ("remote prefill on p1 (0 blocks cached there), "
                          "32 of 39 blocks cached on d1")


def test_a_big_load_difference_wins_over_a_small_overlap():
    busy = worker("d1", used=400, running=12, hashes=cached(PROMPT, 2))
    idle = worker("d2", used=50, running=2)
    assert decode_id([busy, idle]) == "d2"
    # The break-even point: a block of overlap is worth W + 1 = 2 blocks of other KV.
    n = len(PROMPT)
    assert decode_cost(busy, n, 2) - decode_cost(idle, n, 0) == (350 - 2 * 2) * BS
    assert decode_id([worker("d1", used=50 + 2 * 20 - 1, hashes=cached(PROMPT, 20)),
                      worker("d2", used=50)]) == "d1"
    assert decode_id([worker("d1", used=50 + 2 * 20 + 1, hashes=cached(PROMPT, 20)),
                      worker("d2", used=50)]) == "d2"


def test_a_burst_on_one_hot_prefix_spills_over_before_heartbeats_show_it():
    """Requests sent since the last heartbeat count as large as this one: the worker holding
    the prefix takes a few, not all."""
    assigned = {"d1": 0, "d2": 0}
    hot = cached(PROMPT, 32)
    chosen = []
    for _ in range(12):
        ws = [worker("d1", used=20, hashes=hot, assigned=assigned["d1"]),
              worker("d2", used=20, assigned=assigned["d2"])]
        wid = decode_id(ws)
        assigned[wid] += 1
        chosen.append(wid)
    assert chosen[:4] == ["d1"] * 4
    assert "d2" in chosen and chosen.count("d1") > chosen.count("d2")


def test_a_worker_whose_request_just_ended_is_not_busy_by_its_last_status():
    """Its status (up to a heartbeat old) still counts the ended request's blocks: without
    released_blocks the next request would join the other worker's running one."""
    ended = worker("d1", used=40, running=1, released=40, released_requests=1)
    busy = worker("d2", used=20, running=1, assigned=1)
    assert decode_id([ended, busy]) == "d1"
    assert decode_id([worker("d1", used=40, running=1), busy]) == "d2"
    # A request placed there since counts as unseen: the status's running one is the ended
    # one, not it (else a second request would find the worker as empty as the first did).
    again = worker("d1", used=40, running=1, released=40, released_requests=1, assigned=1)
    assert decode_cost(again, 64, 0) > decode_cost(worker("d1"), 64, 0)
    # Never below empty (a status taken after some of them ended already).
    assert decode_cost(worker("d1", used=10, released=40), 64, 0) == decode_cost(worker("d1"), 64, 0)


def test_a_worker_without_room_loses_to_one_with_room_whatever_it_caches():
    full = worker("d1", blocks=100, used=90, hashes=cached(PROMPT, 39))
    roomy = worker("d2", blocks=1000, used=900)
    assert decode_id([full, roomy]) == "d2"


def test_the_overlap_weight_tunes_cache_against_load():
    hot = worker("d1", used=100, hashes=cached(PROMPT, 30))
    cold = worker("d2", used=50)
    assert place([hot, cold], PROMPT, **SHORT).decode.worker_id == "d1"
    got = place([hot, cold], PROMPT, **SHORT, overlap_weight=0.0)
    assert got.decode.worker_id == "d2"


# ---- the prefill worker ------------------------------------------------------------------------

def test_prefill_overlap_weighed_against_queued_tokens():
    d = worker("d")
    holder = worker("p1", "prefill", queued=100, hashes=cached(PROMPT, 32))
    idle = worker("p2", "prefill")
    assert choose_prefill([idle, holder], d, Prompt(PROMPT))[0].worker_id == "p1"
    # 1000 queued tokens (62.5 blocks) ahead outweigh 32 cached blocks.
    swamped = worker("p1", "prefill", queued=1000, hashes=cached(PROMPT, 32))
    assert choose_prefill([idle, swamped], d, Prompt(PROMPT))[0].worker_id == "p2"
    # What we sent it since its heartbeat counts as queued too.
    sent = worker("p1", "prefill", queued=100, assigned_tokens=900, hashes=cached(PROMPT, 32))
    assert choose_prefill([idle, sent], d, Prompt(PROMPT))[0].worker_id == "p2"


def test_exclusions_are_respected_even_for_the_best_cache():
    d = worker("d")
    ws = [worker("p1", "prefill", hashes=cached(PROMPT, 39)), worker("p2", "prefill")]
    chosen, overlap = choose_prefill(ws, d, Prompt(PROMPT), exclude={"p1"})
    assert chosen.worker_id == "p2" and overlap == 0
    assert choose_prefill(ws, d, Prompt(PROMPT), exclude={"p1", "p2"}) is None


@pytest.mark.parametrize("mismatch", [dict(layout="other"), dict(backend="shm")])
def test_only_compatible_prefill_workers_are_chosen_whatever_they_cache(mismatch):
    d = worker("d")
    alien = worker("p1", "prefill", hashes=cached(PROMPT, 39), **mismatch)
    got = place([d, alien, worker("p2", "prefill", queued=500)], PROMPT, **SHORT)
    assert got.prefill.worker_id == "p2"
    got = place([d, alien], PROMPT, **SHORT)
    assert got.prefill is None and got.reason == "no compatible prefill worker"


# ---- conditional disaggregation ----------------------------------------------------------------

def test_the_uncached_part_decides_local_or_remote():
    ws = [worker("p1", "prefill")]
    # 38 of 40 blocks cached: 32 tokens left to compute, under the threshold of 64.
    got = place([worker("d1", hashes=cached(PROMPT, 38))] + ws, PROMPT, **SHORT)
    assert got.prefill is None and got.overlap_blocks == 38
    assert got.reason == ("short uncached part (32 tokens), decode worker has spare budget; "
                          "38 of 39 blocks cached on d1")
    # 30 cached: 160 tokens left, over the threshold: remote.
    got = place([worker("d1", hashes=cached(PROMPT, 30))] + ws, PROMPT, **SHORT)
    assert got.prefill.worker_id == "p1"
    assert got.reason.endswith("30 of 39 blocks cached on d1")
    # The uncached part must also fit the decode worker's spare budget.
    busy = worker("d1", running=490, hashes=cached(PROMPT, 38))
    assert place([busy] + ws, PROMPT, **SHORT).prefill.worker_id == "p1"


def test_measured_prompt_costs_send_a_short_prompt_where_it_is_cheaper():
    """local_prefill_pays: a decode worker whose format is much slower at prompts than the
    prefill worker's (a 1B model: int4 20 ms a token against bf16 8) sends even a short prompt
    remote; one about as fast (the 135M: 3.8 against 3.9) keeps it; each side's queue of
    prompt tokens counts at its own cost; an unreported cost leaves the token rule alone."""
    short = dict(hashes=cached(PROMPT, 38))  # 32 tokens to compute
    assert place([worker("d1", token_s=0.020, **short), worker("p1", "prefill", token_s=0.008)],
                 PROMPT, **SHORT).prefill.worker_id == "p1"
    assert place([worker("d1", token_s=0.0038, **short), worker("p1", "prefill", token_s=0.0039)],
                 PROMPT, **SHORT).prefill is None
    # 1.5x the prefill worker's time still pays; more does not.
    assert place([worker("d1", token_s=0.012, **short), worker("p1", "prefill", token_s=0.008)],
                 PROMPT, **SHORT).prefill is None
    # (0 + 32) * 20 <= 1.5 * (64 + 32) * 8: behind 64 queued tokens (reported, or sent by
    # this coordinator since), the prefill worker is the slower way.
    for queue in (dict(queued=64), dict(assigned_tokens=64)):
        assert place([worker("d1", token_s=0.020, **short), worker("p1", "prefill", token_s=0.008, **queue)],
                     PROMPT, **SHORT).prefill is None
    # The decode worker's own queue of local prefills counts too: (32 + 32) * 12 > 1.5 * 32 * 8.
    assert place([worker("d1", token_s=0.012, assigned_tokens=32, **short),
                  worker("p1", "prefill", token_s=0.008)], PROMPT, **SHORT).prefill.worker_id == "p1"
    for unknown in ((0.0, 0.008), (0.020, 0.0)):
        got = place([worker("d1", token_s=unknown[0], **short),
                     worker("p1", "prefill", token_s=unknown[1])], PROMPT, **SHORT)
        assert got.prefill is None


def test_a_local_prefill_may_stall_a_busy_decode_worker_s_streams_only_so_long():
    """local_prefill_stall_fits: on a decode worker with running streams, a short prompt is
    prefilled there only if its tokens at the worker's cost delay those streams by at most
    max_stall_s; an idle worker stalls no one; an unknown cost leaves the token rule."""
    short = dict(hashes=cached(PROMPT, 38))  # 32 tokens to compute
    prefill = worker("p1", "prefill", token_s=0.0039)
    # The 135M: 32 * 3.8 ms = 122 ms. Local on an idle worker, whatever the cap.
    idle = worker("d1", token_s=0.0038, **short)
    assert place([idle, prefill], PROMPT, **SHORT, max_stall_s=0.0).prefill is None
    # Busy (requests this coordinator has running there): over a 100 ms cap it goes remote,
    # under a 200 ms one it stays; with no cap (the default) it stays.
    d1 = worker("d1", token_s=0.0038, assigned=2, **short)
    assert place([d1, prefill], PROMPT, **SHORT, max_stall_s=0.1).prefill.worker_id == "p1"
    assert place([d1, prefill], PROMPT, **SHORT, max_stall_s=0.2).prefill is None
    assert place([d1, prefill], PROMPT, **SHORT).prefill is None
    # Local prefills already sent there count: 20 queued + 32 tokens at 3.8 ms = 198 ms (the
    # prefill worker's own queue of 64 keeps local_prefill_pays true either way).
    d1 = worker("d1", token_s=0.0038, assigned=2, assigned_tokens=20, **short)
    queued = worker("p1", "prefill", token_s=0.0039, queued=64)
    assert place([d1, queued], PROMPT, **SHORT, max_stall_s=0.15).prefill.worker_id == "p1"
    assert place([d1, queued], PROMPT, **SHORT, max_stall_s=0.2).prefill is None
    # The worker's last heartbeat still counting a request this coordinator has seen finish
    # (a lone client's previous one) is no stream to stall.
    d1 = worker("d1", token_s=0.0038, running=1, assigned=0, **short)
    assert place([d1, prefill], PROMPT, **SHORT, max_stall_s=0.1).prefill is None
    # No prefill worker to send it to: local all the same.
    d1 = worker("d1", token_s=0.0038, assigned=3, **short)
    assert place([d1], PROMPT, **SHORT, max_stall_s=0.0).prefill is None
    # A cost not yet measured: the token rule alone.
    d1 = worker("d1", token_s=0.0, assigned=3, **short)
    assert place([d1, prefill], PROMPT, **SHORT, max_stall_s=0.0).prefill is None


def test_a_request_scoring_its_prompt_is_prefilled_remotely_whenever_it_can_be():
    short = dict(hashes=cached(PROMPT, 38))  # 32 tokens: local by the token rule
    ws = [worker("d1", **short), worker("p1", "prefill")]
    assert place(ws, PROMPT, **SHORT).prefill is None
    assert place(ws, PROMPT, **SHORT, scored=True).prefill.worker_id == "p1"
    assert place(ws[:1], PROMPT, **SHORT, scored=True).prefill is None  # no prefill worker


def test_colocated_reason_names_the_cache():
    got = place([worker("c1", "colocated", hashes=cached(PROMPT, 10))], PROMPT, **SHORT)
    assert got.prefill is None and got.reason == "colocated worker, 10 of 39 blocks cached on c1"


def test_a_tenant_prompt_overlaps_only_that_tenant_s_cached_blocks():
    """Routing scores a prompt with its tenant's salt: another tenant's cached blocks for the
    same tokens are no overlap (they would be a miss on the worker too)."""
    ids = list(range(1, 66))
    mine = worker("d1", hashes=frozenset(block_hashes(ids[:-1], BS, b"salt-a")))
    assert placement.Prompt(ids, b"salt-a").overlap(mine) == 64 // BS
    assert placement.Prompt(ids, b"salt-b").overlap(mine) == 0
    assert placement.Prompt(ids).overlap(mine) == 0


def test_embeddings_go_to_the_least_loaded_prefill_worker_else_a_decode_worker():
    from coordinator.placement import choose_embedder

    inputs = [list(range(1, 40))]
    d1, p1, p2 = worker("d1"), worker("p1", "prefill", queued=64), worker("p2", "prefill")
    assert choose_embedder([d1, p1, p2], inputs).worker_id == "p2"
    assert choose_embedder([d1, p1], inputs).worker_id == "p1"
    assert choose_embedder([d1], inputs).worker_id == "d1"
    assert choose_embedder([], inputs) is None
