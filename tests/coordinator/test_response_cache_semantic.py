"""The semantic response cache on the default model (SmolLM2-135M-Instruct), through a real
cluster at the default threshold: each question of benchmarks/bench_semantic_cache.py's PROBES
is answered and cached, then its paraphrases and near-misses (another number, name or word)
are asked. Every decision the cache makes must be the one its rules predict from the vectors
/api/embed gives for the same texts as the cache embeds them (each in EMBED_TEMPLATE, `"pooling":
"last"`: the same Embed path) and from the turns' words (coordinator/turn_terms.py), and the
hit and false-hit rates it reaches are printed (README, Response cache). The rules' guarantee
is asserted: a question that differs in a number, a name, a word or their order is never
answered from another's entry."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from benchmarks.bench_semantic_cache import PROBES, embed, queries
from coordinator.response_cache_config import DEFAULT_THRESHOLD
from coordinator.turn_terms import TurnTerms
from tests.helpers.cluster import running_cluster

OPTIONS = {"temperature": 0, "num_predict": 1}
NEAR_EDGE = 1e-4  # float32 (the cache) against float64 (here): too close to call


def ask(url: str, text: str) -> str:
    r = httpx.post(url + "/api/chat", timeout=300, json={
        "model": "m", "stream": False, "options": OPTIONS,
        "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    assert r.headers["X-Tandem-Cache"] == r.json()["tandem"]["cache"]
    return r.headers["X-Tandem-Cache"]


@pytest.mark.model
def test_paraphrases_and_near_misses_at_the_default_threshold(default_gguf, tmp_path):
    with running_cluster(default_gguf, tmp_path / "logs", model="m",
                         coordinator_args=("--response-cache", "semantic")) as c:
        bases = [p[0] for p in PROBES]
        asked = queries()
        vectors = embed(c.url, "m", bases + [q for q, _, _ in asked])
        # The cache's index as it grows: each miss is stored (text's vector, its terms, row).
        stored: list[tuple[np.ndarray, TurnTerms, int]] = []
        for row, (text, vector) in enumerate(zip(bases, vectors)):
            assert ask(c.url, text) == "miss"
            stored.append((vector, TurnTerms.of(text), row))
        assert ask(c.url, bases[0]) == "hit"  # the exact repeat
        outcomes: list[tuple[str, str, bool, int]] = []  # (kind, text, hit, served row)
        for (text, kind, own), vector in zip(asked, vectors[len(bases):]):
            terms = TurnTerms.of(text)
            same = [(float(v @ vector), row) for v, t, row in stored if t.same_question(terms)]
            score, row = max(same, default=(-2.0, -1))
            got = ask(c.url, text)
            if abs(score - DEFAULT_THRESHOLD) > NEAR_EDGE:
                assert got == ("hit" if score >= DEFAULT_THRESHOLD else "miss"), (text, score)
            hit = got == "hit"
            outcomes.append((kind, text, hit, row if hit else -1))
            if not hit:
                stored.append((vector, terms, own))

    def share(kinds: tuple[str, ...], right: bool | None = None) -> tuple[int, int]:
        rows = [(o, own) for o, (_, _, own) in zip(outcomes, asked) if o[0] in kinds]
        hits = [1 for (_, _, hit, served), own in rows
                if hit and (right is None or (served == own) == right)]
        return len(hits), len(rows)

    print(f"\nsemantic cache, default model, threshold {DEFAULT_THRESHOLD}:")
    for label, kinds, right in (("paraphrases answered (right question)", ("paraphrase",), True),
                                ("paraphrases answered (another question)", ("paraphrase",), False),
                                ("near-misses answered, number", ("number",), None),
                                ("near-misses answered, name", ("name",), None),
                                ("near-misses answered, other word", ("word",), None)):
        n, of = share(kinds, right)
        print(f"  {label}: {n}/{of}")
    for kind, text, hit, _ in outcomes:
        print(f"  {'HIT ' if hit else 'miss'} {kind:10} {text}")
    kinds = ("number", "name", "word")
    assert share(kinds) == (0, sum(k in kinds for _, k, _ in asked))
