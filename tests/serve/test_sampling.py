"""Sampling: validation, seeds, the truncated distributions (chi-square against the exact one), penalties."""

from __future__ import annotations

import math

import pytest
import torch

from ringmoe.serve.sampling import SamplingParams, next_token, penalized, plain_batch, truncated_probs

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
                                          ("top_p", 1.5), ("min_p", -0.1), ("top_k", 1.5), ("max_tokens", -1),
                                          ("presence_penalty", 3), ("repetition_penalty", 0), ("logprobs", 21),
                                          ("stop", [""]), ("seed", "1"), ("stop_token_ids", [-1]), ("n", 0),
                                              ("logit_bias", ((1, 101.0),)), ("prompt_logprobs", 21)])
def test_every_field_is_validated_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def _exact(params):
    """The distribution by hand: softmax(l / T); min-p, top-k, top-p truncations; renormalise."""
    p = [math.exp(x / params.temperature) for x in LOGITS.tolist()]
    p = [x / sum(p) for x in p]
    keep = [True] * len(p)
    if params.min_p:
        keep = [k and x >= params.min_p * max(p) for k, x in zip(keep, p)]
    if params.top_k:
        kth = sorted(p, reverse=True)[params.top_k - 1]
        keep = [k and x >= kth for k, x in zip(keep, p)]
    if params.top_p < 1:
        order = sorted(range(len(p)), key=lambda i: -p[i] if keep[i] else 0)
        mass, inside = 0.0, set()
        total = sum(x for x, k in zip(p, keep) if k)
        for i in order:
            if keep[i] and mass < params.top_p * total:
                inside.add(i)
                mass += p[i]
        keep = [k and i in inside for i, k in enumerate(keep)]
    q = [x if k else 0.0 for x, k in zip(p, keep)]
    return [x / sum(q) for x in q]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(top_k=3),
                                    SamplingParams(top_p=0.8, temperature=1.3), SamplingParams(min_p=0.2),
                                    SamplingParams(top_k=5, top_p=0.9, min_p=0.05, temperature=0.9)])
def test_draws_follow_the_exact_truncated_distribution(params):
    exact = _exact(params)
    assert torch.allclose(truncated_probs(LOGITS, params), torch.tensor(exact, dtype=torch.float32), atol=1e-6)
    gen = torch.Generator().manual_seed(11)
    n = 20_000
    counts = torch.zeros(len(exact))
    for _ in range(n):
        counts[next_token(LOGITS, params, [], [], gen).token] += 1
    support = [i for i, p in enumerate(exact) if p > 0]
    assert all(counts[i] == 0 for i, p in enumerate(exact) if p == 0)  # nothing outside the truncation
    chi2 = sum((counts[i].item() - n * exact[i]) ** 2 / (n * exact[i]) for i in support)
    # 99.9% quantile of chi-square with len(support) - 1 degrees of freedom stays below 3 * dof + 12
    assert chi2 < 3 * (len(support) - 1) + 12, (chi2, counts.tolist(), exact)


def test_stop_token_ids_are_kept_once_each_in_order():
    assert SamplingParams(stop_token_ids=[7, 3, 7, 3, 9] * 1000).stop_token_ids == (7, 3, 9)


def test_a_seed_reproduces_and_greedy_takes_the_argmax():
    params = SamplingParams(temperature=1.0, seed=5)
    draw = lambda: [next_token(LOGITS, params, [], [], torch.Generator().manual_seed(5)).token for _ in range(1)]
    first = [next_token(LOGITS, params, [], [], g).token for g in [torch.Generator().manual_seed(5)] for _ in range(50)]
    second = [next_token(LOGITS, params, [], [], g).token for g in [torch.Generator().manual_seed(5)] for _ in range(50)]
    assert first == second and len(set(first)) > 1 and draw() == first[:1]
    assert next_token(LOGITS, SamplingParams(temperature=0), [], [], None).token == 0


def test_penalties_match_a_hand_computation():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    prompt, output = [1, 6], [0, 0, 3]
    got = penalized(LOGITS, params, prompt, output)
    want = LOGITS.clone()
    for token in {0, 1, 3, 6}:  # repetition: prompt and output, divide positives, multiply negatives
        want[token] = want[token] / 2 if want[token] > 0 else want[token] * 2
    want[0] -= 0.25 * 2 + 0.5  # frequency x count + presence, output tokens only
    want[3] -= 0.25 * 1 + 0.5
    assert torch.allclose(got, want)


