"""Prefill attention over the paged KV cache: a FlashAttention-2 Triton kernel and a CPU path.

Same contract as kernels/attention.py (ragged batch, causal, GQA, K/V read through block
tables), so both also serve prefill chunks that continue a cached prefix, and decodes
(q_len == 1 is just a one-token chunk).

Triton kernel, one program per (query tile, kv head):

    rows of a tile = BLOCK_Q query tokens x GROUP query heads that share one kv head
        row r -> token tile_start + r // GROUP, query head kv_head * GROUP + r % GROUP
    so K/V tiles are loaded once per GQA group, and a decode fills GROUP rows, not one.

    tiles of sequence b: ceil(q_len_b / BLOCK_Q), numbered from cu_seqlens_q[b] // BLOCK_Q + b.
    The grid has T // BLOCK_Q + B tiles (an upper bound on the sum), so it is known without
    reading cu_seqlens_q on the host; each program binary-searches its sequence and spare
    programs exit at once.

    key loop: positions 0 .. (last query position of the tile), BLOCK_N at a time, each key's
    block id gathered from the block table, online softmax in fp32 (exp2 with log2(e) folded
    into the scale), causal mask: key position <= query position.

CPU path: torch's scaled_dot_product_attention per group of sequences with equal (q_len,
seq_len); fresh prefills use is_causal=True, chunks with a cached prefix an explicit
bottom-right-aligned causal mask.
"""

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, record_launch, triton, tl

_LOG2E = 1.4426950408889634


