"""The one place where engine types meet the internal protobuf messages (proto/worker.proto).
Torch-free: the coordinator uses it too."""

from __future__ import annotations

from common.logprobs import TokenLogprob
from common.rpc import worker_pb2 as pb
from common.sampling_params import GrammarSpec, SamplingParams

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
                 "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("top_k", "repeat_last_n", "num_predict", "min_tokens")


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    msg = pb.SamplingOptions(**{f: getattr(params, f) for f in _FLOAT_FIELDS + _INT_FIELDS},
                             num_ctx=params.num_ctx or 0, logit_bias=dict(params.logit_bias),
                             no_speculation=not params.speculative)
    if params.seed is not None:
        msg.seed = params.seed
    if params.grammar is not None:
        msg.grammar_kind, msg.grammar = params.grammar.kind, params.grammar.value
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def sampling_from_proto(msg: pb.SamplingOptions) -> SamplingParams:
    """Stop strings, stop_token_ids and ignore_eos are the coordinator's business (it
    detokenizes and sends the stop set beside the options); workers never see them."""
    values = {f: getattr(msg, f) for f in _FLOAT_FIELDS + _INT_FIELDS}
    grammar = GrammarSpec(msg.grammar_kind, msg.grammar) if msg.grammar_kind else None
    return SamplingParams(**values, seed=msg.seed if msg.HasField("seed") else None,
                          num_ctx=msg.num_ctx or None, grammar=grammar,
                          logit_bias=tuple(msg.logit_bias.items()),
                          speculative=not msg.no_speculation,
                          logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                          prompt_logprobs=(msg.prompt_logprobs if msg.HasField("prompt_logprobs")
                                           else None))


def logprobs_to_proto(entries: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
            for e in entries or ()]


def logprobs_from_proto(msgs) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top))
            for m in msgs]
