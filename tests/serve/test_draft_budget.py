"""The goodput rule of speculative decoding (``draft_budget.py``): the drafts a step keeps maximise its expected
tokens per second (checked against every choice on small cases), the measured acceptance and step times are what
it reads, and an engine using it generates exactly what it generates without drafts."""

from __future__ import annotations

import itertools
import random

import pytest

from ringmoe.model import MoETransformer, preset
from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.draft_budget import EXPLORE_EVERY, GoodputBudget
from ringmoe.serve.speculative import SpeculativeConfig

PATTERN = [5, 9, 17, 33, 2, 7]
PROMPTS = [PATTERN * 5, list(range(40, 60)) * 2, [3, 4] * 10 + [8], [11]]
NEW = [24, 17, 20, 9]


def _budget(acceptance: list[tuple[int, int]], seconds: dict[int, float]) -> GoodputBudget:
    """A budget that has seen, per draft position, (proposed, accepted) and these step times."""
    budget = GoodputBudget()
    budget.proposed = [p for p, _ in acceptance]
    budget.accepted = [a for _, a in acceptance]
    budget.seconds = dict(seconds)
    return budget


def _goodput(budget: GoodputBudget, kept: list[int], rows: int, ids=None) -> float:
    ids = ids or [None] * len(kept)
    tokens = rows + sum(sum(budget.acceptance(n, request_id)) for n, request_id in zip(kept, ids))
    return tokens / budget.cost(rows + sum(kept))


def test_before_any_step_is_measured_every_draft_is_kept():
    assert GoodputBudget().lengths([4, 0, 2], 3) == [4, 0, 2]


def test_the_measured_case_of_one_request():
    """One request on the demo model (compiled step seconds by rows as measured; acceptance by position 0.65, 0.39,
    0.30, 0.30): a fourth draft costs more (0.24 ms) than its 0.30 tokens bring, the third does not."""
    seconds = {1: 1.05, 2: 1.24, 3: 1.38, 4: 1.41, 5: 1.65}
    budget = _budget([(98, 64), (98, 38), (98, 29), (98, 29)], seconds)
    assert budget.lengths([4], 1) == [3]
    assert _goodput(budget, [3], 1) > max(_goodput(budget, [n], 1) for n in (0, 1, 2, 4))


def test_a_first_draft_that_does_not_pay_alone_can_open_the_way_to_several_that_do():
    """One request, the second row of a step costing half a step more and the rows after it little (as one request's
    compiled step on this CPU): the first draft alone lowers the tokens per second, all four raise them."""
    budget = _budget([(100, 45), (100, 40), (100, 40), (100, 40)], {1: 1.0, 2: 1.5, 3: 1.55, 4: 1.58, 5: 1.6})
    assert _goodput(budget, [1], 1) < _goodput(budget, [0], 1) < _goodput(budget, [4], 1)
    assert budget.lengths([4], 1) == [4]


@pytest.mark.parametrize("seed", range(40))
def test_the_kept_drafts_maximise_goodput(seed):
    """Random acceptance, and step seconds growing linearly with the rows (at random rates; even seeds) or at random
    per row count (odd seeds: a step's time need not grow evenly, nor at all): no other choice of drafts per
    request (each a prefix of its proposal) gives more expected tokens per second."""
    rng = random.Random(seed)
    positions = rng.randint(1, 4)
    proposed = [rng.randint(5, 60) for _ in range(positions)]
    seconds = ({r: 1.0 + rng.uniform(0.0, 0.6) * r for r in (1, 2)} if seed % 2 == 0 else
               {r: rng.uniform(1.0, 3.0) for r in range(1, 24)})
    budget = _budget([(p, rng.randint(0, p)) for p in proposed], seconds)
    proposals = [rng.randint(0, positions) for _ in range(rng.randint(1, 4))]
    rows = len(proposals) + rng.randint(0, 3)  # running requests, some without drafts
    ids = [f"r{j}" for j in range(len(proposals))]
    for request_id in ids:  # each request's own history
        for _ in range(rng.randint(0, 5)):
            count = rng.randint(1, positions)
            budget.observe_acceptance(count, rng.randint(0, count), request_id)
    kept = budget.lengths(proposals, rows, ids)
    assert all(0 <= k <= p for k, p in zip(kept, proposals))
    best = max(_goodput(budget, list(choice), rows, ids)
               for choice in itertools.product(*(range(p + 1) for p in proposals)))
    assert _goodput(budget, kept, rows, ids) == pytest.approx(best, rel=1e-12)


def test_many_requests_on_a_busy_machine_carry_no_drafts():
    """Sixteen requests whose step grows by 6% of its time per row: a draft accepted half of the time is not
    worth its row."""
    budget = _budget([(10, 5)], {16: 1.0, 17: 1.06})
    assert budget.lengths([1] * 16, 16) == [0] * 16


def test_acceptance_is_a_non_increasing_estimate_with_a_prior():
    budget = GoodputBudget()
    assert budget.acceptance(2) == [0.5, 0.5]
    budget.observe_acceptance(3, 1)
    budget.observe_acceptance(3, 3)
    budget.observe_acceptance(1, 1)
    # position 0: 3 accepted of 3, position 1: 1 of 2, position 2: 1 of 2; prior one in two
    assert budget.acceptance(4) == pytest.approx([4 / 5, 2 / 4, 2 / 4, 2 / 4])
    budget.observe_acceptance(2, 0)
    budget.observe_acceptance(2, 0)
    assert budget.acceptance(3) == pytest.approx([4 / 7, 2 / 6, 2 / 6])


