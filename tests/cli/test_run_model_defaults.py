"""`tandem run --local` of a model in Ollama's store (a fake one, in its real layout): the
model's params and system layers apply in this process as the server applies them."""

from __future__ import annotations

import re

import cli.main
from common.model_store import ModelStore
from engine.config import CacheConfig, EngineConfig
from engine.generation import chat_prompt_ids
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_gguf
from tests.helpers.foreign_stores import make_ollama_store

SYSTEM = "You are tiny."
FP32 = ("--decode-quant", "fp32", "--prefill-quant", "fp32")  # no packing, no kernel timing


def test_run_local_takes_the_model_options_and_system(tmp_path, monkeypatch, capsys):
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf").path
    store = make_ollama_store(tmp_path / "ollama", gguf, params={"temperature": 0,
                                                                 "num_predict": 3},
                              system=SYSTEM)
    # This store, not the environment's: TANDEM_HOME stays, with the native kernels it built.
    import cli.common_args
    import cli.run

    stores = lambda: ModelStore(tmp_path / "home", ollama_models=store)  # noqa: E731
    monkeypatch.setattr(cli.common_args, "store", stores)
    monkeypatch.setattr(cli.run, "store", stores)
    engine = LLMEngine.from_path(gguf, EngineConfig(cache=CacheConfig(num_blocks=64)))

    def prompt_tokens(messages) -> int:
        return len(chat_prompt_ids(engine, messages))

    user = {"role": "user", "content": "hello"}
    runs = {}
    for name, extra in (("defaults", []), ("own", ["--system", "Other.", "--num-predict", "5"])):
        assert cli.main.main(["run", "tiny", "hello", "--local", "--verbose", *FP32, *extra]) == 0
        runs[name] = capsys.readouterr().err
    seen = {k: re.search(r"prompt eval: (\d+) tokens.*eval: (\d+) tokens", v) for k, v in runs.items()}
    assert seen["defaults"], runs["defaults"]
    assert [int(g) for g in seen["defaults"].groups()] == [
        prompt_tokens([{"role": "system", "content": SYSTEM}, user]), 3]
    assert [int(g) for g in seen["own"].groups()] == [
        prompt_tokens([{"role": "system", "content": "Other."}, user]), 5]
