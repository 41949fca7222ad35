"""kernels/layout_choice.py: the fastest layout is measured once per host and remembered."""

from __future__ import annotations

import json

from kernels import layout_choice, native


def test_measures_once_picks_the_fastest_and_remembers(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_memo", {})
    timed = []

    def time_layout(name: str) -> float:
        timed.append(name)
        return {"a": 2.0, "b": 1.0}[name]

    assert layout_choice.fastest_layout("fmt", ["a", "b"], time_layout) == "b"
    assert timed == ["a", "b"] * layout_choice.ROUNDS  # in turn, round after round
    timed.clear()
    table = json.loads((tmp_path / "native" / "layouts.json").read_text())
    assert list(table.values()) == ["b"] and list(table)[0].startswith("fmt|")
    # A new process (empty memo) reads the recorded choice instead of measuring again.
    monkeypatch.setattr(layout_choice, "_memo", {})
    assert layout_choice.fastest_layout("fmt", ["a", "b"], time_layout) == "b"
    assert timed == []
    # A recorded choice that is no longer a candidate is measured again.
    monkeypatch.setattr(layout_choice, "_memo", {})
    assert layout_choice.fastest_layout("fmt", ["a"], time_layout) == "a"


def test_each_candidate_keeps_its_best_round(tmp_path, monkeypatch):
    """A burst of load in one round (b's first timing) does not decide: each candidate's best
    time is compared."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_memo", {})
    times = {"a": iter([2.0, 2.1, 2.0]), "b": iter([9.0, 1.0, 1.1])}
    assert layout_choice.fastest_layout("fmt", ["a", "b"], lambda n: next(times[n])) == "b"


def test_each_timed_shape_keeps_its_best_round(tmp_path, monkeypatch):
    """A candidate timed per shape (M = 1, M = 8) keeps each shape's best round: b's bursts fall
    on a different shape each round, so every round's sum loses to a's (9.9, 10.9, 18 > 3),
    while its best M = 1 and best M = 8 (0.9 + 1.9) beat a's 1 + 2."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_memo", {})
    times = {"a": iter([(1.0, 2.0)] * 3), "b": iter([(0.9, 9.0), (9.0, 1.9), (9.0, 9.0)])}
    assert layout_choice.fastest_layout("fmt", ["a", "b"], lambda n: next(times[n])) == "b"


def test_decode_passes_time_each_shape_apart(monkeypatch):
    """time_decode_passes returns M = 1's and M = 8's best repetition each: a burst in one
    shape's pass (a fake clock the passes advance) spoils only that shape's repetition."""
    import time

    import torch

    from kernels.quant_int4 import pack

    packed = pack(torch.randn(64, 64), None, torch.device("cpu"), "cpu")
    clock = [0.0]
    # Cost of one call at M = 1 and at M = 8: the warm-up's, then each repetition's.
    costs = [(1.0, 8.0), (1.0, 100.0), (50.0, 8.0), (3.0, 9.0)]
    m1_calls = [0]

    def forward(x, layer):
        if x.shape[0] == 1:
            m1_calls[0] += 1
        rep = m1_calls[0] // 2  # the warm-up's one M = 1 call, then 2 copies a repetition
        clock[0] += costs[rep][0 if x.shape[0] == 1 else 1]

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    m1, m8 = layout_choice.time_decode_passes(packed, forward, copies=2, reps=3)
    assert (m1, m8) == (2.0, 16.0)  # best M = 1 (rep 1) and best M = 8 (rep 2), 2 copies each


def test_unwritable_cache_still_chooses(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TANDEM_HOME", str(blocker))
    monkeypatch.setattr(layout_choice, "_memo", {})
    assert layout_choice.fastest_layout("fmt", ["a", "b"], lambda n: {"a": 1.0, "b": 3.0}[n]) == "a"


def test_a_threaded_process_measures_its_own_choice(monkeypatch):
    """A threaded native kernel may beat aten's where the serial one did not: the thread counts
    (the pool's and torch's, which aten's kernel runs on) are part of the key where one is
    above 1, and the serial key (and the choices recorded under it) stays."""
    import torch

    from kernels import native

    monkeypatch.setattr(native, "_threads", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    serial = layout_choice.host_key("int4")
    assert "threads" not in serial
    monkeypatch.setattr(native, "_threads", 2)
    assert layout_choice.host_key("int4") == serial + "|threads 2 torch 1"
    # aten's kernel runs on torch's threads: a choice made with them is not a decode worker's.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert layout_choice.host_key("int4") == serial + "|threads 2 torch 2"


def test_a_changed_native_kernel_is_measured_again(monkeypatch):
    """The key names the native sources' digest: a choice made against an earlier kernel is
    not reused for a new one."""
    from kernels import native

    before = layout_choice.host_key("int4")
    assert f"native {native.source_digest()[:12]}" in before
    monkeypatch.setattr(native, "source_digest", lambda: "0" * 64)
    changed = layout_choice.host_key("int4")
    assert changed != before
    # So does the timing method's version: choices an earlier method made are measured again.
    monkeypatch.setattr(layout_choice, "TIMING", layout_choice.TIMING + 1)
    assert layout_choice.host_key("int4") != changed


def test_a_model_beyond_the_cache_has_a_choice_of_its_own(tmp_path, monkeypatch):
    """Weights streamed from memory can change the winner: inside model_weights of a model
    larger than the last-level cache, the choice has a key (and a measurement) of its own."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_memo", {})
    monkeypatch.setattr(layout_choice, "last_level_cache_bytes", lambda: 1000)
    assert not layout_choice.streams_weights(1.0)
    with layout_choice.model_weights(999):
        assert not layout_choice.streams_weights(1.0)
    with layout_choice.model_weights(2000):
        assert layout_choice.streams_weights(1.0) and not layout_choice.streams_weights(0.25)
    assert layout_choice.fastest_layout("fmt", ["a", "b"], lambda n: {"a": 1.0, "b": 2.0}[n]) == "a"
    assert layout_choice.fastest_layout("fmt", ["a", "b"], lambda n: {"a": 2.0, "b": 1.0}[n],
                                        variant="streamed") == "b"
    table = json.loads((tmp_path / "native" / "layouts.json").read_text())
    plain = layout_choice.host_key("fmt")
    assert table == {plain: "a", plain + "|streamed": "b"}


def test_int4_times_a_streamed_model_over_matrices_beyond_the_cache(tmp_path, monkeypatch):
    """The int4 choice for a model that outgrows the cache is timed over distinct copies of a
    2048 x 2048 layer filling twice the cache, each layout's real kernel, and recorded apart."""
    import torch

    from kernels import quant_int4

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_memo", {})
    monkeypatch.setattr(layout_choice, "last_level_cache_bytes", lambda: 4 << 20)
    monkeypatch.setattr(native, "amx_available", lambda level=None: False)  # tiles: test_int4_amx.py
    passes = []
    real = quant_int4._time_passes
    monkeypatch.setattr(quant_int4, "_time_passes",
                        lambda layout, n, k, copies, reps: passes.append((layout, n, k, copies))
                        or real(layout, n, k, copies, reps))
    with layout_choice.model_weights(10 ** 9):
        chosen = quant_int4.default_layout(torch.device("cpu"))
    assert chosen in ("q4_1", "cpu")
    assert passes == [("q4_1", 2048, 2048, 4), ("cpu", 2048, 2048, 4)] * layout_choice.ROUNDS
    table = json.loads((tmp_path / "native" / "layouts.json").read_text())
    assert table == {layout_choice.host_key("int4") + "|streamed": chosen}
