"""The one place where the coordinator's typed values map onto worker.proto messages (sampling
options go through engine.wire, which the workers use to read them back)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.rpc import worker_pb2 as pb
from engine.sampling_params import SamplingParams
from engine.wire import sampling_to_proto


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


def load_from_status(status: pb.WorkerStatus) -> WorkerLoad:
    return WorkerLoad(
        num_blocks=status.num_blocks,
        num_free_blocks=status.num_free_blocks,
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        queued_prefill_tokens=status.queued_prefill_tokens,
        max_num_batched_tokens=status.max_num_batched_tokens,
        block_size=status.block_size or 16,
    )


def generate_request(request_id: str, prompt_ids: list[int], params: SamplingParams,
                     stop_token_ids: frozenset[int], max_tokens: int,
                     remote_prefill: bool, max_chunk_tokens: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling_to_proto(params),
        stop_token_ids=sorted(stop_token_ids),
        max_tokens=max_tokens,
        remote_prefill=remote_prefill,
        max_chunk_tokens=max_chunk_tokens,
    )


def prefill_request(request_id: str, prompt_ids: list[int], params: SamplingParams,
                    reserved: pb.Reserved, max_chunk_tokens: int = 0) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling_to_proto(params),
        destination=pb.KVDestination(endpoint=reserved.kv_endpoint, backend=reserved.kv_backend,
                                     block_ids=list(reserved.block_ids)),
        max_chunk_tokens=max_chunk_tokens,
    )