def test_logprobs_are_the_raw_distribution_and_banned_tokens_are_never_picked():
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=5.0)
    choice = next_token(LOGITS, params, [0], [], None, banned=[1])
    raw = torch.log_softmax(LOGITS, -1)
    assert choice.token == 2  # 0 is penalised below 2, 1 is banned
    assert choice.logprob == pytest.approx(raw[2].item())
    assert [t for t, _ in choice.top] == [0, 1, 2]


@pytest.mark.parametrize("temperature", [1e-300, 1e-9, 9.99e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    for seed in range(5):
        assert next_token(LOGITS, params, [], [], torch.Generator().manual_seed(seed)).token == 0


@pytest.mark.parametrize("top_p", [1e-300, 1e-30, 1e-8])
def test_a_vanishing_top_p_keeps_the_best_token(top_p):
    probs = truncated_probs(LOGITS, SamplingParams(top_p=top_p))
    assert torch.isfinite(probs).all() and probs[0] == 1 and probs[1:].sum() == 0


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1e-320), ("repetition_penalty", 1e300),
                                          ("temperature", 1e300), ("seed", 2**63), ("seed", -(2**63) - 1)])
def test_values_that_would_overflow_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_non_finite_logits_raise_their_own_error_and_minus_inf_is_a_legal_logit():
    from ringmoe.serve.sampling import NonFiniteLogits

    for bad in (float("nan"), float("inf")):
        logits = LOGITS.clone()
        logits[3] = bad
        with pytest.raises(NonFiniteLogits):
            next_token(logits, SamplingParams(temperature=0), [], [], None)
    logits = LOGITS.clone()
    logits[0] = float("-inf")
    assert next_token(logits, SamplingParams(temperature=0), [], [], None).token == 1


@pytest.mark.parametrize("temperature", [0, 1.0])
@pytest.mark.parametrize("masked", [False, True])
def test_when_bans_and_a_grammar_leave_no_token_the_request_fails_by_its_own_error(temperature, masked):
    from ringmoe.serve.sampling import NoAllowedToken

    params = SamplingParams(temperature=temperature, seed=3)
    mask = torch.full_like(LOGITS, float("-inf"))
    mask[[2, 5]] = 0.0  # the grammar allows 2 and 5
    banned = [2, 5] if masked else list(range(len(LOGITS)))
    with pytest.raises(NoAllowedToken, match="no token is allowed"):
        next_token(LOGITS, params, [], [], torch.Generator().manual_seed(0), banned, mask if masked else None)
    # a token left: the grammar's one left is chosen, greedy or drawn; without a grammar never the banned one
    for seed in range(5):
        kept = next_token(LOGITS, params, [], [], torch.Generator().manual_seed(seed), [2], mask if masked else None)
        assert kept.token == 5 if masked else kept.token != 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_plain_batch_picks_what_each_row_picks_alone(seed):
    """Greedy, temperature, min-p and top-k rows (and one with NaN logits) sampled together: every row's token
    equals ``next_token``'s for the same generator state, draw after draw, and so does its logprob where the row
    asks for logprobs."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 301
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0.7, logprobs=0),
              SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.0, min_p=0.05, logprobs=0),
              SamplingParams(temperature=0.9, top_k=40, min_p=0.01), SamplingParams(temperature=2.0, top_k=vocab + 10),
              SamplingParams(temperature=0.5), SamplingParams(temperature=0)]
    assert all(p.plain for p in params) and not SamplingParams(top_p=0.9).plain
    alone = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
    together = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
    for _ in range(20):
        logits = torch.randn(len(params), vocab, generator=gen) * 3
        logits[-2, 7] = float("nan")
        batch = plain_batch(logits, params, together)
        assert batch[-2] is None  # its request alone ends with an error (next_token raises)
        for row in [r for r in range(len(params)) if r != len(params) - 2]:
            p, choice = params[row], batch[row]
            single = next_token(logits[row], p, [1, 2], [3], alone[row])
            assert choice.token == single.token
            # the log-probability where the request asks for logprobs (none computed for the others)
            assert choice.logprob == (single.logprob if p.logprobs is not None else None)


def test_a_plain_batch_breaks_ties_and_reads_infinities_as_argmax_does():
    """Rows whose maximum repeats take its first index (torch.argmax's rule); a row with +inf ends its request
    (None), a row of -inf with one finite logit takes that one."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 64, generator=gen)
    logits[0, [9, 3, 40]] = 5.0
    logits[1, [60, 61]] = 7.5
    logits[2, 11] = float("inf")
    logits[3] = float("-inf")
    logits[3, 17] = -2.0
    batch = plain_batch(logits, [SamplingParams(temperature=0, logprobs=0)] * 5, [None] * 5)
    assert [c.token if c is not None else None for c in batch] == [3, 60, None, 17, int(torch.argmax(logits[4]))]
    assert batch[3].logprob == 0.0
