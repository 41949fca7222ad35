"""The response cache's memory (coordinator/response_cache.py): its answers in LRU order and
their semantic index, bounded by entries and by estimated bytes. Torch-free; numpy for the
cosines. Invariant: every answer with a partition is in that partition's index, and only
answers still held are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from common.logprobs import TokenLogprob
from coordinator.turn_terms import TurnTerms

# Estimated sizes, for the byte bound (Python objects, roughly): an entry's fixed part (its
# object, two keys, its LRU slot), a token id, a logprob entry and each of its alternatives,
# and a word of its turn's terms beside its characters (a str object and its tuple slot; a
# character takes up to 4 bytes).
_ENTRY_BYTES, _TOKEN_BYTES, _LOGPROB_BYTES, _ALT_BYTES, _WORD_BYTES = 512, 8, 96, 48, 64


@dataclass(frozen=True)
class CachedAnswer:
    output_ids: tuple[int, ...]
    chunk_sizes: tuple[int, ...]  # tokens per arrival, as the workers sent them
    logprobs: tuple[TokenLogprob, ...]  # parallel to output_ids, when the request asked
    prompt_logprobs: tuple[TokenLogprob, ...]  # with the first token, when asked
    finish_reason: str  # "stop" | "length"
    max_tokens: int  # the request's; a semantic hit must fit the new one's
    partition: bytes | None = None  # its semantic partition, if it is in the index
    vector: np.ndarray | None = None  # its last user turn's unit vector (float32), if it is
    terms: TurnTerms | None = None  # its last user turn's words, if it is (turn_terms.py)


def entry_bytes(answer: CachedAnswer) -> int:
    """The estimate the byte bound counts."""
    def lp(entries: Sequence[TokenLogprob]) -> int:
        return sum(_LOGPROB_BYTES + _ALT_BYTES * len(e.top) for e in entries)

    return (_ENTRY_BYTES + _TOKEN_BYTES * (len(answer.output_ids) + len(answer.chunk_sizes))
            + lp(answer.logprobs) + lp(answer.prompt_logprobs)
            + (answer.vector.nbytes if answer.vector is not None else 0)
            + (sum(_WORD_BYTES + (len(w) if w.isascii() else 4 * len(w))
                   for w in (*answer.terms.literals, *answer.terms.words))
               if answer.terms is not None else 0))


class AnswerStore:
    """The LRU of answers and their semantic index, bounded by entries and estimated bytes.
    Invariant: every answer with a partition is in `_index[partition]`, and only those."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._answers: OrderedDict[bytes, CachedAnswer] = OrderedDict()
        self._index: dict[bytes, dict[bytes, CachedAnswer]] = {}
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: bytes) -> CachedAnswer | None:
        answer = self._answers.get(key)
        if answer is not None:
            self._answers.move_to_end(key)
        return answer

    def nearest(self, partition: bytes, vector: np.ndarray, threshold: float,
                fits: Callable[[CachedAnswer], bool]) -> tuple[CachedAnswer, float] | None:
        """The answer of `partition` whose vector is closest to `vector` at `threshold` or
        above and that `fits`, with its cosine; it becomes the most recently used."""
        members = self._index.get(partition)
        if not members:
            return None
        keys = list(members)
        # Unit vectors (the embeddings are L2-normalized): dot products are the cosines.
        scores = np.stack([members[k].vector for k in keys]) @ vector
        for i in np.argsort(-scores):
            if scores[i] < threshold:
                break
            if fits(members[keys[i]]):
                self._answers.move_to_end(keys[i])
                return members[keys[i]], float(scores[i])
        return None

    def put(self, key: bytes, answer: CachedAnswer) -> bool:
        """Stores `answer` as the most recent, then drops the least recent until both bounds
        hold. False (nothing stored) for an answer larger than the byte bound by itself."""
        size = entry_bytes(answer)
        if size > self.max_bytes:
            return False
        self._drop(key)
        self._answers[key] = answer
        self.bytes += size
        if answer.partition is not None:
            self._index.setdefault(answer.partition, {})[key] = answer
        while len(self._answers) > self.max_entries or self.bytes > self.max_bytes:
            oldest = next(iter(self._answers))
            self._drop(oldest)
            self.evicted += 1
        return True

    def _drop(self, key: bytes) -> None:
        answer = self._answers.pop(key, None)
        if answer is None:
            return
        self.bytes -= entry_bytes(answer)
        if answer.partition is not None:
            members = self._index[answer.partition]
            del members[key]
            if not members:
                del self._index[answer.partition]
