"""Regenerate tests/data/kquant: tiny random LLaMA and Qwen3 GGUFs quantized by llama.cpp's own
`llama-quantize`, and llama.cpp's greedy continuations on them (llama-server, temperature 0).

    python -m reliability.llamacpp_fixtures [--peer ../shared/peer] [--out tests/data/kquant]

A developer tool, run by hand where the peer is built (`bash ../shared/peer/llamacpp.sh build`);
the tests read only what it wrote. The models have one layer and a 256-token vocabulary (the
default model's tokenizer, cut) so that each file stays under 800 KB. Unlike the peer's own
random maker, whose tied embeddings and small weights make every greedy path repeat the last
token (a witness that cannot tell a right model from a wrong one), the output matrix is its own
and every matrix is scaled by its fan-in, so attention and MLP decide the next token. Random
weights still give near-ties more often than a trained model's; the test allows a part at a
near-tie, as for the default model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ARCHS = ("llama", "qwen3")
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
NEW_TOKENS = 16
# Prompts as token ids (the vocabulary is the default model's, cut to 512): a few lengths, some
# repetition, so that the continuation depends on attention and not only on the last token.
PROMPTS = ([1, 45, 200, 17, 88, 211, 9], [1] + list(range(100, 140)), [1, 7, 7, 7, 240, 241, 242, 7, 7])
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 1, 256


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "peer")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "data" / "kquant")
    p.add_argument("--build", type=Path, default=Path(os.environ.get("PEER", Path.home() / ".cache" / "tandem-peer")) / "build" / "bin")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            f16 = Path(tmp) / f"tiny-{arch}-f16.gguf"
            write_random_f16(f16, arch, seed=ARCHS.index(arch) + 7, peer=args.peer)
            for qtype in TYPES:
                out = args.out / f"tiny-{arch}-{qtype}.gguf"
                subprocess.run([str(args.build / "llama-quantize"), str(f16), str(out), qtype, "1"],
                               check=True, stdout=subprocess.DEVNULL)
                cases.append({"file": out.name, "arch": arch, "type": qtype,
                              "greedy": greedy(args.build / "llama-server", out)})
                print(f"{out.name}: {out.stat().st_size} bytes", flush=True)
    (args.out / "llamacpp-greedy.json").write_text(json.dumps(
        {"new_tokens": NEW_TOKENS, "llama_cpp": "0c1e570 (llama_cpp_python 0.3.36 sdist)", "cases": cases},
        indent=1) + "\n")
    return 0


def write_random_f16(path: Path, arch: str, seed: int, peer: Path) -> None:
    from gguf import GGUFReader, GGUFWriter

    spec = importlib.util.spec_from_file_location("make_random_gguf", peer / "make_random_gguf.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)  # for its tokenizer copy (and the default model's path)
    head_dim, rng = HIDDEN // HEADS, np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tandem-fixture-{arch}")
    maker.copy_tokenizer(GGUFReader(maker.DEFAULT_TOKENIZER), w, VOCAB)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(VOCAB)
    w.add_file_type(1)  # mostly F16

    def rand(rows, cols, std=None):  # numpy (rows, cols) is GGUF's (ne1, ne0); std 1/sqrt(fan-in)
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (std or cols ** -0.5)).astype(np.float16)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(VOCAB, HIDDEN, std=1.0))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    w.add_tensor("output.weight", rand(VOCAB, HIDDEN))
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm(HIDDEN))
        w.add_tensor(b + "ffn_norm.weight", norm(HIDDEN))
        w.add_tensor(b + "attn_q.weight", rand(HEADS * head_dim, HIDDEN))
        w.add_tensor(b + "attn_k.weight", rand(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(b + "attn_v.weight", rand(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(b + "attn_output.weight", rand(HIDDEN, HEADS * head_dim))
        if arch == "qwen3":
            w.add_tensor(b + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(b + "attn_k_norm.weight", norm(head_dim))
        w.add_tensor(b + "ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(b + "ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(b + "ffn_down.weight", rand(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy(server: Path, model: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(server), "-m", str(model), "-t", "1", "-c", "256", "-np", "1",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"llama-server did not start on {model}")
                time.sleep(0.3)
        results = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1,
                    "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True}
            req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                answer = json.loads(r.read())
            tokens = answer["tokens"]
            if len(tokens) != NEW_TOKENS:
                raise RuntimeError(f"llama-server gave {len(tokens)} tokens, not {NEW_TOKENS}")
            results.append({"prompt_ids": prompt, "output_ids": tokens})
        return results
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    raise SystemExit(main())
