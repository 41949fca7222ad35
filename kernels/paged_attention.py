"""Decode attention over the paged KV cache: a Triton kernel with optional split-K, and a CPU
path. Same contract as kernels/attention.py; built for q_len == 1 (decode is memory bound: the
work is reading each sequence's K/V once).

Triton kernel, grid (B, Hkv, NUM_SPLITS):

    program (b, kv_head, s) loads the GROUP query heads that share kv_head as one [GROUP_P, D]
    tile, so each K/V byte is read once per group, not once per query head; and walks keys
    [s * part, (s + 1) * part) with part = ceil(seq_len / NUM_SPLITS) rounded up to BLOCK_N.

    NUM_SPLITS == 1: writes the normalized output directly.
    NUM_SPLITS  > 1 (flash-decoding, for long contexts and small batches, so the GPU has
    enough programs): each split writes its normalized partial output and its log2-sum-exp;
    a second kernel merges the splits of each (token, head):

        out = sum_s 2^(lse_s - max lse) * part_s / sum_s 2^(lse_s - max lse)

A sequence with q_len > 1 is still computed exactly (its tokens are processed one after the
other, each with its own causal limit), only without the K/V reuse that the prefill kernel
gives; so routing a batch here by shape (T == B) can never change a result.

CPU path: all decodes of the batch at once: one block-granular gather of K/V into a padded
[B, S_max, Hkv, D], a length mask and two batched matmuls in fp32 (measured against per-sequence
SDPA in kernels/bench_attention.py).
"""

import functools

from dataclasses import dataclass

import torch

from kernels._triton import HAS_TRITON, triton, tl
from kernels.flash_attention import _LOG2E, _dot_precision, check_paged_attention_args

if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,                 # [T, Hq, D]
        k_cache_ptr,           # [NB, BS, Hkv, D]
        v_cache_ptr,           # [NB, BS, Hkv, D]
        out_ptr,               # [T, Hq, D]                 written when NUM_SPLITS == 1
        part_out_ptr,          # [T, Hq, NUM_SPLITS, D] fp32, contiguous; when NUM_SPLITS > 1
        part_lse_ptr,          # [T, Hq, NUM_SPLITS] fp32, contiguous; log2-sum-exp per split
        cu_seqlens_q_ptr,      # [B + 1] int32
        seq_lens_ptr,          # [B] int32
        block_tables_ptr,      # [B, max_blocks] int32
        qk_scale,              # float: softmax scale * log2(e)
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,             # block_tables.stride(0); stride(1) must be 1
        NUM_HEADS: tl.constexpr,     # Hq
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,    # next_pow2(HEAD_DIM), >= 16
        GROUP: tl.constexpr,         # Hq // Hkv
        GROUP_P: tl.constexpr,       # next_pow2(GROUP), >= 16 (tl.dot's minimum)
        BLOCK_SIZE: tl.constexpr,    # tokens per cache block
        BLOCK_N: tl.constexpr,       # keys per step
        NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
        part = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        key_lo = split * part

        g = tl.arange(0, GROUP_P)
        head = kv_head * GROUP + g
        g_mask = g < GROUP
        d = tl.arange(0, HEAD_DIM_P)
        d_mask = d < HEAD_DIM
        q_mask = g_mask[:, None] & d_mask[None, :]
        block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

        q_len = q_end - q_start
        for i in range(0, q_len):                       # one iteration for a decode
            key_hi = tl.minimum(key_lo + part, seq_len - q_len + i + 1)     # causal limit
            token = q_start.to(tl.int64) + i
            q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh
                        + d[None, :] * stride_qd, mask=q_mask, other=0.0)
            m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([GROUP_P], dtype=tl.float32)
            acc = tl.zeros([GROUP_P, HEAD_DIM_P], dtype=tl.float32)
            for start in range(key_lo, key_hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                n_mask = n < key_hi
                # int64: block id * stride_kb passes 2**31 elements in a large cache.
                block = tl.load(block_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
                slot = n % BLOCK_SIZE
                kv_mask = n_mask[:, None] & d_mask[None, :]
                k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                            + kv_head * stride_kh + d[None, :] * stride_kd,
                            mask=kv_mask, other=0.0)
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
                qk = tl.where(n_mask[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.exp2(qk - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                            + kv_head * stride_vh + d[None, :] * stride_vd,
                            mask=kv_mask, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                    input_precision=DOT_PRECISION)
                m_i = m_new
            # An empty split (key_lo >= key_hi) leaves l_i == 0: output 0, weight 2^-inf = 0.
            empty = l_i == 0.0
            acc = acc / tl.where(empty, 1.0, l_i)[:, None]
            if NUM_SPLITS == 1:
                tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh
                         + d[None, :] * stride_od,
                         acc.to(out_ptr.dtype.element_ty), mask=q_mask)
            else:
                row = (token * NUM_HEADS + head) * NUM_SPLITS + split       # [GROUP_P] int64
                tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
                lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
                tl.store(part_lse_ptr + row, lse, mask=g_mask)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,               # [T, Hq, D]
        part_out_ptr,          # [T, Hq, NUM_SPLITS, D] fp32, contiguous
        part_lse_ptr,          # [T, Hq, NUM_SPLITS] fp32, contiguous
        stride_ot, stride_oh, stride_od,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        NUM_SPLITS_P: tl.constexpr,  # next_pow2(NUM_SPLITS)
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, NUM_SPLITS_P)
        s_mask = s < NUM_SPLITS
        d = tl.arange(0, HEAD_DIM_P)
        d_mask = d < HEAD_DIM
        row = (token * NUM_HEADS + head) * NUM_SPLITS + s                  # [NUM_SPLITS_P]
        lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
        # Split 0 always holds key 0, so max(lse) is finite.
        w = tl.exp2(lse - tl.max(lse, 0))
        part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                       mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split the context only when (B * Hkv) programs leave the GPU's SMs idle and each split
    still gets >= 512 keys; at most 16 splits. max_context is an upper bound from shapes
    (max_blocks * block_size), so choosing reads no device value."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_context <= 1024:
        return 1
    by_length = max_context // 512
    by_occupancy = -(-2 * num_sms // programs)
    return max(1, min(16, by_length, by_occupancy))


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float, *,
                        num_splits: int | None = None, block_n: int | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the decode kernel (plus the merge kernel when splitting).

    Shapes as in kernels/attention.py -> out [T, Hq, D]. num_splits: None picks by
    choose_num_splits; block_n: keys per step (power of two >= 16, default 64). Runs on
    CUDA, or on CPU tensors under TRITON_INTERPRET=1.
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_decode_triton needs triton installed")
    check_paged_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads,
                                       block_tables.shape[1] * block_size, _num_sms(q.device))
    block_n = block_n or 64
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got "
                         f"{tuple(out.shape)}, {out.dtype}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits,
                               dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out       # not touched: NUM_SPLITS == 1 compiles those paths out
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, out_ptr=out,
        part_out_ptr=part_out, part_lse_ptr=part_lse,
        cu_seqlens_q_ptr=cu_seqlens_q, seq_lens_ptr=seq_lens, block_tables_ptr=block_tables,
        qk_scale=scale * _LOG2E,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_qd=q.stride(2),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2), stride_kd=k_cache.stride(3),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2), stride_vd=v_cache.stride(3),
        stride_bt=block_tables.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out_ptr=out, part_out_ptr=part_out, part_lse_ptr=part_lse,
            stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits, NUM_SPLITS_P=triton.next_power_of_2(num_splits),
        )
    return out


