"""Speculative decoding: a drafter proposes k tokens, the target model scores all k + 1 positions in one step.

A running request whose next step would compute one token (its last sampled one) instead computes that token
and k drafted ones as one multi-token item of the paged step (their K/V are written like a prompt chunk's).
Row i of the item's logits is the target's distribution p_i after draft i - 1.  The drafters here propose one
token per place deterministically (q_i one-hot on d_i), for which the rejection rule of speculative sampling
(accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i), else draw from the residual max(p_i - q_i, 0),
renormalised: p_i without d_i) has an equivalent that needs no extra randomness: draw x_i ~ p_i as decoding would
(argmax when greedy), emit it, and go on to row i + 1 only while x_i = d_i.  d_i is accepted with probability
p_i(d_i), the emitted token is distributed as p_i whatever the draft, and when every draft was accepted the last
row gives one more token (the "bonus").  Each emitted token costs one draw from the request's generator, exactly as
without speculation: a seeded request samples the same tokens with or without drafts wherever its logits are the
same bits (always in the deterministic mode, where every row runs on fixed tiles).  The positions after the
first rejection were computed for nothing: the request's ``num_computed`` counts only accepted tokens, so their
K/V slots are overwritten by the next step, and prefix-cache hashes are taken only over accepted tokens.

Drafters: ``NgramDrafter`` (prompt lookup: the tokens that followed the latest earlier occurrence of the
context's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``; vLLM's keys) and DeepSeek-V3's
multi-token prediction module (``mtp_drafter.py``; method "mtp").  Both propose greedily (one token per place), so
the rule above applies as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from .sampling import NoAllowedToken, NonFiniteLogits, SamplingParams, TokenChoice, truncated_probs

__all__ = ["SpeculativeConfig", "NgramDrafter", "SpeculationStats", "verify_drafts", "can_speculate", "draw",
           "check_finite"]

MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 64


METHODS = ("ngram", "mtp")
DEFAULT_TOKENS = {"ngram": 4, "mtp": 1}  # DeepSeek-V3 ships one MTP module: one draft is what it was trained for
DRAFT_LENGTHS = ("fixed", "goodput")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` keys: method ("ngram": prompt lookup; "mtp": the model's multi-token
    prediction module, drafting one token per pass of it), num_speculative_tokens (default 4 for ngram, 1 for mtp),
    prompt_lookup_min/max (ngram), and disable_by_batch_size: no drafts in a step whose ep group runs at least this
    many requests (where a step is compute-bound, verifying k + 1 tokens per request costs more than the accepted
    drafts save; None: always).  draft_length (ringmoe's): "fixed" verifies every draft proposed (up to
    num_speculative_tokens, vLLM's behaviour); "goodput" keeps, each step, the drafts that raise the step's expected
    tokens per second, from the acceptance and step times measured as the engine runs (``draft_budget.py``)."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    draft_length: str = "fixed"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r} (EAGLE "
                             f"drafters are not built)")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_TOKENS[self.method])
        for name, high in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_min", MAX_LOOKUP),
                           ("prompt_lookup_max", MAX_LOOKUP)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
                raise ValueError(f"speculative_config.{name} must be an int in [1, {high}], got {value!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be a positive int, got {limit!r}")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_config.draft_length must be one of {DRAFT_LENGTHS}, got "
                             f"{self.draft_length!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict or a JSON object string -> a config; ValueError naming a bad key."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config must be a JSON object: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                 "draft_length"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown}; supported: {sorted(known)}")
        lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(value))
        if value.get("method") == "mtp" and lookup:
            raise ValueError(f"speculative_config: {lookup} are for method 'ngram', not 'mtp'")
        return cls(**value)

    def drafter(self) -> "NgramDrafter":
        return NgramDrafter(self.prompt_lookup_min, self.prompt_lookup_max)


class NgramDrafter:
    """Prompt lookup: find an earlier occurrence of the context's last n tokens (n = max .. min) and propose the
    tokens that followed it: the latest occurrence followed by k tokens, else the one followed by the most (in a
    loop of period p the latest occurrence overlaps the suffix and only p tokens follow it)."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (none when no n-gram recurs).  It runs for every running
        request at every step, so the places where the last token recurs are found first by ``list.index`` (a
        scan in C), and only there are the longer n-grams compared: at 4,000 tokens of context ~60 us, where a
        comparison at every place in Python took ~490 us."""
        length = len(tokens)
        if k < 1 or length < 2:
            return []
        last, ends, start = tokens[-1], [], 0  # ends: e < length with tokens[e - 1] == last, ascending
        try:
            while True:
                start = tokens.index(last, start, length - 1) + 1
                ends.append(start)
        except ValueError:
            pass
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            suffix = tokens[length - n:]
            matches = [end for end in ends if end >= n and tokens[end - n:end] == suffix]
            if matches:  # the latest occurrence with k tokens after it, else the one followed by the most
                full = [end for end in matches if end + k <= length]
                end = full[-1] if full else matches[0]
                return tokens[end:end + k]
        return []


def can_speculate(params: SamplingParams, output_len: int) -> bool:
    """Drafts are verified for requests whose rows follow the plain distribution (``SamplingParams.plain``: no
    penalties, bias, top-p or top logprobs), one sample, and no banned tokens any more (min_tokens reached); a
    grammar's mask applies to each row as it is drawn (``draw``)."""
    return params.plain and params.n == 1 and output_len >= params.min_tokens


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
         mask: torch.Tensor | None = None) -> int:
    """The token decoding chooses from one row of logits (V,) float32 of a ``can_speculate`` request: the argmax,
    or one draw from the truncated distribution; ``mask`` (V,) the additive grammar mask (0 / -inf)."""
    if mask is not None:
        logits = logits + mask
        if bool(torch.isneginf(logits).all()):
            raise NoAllowedToken("no token is allowed here: the grammar excludes them all")
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(truncated_probs(logits, params), 1, generator=generator))


def check_finite(logits: torch.Tensor) -> None:
    """NonFiniteLogits when a row is NaN or +inf (the engine ends that request alone)."""
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise NonFiniteLogits("the model produced NaN or inf logits for this request")


def verify_drafts(drafts: list[int], logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> list[TokenChoice]:
    """The tokens a step with ``drafts`` yields (no grammar): the accepted drafts, then one more (the correction at
    the first rejection, or the bonus when all were accepted).  logits (len(drafts) + 1, V): row i is the target's
    distribution after drafts[:i].  For ``can_speculate`` params only.  Raises NonFiniteLogits when a row is NaN
    or +inf.  (The engine runs the same loop row by row, a grammar's mask drawn from its state after the rows
    before: ``Engine._verify``.)"""
    logits = logits.float()
    check_finite(logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = []
    for i in range(len(drafts) + 1):  # draw as decoding would; go on while the draw is the draft
        token = draw(logits[i], params, generator)
        chosen.append(TokenChoice(token, float(logprobs[i, token])))
        if i == len(drafts) or token != drafts[i]:
            return chosen


@dataclass
class SpeculationStats:
    """Counters with vLLM's meaning: drafts (requests x steps that carried drafts), draft tokens proposed,
    accepted tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_position) < proposed:
            self.accepted_per_position.append(0)
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per drafted step: accepted drafts + the one every step yields."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
