"""Where the semantic response cache's threshold can sit: the cosine similarities of paraphrases
and near-misses of a set of questions, embedded by tandem's own path (/api/embed, the Embed RPC
that coordinator/response_cache.py calls), and the hit and false-hit rates per threshold.

    python -m benchmarks.bench_semantic_cache [--model smollm2] [--url URL]
    python -m benchmarks.bench_semantic_cache --embed-model FILE_OR_NAME [--url URL]

Without --url it starts a cluster of the model (1 prefill + 1 decode worker, as `tandem
serve`). --embed-model measures an embedding model as `--response-cache
semantic:model=NAME,threshold=T` uses it (each text as written, the model's own pooling): the
table to choose T from, and whether `match=literals` (the numbers-and-names rows) is safe
with it. Each PROBES row is a question that is cached first, then asked again as paraphrases
(the same question in other words: a hit is right) and near-misses (another number or name:
a hit is a wrong answer). As in the cache, a query is matched to the most similar cached
question among all of them (one partition: same options and everything but the turn), by the
embedding alone, with the same numbers and names required (the cache's rule before stop 45),
and with the cache's rules on the words (coordinator/turn_terms.py: the same numbers, names
and symbols in order, and the same words in the same order once written out):

    hit     paraphrases whose best match is their own question, at >= T
    wrong   paraphrases whose best match at >= T is another question
    false   near-misses with any match at >= T (and by how they differ: number, name, word)

The test (tests/coordinator/test_response_cache_semantic.py) checks the cache's decisions
against the same cosines, at the default threshold.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from dataclasses import dataclass

import numpy as np

# (question, paraphrases, near-misses): each near-miss asks something else, and says how it
# differs: "number", "name" (a proper noun), or "word" (any other word: ocean / desert).
PROBES: tuple[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]], ...] = (
    ("What is the capital of France?",
     ("What's the capital of France?", "Which city is the capital of France?"),
     (("name", "What is the capital of Germany?"), ("name", "What is the capital of Spain?"),
      ("word", "What is the currency of France?"))),
    ("How many legs does a spider have?",
     ("How many legs do spiders have?", "how many legs does a spider have"),
     (("word", "How many legs does an ant have?"), ("word", "How many eyes does a spider have?"))),
    ("What is 12 times 7?",
     ("What's 12 times 7?", "What do you get when you multiply 12 by 7?"),
     (("number", "What is 12 times 8?"), ("number", "What is 13 times 7?"),
      ("word", "What is 12 plus 7?"))),
    ("Who wrote Romeo and Juliet?",
     ("Who is the author of Romeo and Juliet?", "Who wrote 'Romeo and Juliet'?"),
     (("name", "Who wrote Pride and Prejudice?"), ("word", "Who directed Romeo and Juliet?"))),
    ("Convert 10 miles to kilometers.",
     ("How many kilometers are in 10 miles?", "Convert 10 miles into kilometers."),
     (("number", "Convert 25 miles to kilometers."), ("word", "Convert 10 kilometers to miles."))),
    ("What year did World War II end?",
     ("When did World War II end?", "In what year did the Second World War end?"),
     (("name", "What year did World War I end?"), ("word", "What year did World War II start?"))),
    ("Give me a recipe for pancakes.",
     ("How do I make pancakes?", "Can you give me a pancake recipe?"),
     (("word", "Give me a recipe for waffles."),)),
    ("What is the boiling point of water in Celsius?",
     ("At what temperature in Celsius does water boil?",
      "What's the boiling point of water in Celsius?"),
     (("name", "What is the boiling point of water in Fahrenheit?"),
      ("word", "What is the freezing point of water in Celsius?"))),
    ("Write a haiku about the ocean.",
     ("Compose a haiku about the ocean.", "Write a haiku about the sea."),
     (("word", "Write a haiku about the desert."),)),
    ("What is the square root of 144?",
     ("What's the square root of 144?", "Find the square root of 144."),
     (("number", "What is the square root of 169?"), ("word", "What is the cube root of 144?"))),
    ("Translate 'good morning' into Spanish.",
     ("How do you say 'good morning' in Spanish?", "Translate good morning to Spanish."),
     (("name", "Translate 'good morning' into German."),
      ("word", "Translate 'good night' into Spanish."))),
    ("How old is Alice if she was born in 1990?",
     ("If Alice was born in 1990, how old is she?", "How old is Alice, born in 1990?"),
     (("name", "How old is Bob if he was born in 1990?"),
      ("number", "How old is Alice if she was born in 1985?"))),
    ("What is the population of Tokyo?",
     ("How many people live in Tokyo?", "What's the population of Tokyo?"),
     (("name", "What is the population of Paris?"), ("word", "What is the area of Tokyo?"))),
    ("How far is the Moon from Earth?",
     ("What is the distance from the Earth to the Moon?", "How far away is the Moon from Earth?"),
     (("name", "How far is Mars from Earth?"),)),
    ("Sort the numbers 5, 3, 9 in ascending order.",
     ("Sort 5, 3, 9 in ascending order.", "Put the numbers 5, 3, 9 in ascending order."),
     (("number", "Sort the numbers 5, 3, 8 in ascending order."),
      ("word", "Sort the numbers 5, 3, 9 in descending order."))),
    ("Email John that the meeting moved to 3 pm.",
     ("Write an email to John saying the meeting moved to 3 pm.",
      "Email John: the meeting has moved to 3 pm."),
     (("name", "Email Mary that the meeting moved to 3 pm."),
      ("number", "Email John that the meeting moved to 4 pm."),
      ("word", "Email John that the lunch moved to 3 pm."))),
)
THRESHOLDS = tuple(round(0.80 + 0.01 * i, 2) for i in range(20))


@dataclass(frozen=True)
class Match:
    query: str
    kind: str  # "paraphrase", or the near-miss's: "number" | "name" | "word"
    own: int  # the PROBES row it came from
    best: int  # the most similar cached question's row (embedding alone)
    score: float  # its cosine
    own_score: float  # the cosine with its own question
    named: int  # ... among those with the same numbers and names, or -1
    named_score: float
    guarded: int  # ... among those the cache's word rules allow (turn_terms.py), or -1
    guarded_score: float
    other_score: float  # the highest cosine with another question (an unrelated one)


def embed(url: str, model: str, texts: list[str], pooling: str = "last") -> np.ndarray:
    """Unit vectors of `texts` from /api/embed (L2-normalized), as the cache computes them
    with the chat model's own embedding (pooling "last": each text in its EMBED_TEMPLATE, the
    last position's state) or with an embedding model (pooling "own": each text as written,
    the model's own pooling), or, with pooling "mean", each text mean-pooled."""
    from coordinator.response_cache import EMBED_TEMPLATE

    if pooling == "last":
        texts = [EMBED_TEMPLATE.format(t) for t in texts]
    fields = {"model": model, "input": texts}
    if pooling != "own":
        fields["pooling"] = pooling
    body = json.dumps(fields).encode()
    request = urllib.request.Request(url + "/api/embed", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return np.asarray(json.load(r)["embeddings"], dtype=np.float64)


def queries() -> list[tuple[str, str, int]]:
    """(text, kind, its PROBES row) of every paraphrase and near-miss."""
    found = [(q, "paraphrase", i) for i, p in enumerate(PROBES) for q in p[1]]
    return found + [(q, kind, i) for i, p in enumerate(PROBES) for kind, q in p[2]]


def matches(url: str, model: str, pooling: str = "last") -> list[Match]:
    from coordinator.turn_terms import TurnTerms  # the cache's own rules

    bases = [p[0] for p in PROBES]
    asked = queries()
    vectors = embed(url, model, bases + [q for q, _, _ in asked], pooling)
    scores = vectors[len(bases):] @ vectors[:len(bases)].T
    out = []
    for j, (q, kind, own) in enumerate(asked):
        terms = TurnTerms.of(q)

        def best(allowed: list[int]) -> tuple[int, float]:
            i = max(allowed, key=lambda i: scores[j, i]) if allowed else -1
            return i, float(scores[j, i]) if allowed else -2.0

        named = best([i for i, b in enumerate(bases) if TurnTerms.of(b).literals == terms.literals])
        guarded = best([i for i, b in enumerate(bases) if TurnTerms.of(b).same_question(terms)])
        out.append(Match(q, kind, own, int(np.argmax(scores[j])), float(np.max(scores[j])),
                         float(scores[j, own]), *named, *guarded,
                         float(max(scores[j, i] for i in range(len(bases)) if i != own))))
    return out


GUARDS = {"none": "embedding alone", "names": "with the same numbers and names required (the "
          "cache's match=literals; its only rule before stop 45)",
          "words": "with the cache's rules on the words (turn_terms.py; match=words, the default)"}


def rates(found: list[Match], threshold: float, guard: str = "words") -> dict[str, float]:
    """At `threshold`, as the cache decides (guard: GUARDS' key): "hit" paraphrases answered
    with their own question's answer, "wrong" with another's, and per near-miss kind (and
    "near-miss" for all) the share answered at all (false hits)."""
    def best(m: Match) -> tuple[int, float]:
        return {"none": (m.best, m.score), "names": (m.named, m.named_score),
                "words": (m.guarded, m.guarded_score)}[guard]

    para = [m for m in found if m.kind == "paraphrase"]
    out = {"hit": sum(best(m)[1] >= threshold and best(m)[0] == m.own for m in para) / len(para),
           "wrong": sum(best(m)[1] >= threshold and best(m)[0] != m.own for m in para) / len(para)}
    for kind in ("near-miss", "number", "name", "word"):
        near = [m for m in found if m.kind != "paraphrase" and kind in ("near-miss", m.kind)]
        out[kind] = sum(best(m)[1] >= threshold for m in near) / len(near)
    return out


def report(found: list[Match]) -> None:
    para = sorted(m.own_score for m in found if m.kind == "paraphrase")
    near = sorted(m.own_score for m in found if m.kind != "paraphrase")
    kinds = ", ".join(f"{sum(m.kind == k for m in found)} {k}" for k in ("number", "name", "word"))
    print(f"{len(PROBES)} questions, {len(para)} paraphrases, {len(near)} near-misses ({kinds})")
    print(f"cosine with its own question: paraphrases min {para[0]:.4f} median "
          f"{np.median(para):.4f} max {para[-1]:.4f}; near-misses min {near[0]:.4f} median "
          f"{np.median(near):.4f} max {near[-1]:.4f}; any query with another question: max "
          f"{max(m.other_score for m in found):.4f}")
    for guard, title in GUARDS.items():
        print(title)
        print(f"{'threshold':>9} {'hit':>7} {'wrong':>7} {'false':>7} {'number':>7} {'name':>7} "
              f"{'word':>7}")
        for t in THRESHOLDS:
            r = rates(found, t, guard)
            print(f"{t:>9.2f} {r['hit']:>7.1%} {r['wrong']:>7.1%} {r['near-miss']:>7.1%} "
                  f"{r['number']:>7.1%} {r['name']:>7.1%} {r['word']:>7.1%}")
    for m in sorted(found, key=lambda m: (m.kind, -m.own_score)):
        print(f"  {m.kind:10} {m.own_score:.4f} best {m.score:.4f}"
              f"{'' if m.best == m.own else ' (another question)'}  {m.query}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--url", help="a running tandem server (default: start a cluster)")
    p.add_argument("--pooling", choices=("last", "mean", "both"), default="both",
                   help="last: the cache's embedding (default threshold's); mean: /api/embed's "
                        "default, which the cache used before; both: one after the other")
    p.add_argument("--embed-model", metavar="MODEL",
                   help="measure this embedding model as the cache's model=NAME embeds (the "
                        "text as written, the model's own pooling) instead of --model")
    args = p.parse_args(argv)
    if args.embed_model:
        args.model, poolings = args.embed_model, ("own",)
    else:
        poolings = ("mean", "last") if args.pooling == "both" else (args.pooling,)

    def run(url: str, model: str) -> None:
        for pooling in poolings:
            print(f"== pooling {pooling}" + {"last": " (the cache's)", "own": " (the model's own: "
                                             "the cache's with model=NAME)"}.get(pooling, ""))
            report(matches(url, model, pooling))

    if args.url:
        run(args.url.rstrip("/"), args.model)
        return
    import tempfile
    from pathlib import Path

    from common.model_store import default_store
    from deploy.local import LocalCluster
    from deploy.process_plan import free_port, plan
    from deploy.local_topology import Topology

    path = default_store().resolve(args.model)
    with tempfile.TemporaryDirectory(prefix="tandem-semantic-") as tmp:
        topology = Topology(model=str(path), model_path=path, log_dir=Path(tmp), port=free_port(),
                            coordinator_args=("--model-name", "m"))
        specs, ready = plan(topology)
        with LocalCluster(specs, ready, start_timeout_s=300) as cluster:
            cluster.start()
            run(ready.url, "m")


if __name__ == "__main__":
    main()
