"""lm-eval 0.4's `local-completions` model against a real tandem cluster on the default model,
as `lm_eval --model local-completions --batch_size 4` runs it: a loglikelihood task (eight
multiple-choice items, tests/data/lm_eval/capitals.jsonl, no hub download) sends batches of
four token-id prompts to /v1/completions with echo and logprobs, tokenizing through the server
(/tokenizer_info, /tokenize, /detokenize: lm-eval's remote tokenizer). Each score lm-eval
reports must equal the one a single-prompt request gets, and its accuracy the one those give."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import yaml

from tests.conftest import DATA
from tests.helpers.cluster import running_cluster

MODEL = "smollm2"
ITEMS = DATA / "lm_eval" / "capitals.jsonl"


@pytest.fixture(scope="module")
def cluster(default_gguf, tmp_path_factory):
    with running_cluster(default_gguf, tmp_path_factory.mktemp("lm_eval") / "logs", model=MODEL,
                         coordinator_args=("--heartbeat-misses", "30")) as cluster:
        yield cluster


def task_dir(root):
    """The task YAML, pointing at the local dataset (lm-eval's `json` builder reads it offline)."""
    (root / "capitals.yaml").write_text(yaml.safe_dump({
        "task": "tandem_capitals", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(ITEMS)}}, "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "answer", "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    return root


def test_local_completions_with_batch_size_4_scores_as_single_requests_do(cluster, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    result = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"model={MODEL},base_url={cluster.url}/v1/completions,num_concurrent=1,"
                    "max_retries=1,tokenized_requests=True,tokenizer_backend=remote"),
        tasks=["tandem_capitals"], task_manager=TaskManager(include_path=str(task_dir(tmp_path))),
        batch_size=4, log_samples=True)

    items = [json.loads(line) for line in ITEMS.read_text().splitlines()]
    samples = sorted(result["samples"]["tandem_capitals"], key=lambda s: s["doc_id"])
    assert len(samples) == len(items) == 8
    correct = 0
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        for item, sample in zip(items, samples):
            scores = []
            for choice, (logprob, _greedy) in zip(item["choices"], sample["filtered_resps"]):
                # The same continuation, one prompt per request: its tokens' logprobs summed.
                context = client.post("/tokenize", json={"prompt": item["question"],
                                                         "add_special_tokens": False}).json()
                whole = client.post("/tokenize", json={"prompt": f"{item['question']} {choice}",
                                                       "add_special_tokens": False}).json()
                single = client.post("/v1/completions", json={
                    "model": MODEL, "prompt": whole["tokens"], "max_tokens": 1, "logprobs": 1,
                    "echo": True, "temperature": 0}).json()
                expected = sum(single["choices"][0]["logprobs"]["token_logprobs"]
                               [context["count"]:-1])
                assert logprob == pytest.approx(expected, abs=1e-3), (item, choice)
                scores.append(expected)
            correct += scores.index(max(scores)) == item["answer"]
    assert result["results"]["tandem_capitals"]["acc,none"] == pytest.approx(correct / len(items))
    # Batched: 32 loglikelihood requests went out as 8 POSTs of four prompts each. The access
    # line is written after the response is sent, so the last one may trail the last answer.
    line, deadline = '"POST /v1/completions HTTP/1.1" 200', time.monotonic() + 30  # a hang guard
    while (cluster.log_dir / "coordinator.log").read_text().count(line) < 8 + 32:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (cluster.log_dir / "coordinator.log").read_text().count(line) == 8 + 32
