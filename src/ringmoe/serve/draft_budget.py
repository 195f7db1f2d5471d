"""How many of its drafts each request carries into a step: the step's expected tokens per second (its goodput).

A drafted token costs a row of the step whether or not it is accepted.  Where a step is cheap per row (one request
on a CPU, where the step is mostly fixed overhead) verifying several drafts is nearly free; where the rows already
keep the machine busy (many requests) each draft row adds its share of the step's time, and drafts that are
accepted a third of the time slow decoding down (measured with prompt lookup on the demo model, every draft
verified: 0.60x at a steady load of 16 requests, ``bench_spec.py``).  SmartSpec's rule (Liu et al., 2024, "Optimizing Speculative Decoding for Serving Large
Language Models Using Goodput") chooses the drafts of a step to maximise

    goodput = E[tokens the step yields] / time of the step,

with E[tokens] = sum over requests of (1 + sum_i P(draft i accepted)) (every request yields its one token, and
draft i counts when drafts 1..i are all accepted) and the step's time a function of its rows.  Both are measured
here as the engine runs:

- ``P(draft i accepted)``: per draft position, accepted / proposed over the verified drafts so far (with a prior of
  one acceptance in two), and for each request its own counts with that as their prior (``REQUEST_PRIOR``
  pseudo-counts: a request looping over its own text accepts most drafts, one writing new text few; SmartSpec
  too keeps each request's acceptance), made non-increasing in i (draft i + 1 is accepted only after draft i);
- the step's seconds per row count: the median of the last ``WINDOW`` decode-only steps (every item one token and
  its drafts) that ran with that many rows (a median: one step stalled by the collector or another process must not
  price a row count out for good), read between measured counts linearly; a count past the largest measured is
  read with the slope of the two largest (none measured yet: drafts are all kept, which measures them).  A count
  the rule stops using is measured no more, so every ``EXPLORE_EVERY``-th step with drafts keeps the next draft the
  rule turned down too (one row: the count the rule stopped at is measured again, at the cost of one row).

Drafts are ordered the likeliest first (a request's draft i + 1 only after its draft i), so that the first n of the
order are the n drafts that yield the most expected tokens; the step keeps the first n for the n that maximises
(r + sum of their p) / c(r + n), r the rows without drafts, every n compared.  (Stopping at the first draft that
does not raise the goodput, p <= T (c(r + 1) - c(r)) / c(r), would be the same where c grows evenly; measured on
this CPU it does not: one request's compiled step cost 1.0 ms at one row, 1.5 ms at two and 1.6 ms at five, so the
first draft never paid alone and the rule kept too few: 1.09x against 1.30x with every draft, ``bench_spec.py``.)
The choice never changes what a request generates (every draft is verified by the rule of ``speculative.py``), only
how fast.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import statistics

__all__ = ["GoodputBudget"]

PRIOR = 1.0  # pseudo-counts: one acceptance in two before anything is measured
REQUEST_PRIOR = 4.0  # pseudo-counts of the engine-wide estimate in a request's own
WINDOW = 15  # a row count's cost: the median of its last this many steps
EXPLORE_EVERY = 16  # every this many choices with drafts proposed, one draft more than the rule's is kept


class GoodputBudget:
    """The measured acceptance per draft position and step seconds per row count, and the drafts they justify."""

    def __init__(self):
        self.proposed: list[int] = []  # per draft position: drafts verified there
        self.accepted: list[int] = []  # per draft position: drafts accepted there
        self.by_request: dict[str, tuple[list[int], list[int]]] = {}  # request id -> its (proposed, accepted)
        self.seconds: dict[int, float] = {}  # rows of a decode-only step -> median of its recent seconds
        self._recent: dict[int, collections.deque] = {}
        self.choices = 0  # choices made with drafts proposed
        self.explore_every: int | None = EXPLORE_EVERY  # None: never a draft past the rule's choice

    def observe_acceptance(self, proposed: int, accepted: int, request_id: str | None = None) -> None:
        """One request's verified drafts: ``proposed`` of them, the first ``accepted`` accepted."""
        counts = [(self.proposed, self.accepted)]
        if request_id is not None:
            counts.append(self.by_request.setdefault(request_id, ([], [])))
        for proposed_at, accepted_at in counts:
            while len(proposed_at) < proposed:
                proposed_at.append(0)
                accepted_at.append(0)
            for i in range(proposed):
                proposed_at[i] += 1
                accepted_at[i] += i < accepted

    def forget(self, request_id: str) -> None:
        """A request has left the engine."""
        self.by_request.pop(request_id, None)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows took ``seconds``."""
        recent = self._recent.setdefault(rows, collections.deque(maxlen=WINDOW))
        recent.append(seconds)
        self.seconds[rows] = statistics.median(recent)

    def acceptance(self, count: int, request_id: str | None = None) -> list[float]:
        """P(draft i accepted) for i = 0 .. count - 1 (of request ``request_id``'s drafts), non-increasing."""
        proposed_at, accepted_at = self.by_request.get(request_id, ([], []))
        probabilities, last = [], 1.0
        for i in range(count):
            p = (self.accepted[i] + PRIOR) / (self.proposed[i] + 2 * PRIOR) if i < len(self.proposed) else 0.5
            if i < len(proposed_at):
                p = (accepted_at[i] + REQUEST_PRIOR * p) / (proposed_at[i] + REQUEST_PRIOR)
            last = min(last, p)
            probabilities.append(last)
        return probabilities

    def cost(self, rows: int) -> float | None:
        """Estimated seconds of a decode-only step of ``rows`` rows; None before any step is measured."""
        if rows in self.seconds:
            return self.seconds[rows]
        known = sorted(self.seconds)
        if not known:
            return None
        at = bisect.bisect(known, rows)
        if 0 < at < len(known):  # between two measured counts
            low, high = known[at - 1], known[at]
            return self.seconds[low] + (self.seconds[high] - self.seconds[low]) * (rows - low) / (high - low)
        if at == 0 or len(known) == 1:  # below every measured count: no cheaper than the smallest; past the only
            return self.seconds[known[0]]  # measured count: its cost (so the drafts run, and are measured)
        low, high = known[-2], known[-1]
        slope = max(0.0, (self.seconds[high] - self.seconds[low]) / (high - low))
        return self.seconds[high] + slope * (rows - high)

    def lengths(self, proposals: list[int], rows: int, request_ids: list[str] | None = None) -> list[int]:
        """How many of its drafts each request keeps: ``proposals[j]`` drafts proposed for request j (whose id is
        ``request_ids[j]``), ``rows`` the step's rows without drafts (one per request it runs)."""
        if self.cost(rows) is None:
            return list(proposals)
        if any(proposals):
            self.choices += 1
        explore = self.explore_every is not None and any(proposals) and self.choices % self.explore_every == 0
        ids = request_ids if request_ids is not None else [None] * len(proposals)
        probabilities = [self.acceptance(count, request_id) for count, request_id in zip(proposals, ids)]
        # the drafts in the order they are worth adding: each request's next one, the likeliest first (for any
        # number n of drafts, the first n of this order yield the most tokens any n drafts can); the step keeps the
        # first n for the n of the highest goodput, looked for over every n: a step's seconds need not grow evenly
        # with its rows (on a CPU the first row past one request's can cost several of the next: another graph,
        # more experts read), so the first draft that does not pay alone may still open the way to several that do
        order = []  # (request, its draft's probability); a heap of each request's next draft (ties: the first)
        heads = [(-probabilities[j][0], j, 0) for j in range(len(proposals)) if proposals[j]]
        heapq.heapify(heads)
        while heads:
            p, j, i = heapq.heappop(heads)
            order.append((j, -p))
            if i + 1 < proposals[j]:
                heapq.heappush(heads, (-probabilities[j][i + 1], j, i + 1))
        tokens, step = float(rows), self.cost(rows)
        count, best_tokens, best_step = 0, tokens, step
        for n, (_, p) in enumerate(order, start=1):
            tokens, step = tokens + p, self.cost(rows + n)
            if tokens * best_step > best_tokens * step:  # a higher tokens per second (ties: the fewer drafts)
                count, best_tokens, best_step = n, tokens, step
        if explore:  # one row more than the rule keeps: the cost it stopped at, measured again
            count = min(count + 1, len(order))
        kept = [0] * len(proposals)
        for j, _ in order[:count]:
            kept[j] += 1
        return kept
