"""kernels/native_cache.py: a cached native library loads only from a directory only we can
write and only while its bytes match its manifest; a library the loader refuses falls back to
aten's kernels with one log line."""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest

from kernels import native, native_cache


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "native"


def test_the_cache_is_private_and_a_tampered_library_is_built_again(home, caplog):
    built = native._build("default")
    assert built.parent == home and stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert native_cache.manifest_path(built).exists()
    good = built.read_bytes()
    assert native._build("default") == built and built.read_bytes() == good  # cached: no rebuild
    built.write_bytes(good[:-64] + b"\xcc" * 64)  # changed after the build
    with caplog.at_level(logging.WARNING, logger="tandem.kernels"):
        again = native._build("default")
    assert again == built and built.read_bytes() == good  # built again, not loaded as found
    assert "does not match its manifest" in caplog.text


def test_a_library_without_a_manifest_is_not_trusted(home):
    built = native._build("default")
    native_cache.manifest_path(built).unlink()
    assert not native_cache.verified(built, "any key")


def test_a_cache_directory_others_can_write_is_refused(home, caplog):
    home.mkdir(parents=True)
    home.chmod(0o777)
    native_cache._private_dir.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tandem.kernels"):
        built = native._build("default")
    assert built.parent != home and not list(home.iterdir())
    assert stat.S_IMODE(os.stat(built.parent).st_mode) == 0o700
    assert "writable by others" in caplog.text and str(home) in caplog.text
    shutil.rmtree(built.parent)


def test_a_library_the_loader_refuses_falls_back_to_aten(monkeypatch, tmp_path, caplog):
    def refuse(path, *args, **kwargs):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(native, "_build", lambda level: tmp_path / "tandem_default_x.so")
    monkeypatch.setattr(native.ctypes, "CDLL", refuse)
    native.library.cache_clear()
    native.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.kernels"):
            assert native.available() is False
            assert native.available() is False
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "using aten's" in lines[0] and "failed to map" in lines[0]
    finally:
        native.library.cache_clear()
        native.available.cache_clear()
