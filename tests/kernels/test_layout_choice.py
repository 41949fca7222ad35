"""kernels/layout_choice.py: the fastest layout is measured once per host and remembered."""

from __future__ import annotations

import json

from kernels import layout_choice


def test_measures_once_picks_the_fastest_and_remembers(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_memo", {})
    timed = []

    def time_layout(name: str) -> float:
        timed.append(name)
        return {"a": 2.0, "b": 1.0}[name]

    assert layout_choice.fastest_layout("fmt", ["a", "b"], time_layout) == "b"
    assert timed == ["a", "b"]
    table = json.loads((tmp_path / "native" / "layouts.json").read_text())
    assert list(table.values()) == ["b"] and list(table)[0].startswith("fmt|")
    # A new process (empty memo) reads the recorded choice instead of measuring again.
    monkeypatch.setattr(layout_choice, "_memo", {})
    assert layout_choice.fastest_layout("fmt", ["a", "b"], time_layout) == "b"
    assert timed == ["a", "b"]
    # A recorded choice that is no longer a candidate is measured again.
    monkeypatch.setattr(layout_choice, "_memo", {})
    assert layout_choice.fastest_layout("fmt", ["a"], time_layout) == "a"


def test_unwritable_cache_still_chooses(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TANDEM_HOME", str(blocker))
    monkeypatch.setattr(layout_choice, "_memo", {})
    assert layout_choice.fastest_layout("fmt", ["a", "b"], lambda n: {"a": 1.0, "b": 3.0}[n]) == "a"


def test_a_threaded_process_measures_its_own_choice(monkeypatch):
    """A threaded native kernel may beat aten's where the serial one did not: the thread count
    is part of the key above 1, and the serial key (and the choices recorded under it) stays."""
    from kernels import native

    monkeypatch.setattr(native, "_threads", 1)
    serial = layout_choice.host_key("int4")
    assert "threads" not in serial
    monkeypatch.setattr(native, "_threads", 2)
    assert layout_choice.host_key("int4") == serial + "|threads 2"


def test_a_changed_native_kernel_is_measured_again(monkeypatch):
    """The key names the native sources' digest: a choice made against an earlier kernel is
    not reused for a new one."""
    from kernels import native

    before = layout_choice.host_key("int4")
    assert f"native {native.source_digest()[:12]}" in before
    monkeypatch.setattr(native, "source_digest", lambda: "0" * 64)
    assert layout_choice.host_key("int4") != before
