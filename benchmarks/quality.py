"""Quality of each weight format against fp32 on one fixed text.

    python -m benchmarks.quality [MODEL] [--formats fp32,bf16,int8,int4,w8a8] [--kv-dtype bf16]
                             [--chunk 16] [--reference F16_MODEL]

For each format: perplexity of the text, its change against fp32, and greedy top-1
agreement (share of positions where the format's most likely next token equals fp32's).
The text goes through in decode-sized passes (--chunk tokens over the growing KV cache),
every projection in that format, so the figures are those of the kernels a decode worker
runs; the baseline is always fp32 weights with an fp32 KV cache. ATEN_CPU_CAPABILITY picks
the dispatch level (and so the kernels) being judged.

--reference F16_MODEL: the baseline is that file's fp32 instead (another file of the same model
and vocabulary, e.g. the F16 GGUF a K-quant was made from), and every listed format of MODEL,
fp32 included, is judged against it: what the file's quantization costs, not only tandem's.

--text FILE [--max-tokens N]: judge on that text (its first N tokens) instead of the built-in
one, e.g. the text given to llama.cpp's `llama-perplexity` for the same two files, so that
the file's own cost (measured by llama.cpp) and tandem's can be told apart.
"""

from __future__ import annotations

import argparse
import math

import torch

from engine.config import CacheConfig
from engine.llm_engine import KV_TORCH_DTYPES
from engine.loaders import load_model
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class
from worker.runtime import configure_process
from common.tokenizer import Tokenizer

TEXT = """\
The history of computing is a story of abstraction. Early machines were programmed by \
rewiring panels of cables, and every new problem meant a new arrangement of hardware. The \
stored-program computer changed that: instructions became data, held in the same memory as \
the numbers they worked on, and a single machine could be turned to any task that could be \
written down precisely.

Languages followed. Assembly gave names to instructions, compilers turned formulas into \
machine code, and operating systems let many programs share one processor without knowing \
about each other. Each layer hid the details of the one below it, so that people could think \
about what they wanted done rather than how the wires were arranged.

Networks added a new kind of abstraction. A program on one computer could call a service on \
another as if it were a local function, and the internet grew out of thousands of such \
agreements about message formats and addresses. Today a request to a web page may touch \
dozens of machines in several countries before the answer comes back, in well under a second.

Machine learning is the latest layer. Instead of writing rules by hand, engineers collect \
examples and let an optimization procedure find the parameters of a model that reproduces \
them. Large language models are trained this way on huge collections of text, and they can \
answer questions, translate, and write code. Serving them efficiently is itself an \
engineering problem: the model must read billions of numbers for every word it produces.
"""


def evaluate(loaded, fmt: str, ids: list[int], chunk: int = 16,
             kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Log-probabilities [len(ids) - 1, vocab] of each next token, every projection in fmt.

    The text goes through in passes of `chunk` tokens over the growing KV cache, so the
    projections run the kernels of decode-sized passes (a decode worker's steps and local
    chunks), not the dense path of prefill-sized ones (kernels/quant_int4.py: 48+ rows)."""
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, fmt)  # one copy: fmt
    bs = 16
    n_blocks = (len(ids) + bs - 1) // bs
    runner = ModelRunner(model, CacheConfig(block_size=bs, num_blocks=n_blocks), kv_dtype)
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            batch = runner.prepare([SequenceChunk(piece, start, list(range(n_blocks)), True)])
            out.append(model.compute_logits(model.forward(batch, runner.kv_cache)))
    logits = torch.cat(out)
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def main(argv: list[str] | None = None) -> None:
    from common.model_store import default_store

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--formats", default="fp32,bf16,int8,int4,w8a8")
    parser.add_argument("--kv-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="KV cache element type of every format but the fp32 baseline's")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per pass (decode-sized: < 48)")
    parser.add_argument("--reference", help="a file of the same model whose fp32 is the baseline")
    parser.add_argument("--text", help="a UTF-8 text file to judge on instead of the built-in text")
    parser.add_argument("--max-tokens", type=int, default=0, help="use the text's first N tokens (0: all)")
    args = parser.parse_args(argv)
    if args.chunk < 1:
        parser.error("--chunk must be >= 1")
    if args.max_tokens < 0:
        parser.error("--max-tokens must be >= 0")
    text = TEXT
    if args.text:
        try:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"--text {args.text}: {e}")
    configure_process(1)
    path = default_store().resolve(args.model)
    loaded = load_model(path)
    ids = Tokenizer.from_path(path).encode(text, add_special_tokens=True)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    if len(ids) > loaded.config.max_position:
        parser.error(f"the text has {len(ids)} tokens, more than the model's context of "
                     f"{loaded.config.max_position}: pass --max-tokens")
    targets = torch.tensor(ids[1:])
    print(f"model {loaded.config.name}; text of {len(ids)} tokens in passes of {args.chunk}; "
          f"KV {args.kv_dtype} (the fp32 baseline: fp32 KV); aten level "
          f"{torch.backends.cpu.get_cpu_capability()}")
    kv_dtype = KV_TORCH_DTYPES[args.kv_dtype]
    print(f"{'format':8} {'perplexity':>11} {'change':>9} {'top-1 agreement':>16}")
    base_top1 = None
    base_ppl = None
    formats = args.formats.split(",")
    runs = [(loaded, fmt, kv_dtype) for fmt in formats]
    if args.reference:
        reference = load_model(default_store().resolve(args.reference))
        if reference.config.vocab_size != loaded.config.vocab_size:
            parser.error(f"--reference has a vocabulary of {reference.config.vocab_size}, "
                         f"the model {loaded.config.vocab_size}")
        runs = [(reference, "fp32", torch.float32)] + runs
        print(f"baseline: fp32 of {args.reference}")
    elif formats[0] != "fp32" or args.kv_dtype != "fp32":
        runs = [(loaded, "fp32", torch.float32)] + [
            (loaded, f, kv_dtype) for f in formats if f != "fp32" or args.kv_dtype != "fp32"]
    else:
        runs[0] = (loaded, "fp32", torch.float32)
    for i, (source, fmt, kv) in enumerate(runs):
        logprobs = evaluate(source, fmt, ids, args.chunk, kv)
        if args.reference:
            fmt = "ref fp32" if i == 0 else fmt
        ppl = math.exp(-logprobs.gather(1, targets[:, None]).mean().item())
        top1 = logprobs.argmax(-1)
        if base_top1 is None:
            base_top1, base_ppl = top1, ppl
        agree = (top1 == base_top1).float().mean().item()
        print(f"{fmt:8} {ppl:11.3f} {100 * (ppl / base_ppl - 1):+8.2f}% {100 * agree:15.1f}%")


if __name__ == "__main__":
    main()
