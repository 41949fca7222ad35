"""The tensors of one forward pass over a ragged batch, built by the model runner.

Layout for B sequences and T = sum of their new tokens (decodes contribute 1 token each,
prefill chunks any number):

    input_ids     [T]    new tokens, sequence after sequence
    positions     [T]    absolute position of each new token in its sequence
    slot_mapping  [T]    cache slot of each new token: block_table[pos // bs] * bs + pos % bs
    cu_seqlens_q  [B+1]  new-token offsets: sequence b owns rows cu[b]:cu[b+1]
    seq_lens      [B]    context length after this pass (cached prefix + new tokens)
    block_tables  [B, M] each sequence's block ids, padded with 0 (never read past seq_lens)
    logits_indices[S]    rows whose hidden state becomes logits (last token of sequences
                         that sample in this pass; a speculative verification's last token
                         and each of its draft tokens)
    has_decode           whether any sequence is in its decode phase (feeds back a generated
                         token) rather than a prompt chunk; a colocated model holding two
                         weight formats picks its copy by it (engine/models/llama.py)
    rows_as_decodes      every multi-token sequence is a decode (a speculative verification:
                         its last token and drafts), so each of its rows may be attended as a
                         one-token decode at its own position (kernels/attention.py); the
                         pass then qualifies for the native decode call
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    # None: not stated (a batch built by hand); the model then counts one-token sequences.
    has_decode: bool | None = None
    # Called as on_layer_done(layer_index) right after a layer's K/V is in the cache: the
    # prefill worker uses it to start that layer's transfer while later layers compute.
    on_layer_done: Callable[[int], None] | None = None
    rows_as_decodes: bool = False

    def to(self, device: torch.device) -> "ForwardBatch":
        """The same batch with its tensors on `device` (itself when they already are)."""
        if self.input_ids.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return ForwardBatch(move(self.input_ids), move(self.positions), move(self.slot_mapping),
                            move(self.cu_seqlens_q), move(self.seq_lens), move(self.block_tables),
                            move(self.logits_indices), self.has_decode, self.on_layer_done,
                            self.rows_as_decodes)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
