"""Speculative decoding's configuration: `--speculative ngram:k=N[,n=MIN..MAX]` or
`--speculative draft:MODEL,k=N`. Torch-free: the flags import it.

    ngram:k=4           prompt lookup (engine/ngram_proposer.py): up to 4 tokens copied after
                        the longest matching suffix of 3..1 tokens of the prompt + output
    ngram:k=4,n=2..4    the suffix must match 2 to 4 tokens (n=3 alone means 3..3)
    draft:smollm2,k=4   a draft model (engine/draft_proposer.py) proposes 4 tokens a step;
                        MODEL resolves as --model does (a store name or a path); it must
                        share the target's vocabulary (checked when it loads)
"""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16  # verifying more than this per step only wastes compute on a CPU
SPECULATIVE_HELP = ("speculative decoding on decode (and colocated) workers: "
                    "ngram:k=N[,n=MIN..MAX] proposes up to N tokens copied from the prompt and "
                    "output after the longest matching suffix of MIN..MAX tokens (default n=1..3); "
                    "draft:MODEL,k=N has a smaller model of the same vocabulary (a store name "
                    "or path, as --model) propose N tokens a step; off by default")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int = 4  # k: the most draft tokens verified per step
    prompt_lookup_min: int = 1  # shortest suffix that may match
    prompt_lookup_max: int = 3  # longest suffix tried first
    # method "draft" only: the draft model, as --model names one (resolved when it loads).
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative k must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 16):
            raise ValueError(f"speculative n must be a range MIN..MAX with 1 <= MIN <= MAX <= 16, "
                             f"got {lo!r}..{hi!r}")
        if self.method == "draft" and not (isinstance(self.draft_model, str)
                                           and self.draft_model.strip()):
            raise ValueError(f"speculative method draft needs a draft model, got "
                             f"{self.draft_model!r}")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"a draft model is for method draft, not {self.method!r}")

    @property
    def spec(self) -> str:
        """The flag's spelling of this config (parse_speculative(c.spec) == c)."""
        if self.method == "draft":
            return f"draft:{self.draft_model},k={self.num_speculative_tokens}"
        return (f"{self.method}:k={self.num_speculative_tokens},"
                f"n={self.prompt_lookup_min}..{self.prompt_lookup_max}")


def parse_speculative(text: str | None) -> SpeculativeConfig | None:
    """`--speculative`'s value -> its config; None or "" or "off" -> None (no speculation).
    ValueError naming what is wrong otherwise."""
    if text is None or text.strip() in ("", "off", "none"):
        return None
    method, _, rest = text.strip().partition(":")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative {text!r}: the method must be one of "
                         f"{', '.join(SPECULATIVE_METHODS)} (e.g. ngram:k=4 or draft:MODEL,k=4)")
    fields: dict = {}
    items = [part.strip() for part in rest.split(",")]
    if method == "draft":
        # The model comes first and is not a key=value item (a path may hold "=", not ",").
        model, items = items[0], items[1:]
        if not model or "=" in model and model.partition("=")[0] in ("k", "n"):
            raise ValueError(f"--speculative {text!r}: draft needs its model first "
                             f"(draft:MODEL,k=N)")
        fields["draft_model"] = model
    for item in filter(None, items):
        key, eq, value = item.partition("=")
        try:
            if not eq:
                raise ValueError
            if key == "k":
                fields["num_speculative_tokens"] = int(value)
            elif key == "n" and method == "ngram":
                lo, dots, hi = value.partition("..")
                fields["prompt_lookup_min"] = int(lo)
                fields["prompt_lookup_max"] = int(hi) if dots else int(lo)
            else:
                raise KeyError(key)
        except KeyError:
            raise ValueError(f"--speculative {text!r}: unknown option {key!r} "
                             f"({'ngram takes k=N and n=MIN..MAX' if method == 'ngram' else 'draft takes MODEL then k=N'})") from None
        except ValueError:
            raise ValueError(f"--speculative {text!r}: {item!r} must be k=N or n=MIN..MAX with "
                             f"integers") from None
    if "num_speculative_tokens" not in fields:
        raise ValueError(f"--speculative {text!r}: k=N is required (e.g. {method}:"
                         f"{'MODEL,' if method == 'draft' else ''}k=4)")
    try:
        return SpeculativeConfig(method, **fields)
    except ValueError as exc:
        raise ValueError(f"--speculative {text!r}: {exc}") from None
