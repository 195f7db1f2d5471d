"""The messages between front ends and the engine-core process: msgpack (msgspec) of plain tuples, no pickle.

A message is ZMQ frames: its kind, then msgpack payloads.  Front end -> engine core:
``hello`` (a front end announces itself), ``add`` (request id, prompt ids, sampling parameters),
``abort`` (request id), ``status`` (a token the answer echoes).  Engine core -> front end: ``info``
(``EngineInfo``), ``step`` (the front end's ``RequestOutput``s of one step, then the step's ``StepStats``),
``refused`` (request id, message), ``status`` (token, ``EngineLoad``), ``failed`` (message).

A grammar travels compiled (xgrammar's JSON of the compiled grammar, beside its spec): the front end compiled
it under its time limit, so the engine core only loads it.  A ``RequestOutput``'s whole text and token ids
travel with its last output only (the front end reads them there); its logits never travel.
"""

from __future__ import annotations

import dataclasses

import msgspec

from .engine import StepStats
from .engine_client import EngineInfo, EngineLoad
from .request import RequestOutput
from .sampling import SamplingParams, TokenChoice
from .speculative import SpeculationStats
from .structured import GrammarSpec

__all__ = ["encode", "decode", "params_to_wire", "params_from_wire", "output_to_wire", "output_from_wire",
           "stats_to_wire", "stats_from_wire", "info_to_wire", "info_from_wire", "load_to_wire", "load_from_wire"]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()
_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.name != "grammar"]
_STATS_FIELDS = [f.name for f in dataclasses.fields(StepStats) if f.name != "speculation"]


def encode(value) -> bytes:
    return _encoder.encode(value)


def decode(data: bytes):
    return _decoder.decode(data)


def params_to_wire(params: SamplingParams) -> list:
    """The fields in declaration order, then the grammar as [kind, source, compiled JSON] or None."""
    grammar = params.grammar
    wired = None if grammar is None else [grammar.spec.kind, grammar.spec.source, grammar.serialized()]
    return [getattr(params, name) for name in _PARAM_FIELDS] + [wired]


def params_from_wire(values: list, load_grammar) -> SamplingParams:
    """``load_grammar(spec, compiled_json)`` gives the engine's CompiledGrammar (validation runs again here:
    a malformed message is refused like a malformed request)."""
    if not isinstance(values, list) or len(values) != len(_PARAM_FIELDS) + 1:
        raise ValueError("malformed sampling parameters")
    fields = dict(zip(_PARAM_FIELDS, values))
    fields["logit_bias"] = tuple(tuple(pair) for pair in fields["logit_bias"])
    grammar = values[-1]
    if grammar is not None:
        kind, source, compiled = grammar
        fields["grammar"] = load_grammar(GrammarSpec(kind, source), compiled)
    return SamplingParams(**fields)


def _choice(c: TokenChoice | None):
    return None if c is None else [c.token, c.logprob, [list(t) for t in c.top], c.rank]


def _unchoice(values) -> TokenChoice | None:
    if values is None:
        return None
    token, logprob, top, rank = values
    return TokenChoice(token, logprob, [tuple(t) for t in top], rank)


def output_to_wire(out: RequestOutput) -> list:
    last = out.finished
    return [out.request_id, out.new_token_ids, out.text_delta, out.finished, out.finish_reason,
            [_choice(c) for c in out.logprobs], out.output_ids if last else [], out.text if last else "",
            out.timings, out.error, out.error_type, out.group_id, out.index,
            None if out.prompt_logprobs is None else [_choice(c) for c in out.prompt_logprobs]]


def output_from_wire(values: list) -> RequestOutput:
    (request_id, new_ids, delta, finished, reason, logprobs, output_ids, text, timings, error, error_type, group_id,
     index, prompt_logprobs) = values
    return RequestOutput(request_id, new_ids, delta, finished, reason, [_unchoice(c) for c in logprobs], output_ids,
                         text, timings, error=error, error_type=error_type, group_id=group_id, index=index,
                         prompt_logprobs=None if prompt_logprobs is None else [_unchoice(c) for c in prompt_logprobs])


def stats_to_wire(stats: StepStats) -> list:
    spec = stats.speculation
    return [getattr(stats, name) for name in _STATS_FIELDS] + [
        [spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.accepted_per_position]]


def stats_from_wire(values: list) -> StepStats:
    stats = StepStats(**dict(zip(_STATS_FIELDS, values)))
    stats.speculation = SpeculationStats(*values[-1])
    return stats


def info_to_wire(info: EngineInfo) -> list:
    return list(dataclasses.astuple(info))


def info_from_wire(values: list) -> EngineInfo:
    info = EngineInfo(*values)
    return dataclasses.replace(info, eos_ids=tuple(info.eos_ids))


def load_to_wire(load: EngineLoad) -> list:
    return [load.running, load.waiting, load.kv_usage, load.ranks]


def load_from_wire(values: list) -> EngineLoad:
    return EngineLoad(*values)
