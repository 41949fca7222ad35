"""The response cache's settings (coordinator/response_cache.py), parsed from the coordinator's
`--response-cache` flag:

    exact                              identical requests only
    semantic                           also a paraphrased last user turn, at DEFAULT_THRESHOLD
    semantic:threshold=0.97            ... at that cosine similarity or above
    semantic:model=NAME,threshold=T    ... the turn embedded by model NAME (an embedding model
                                       served beside the chat models) instead of the chat
                                       model itself; T is required: DEFAULT_THRESHOLD was
                                       measured for the chat model's own embedding
    semantic:model=...,match=literals  a hit needs the same numbers, names and symbols only,
                                       not the same words too (match=words, the default;
                                       coordinator/turn_terms.py): for an embedding model
                                       that separates paraphrases from near-misses itself
                                       (refused without model=)
    exact:entries=256,bytes=16000000   the bounds (both modes; the LRU drops beyond either)

Off unless the flag is given. Its own module (not response_cache.py) so that
coordinator/config.py can hold it without importing the request flow.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("exact", "semantic")
MATCHES = ("words", "literals")  # what a semantic hit's turns must share (TurnTerms)
# The cosine at and above which a last user turn counts as the same question, when the rules on
# the turns' words (coordinator/turn_terms.py) allow it. Measured on the default model
# (SmolLM2-135M-Instruct; the turn embedded as the cache does, PromptEOL's last position,
# coordinator/response_cache.py EMBED_TEMPLATE; README "Response cache", `python -m
# benchmarks.bench_semantic_cache`): unrelated questions reached 0.960 with each other,
# paraphrases 0.943-0.999, and near-misses 0.877-0.999, so the embedding alone separates no
# near-miss, and the word rules do that work. 0.97 sits above every unrelated pair; there 7
# of 32 paraphrases hit (the same words again: contractions, case, punctuation) and none of
# 32 near-misses. With numbers and names alone (the rule before stop 45), 0.98 answered 7 of 15
# near-misses that differ in another word.
DEFAULT_THRESHOLD = 0.97
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class ResponseCacheConfig:
    mode: str = "exact"  # "exact" | "semantic"
    threshold: float = DEFAULT_THRESHOLD  # semantic: least cosine similarity of a hit, -1..1
    max_entries: int = DEFAULT_MAX_ENTRIES  # answers kept, at most
    max_bytes: int = DEFAULT_MAX_BYTES  # their estimated size (ResponseCache.entry_bytes), at most
    # semantic: the served model that embeds the turns; None: each request's own chat model
    embed_model: str | None = None
    match: str = "words"  # semantic: "words" | "literals" (MATCHES; TurnTerms.same_question)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"response cache mode must be one of {', '.join(MODES)}, "
                             f"got {self.mode!r}")
        if isinstance(self.threshold, bool) or not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"response cache threshold must be a cosine similarity in -1..1, "
                             f"got {self.threshold!r}")
        if self.match not in MATCHES:
            raise ValueError(f"response cache match must be one of {', '.join(MATCHES)}, "
                             f"got {self.match!r}")
        if self.embed_model is not None and (not isinstance(self.embed_model, str)
                                             or not self.embed_model.strip()):
            raise ValueError(f"response cache model must be a model name, got {self.embed_model!r}")
        if self.match == "literals" and self.embed_model is None:
            # The chat model's own embedding puts "an egg" and "an egg white" at 0.996: the
            # words rule is what keeps those apart (coordinator/turn_terms.py).
            raise ValueError("response cache match=literals needs an embedding model (model=NAME): "
                             "the chat model's own embedding does not tell questions that "
                             "differ in a word apart")
        for name in ("max_entries", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"response cache {name} must be an integer >= 1, got {value!r}")

    @property
    def semantic(self) -> bool:
        return self.mode == "semantic"

    @classmethod
    def parse(cls, spec: str) -> ResponseCacheConfig:
        """`MODE[:key=value,...]` with keys threshold, model and match (semantic only),
        entries and bytes; ValueError naming what is wrong."""
        mode, _, rest = spec.strip().partition(":")
        values: dict[str, object] = {"mode": mode}
        names = {"threshold": ("threshold", float), "model": ("embed_model", str),
                 "match": ("match", str), "entries": ("max_entries", int),
                 "bytes": ("max_bytes", int)}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in names:
                raise ValueError(f"--response-cache {spec!r}: expected key=value with keys "
                                 f"{', '.join(names)}, got {item!r}")
            field, kind = names[key.strip()]
            if field in ("threshold", "embed_model", "match") and mode != "semantic":
                raise ValueError(f"--response-cache {spec!r}: {key.strip()} applies to the "
                                 "semantic mode only")
            try:
                values[field] = kind(value.strip())
            except ValueError:
                raise ValueError(f"--response-cache {spec!r}: {key.strip()} must be "
                                 f"{'a number' if kind is float else 'an integer'}, "
                                 f"got {value.strip()!r}") from None
        if "embed_model" in values and "threshold" not in values:
            # Cosines of another model's vectors sit elsewhere: a threshold measured for the
            # chat model's embedding would be a guess for this one.
            raise ValueError(f"--response-cache {spec!r}: give a threshold with model=, "
                             f"measured for that model (python -m benchmarks.bench_semantic_cache "
                             f"--embed-model NAME prints the hit rates at each threshold); "
                             f"{DEFAULT_THRESHOLD} is the chat model's own embedding's")
        return cls(**values)  # type: ignore[arg-type]
