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

CPU path: all decodes of the batch in one call of the native kernel kernels/csrc/paged_decode.cpp
(kernels/native.py builds it per instruction-set level). It reads K/V in place from the paged
cache (fp32 or bf16, upcast in registers), so there is no gather copy: the older path copied
every sequence's whole context into a contiguous fp32 buffer per layer, which made a batch-8
step cost ~4x a batch-1 step. The G = Hq / Hkv query heads of one kv head are computed together,
so each K/V row is read once per group; softmax in fp32. It needs fp32 q (the model's residual
stream is fp32) and contiguous cache blocks (native_decode_supported). Where the native library
does not build, or the tensors do not suit it, the torch fallback runs: one block-granular
gather of K/V into a padded [B, S_max, Hkv, D] fp32 buffer, a length mask and two batched
matmuls (paged_decode_torch). Both are measured in benchmarks/bench_attention.py.
"""

import functools

from dataclasses import dataclass

import torch

from kernels import native
from kernels._triton import HAS_TRITON, record_launch, triton, tl
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
    record_launch("paged_decode")
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
        record_launch("merge_splits")
        _merge_splits_kernel[(num_tokens, num_heads)](
            out_ptr=out, part_out_ptr=part_out, part_lse_ptr=part_lse,
            stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits, NUM_SPLITS_P=triton.next_power_of_2(num_splits),
        )
    return out


# ----------------------------------------------------------------------------------------------
# CPU path


@dataclass(frozen=True)
class DecodePlan:
    """Index tensors of a batch's decode rows. They are the same for every layer of a pass,
    so the model builds them once per forward (plan_decode) instead of once per layer.

    The native kernel reads rows32, lens32 and table32; the torch fallback the other three."""

    rows: torch.Tensor  # [n] int64 query row of each decode sequence
    tables: torch.Tensor  # [n * nblk] int64 block ids to gather; past a sequence's need -> 0
    padding: torch.Tensor  # [n, nblk * BS] True at positions >= the sequence's length
    rows32: torch.Tensor  # [n] int32, rows
    lens32: torch.Tensor  # [n] int32 context length of each decode sequence
    table32: torch.Tensor  # [n, nblk] int32, contiguous: their block-table rows (-> 0 past need)
    max_row: int  # bounds the native call checks (it reads memory unchecked): largest row,
    max_block: int  # largest block id in table32,
    max_len: int  # longest context


def plan_decode(cu_seqlens_q: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                block_size: int, seqs: list[int]) -> DecodePlan | None:
    if not seqs:
        return None
    lens = torch.tensor([seq_lens[b] for b in seqs])
    num_blocks = -(-int(lens.max()) // block_size)
    needed = torch.arange(num_blocks)[None, :] * block_size < lens[:, None]
    table32 = torch.where(needed, block_tables[seqs, :num_blocks], 0).to(torch.int32).contiguous()
    padding = torch.arange(num_blocks * block_size)[None, :] >= lens[:, None]
    rows = torch.tensor([cu_seqlens_q[b] for b in seqs])
    return DecodePlan(rows, table32.reshape(-1).long(), padding, rows.to(torch.int32),
                      lens.to(torch.int32), table32, int(rows.max()), int(table32.max()),
                      int(lens.max()))


def native_decode_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: torch.Tensor) -> bool:
    """Whether kernels/csrc/paged_decode.cpp takes these tensors as they are: fp32 q and out,
    an fp32 or bf16 cache, all on the CPU; head rows of q and out contiguous ([., Hq, D] with
    strides [any, D, 1]); each cache block contiguous ([NB, BS, Hkv, D] with strides
    [block stride, Hkv * D, D, 1], as kv_cache[i, 0] of the model's [L, 2, NB, BS, Hkv, D]
    cache is), K and V with one block stride; a GQA group of at most 64 heads."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    inner = (num_kv_heads * head_dim, head_dim, 1)
    return (q.dtype == out.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
            and {t.device.type for t in (q, out, k_cache, v_cache)} == {"cpu"}
            and q.stride()[1:] == out.stride()[1:] == (head_dim, 1)
            and k_cache.stride()[1:] == v_cache.stride()[1:] == inner
            and k_cache.stride(0) == v_cache.stride(0)
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64)


