"""Logprobs end to end on a tiny random model: the single-process engine's entries against
log_softmax of its own logits, the validation of the option, and a real cluster (coordinator,
prefill and decode processes, every request prefilled remotely) whose entries, through the real
`ollama` client, equal log_softmax of the single-process engine's logits for the greedy tokens:
the first token's from the prefill worker's PrefillResult, the rest from the decode stream."""

from __future__ import annotations

import ollama
import pytest
import torch

from engine.errors import InvalidOptionError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.api_cluster import MODEL, WORKER_ARGS
from tests.cluster import running_cluster
from tests.model_factory import make_tiny_hf_model

NUM_PREDICT = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("lp") / "model", "llama")


def reference(model_dir, prompt_ids: list[int], n: int):
    """(greedy tokens, their entries, log_softmax of the logits each was drawn from)."""
    engine = LLMEngine.from_path(model_dir, num_blocks=64)
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def capture(*args, **kwargs):
        logits = execute(*args, **kwargs)
        seen.append(torch.log_softmax(logits[0].float(), -1))
        return logits

    engine.runner.execute = capture
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0, logprobs=n,
                                                            num_predict=NUM_PREDICT))
    tokens, entries = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request.request_id:
                tokens += out.new_token_ids
                entries += out.logprobs or []
    return tokens, entries, seen


def test_engine_entries_are_log_softmax_of_its_logits(model_dir):
    tokens, entries, seen = reference(model_dir, [1, 5, 9, 33, 4], n=3)
    assert tokens and [e.token_id for e in entries] == tokens
    for e, logp in zip(entries, seen):
        assert e.logprob == pytest.approx(logp[e.token_id].item(), abs=1e-6)
        values, ids = logp.topk(3)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert e.top[0][0] == e.token_id  # greedy: the chosen token is the most probable


def test_engine_reports_nothing_unless_asked(model_dir):
    engine = LLMEngine.from_path(model_dir, num_blocks=64)
    asked = engine.add_request([1, 5, 9], SamplingParams(temperature=0, logprobs=0, num_predict=3))
    plain = engine.add_request([1, 5, 7], SamplingParams(temperature=0, num_predict=3))
    got: dict[str, list] = {asked.request_id: [], plain.request_id: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out.logprobs)
    assert all(lp is None for lp in got[plain.request_id])
    assert all(lp is None or (len(lp) == 1 and lp[0].top == ()) for lp in got[asked.request_id])
    assert any(lp for lp in got[asked.request_id])


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_the_option_is_validated(value):
    with pytest.raises(InvalidOptionError, match="logprobs"):
        SamplingParams(logprobs=value)
    assert SamplingParams.from_options({"logprobs": 3}).logprobs is None  # no Ollama option


def test_cluster_logprobs_match_the_single_process_engine(model_dir, tmp_path):
    with running_cluster(model_dir, tmp_path / "logs", model=MODEL, worker_args=WORKER_ARGS,
                         prefill_threshold=0) as cluster:
        client = ollama.Client(host=cluster.url, timeout=60)
        options = {"temperature": 0, "num_predict": NUM_PREDICT}
        whole = client.generate(model=MODEL, prompt="Name three rivers.", options=options,
                                logprobs=True, top_logprobs=2)
        parts = list(client.generate(model=MODEL, prompt="Name three rivers.", options=options,
                                     logprobs=True, stream=True))
        # The ollama client drops tandem's own figures; raw HTTP shows where the prefill ran.
        raw = cluster.chat([{"role": "user", "content": "Hi"}], options=options, logprobs=True)
    assert raw["tandem"]["prefill_worker"] and len(raw["logprobs"]) == raw["eval_count"]
    prompt_ids = whole.context[:whole.prompt_eval_count]
    output_ids = whole.context[whole.prompt_eval_count:]
    tokens, _, seen = reference(model_dir, prompt_ids, n=2)
    assert output_ids == tokens and len(whole.logprobs) == len(tokens)
    streamed = [e for p in parts for e in (p.logprobs or [])]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.logprobs],
                                                          abs=1e-4)
    for entry, token, logp in zip(whole.logprobs, tokens, seen):
        assert entry.logprob == pytest.approx(logp[token].item(), abs=1e-4)
        values, _ = logp.topk(2)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
