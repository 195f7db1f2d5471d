"""Drafting with DeepSeek-V3's multi-token prediction module (``speculative_config={"method": "mtp"}``).

The module (``model/mtp.py``) at position i reads the main model's final-norm hidden state h_i and the token
t_{i+1} and predicts t_{i+2}.  It is a transformer block with a paged KV cache of its own (the runner's layer
num_layers, in the request's block table), so after every engine step it must see each position the step
computed, in order:

* catch-up: a request whose step computed positions start .. c - 1 (c = its ``num_computed`` after the step:
  accepted tokens only) runs the module on those positions, reading the step's hidden states of them
  (``report_all``) and the tokens t_{start+1} .. t_c (t_c: the token the step sampled, or mid-prompt the next
  prompt token); the module's K/V of those positions are written, overwriting what an earlier draft pass left;
* draft 1: the module's state at position c - 1 gives, by the shared head, the greedy guess of t_{c+1}: the token
  after the one the next step feeds (t_c);
* drafts 2 .. k: the module runs again at positions c, c + 1, ... on its own state and its previous draft
  (vLLM's chaining of one MTP module); their K/V go to slots that the next step's catch-up overwrites, in blocks
  grown for them ahead of the scheduler (with no free block the request drafts fewer tokens).

Every pass is one packed batch over the engine's requests (on a mesh, a plan every rank runs: the module's MoE
exchanges its tokens like any layer); with the engine's decode graph, a pass of decode-like items (a verified
step's rows, a chained draft; not a prompt chunk's) runs as a graph of its own (``DecodeGraph.run`` with ``mtp``),
its head's greedy choice made inside it, and on one process the catch-up needs no pass where the step's graph ran
the module over its rows (``DRAFTED``: each row read the graph's greedy token) and the request took those tokens
(``_caught_up``).  Drafts are greedy; the target's rule (``verify_drafts``) keeps the output
distribution exact whatever they are.  A request never drafts when its rows are not plain (``can_speculate``),
and requests that can never draft (penalties, n > 1) skip the module altogether.  A prefix-cache hit
reuses the module's K/V written by the request that computed those blocks (the last position of a block read the
token after it in that request): drafts may differ, outputs cannot.
"""

from __future__ import annotations

import torch

from .decode_graph import DRAFTED, LOGITS
from .kv_cache import NoFreeBlocks
from .request import Request, Status
from .runner import WorkItem

__all__ = ["MTPDrafter"]


