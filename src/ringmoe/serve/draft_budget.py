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

Drafts are added one at a time, the likeliest first (a request's draft i + 1 only after its draft i): a draft with
acceptance probability p, added to a step of r rows yielding T expected tokens, raises the goodput when
(T + p) / c(r + 1) > T / c(r), i.e. p > T (c(r + 1) - c(r)) / c(r); the first draft that does not is where it stops.
The choice never changes what a request generates (every draft is verified by the rule of ``speculative.py``), only
how fast.
"""

from __future__ import annotations

import bisect
import collections
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
        kept = [0] * len(proposals)
        tokens, step = float(rows), self.cost(rows)
        while True:
            # the likeliest next draft: each request's next one (its probability falls with the position)
            best = max((j for j in range(len(proposals)) if kept[j] < proposals[j]),
                       key=lambda j: probabilities[j][kept[j]], default=None)
            if best is None:
                return kept
            p, longer = probabilities[best][kept[best]], self.cost(rows + 1)
            if (tokens + p) * step <= tokens * longer:  # it would not raise tokens per second
                if explore:  # one row more than the rule keeps: the cost it stopped at, measured again
                    kept[best] += 1
                return kept
            kept[best] += 1
            tokens, step, rows = tokens + p, longer, rows + 1