def test_a_requests_own_acceptance_weighs_on_its_drafts():
    """A request whose drafts were all accepted keeps more than the engine-wide rate justifies, one whose drafts were
    all rejected fewer; a request that left is forgotten."""
    budget = _budget([(40, 20), (20, 10)], {1: 1.0, 2: 1.3, 3: 1.6})
    for _ in range(6):
        budget.observe_acceptance(2, 2, "looping")
        budget.observe_acceptance(2, 0, "writing")
    looping, writing = budget.acceptance(2, "looping"), budget.acceptance(2, "writing")
    anyone = budget.acceptance(2)
    assert looping[0] > anyone[0] > writing[0] and looping[1] > anyone[1] > writing[1]
    g0 = (20 + 6 + 1) / (40 + 12 + 2)  # the engine-wide estimate, now with both requests' drafts
    assert looping[0] == pytest.approx((6 + 4 * g0) / (6 + 4))
    assert budget.lengths([2, 2], 2, ["looping", "writing"]) == [2, 0]
    budget.forget("looping")
    assert budget.acceptance(2, "looping") == anyone and set(budget.by_request) == {"writing"}


def test_step_cost_reads_between_and_past_the_measured_row_counts():
    budget = GoodputBudget()
    assert budget.cost(3) is None
    budget.observe_step(2, 2.0)
    assert budget.cost(1) == budget.cost(5) == 2.0  # one count measured: its cost everywhere
    budget.observe_step(4, 3.0)
    assert budget.cost(3) == pytest.approx(2.5)
    assert budget.cost(6) == pytest.approx(4.0)  # the slope of the two largest
    assert budget.cost(1) == 2.0
    budget.observe_step(4, 4.0)  # the median of the recent steps
    assert budget.cost(4) == pytest.approx(3.5)
    budget.observe_step(4, 3.0)
    budget.observe_step(4, 90.0)  # one stalled step moves the median by no more than one place
    assert budget.cost(4) == pytest.approx(3.5)


def test_every_sixteenth_choice_keeps_one_draft_more():
    """A row count the rule stopped at is measured again: every EXPLORE_EVERY-th choice with drafts keeps the next
    draft the rule turned down (the likeliest: request 5's, whose own drafts were all accepted)."""
    budget = _budget([(10, 5)], {16: 1.0, 17: 1.06})
    budget.observe_acceptance(1, 1, "r5")
    ids = [f"r{j}" for j in range(16)]
    kept = [budget.lengths([1] * 16, 16, ids) for _ in range(2 * EXPLORE_EVERY)]
    one_more = [0] * 5 + [1] + [0] * 10
    explored = [i for i, k in enumerate(kept) if k == one_more]
    assert explored == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert all(k == [0] * 16 for i, k in enumerate(kept) if i not in explored)
    assert budget.lengths([0] * 16, 16) == [0] * 16  # nothing proposed: not a choice
    assert budget.choices == 2 * EXPLORE_EVERY


def test_config_key_is_checked():
    assert SpeculativeConfig.parse('{"method": "ngram", "draft_length": "goodput"}').draft_length == "goodput"
    assert SpeculativeConfig.parse({"method": "mtp"}).draft_length == "fixed"
    with pytest.raises(ValueError, match="draft_length"):
        SpeculativeConfig.parse({"method": "ngram", "draft_length": "auto"})


def _generate(engine):
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, NEW)]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def test_an_engine_keeps_what_pays_and_generates_the_same_tokens():
    """float64 tiny model, n-gram drafts: with the measured budget, with steps priced so that no draft pays, and
    with every row free, the tokens are those of decoding without drafts; the budget measured the engine's
    decode-only steps and every verified draft."""
    model = MoETransformer(preset("tiny")).double()
    model.init_weights(3, std=0.3)
    want = _generate(Engine(model, block_size=4))
    config = {"method": "ngram", "num_speculative_tokens": 3, "draft_length": "goodput"}

    engine = Engine(model, block_size=4, speculative_config=config)
    assert _generate(engine) == want
    budget, stats = engine.draft_budget, engine.spec_stats
    assert stats.num_draft_tokens > 0 and budget.seconds
    assert max(budget.seconds) <= len(PROMPTS) * 4 and min(budget.seconds) >= 1
    assert budget.proposed[0] == stats.num_drafts and sum(budget.proposed) == stats.num_draft_tokens
    assert sum(budget.accepted) == stats.num_accepted_tokens
    assert budget.by_request == {}  # every request finished: nothing of them stays

    for price, drafts in ((lambda rows: 1.0 + 10.0 * rows, False), (lambda rows: 1.0, True)):
        engine = Engine(model, block_size=4, speculative_config=config)
        engine.draft_budget.seconds = {rows: price(rows) for rows in range(1, 20)}
        engine.draft_budget.observe_step = lambda rows, seconds: None  # these prices stay
        engine.draft_budget.explore_every = None
        assert _generate(engine) == want
        assert (engine.spec_stats.num_draft_tokens > 0) == drafts
        if drafts:  # every row free: every proposed draft is kept, as with draft_length "fixed"
            fixed = Engine(model, block_size=4, speculative_config={**config, "draft_length": "fixed"})
            assert _generate(fixed) == want
            assert engine.spec_stats.num_draft_tokens == fixed.spec_stats.num_draft_tokens