class MTPDrafter:
    """The engine's MTP drafting passes; ``k`` drafts per request and step at most."""

    def __init__(self, engine, k: int):
        self.engine, self.k = engine, k
        self.caught_up_by_steps = 0  # requests' catch-ups that the model's graph step ran itself (``DRAFTED``)

    @staticmethod
    def tracks(request: Request) -> bool:
        """Whether the module follows ``request`` (it may draft for it some day: plain rows and one sample;
        min_tokens only delays drafting)."""
        return request.params.plain and request.params.n == 1

    def propose(self, request: Request, room: int) -> list[int]:
        return request.mtp_drafts[:room]

    def after_step(self, plan: list[list[WorkItem]], reports: dict) -> None:
        """Catch the module up on what the step computed (``plan`` and its ``reports``) and leave each request due
        to decode its drafts in ``request.mtp_drafts``."""
        engine = self.engine
        catch_up, due = [[] for _ in plan], []
        states, guesses = {}, {}  # per request: the module's last state, and its first draft, where known
        for group, items in enumerate(plan):
            for item in items:
                request = engine.requests.get(item.request_id)
                if request is None or request.status != Status.RUNNING or not self.tracks(request):
                    continue
                request.mtp_drafts = []
                computed = request.num_computed - item.start  # accepted positions of this step
                if computed < 1 or (item.kind != "ring" and ("all", item.request_id) not in reports):
                    continue
                if not self._caught_up(item, request, computed, reports, states, guesses):
                    catch_up[group].append(self._catch_up(item, request, computed, reports))
                room = engine.draft_room(request, group)
                if room > 0 and request.output_ids and request.remaining == 1:
                    due.append((group, request, room))
        if any(catch_up):
            passed, _ = engine.run_plan(catch_up, mtp=True)
            pending = [request.request_id for _, request, _ in due if request.request_id not in states]
            states.update((request_id, passed[request_id]) for request_id in pending)
            guesses.update(zip(pending, self._greedy(passed, pending)))
        for _, request, _ in due:  # the first draft: the head's greedy guess from the module's last state
            request.mtp_drafts.append(guesses[request.request_id])
        while True:  # one more draft per pass, from the module's state after its previous draft
            due = [(group, request, room) for group, request, room in due
                   if len(request.mtp_drafts) < min(room, self.k) and self._grow(group, request)]
            if not due:
                return
            states, _ = engine.run_plan(self._chain(due, states, len(plan)), mtp=True)
            for (_, request, _), token in zip(due, self._greedy(states, [r.request_id for _, r, _ in due])):
                request.mtp_drafts.append(token)

    def _chain(self, due: list, states: dict, groups: int) -> list[list[WorkItem]]:
        """The next pass: each request's module on its own last state (``states``) and its last draft, one position
        further."""
        cp = self.engine.mesh.cp
        plan = [[] for _ in range(groups)]
        for group, request, _ in due:
            blocks = self.engine.groups[group].blocks
            tables = blocks.block_table(request.request_id)
            plan[group].append(WorkItem(request.request_id, [request.mtp_drafts[-1]],
                                        request.num_computed + len(request.mtp_drafts) - 1,
                                        tables if cp > 1 else [tables], "decode" if cp > 1 else "paged",
                                        blocks.ring_len[request.request_id] if cp > 1 else 0,
                                        previous=states[request.request_id][None]))
        return plan

    def _caught_up(self, item: WorkItem, request: Request, computed: int, reports: dict, states: dict,
                   guesses: dict) -> bool:
        """Whether the step itself ran the module over its rows for ``request`` the way the catch-up would (a graph
        step of the engine's with ``DRAFTED``: each row read the graph's greedy token, so where the request took
        those tokens, the first ``computed`` of them): then its last state and first draft join ``states`` and
        ``guesses``, and no catch-up pass is needed (its rows' K/V past the accepted ones are overwritten later,
        as a draft pass's are)."""
        drafted, head = reports.get(DRAFTED), reports.get(LOGITS)
        if drafted is None or item.request_id not in head.spans:
            return False
        first = head.spans[item.request_id][0]
        if head.tokens[first:first + computed] != request.all_ids[item.start + 1:item.start + computed + 1]:
            return False  # (a sampled token, or a draft the rule accepted other than greedily)
        last = first + computed - 1
        states[item.request_id], guesses[item.request_id] = drafted.states[last], drafted.tokens[last]
        self.caught_up_by_steps += 1
        return True

    @staticmethod
    def _catch_up(item: WorkItem, request: Request, computed: int, reports: dict) -> WorkItem:
        """The module's pass over the ``computed`` positions the step's ``item`` added: the tokens one place ahead,
        placed as the item's own (a ring prefill's rows stay on their ranks: ``keep_hidden``)."""
        ahead = request.all_ids[item.start + 1:request.num_computed + 1]
        if item.kind == "ring":
            return WorkItem(item.request_id, ahead, 0, item.tables, "ring", item.ring_len)
        return WorkItem(item.request_id, ahead, item.start, item.tables, item.kind, item.ring_len,
                        previous=reports[("all", item.request_id)][:computed])

    def _greedy(self, states: dict, request_ids: list[str]) -> list[int]:
        """The head's greedy guess from each request's last state of a pass (``states``: its reports): the decode
        graph's choice where the pass ran as one on this process (``LOGITS``), else the head applied here."""
        if not request_ids:
            return []
        head = states.get(LOGITS)
        if head is not None:
            return [token for token, _ in head.last_rows(request_ids)[1]]
        with torch.no_grad():
            last = torch.stack([states[request_id] for request_id in request_ids])
            return self.engine.model.lm_head(last.to(self.engine.runner.device)).argmax(-1).tolist()

    def _grow(self, group: int, request: Request) -> bool:
        """Blocks for the next chained pass's position (num_computed + drafts - 1); False when none is free."""
        blocks = self.engine.groups[group].blocks
        try:
            blocks.grow(request.request_id, request.num_computed + len(request.mtp_drafts))
        except NoFreeBlocks:
            return False
        return True