def paged_decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: DecodePlan | None, scale: float, out: torch.Tensor,
                        level: str | None = None, *, checked: bool = False) -> None:
    """Decode rows as planned, by kernels/csrc/paged_decode.cpp (one call for the batch),
    written straight into rows plan.rows of `out`. K/V are read in place from the paged cache
    (no gather copy); the G query heads of one kv head are computed together, so each K/V row
    is read once per group. level: the native build to use (default: the dispatch level).
    Raises ValueError where native_decode_supported is False or the plan points outside
    q, out or the cache (the kernel itself reads what it is told to). checked: the caller has
    just asked native_decode_supported (paged_decode_cpu, every layer of a step)."""
    if plan is None:
        return
    if not checked and not native_decode_supported(q, k_cache, v_cache, out):
        raise ValueError("paged_decode_native: unsupported tensors (dtypes "
                         f"{q.dtype}/{k_cache.dtype}/{out.dtype}, strides q {q.stride()}, "
                         f"k_cache {k_cache.stride()}, v_cache {v_cache.stride()}, "
                         f"out {out.stride()})")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if (plan.max_row >= min(q.shape[0], out.shape[0]) or plan.max_block >= num_blocks
            or plan.max_len > plan.table32.shape[1] * block_size):
        raise ValueError(f"paged_decode_native: plan out of range (row {plan.max_row} of "
                         f"{q.shape[0]}, block {plan.max_block} of {num_blocks}, length "
                         f"{plan.max_len} > {plan.table32.shape[1]} blocks of {block_size})")
    native.check(native.library(level).tandem_paged_decode(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.dtype == torch.bfloat16), k_cache.stride(0), block_size, num_kv_heads,
        q.shape[1], head_dim, plan.rows32.data_ptr(), plan.lens32.data_ptr(),
        plan.table32.data_ptr(), plan.table32.stride(0), plan.rows32.shape[0], scale,
        out.data_ptr(), out.stride(0)), "paged decode")


def _gather_head_major(cache: torch.Tensor, tables: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Blocks `tables` ([n * nblk]) of cache as fp32 [n, Hkv, nblk * BS, D], contiguous.

    One index_select of whole blocks, then one copy into head-major fp32: batched matmuls on
    a permuted (non-contiguous) K run 5-10x slower on the CPU than this extra copy costs."""
    blocks = cache.index_select(0, tables)                           # [n * nblk, BS, Hkv, D]
    seq_major = blocks.view(num_seqs, -1, *cache.shape[2:])          # [n, S, Hkv, D]
    out = torch.empty(num_seqs, cache.shape[2], seq_major.shape[1], cache.shape[3])
    return out.copy_(seq_major.transpose(1, 2))


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: DecodePlan | None, scale: float, out: torch.Tensor) -> None:
    """The fallback where the native kernels are unavailable (or the tensors do not suit
    them): all sequences at once in torch:

        tables  [n, nblk]                table rows; entries past a sequence's need -> block 0
        K, V    [n, Hkv, nblk * BS, D]   whole blocks gathered, fp32, head-major
        scores  [n, Hkv, S, G] = K @ q^T     (positions >= seq_len -> -inf)
        out     [n, Hkv, G, D] = softmax(scores over S)^T @ V

    K @ q^T (a tall-skinny product) beats q @ K^T by ~2x on one core; per-sequence SDPA is
    slower still for B > 1 and for long contexts. The gather copies every sequence's whole
    context per layer, which the native kernel avoids (benchmarks/bench_attention.py).
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


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan | None, scale: float, out: torch.Tensor, *,
                     use_native: bool = True, level: str | None = None) -> None:
    """Decode (q_len == 1) rows of the batch, as planned, written into `out` ([T, Hq, D]):
    the native kernel (paged_decode_native) where the native library loads and the tensors
    suit it (native_decode_supported: fp32 q, fp32 or bf16 cache, contiguous blocks), else
    the torch gather path (paged_decode_torch). use_native=False forces the torch path;
    level picks the native build (default: the dispatch level)."""
    if plan is None:
        return
    if (use_native and native_decode_supported(q, k_cache, v_cache, out)
            and (level is not None or native.available())):
        paged_decode_native(q, k_cache, v_cache, plan, scale, out, level, checked=True)
    else:
        paged_decode_torch(q, k_cache, v_cache, plan, scale, out)
