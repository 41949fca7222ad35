"""The native kernels' build cache (kernels/native.py): a directory only this user can write,
and a manifest next to each library saying what it was built from and what its bytes hash to.

Why: a cached library is code that every tandem process of this user loads. Before this, any
file with the right name ran, so whoever could write the directory ran code in every worker.

    $TANDEM_HOME/native/                0700 and ours, else refused for a private temp directory
        tandem_avx2_<key[:16]>.so       the library
        tandem_avx2_<key[:16]>.json     {"key": KEY, "sha256": SHA256 of the .so's bytes}

    KEY = sha256 of the sources, the flags and the compiler's version (native._build)

A library is used only if its manifest names the full KEY and its bytes hash to the recorded
sha256; anything else (bytes changed after the build, a library cut short, no manifest, another
build's manifest) is built again. The manifest cannot stop someone who can write the directory
(they could rewrite both); the directory check does that, and the manifest catches a library
changed after it was written. Both are written to temporary names and renamed into place, so
builders running at once never show a reader half a file; a reader that meets one builder's
library with another's manifest builds once more.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger("tandem.kernels")


def trusted_dir(root: Path) -> Path:
    """`root`, created 0700 if missing, when only this user can write it; otherwise (another
    owner, group- or world-writable, not a directory, not creatable) a private temp directory
    for this process, with one warning saying why."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(root)
    except OSError as e:
        return _private_dir(f"{root} cannot be created ({e.strerror})")
    if not stat.S_ISDIR(st.st_mode):
        return _private_dir(f"{root} is not a directory (a symlink is not followed)")
    if st.st_uid != os.getuid():
        return _private_dir(f"{root} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return _private_dir(f"{root} is writable by others (mode {stat.S_IMODE(st.st_mode):o}; "
                            f"`chmod 700 {root}` if nobody else wrote there)")
    return root


@functools.lru_cache(maxsize=None)
def _private_dir(why: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="tandem-native-"))  # 0700, ours
    log.warning("native kernel cache refused: %s; building into %s for this process only",
                why, path)
    return path


def manifest_path(library: Path) -> Path:
    return library.with_suffix(".json")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verified(library: Path, key: str) -> bool:
    """Whether `library` is the build of `key` that its manifest recorded, byte for byte."""
    if not library.exists():
        return False
    try:
        manifest = json.loads(manifest_path(library).read_text())
        ok = manifest["key"] == key and manifest["sha256"] == sha256_file(library)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        log.warning("cached native library %s does not match its manifest (changed after it "
                    "was built, or built by another version); building it again", library)
    return ok


def install(built: Path, library: Path, key: str) -> None:
    """Move the freshly built `built` to `library` and record its manifest beside it."""
    manifest = json.dumps({"key": key, "sha256": sha256_file(built)})
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=library.parent)
    with os.fdopen(fd, "w") as f:
        f.write(manifest)
    os.replace(built, library)
    os.replace(tmp, manifest_path(library))
