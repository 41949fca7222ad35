"""Models already in the Hugging Face hub cache, used where they lie (nothing is copied).

Layout under the root ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; read
only by entry points), as huggingface_hub writes it:

    root/models--<org>--<name>/refs/main             the revision `main` points at
    root/models--<org>--<name>/snapshots/<rev>/...   the repo's files (links into ../../blobs)

Names:

    org/name            the snapshot directory when it is a Hugging Face model (config.json);
                        else its one GGUF file
    org/name:Q4_K_M     the GGUF file of the snapshot whose name holds the tag, in any case
    hf.co/org/name:TAG  the same (Ollama's spelling of a hub model)

`download` fills the cache through huggingface_hub where it is installed (an optional
dependency, imported only then) and the hub is reachable. Torch-free.
"""

from __future__ import annotations

import re
from pathlib import Path

from common.errors import ModelNotFoundError
from common.model_name import DEFAULT_HOST, DEFAULT_TAG, ModelName

HUB_HOSTS = ("hf.co", "huggingface.co")
# The quantization tag in a GGUF file's name (model-Q4_K_M.gguf, model.q8_0.gguf, -IQ4_XS-).
_QUANT_TAG = re.compile(r"[-_.]((?:I?Q\d(?:_[0-9A-Z]+)*)|F16|F32|BF16)(?=[-_.])", re.IGNORECASE)


class HFCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def repo_dir(self, text: str) -> Path | None:
        """The cache folder the name `text` would live in; None for a name that names no hub
        repo (no organisation, or another registry)."""
        parsed = ModelName.parse(text)
        explicit_org = "/" in text.partition(":")[0]
        if parsed is None or not explicit_org or parsed.host not in (DEFAULT_HOST, *HUB_HOSTS):
            return None
        return self.root / f"models--{parsed.namespace}--{parsed.model}"

    def where(self, text: str) -> str:
        repo = self.repo_dir(text)
        return str(repo if repo is not None else self.root)

    def names(self) -> list[str]:
        """A name for each model the cache holds, as find() takes it: `org/name` for a Hugging
        Face model (config.json) or a lone GGUF file, `org/name:TAG` for each GGUF file with a
        quantization tag in its name. From folder listings alone."""
        names = []
        for repo in sorted(self.root.glob("models--*--*")):
            org, _, model = repo.name.removeprefix("models--").partition("--")
            try:
                snapshot = _snapshot(repo)
            except ModelNotFoundError:
                continue
            if (snapshot / "config.json").is_file():
                names.append(f"{org}/{model}")
                continue
            ggufs = sorted(p for p in snapshot.rglob("*.gguf") if p.is_file())
            tags = [m.group(1) for m in map(_QUANT_TAG.search, (p.name for p in ggufs)) if m]
            names += ([f"{org}/{model}"] if len(ggufs) == 1 and not tags
                      else [f"{org}/{model}:{tag}" for tag in dict.fromkeys(tags)])
        return names

    def find(self, text: str) -> Path | None:
        """The snapshot directory or GGUF file `text` names; None if the cache has no such
        repo. ModelNotFoundError when the repo is there but holds nothing that matches."""
        repo = self.repo_dir(text)
        if repo is None or not repo.is_dir():
            return None
        snapshot = _snapshot(repo)
        parsed = ModelName.parse(text)
        tag = parsed.tag
        ggufs = sorted(p for p in snapshot.rglob("*.gguf") if p.is_file())
        if tag == DEFAULT_TAG:
            if (snapshot / "config.json").is_file():
                return snapshot
            if len(ggufs) == 1:
                return ggufs[0]
            choice = (f"; name one by its quantization tag, as {parsed.namespace}/{parsed.model}"
                      ":Q4_K_M" if ggufs else "")
            raise ModelNotFoundError(f"{snapshot} holds no config.json and {len(ggufs)} GGUF "
                                     f"files ({', '.join(p.name for p in ggufs)}){choice}")
        matching = [p for p in ggufs if tag.lower() in p.name.lower()]
        if not matching:
            raise ModelNotFoundError(f"{snapshot} holds no GGUF file with {tag!r} in its name; "
                                     f"it has: {', '.join(p.name for p in ggufs) or 'none'}")
        return matching[0]  # several (Q4_K matches Q4_K_M and Q4_K_S): the first by name

    def download(self, text: str, endpoint: str | None = None) -> Path:
        """Fetch the repo `text` names into the cache (only the GGUF files with its tag, where
        it has one) and return what find(text) then gives. endpoint: the hub's URL; None for
        huggingface_hub's own ($HF_ENDPOINT or https://huggingface.co)."""
        parsed = ModelName.parse(text)
        if self.repo_dir(text) is None:
            raise ModelNotFoundError(f"{text!r} names no Hugging Face repo (expected org/name)")
        try:
            from huggingface_hub import snapshot_download  # noqa: PLC0415 (optional)
        except ImportError:
            raise ModelNotFoundError(
                f"{text!r} names a Hugging Face repo; fetching it needs huggingface_hub (pip "
                f"install huggingface_hub), or put it in {self.root} yourself") from None
        repo = f"{parsed.namespace}/{parsed.model}"
        tag = parsed.tag
        patterns = None if tag == DEFAULT_TAG else sorted(
            {f"*{t}*.gguf" for t in (tag, tag.lower(), tag.upper())})
        try:
            snapshot_download(repo, cache_dir=self.root, allow_patterns=patterns,
                              endpoint=endpoint)
        except OSError as e:  # no connection, or nothing cached (huggingface_hub's errors)
            raise ModelNotFoundError(
                f"cannot fetch {repo} from the Hugging Face hub "
                f"({endpoint or 'huggingface.co'}): the hub is not reachable from here or has "
                f"no such repo ({str(e).splitlines()[0][:200]})") from e
        found = self.find(text)
        if found is None:
            raise ModelNotFoundError(f"the hub sent nothing for {text!r} into {self.root}")
        return found


def _snapshot(repo: Path) -> Path:
    """The revision refs/main names, else the newest snapshot."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted((p for p in (repo / "snapshots").glob("*") if p.is_dir()),
                       key=lambda p: p.stat().st_mtime)
    if not snapshots:
        raise ModelNotFoundError(f"{repo} has no snapshot: the download never finished")
    return snapshots[-1]
