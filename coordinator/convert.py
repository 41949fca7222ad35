"""The one place where the coordinator's typed values map onto worker.proto messages (sampling
options go through common.wire, which the workers use to read them back)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.rpc import worker_pb2 as pb
from common.sampling_params import SamplingParams
from common.wire import sampling_to_proto


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as last reported in a heartbeat (WorkerStatus)."""

    num_blocks: int = 0  # KV pool size; 0 = not reported yet
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens accepted but not yet prefilled
    max_num_batched_tokens: int = 0  # per-forward-pass token budget; 0 = not reported
    block_size: int = 16
    # Seconds one prompt token costs its passes (engine/prefill_cost.py); 0 = not reported.
    prefill_token_seconds: float = 0.0
    # Chain hashes of the full blocks its prefix cache holds (engine.block_manager.block_hashes),
    # for prefix-aware placement. A new frozenset per heartbeat, never mutated, so a snapshot
    # taken for one placement stays consistent while the next heartbeat lands.
    cached_hashes: frozenset[bytes] = field(default=frozenset(), repr=False, compare=False)


@dataclass(frozen=True)
class KVCounters:
    """A worker's KV transfer counters since it started (WorkerStatus.kv), as last reported."""

    backend: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    transfer_seconds: float = 0.0  # sum over finished transfers of their duration
    skipped_blocks: int = 0  # blocks not moved because the receiver had them cached
    auth_rejected: int = 0  # KV frames/handshakes refused for want of the cluster secret


@dataclass(frozen=True)
class SpecDecodeCounters:
    """A worker's speculative decoding counters since it started (WorkerStatus.spec_decode)."""

    num_steps: int = 0  # verifications: a request's pass that carried a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + the target's own token, per verification
    method: str = ""  # the proposer ("ngram", "draft"); "" from a worker that predates it


def spec_from_status(status: pb.WorkerStatus) -> SpecDecodeCounters | None:
    """None when the worker does not speculate."""
    if not status.HasField("spec_decode"):
        return None
    s = status.spec_decode
    return SpecDecodeCounters(s.num_steps, s.num_draft_tokens, s.num_accepted_tokens,
                              s.num_emitted_tokens, s.method)


def load_from_status(status: pb.WorkerStatus) -> WorkerLoad:
    return WorkerLoad(
        num_blocks=status.num_blocks,
        num_free_blocks=status.num_free_blocks,
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        queued_prefill_tokens=status.queued_prefill_tokens,
        max_num_batched_tokens=status.max_num_batched_tokens,
        block_size=status.block_size or 16,
        prefill_token_seconds=max(0.0, status.prefill_token_seconds),
        cached_hashes=frozenset(status.cached_block_hashes),
    )


def kv_from_status(status: pb.WorkerStatus) -> KVCounters | None:
    """None when the worker reported no counters (an older worker, or none yet)."""
    if not status.HasField("kv"):
        return None
    kv = status.kv
    return KVCounters(backend=kv.backend, bytes_sent=kv.bytes_sent,
                      bytes_received=kv.bytes_received, transfers_done=kv.transfers_done,
                      transfers_failed=kv.transfers_failed,
                      transfer_seconds=kv.transfer_seconds, skipped_blocks=kv.skipped_blocks,
                      auth_rejected=kv.auth_rejected)


def refused_from_status(status: pb.WorkerStatus) -> dict[tuple[str, str], int]:
    """The worker's refused internal calls, (method, reason) -> count (common/refused_calls.py)."""
    return {(r.method, r.reason): r.count for r in status.refused_calls}


def generate_request(request_id: str, prompt_ids: list[int], params: SamplingParams,
                     stop_token_ids: frozenset[int], max_tokens: int,
                     remote_prefill: bool, max_chunk_tokens: int = 0,
                     transfer_id: str = "", num_prior_output_tokens: int = 0,
                     cache_salt: bytes = b"") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling_to_proto(params),
        stop_token_ids=sorted(stop_token_ids),
        max_tokens=max_tokens,
        remote_prefill=remote_prefill,
        max_chunk_tokens=max_chunk_tokens,
        transfer_id=transfer_id,
        num_prior_output_tokens=num_prior_output_tokens,
        cache_salt=cache_salt,
    )


def prefill_request(transfer_id: str, prompt_ids: list[int], params: SamplingParams,
                    kv_endpoint: str, kv_backend: str, max_chunk_tokens: int = 0,
                    num_prior_output_tokens: int = 0, cache_salt: bytes = b"",
                    stop_token_ids: frozenset[int] = frozenset()) -> pb.PrefillRequest:
    """The prefill worker's request id is the transfer id: unique per attempt of a request."""
    return pb.PrefillRequest(
        request_id=transfer_id,
        transfer_id=transfer_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling_to_proto(params),
        destination=pb.KVDestination(endpoint=kv_endpoint, backend=kv_backend),
        max_chunk_tokens=max_chunk_tokens,
        num_prior_output_tokens=num_prior_output_tokens,
        cache_salt=cache_salt,
        stop_token_ids=sorted(stop_token_ids),
    )