if HAS_TRITON:

    @triton.jit
    def _find_sequence(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
        """Largest b with cu_seqlens_q[b] // BLOCK_Q + b <= tile (tile numbering above)."""
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
            if first_tile <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _flash_attention_kernel(
        q_ptr,                 # [T, Hq, D]
        k_cache_ptr,           # [NB, BS, Hkv, D]
        v_cache_ptr,           # [NB, BS, Hkv, D]
        out_ptr,               # [T, Hq, D]
        cu_seqlens_q_ptr,      # [B + 1] int32
        seq_lens_ptr,          # [B] int32
        block_tables_ptr,      # [B, max_blocks] int32
        qk_scale,              # float: softmax scale * log2(e)
        num_seqs,              # B
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,             # block_tables.stride(0); stride(1) must be 1
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,    # next_pow2(HEAD_DIM), >= 16
        GROUP: tl.constexpr,         # Hq // Hkv
        BLOCK_SIZE: tl.constexpr,    # tokens per cache block
        BLOCK_Q: tl.constexpr,       # query tokens per tile
        BLOCK_M: tl.constexpr,       # rows per tile, pow2 >= BLOCK_Q * GROUP, >= 16
        BLOCK_N: tl.constexpr,       # keys per step, pow2 >= 16
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored for 16-bit)
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = _find_sequence(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        tile_in_seq = tile - (q_start // BLOCK_Q + seq)
        if tile_in_seq * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len                     # cached positions before the chunk

        rows = tl.arange(0, BLOCK_M)
        q_idx = tile_in_seq * BLOCK_Q + rows // GROUP             # query index within the chunk
        head = kv_head * GROUP + rows % GROUP
        row_mask = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = prefix + q_idx                                    # absolute position
        d = tl.arange(0, HEAD_DIM_P)
        d_mask = d < HEAD_DIM
        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :] * stride_qd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
        block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        key_end = tl.minimum(seq_len, prefix + (tile_in_seq + 1) * BLOCK_Q)
        for start in range(0, key_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_mask = n < key_end
            # int64: block id * stride_kb passes 2**31 elements in a large cache.
            block = tl.load(block_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            slot = n % BLOCK_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                        + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # Padding rows see no key: keep them finite (their output is never stored).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                        + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :] * stride_od,
                 acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def check_paged_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                               block_tables: torch.Tensor, allow_fp32_queries: bool = False) -> None:
    """Raise ValueError unless the arguments follow the paged-attention contract (shapes,
    dtypes, devices, unit inner strides). Values (lengths, block ids) are not read: that
    would cost a host sync on the GPU."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache, v_cache must be [NB, BS, Hkv, D] of one shape, got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and cache ({k_cache.shape[3]}) differ")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"Hq ({num_heads}) must be a multiple of Hkv ({num_kv_heads})")
    mixed_ok = allow_fp32_queries and q.dtype == torch.float32 and k_cache.dtype in (torch.bfloat16, torch.float16)
    if k_cache.dtype != v_cache.dtype or (q.dtype != k_cache.dtype and not mixed_ok):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"seq_lens must be [B] and cu_seqlens_q [B + 1], got "
                         f"{tuple(seq_lens.shape)}, {tuple(cu_seqlens_q.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [B={num_seqs}, max_blocks], got "
                         f"{tuple(block_tables.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens),
                    ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"caches on {k_cache.device}/{v_cache.device}, q on {q.device}")
    if num_seqs and block_tables.shape[1] and block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous (stride(1) == 1)")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches get full fp32 products (torch's default); 16-bit inputs ignore the flag.
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_tiles(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for prefill: 64 x 64, and 64 x 32 past head_dim 128 (registers);
    BLOCK_M grows to hold one token's whole GQA group when the group is larger."""
    block_m = max(64, triton.next_power_of_2(group))
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n


def flash_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, *,
                           block_m: int | None = None, block_n: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the FlashAttention-2 kernel on a ragged batch (any mix of chunk lengths).

    q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; cu_seqlens_q: [B+1] int32;
    seq_lens: [B] int32; block_tables: [B, max_blocks] int32 -> out [T, Hq, D].
    block_m / block_n override the tile heuristic (powers of two, >= 16); tests use small
    ones to cross tile tails. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1.
    """
    if not HAS_TRITON:
        raise RuntimeError("flash_attention_triton needs triton installed")
    check_paged_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    default_m, default_n = _prefill_tiles(group, head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if block_m < group:
        raise ValueError(f"block_m ({block_m}) must hold one GQA group ({group} heads)")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got "
                         f"{tuple(out.shape)}, {out.dtype}")
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    record_launch("flash_attention")
    _flash_attention_kernel[grid](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, out_ptr=out,
        cu_seqlens_q_ptr=cu_seqlens_q, seq_lens_ptr=seq_lens, block_tables_ptr=block_tables,
        qk_scale=scale * _LOG2E, num_seqs=num_seqs,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_qd=q.stride(2),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2), stride_kd=k_cache.stride(3),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2), stride_vd=v_cache.stride(3),
        stride_bt=block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), GROUP=group,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4 if head_dim <= 64 else 8,
    )
    return out


# ----------------------------------------------------------------------------------------------
# CPU path


def gather_sequence_kv(cache: torch.Tensor, block_tables: torch.Tensor, seqs: list[int],
                       length: int) -> torch.Tensor:
    """The first `length` positions of sequences `seqs` as [len(seqs), length, Hkv, D].

    Gathers whole blocks (one index_select of BS * Hkv * D contiguous rows each), which is
    several times faster than gathering slot by slot. Table entries past a sequence's last
    needed block are never read, so their value does not matter.
    """
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    rows = block_tables[seqs, :num_blocks].reshape(-1).long()
    blocks = cache.index_select(0, rows)                  # [n * num_blocks, BS, Hkv, D]
    return blocks.view(len(seqs), num_blocks * block_size, *cache.shape[2:])[:, :length]


def flash_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: list[int], seq_lens: list[int],
                        block_tables: torch.Tensor, scale: float, seqs: list[int],
                        out: torch.Tensor) -> None:
    """Attention for sequences `seqs` of the batch, written into `out` ([T, Hq, D]).

    cu_seqlens_q, seq_lens: the batch's index tensors as Python lists (read once by the
    caller). Sequences with equal (q_len, seq_len) share one SDPA call. Fresh prefills
    (q_len == seq_len) use is_causal; chunks after a cached prefix a bottom-right mask:

        keys   0 1 2 3 4 5       (prefix 3, chunk of 3)
        q@3    x x x x . .
        q@4    x x x x x .
        q@5    x x x x x x
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for b in seqs:
        groups.setdefault((cu_seqlens_q[b + 1] - cu_seqlens_q[b], seq_lens[b]), []).append(b)
    group = q.shape[1] // k_cache.shape[2]
    for (q_len, seq_len), members in groups.items():
        if q_len == 0:
            continue
        qb = torch.stack([q[cu_seqlens_q[b]:cu_seqlens_q[b] + q_len] for b in members])
        # A bf16 (or fp16) cache under fp32 queries: SDPA wants one dtype, so the gathered
        # context is upcast (the cache itself stays in its dtype).
        keys = gather_sequence_kv(k_cache, block_tables, members, seq_len).to(qb.dtype)
        values = gather_sequence_kv(v_cache, block_tables, members, seq_len).to(qb.dtype)
        mask = None
        if q_len != seq_len:
            q_pos = torch.arange(seq_len - q_len, seq_len)
            mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]     # True = attend
        o = F.scaled_dot_product_attention(
            qb.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1)
        o = o.transpose(1, 2)                                           # [n, L, Hq, D]
        for i, b in enumerate(members):
            out[cu_seqlens_q[b]:cu_seqlens_q[b] + q_len] = o[i]
