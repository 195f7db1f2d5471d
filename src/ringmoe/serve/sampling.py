"""Sampling parameters of a request, and turning one row of logits into the next token.

The order is vLLM's: penalties on the raw logits, then temperature, then the truncations
(min-p, top-k, top-p) of the resulting distribution, then a draw from the request's own
generator (so a request with a seed gives the same tokens whatever else is in the batch).
Log-probabilities returned to the user are those of the model's raw distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["SamplingParams", "next_token", "plain_batch", "TokenChoice", "MAX_LOGPROBS", "NonFiniteLogits",
           "NoAllowedToken", "check_bans", "prompt_choices"]

MAX_LOGPROBS = 20
# below this temperature sampling is greedy (vLLM's rule): dividing logits by 1e-300 overflows to inf
GREEDY_BELOW = 1e-5
# temperature above this is refused: softmax(l / T) is uniform to float32 precision long before
MAX_TEMPERATURE = 100.0
# repetition_penalty divides (or multiplies) logits: bounded away from 0 and infinity
PENALTY_RANGE = (1e-2, 1e2)
SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed takes as a signed 64-bit value
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound on each logit_bias value


class NonFiniteLogits(ValueError):
    """The model produced NaN or +inf logits for a request: that request ends with an error, no other."""


class NoAllowedToken(ValueError):
    """The request's own constraints (its grammar, the tokens ``min_tokens`` bans) leave no token to choose: that
    request ends with an error (its fault: over HTTP a 400), no other."""


def check_bans(params: "SamplingParams", eos_ids, vocab: int) -> None:
    """ValueError naming stop_token_ids where ``min_tokens`` would ban every token of the ``vocab``: its stop ids
    with the end-of-sequence ids (``eos_ids``, in range; none with ignore_eos) cover the vocabulary."""
    eos = () if params.ignore_eos else eos_ids
    if params.min_tokens and len(set(params.stop_token_ids).union(eos)) >= vocab:
        raise ValueError(f"stop_token_ids: with the end-of-sequence ids they are all {vocab} tokens, which "
                         f"min_tokens ({params.min_tokens}) bans: no token could be chosen")


def _number(name, value, low=None, high=None, low_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")


def _int(name, value, low, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    temperature 0 = greedy.  top_k <= 0, top_p 1 and min_p 0 switch those truncations off.
    presence/frequency penalties (OpenAI's, in [-2, 2]) apply to generated tokens; repetition_penalty
    (> 0, 1 = off; logits > 0 divided by it, < 0 multiplied) to prompt and generated tokens.
    stop: strings that end the text (not included in it); stop_token_ids: ids that end it (also not
    included).  max_tokens: new tokens at most; min_tokens: end-of-sequence and stop ids are banned
    before that; max_tokens 0 computes the prompt only (for its prompt logprobs) and ends with "length".
    ignore_eos: keep going past the end-of-sequence token.  logprobs: how many top alternatives to
    return per token (None = none; 0 = the chosen token's only); prompt_logprobs: the same for every
    prompt token (the first has none: nothing precedes it).
    n: parallel samples of the prompt (they share its KV blocks; sample i draws from seed + i).
    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before sampling.
    grammar: a compiled grammar (``structured.GrammarBackend.compile``) the output must follow.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: object | None = None

    def __post_init__(self):
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _int("top_k", self.top_k, -1)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _int("seed", self.seed, SEED_RANGE[0], allow_none=True)
        if self.seed is not None and self.seed > SEED_RANGE[1]:
            raise ValueError(f"seed must be <= {SEED_RANGE[1]} (a signed 64-bit int), got {self.seed}")
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, *PENALTY_RANGE)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for token in self.stop_token_ids:
            _int("stop_token_ids", token, 0)
        # each once (every sampled token is looked up among them; in order, so a request's ids read as given)
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        _int("max_tokens", self.max_tokens, 0)
        _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value, 0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        _int("n", self.n, 1)
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple((token, bias) for token, bias in self.logit_bias))
        for token, bias in self.logit_bias:
            _int("logit_bias", token, 0)
            _number("logit_bias", bias, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)

    @property
    def plain(self) -> bool:
        """Greedy, or temperature with min-p / top-k, and nothing else: no penalty, no bias, no top-p, no top
        logprobs (rows that ``plain_batch`` picks together)."""
        return (self.repetition_penalty == 1.0 and not self.presence_penalty and not self.frequency_penalty
                and not self.logit_bias and not self.logprobs and (self.greedy or self.top_p >= 1.0))

    @property
    def greedy(self) -> bool:
        """temperature 0, or so close to it that dividing by it would overflow: the argmax."""
        return self.temperature < GREEDY_BELOW


@dataclass
class TokenChoice:
    """The token picked, its log-probability, and the top alternatives (id, logprob), best first; for a
    prompt token its rank in the model's distribution (1 = the most likely)."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


