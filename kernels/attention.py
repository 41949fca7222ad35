"""Attention over the paged KV cache for a ragged batch (the one op the model calls).

A batch holds B sequences. Sequence b contributes q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]
query tokens, which are its *last* q_len_b positions: it has seq_lens[b] tokens of context in
the cache in total (prefix already cached + the new tokens, whose K/V the caller has already
written). Query i of sequence b sits at position p = seq_lens[b] - q_len_b + i and attends to
cached positions 0..p (causal). A decode is q_len_b == 1; a prefill chunk continuing a cached
prefix is q_len_b < seq_lens[b]; a fresh prefill is q_len_b == seq_lens[b].

Position j of sequence b lives in block block_tables[b, j // block_size] at offset
j % block_size. GQA: query head h reads kv head h // (Hq // Hkv).

    cu_seqlens_q  0     3 4        9        (B = 3; T = 9)
    q rows        [a a a|b|c c c c c]
    seq_lens      [3,    7, 12]           a: fresh prefill, b: decode at position 6,
                                          c: chunk at positions 7..11 after a 7-token prefix

Implementations (one file each), chosen by `paged_attention` from the device:
- CUDA + Triton: kernels/paged_attention.py's decode kernel when T == B (every sequence a
  decode, the common decode-node step), else kernels/flash_attention.py's kernel, which takes
  any mix of decodes and chunks in one launch. Neither reads a device value on the host.
- CPU: sequences split on the host (.tolist() of the small index tensors) into decodes and
  prefill chunks; both write into one output. Decodes: all of them in one call of the native
  kernel (kernels/csrc/paged_decode.cpp via kernels/paged_attention.py), which reads K/V in
  place from the paged cache (no gather copy; a GQA group shares each K/V row read), for fp32
  q over an fp32 or bf16 cache; else (no native library, other dtypes or layouts) a batched
  torch gather + matmul. Prefill chunks: SDPA (kernels/flash_attention.py).
- `paged_attention_reference`: the definition, a plain loop in fp32, for tests only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import batch_invariance
from kernels._triton import use_triton
from kernels.flash_attention import (check_paged_attention_args, flash_attention_cpu,
                                     flash_attention_triton)
from kernels.paged_attention import DecodePlan, paged_decode_cpu, paged_decode_triton, plan_decode


@dataclass(frozen=True)
class AttentionPlan:
    """CPU-side index work for one pass, shared by all its layers: which sequences decode and
    which run prefill chunks, and the decode index tensors (native kernel and torch fallback)."""

    starts: list[int]  # cu_seqlens_q as a list
    lens: list[int]  # seq_lens as a list
    chunks: list[int]  # sequences with q_len > 1
    decode: DecodePlan | None


def plan_paged_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, block_size: int,
                         rows_as_decodes: bool = False) -> AttentionPlan | None:
    """Built once per forward pass and handed to every layer's paged_attention. None where
    the kernels need no host-side plan (CUDA). rows_as_decodes: every multi-token sequence
    is a speculative verification (engine/forward_batch.py), attended row by row as decodes:
    the same kernel and arithmetic as the plain steps it stands for (so its rows' logits equal
    theirs), and a pass the native decode call takes whole."""
    if use_triton(cu_seqlens_q):
        return None
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    decodes, chunks = [], []
    for b in range(len(lens)):
        q_len = starts[b + 1] - starts[b]
        if q_len == 1:
            decodes.append(b)
        elif q_len > 1:
            chunks.append(b)
    if chunks and (rows_as_decodes or batch_invariance.enabled()):
        return _rows_as_decodes(starts, lens, block_tables, block_size, decodes, chunks)
    return AttentionPlan(starts, lens, chunks, plan_decode(starts, lens, block_tables, block_size, decodes))


def _rows_as_decodes(starts: list[int], lens: list[int], block_tables: torch.Tensor,
                     block_size: int, decodes: list[int], chunks: list[int]) -> AttentionPlan:
    """Batch-invariant mode (kernels/batch_invariance.py): each query row of a prefill chunk is
    attended as a decode at its own position (query row r of a chunk at position p reads keys
    0..p of its sequence's blocks, as a decode of length p + 1 would). SDPA's arithmetic for a
    row depends on how many queries and keys its call holds, so a prompt cut into other chunks,
    or shortened by a prefix-cache hit, would see other sums; the native decode kernel computes
    each (row, kv head) alone in one order, the same one a later decode step of that sequence
    uses."""
    rows, row_lens, owners = [], [], []
    for b in decodes:
        rows.append(starts[b])
        row_lens.append(lens[b])
        owners.append(b)
    for b in chunks:
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            rows.append(starts[b] + i)
            row_lens.append(lens[b] - q_len + i + 1)
            owners.append(b)
    tables = block_tables[owners]
    return AttentionPlan(starts, lens, [], plan_decode(rows, row_lens, tables, block_size,
                                                       list(range(len(rows)))))


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain per-sequence attention in fp32; the definition every fast path is tested against."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    starts = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[b, pos // block_size].long()
        keys = k_cache[blocks, pos % block_size].float()      # [S, Hkv, D]
        values = v_cache[blocks, pos % block_size].float()
        keys = keys.repeat_interleave(group, dim=1)            # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        qb = q[q_start:q_end].float()                          # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", qb, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = pos[None, :] > q_pos[:, None]                   # [L, S] True = future
        scores.masked_fill_(mask[None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out


def paged_attention_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                        plan: AttentionPlan | None = None):
    """CPU fast path: decodes batched together, prefill chunks through SDPA. Without a plan
    the arguments are checked and one is built; a caller passing a plan built for these index
    tensors (the model, once per pass) skips both."""
    if plan is None:
        # fp32 queries over a 16-bit cache are the model's bf16-KV case; the CPU paths upcast.
        check_paged_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                   allow_fp32_queries=True)
        plan = plan_paged_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    out = torch.empty_like(q)
    paged_decode_cpu(q, k_cache, v_cache, plan.decode, scale, out)
    flash_attention_cpu(q, k_cache, v_cache, plan.starts, plan.lens, block_tables, scale, plan.chunks, out)
    return out


def paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """GPU path. T == B is routed to the decode kernel by shape alone; that kernel is exact
    for any q_len, so the routing only affects speed (a T == B batch holding a 0-token and
    a 2-token sequence is still right)."""
    if q.shape[0] == seq_lens.shape[0]:
        return paged_decode_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                   scale)
    return flash_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                  scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, plan: AttentionPlan | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; cu_seqlens_q: [B+1] int32;
    seq_lens: [B] int32; block_tables: [B, max_blocks] int32 -> [T, Hq, D].
    plan: from plan_paged_attention for these index tensors (optional; saves per-layer work)."""
    if use_triton(q):
        if q.dtype != k_cache.dtype:  # the model's fp32 queries over a bf16 cache: the Triton
            # kernels take one dtype, so the queries go to the cache's (its precision anyway)
            return paged_attention_triton(q.to(k_cache.dtype), k_cache, v_cache, cu_seqlens_q,
                                          seq_lens, block_tables, scale).to(q.dtype)
        return paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                      scale)
    return paged_attention_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, plan)