# ----------------------------------------------------------------------------------------------
# CPU path


def _gather_head_major(cache: torch.Tensor, tables: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Blocks `tables` ([n * nblk]) of cache as fp32 [n, Hkv, nblk * BS, D], contiguous.

    One index_select of whole blocks, then one copy into head-major fp32: batched matmuls on
    a permuted (non-contiguous) K run 5-10x slower on the CPU than this extra copy costs."""
    blocks = cache.index_select(0, tables)                           # [n * nblk, BS, Hkv, D]
    seq_major = blocks.view(num_seqs, -1, *cache.shape[2:])          # [n, S, Hkv, D]
    out = torch.empty(num_seqs, cache.shape[2], seq_major.shape[1], cache.shape[3])
    return out.copy_(seq_major.transpose(1, 2))


@dataclass(frozen=True)
class DecodePlan:
    """Index tensors of a batch's decode rows. They are the same for every layer of a pass,
    so the model builds them once per forward (plan_decode) instead of once per layer."""

    rows: torch.Tensor  # [n] query row of each decode sequence
    tables: torch.Tensor  # [n * nblk] block ids to gather; entries past a sequence's need -> 0
    padding: torch.Tensor  # [n, nblk * BS] True at positions >= the sequence's length


def plan_decode(cu_seqlens_q: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                block_size: int, seqs: list[int]) -> DecodePlan | None:
    if not seqs:
        return None
    lens = torch.tensor([seq_lens[b] for b in seqs])
    num_blocks = -(-int(lens.max()) // block_size)
    tables = block_tables[seqs, :num_blocks].long()
    needed = torch.arange(num_blocks)[None, :] * block_size < lens[:, None]
    tables = torch.where(needed, tables, 0).reshape(-1)
    padding = torch.arange(num_blocks * block_size)[None, :] >= lens[:, None]
    rows = torch.tensor([cu_seqlens_q[b] for b in seqs])
    return DecodePlan(rows, tables, padding)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan | None, scale: float, out: torch.Tensor) -> None:
    """Decode (q_len == 1) rows of the batch, as planned, written into `out` ([T, Hq, D]).
    All sequences at once:

        tables  [n, nblk]                table rows; entries past a sequence's need -> block 0
        K, V    [n, Hkv, nblk * BS, D]   whole blocks gathered, fp32, head-major
        scores  [n, Hkv, S, G] = K @ q^T     (positions >= seq_len -> -inf)
        out     [n, Hkv, G, D] = softmax(scores over S)^T @ V

    K @ q^T (a tall-skinny product) beats q @ K^T by ~2x on one core; per-sequence SDPA is
    slower still for B > 1 and for long contexts (kernels/bench_attention.py).
    """
    if plan is None:
        return
    num_seqs = plan.rows.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    keys = _gather_head_major(k_cache, plan.tables, num_seqs)         # [n, Hkv, S, D]
    values = _gather_head_major(v_cache, plan.tables, num_seqs)
    qb = q.index_select(0, plan.rows).float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(keys, qb.transpose(2, 3)).mul_(scale)       # [n, Hkv, S, G]
    scores.masked_fill_(plan.padding[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=2)
    o = torch.matmul(probs.transpose(2, 3), values)                   # [n, Hkv, G, D]
    out.index_copy_(0, plan.rows, o.reshape(num_seqs, -1, head_dim).to(out.dtype))