def penalized(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties to one row of logits (V,) float32."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def truncated_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request draws from: softmax(logits / T), truncated and renormalised."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    if 0 < params.top_k < probs.shape[0]:
        kth = torch.topk(probs, params.top_k).values[-1]
        keep &= probs >= kth
    if params.top_p < 1.0:
        ordered, order = torch.sort(probs.masked_fill(~keep, 0.0), descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass of the better tokens
        inside = torch.zeros_like(keep)
        inside[order] = before < params.top_p * ordered.sum()  # smallest prefix reaching top_p
        inside[order[0]] = True  # the best token always (top_p * mass can round to 0 in float32)
        keep &= inside
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum()


def next_token(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
               generator: torch.Generator | None, banned: list[int] = (),
               mask: torch.Tensor | None = None) -> TokenChoice:
    """Pick the next token from one row of logits (V,) (any float dtype; computed in float32).

    mask: (V,) float32 added to the logits after the penalties and logit_bias: 0 where a token is allowed,
    -inf where a grammar forbids it.  The returned logprobs are the model's own (before any of that).
    Raises NonFiniteLogits when a logit is NaN or +inf (a broken model or input): the caller ends this
    request alone.  -inf is a legal logit (a banned token)."""
    logits = logits.float()
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise NonFiniteLogits("the model produced NaN or inf logits for this request")
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    adjusted = penalized(logits, params, prompt, output)
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        adjusted.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.tensor(biases, dtype=adjusted.dtype))
    if banned:
        adjusted[torch.tensor(list(banned), dtype=torch.long)] = float("-inf")
    if mask is not None:
        adjusted += mask
    if (banned or mask is not None) and bool(torch.isneginf(adjusted).all()):
        # (argmax would pick token 0, a banned one, and a draw would fail on a NaN distribution)
        causes = [cause for cause, present in (("the grammar", mask is not None),
                                               ("the stop and end-of-sequence ids min_tokens bans", banned)) if present]
        raise NoAllowedToken(f"no token is allowed here: {' and '.join(causes)} exclude every token")
    if params.greedy:
        token = int(torch.argmax(adjusted))
    else:
        token = int(torch.multinomial(truncated_probs(adjusted, params), 1, generator=generator))
    choice = TokenChoice(token, float(raw_logprobs[token]))
    if params.logprobs:
        values, ids = torch.topk(raw_logprobs, min(params.logprobs, raw_logprobs.shape[0]))
        choice.top = list(zip(ids.tolist(), values.tolist()))
    return choice


def plain_batch(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[TokenChoice | None]:
    """``next_token`` for the rows of ``SamplingParams.plain`` requests (nothing banned, no grammar), the
    batch's arithmetic done together: logits (B, V) -> a choice per row, the one ``next_token`` gives it (its
    log-probability only where the row's request asks for logprobs, else None), or None for a row with NaN or +inf
    logits (``next_token`` then raises for that request alone).

    Softmax, the min-p and top-k masks run on the whole batch (row by row they are the same operations);
    each sampled row's renormalisation and draw stay per row, from its own generator, so a seeded request
    draws what it would alone."""
    logits = logits.float()
    tokens, finite = _row_argmax(logits)
    sampled = [r for r, p in enumerate(params) if not p.greedy and finite[r]]
    if sampled:
        chosen = params if len(sampled) == len(params) else [params[r] for r in sampled]
        rows = logits[sampled] if len(sampled) < len(params) else logits
        temperature = torch.tensor([p.temperature for p in chosen], dtype=torch.float32)[:, None]
        probs = torch.softmax(rows / temperature, dim=-1)
        keep = probs >= torch.tensor([p.min_p for p in chosen])[:, None] * probs.amax(dim=1, keepdim=True)
        top_k = [p.top_k if 0 < p.top_k < probs.shape[1] else 0 for p in chosen]  # 0: no cut
        if any(top_k):  # the k-th largest probability of each row that cuts (0 for the others: keeps all)
            best = torch.topk(probs, max(top_k), dim=1).values
            kth = best.gather(1, (torch.tensor(top_k).clamp(min=1) - 1)[:, None])
            keep &= probs >= torch.where(torch.tensor(top_k)[:, None] > 0, kth, torch.zeros_like(kth))
        probs = probs.masked_fill(~keep, 0.0)
        for row, r in enumerate(sampled):
            p = probs[row] / probs[row].sum()
            tokens[r] = int(torch.multinomial(p, 1, generator=generators[r]))
    # the chosen tokens' log-probabilities, of the rows that asked for logprobs only (nothing reads the others': a
    # log-softmax over 32 rows of 4096 logits is ~2% of a compiled batch-32 decode step)
    asked = [r for r, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[float | None] = [None] * len(params)
    if asked:
        rows = logits[asked] if len(asked) < len(params) else logits
        picked = torch.tensor([tokens[r] for r in asked], device=logits.device)[:, None]
        for r, value in zip(asked, torch.log_softmax(rows, dim=1).gather(1, picked)[:, 0].tolist()):
            logprobs[r] = value
    return [TokenChoice(t, lp) if ok else None for t, lp, ok in zip(tokens, logprobs, finite)]


def _row_argmax(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """logits (B, V) float32 -> (each row's argmax: the first index of its largest value, whether the row has
    neither NaN nor +inf), as lists.  On a CPU numpy's vectorised reductions do it: torch's CPU argmax over
    rows of a few thousand logits is 4-6x slower (32 x 4096: 31 us for numpy's argmax, max and compare
    together, 180 us for torch's argmax alone), and so are its any() of isnan / isposinf."""
    if logits.device.type == "cpu":
        values = logits.detach().numpy()
        # a row's max is NaN if it holds a NaN (max propagates it), +inf if it holds +inf: neither is < inf
        return values.argmax(axis=1).tolist(), (values.max(axis=1) < np.inf).tolist()
    finite = ~(torch.isnan(logits).any(dim=1) | torch.isposinf(logits).any(dim=1))
    return torch.argmax(logits, dim=1).tolist(), finite.tolist()


def prompt_choices(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenChoice]:
    """Prompt logprobs: row i of ``logits`` (n, V) predicts ``targets[i]``; its logprob and the ``top``
    best alternatives (the model's raw distribution, float32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[1]), dim=-1)
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in targets]
    return [TokenChoice(t, lp, alt, rank) for t, lp, alt, rank in zip(targets, chosen, alternatives, ranks)]
