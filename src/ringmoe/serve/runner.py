"""One model step on one rank: a packed batch of work items, K/V in paged buffers.

The runner owns, per layer, K and V buffers of shape (num_blocks, block_size, kv_heads, head_dim), in the model's
dtype or, for an FP8 cache (``kv_cache_dtype="fp8_e4m3"``), as uint8 e4m3 codes with per-layer scales
(``kv_scales.py``): ``write`` encodes, every reader decodes what it gathers.
A step packs the new tokens of every item of this rank's ep group into one (1, tokens) row, each
with its own positions, and runs the model once; the MoE layers see all of them together (and,
under expert parallelism, meet the other ep groups' tokens in the all-to-all: a rank with no item
still runs the step with an empty batch, so no exchange waits for it).

Attention per item kind (``paged`` prompt chunks and decodes at cp = 1; ``ring`` prefill and sharded
``decode`` merged over the cp group at cp > 1) is the step's ``StepAttention`` (``step_attention.py``),
the ``AttentionBackend`` the runner hands the model.

``step`` returns the final hidden state (hidden,) of the last token of every item marked ``report``
that this rank holds (the driver turns them into logits and samples), and under the key
``("all", request_id)`` the hidden states (n, hidden) of every token of an item marked ``report_all``
(a prompt chunk whose prompt logprobs were asked for).  An item's ``copies`` (block copies of a
copy on write) are made before any token of the step is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.paged import read_cache
from ..float8 import decode_e4m3, encode_e4m3
from ..prepacked import prepack_module
from ..model.transformer import MoETransformer
from ..parallel.layout import positions as layout_positions, shard
from ..parallel.ring import RingStats
from .decode_graph import DecodeGraph
from .kv_scales import calibrate_kv_scales, kv_cache_is_fp8
from .placement import owned_prefill_positions, padded_length
from .step_attention import StepAttention

__all__ = ["ModelRunner", "WorkItem"]


@dataclass
class WorkItem:
    """Tokens ``token_ids`` at positions start .. start + len - 1 of request ``request_id``.

    kind: "paged" | "ring" | "decode".  tables: the request's block table on each cp rank.
    ring_len: tokens prefilled by the ring in the request's current residency (cp > 1).
    report: the driver needs the last token's hidden state (a new token is due).
    generated: every token of the item is a generated one, computed alone as a decode (in
    deterministic mode such items may use the fast kernel: a decode at position p always has the
    same shapes; prompt positions, whose chunking varies, use the fixed-tile kernel).
    """

    request_id: str
    token_ids: list[int]
    start: int
    tables: list[list[int]]
    kind: str = "paged"
    ring_len: int = 0
    report: bool = True
    generated: bool = False
    report_all: bool = False
    copies: list[tuple[int, int]] | None = None
    drafts: int = 0  # the last ``drafts`` tokens are speculative drafts the step verifies (report_all is set)
    previous: torch.Tensor | None = None  # an MTP item: the states (n, hidden) its module reads (``mtp_step``)
    keep_hidden: bool = False  # a ring item whose rows each rank keeps for the MTP pass after the step


def store_head_input_major(model: MoETransformer) -> None:
    """Keep the LM head's weight (vocab, hidden) in memory as its transpose (hidden, vocab) is laid out: same
    values, shape and parameter, strides (1, vocab).  A step computes logits for a few rows at a time (one per
    running request), and a CPU GEMM of few rows streams a (hidden, vocab) operand along its rows much faster
    than it takes the dot products of a (vocab, hidden) one: a batch-1 head 138 -> 84 us, batch 8 282 -> 149 us
    with this machine's MKL on 2 threads (a prompt's many rows run alike either way).  On CPUs only, before the
    decode graph is compiled (its code assumes the strides it was traced with); a tied embedding shares the
    layout (its lookups read strided rows: a few per step)."""
    weight = model.lm_head.weight
    if weight.dim() == 2 and weight.stride(0) != 1:
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()


class ModelRunner:
    def __init__(self, model: MoETransformer, num_blocks: int, block_size: int, backend: str = "auto",
                 deterministic: bool = False, decode_graph: str = "off", kv_cache_dtype: str = "auto",
                 prepack_weights: bool = False):
        """decode_graph: how decode-only steps run: "compiled" (``DecodeGraph`` under torch.compile),
        "static" (the same padded fixed-shape step, eager), "off" (the general eager step).
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (one byte per cached value).
        prepack_weights: keep oneDNN copies of the weights the eager products use (CPU float32, not in the
        deterministic mode: its fixed tiles are the point there); ``prepacked_bytes`` counts them."""
        if decode_graph not in ("compiled", "static", "off"):
            raise ValueError(f"decode_graph must be 'compiled', 'static' or 'off', got {decode_graph!r}")
        fp8 = kv_cache_is_fp8(kv_cache_dtype)
        config = model.config
        param = model.embed_tokens.weight
        self.model, self.block_size, self.backend = model.eval(), block_size, backend
        if param.device.type == "cpu":
            store_head_input_major(model)
        self.prepacked_bytes = prepack_module(model) if prepack_weights and not deterministic else 0
        self.deterministic = deterministic
        self.mesh, self.layout = model.mesh, model.layout
        self.latent = config.mla  # MLA: the cache holds each token's latent and RoPE key, once (K = V)
        # one block past the block manager's: the scratch block, where padding rows of a decode graph write
        self.scratch_block = num_blocks
        if self.latent:
            shape = (num_blocks + 1, block_size, 1, config.kv_lora_rank + config.qk_rope_head_dim)
        else:
            shape = (num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        storage = torch.uint8 if fp8 else param.dtype
        layers = config.num_layers + config.mtp_layers  # the multi-token prediction modules' caches last
        # one buffer (layers, K and V (MLA: the latent once), *shape): each layer's K and V are views of it, so a
        # decode graph's new K/V of every layer (layers, 2, B, ...) go in with one write (``DecodeGraph.run``)
        self.kv_buffer = torch.zeros(layers, 1 if self.latent else 2, *shape, dtype=storage, device=param.device)
        self.k_cache = list(self.kv_buffer[:, 0].unbind(0))
        self.v_cache = self.k_cache if self.latent else list(self.kv_buffer[:, 1].unbind(0))
        # per layer (k_scale, v_scale) of the FP8 cache, else None; MLA's one latent buffer has one scale
        self.kv_scales = calibrate_kv_scales(model, self.latent) if fp8 else None
        self.ring_stats = RingStats()
        self.history: list[dict] = []  # per step, when the engine records them
        self.kept: dict[str, torch.Tensor] = {}  # the last step's rows of its keep_hidden ring items
        # a decode graph's step: its real rows' assignments per MoE layer and expert (moe layers, E) int64, read once
        # by the engine (the layers' ``last_stats`` are made from them only when read); None after any other step
        self.expert_counts: torch.Tensor | None = None
        # steps run in parts: decode rows in the decode graph, prompt chunks in its prompt graph, the rest eagerly
        self.split_steps = 0  # (``step``: two parts or more)
        self.decode_graph = None  # a model that cannot run the fixed-shape step (capacity, replicas) never has one
        if decode_graph != "off" and model.static_ready:
            self.decode_graph = DecodeGraph(self, decode_graph == "compiled")

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def bytes_per_token(self) -> int:
        first = self.k_cache[0]
        copies = 1 if self.latent else 2
        return copies * len(self.k_cache) * first[0, 0].numel() * first.element_size()

    def kv_scale(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s FP8 scales (k_scale, v_scale), or None for a cache in the model's dtype."""
        return None if self.kv_scales is None else self.kv_scales[index]

    def encode(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V as layer ``index``'s cache stores them (e4m3 codes for an FP8 cache, else unchanged)."""
        if self.kv_scales is None:
            return k, v
        k_scale, v_scale = self.kv_scales[index]
        return encode_e4m3(k, k_scale), encode_e4m3(v, v_scale)

    def as_cached(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V as a later read of layer ``index``'s cache returns them (an FP8 cache's e4m3 round trip): what a
        prefill that attends without reading the cache (the ring) must see, to match the paged path."""
        if self.kv_scales is None:
            return k, v
        k_scale, v_scale = self.kv_scales[index]
        k_codes, v_codes = self.encode(index, k, v)
        return decode_e4m3(k_codes, k_scale, k.dtype), decode_e4m3(v_codes, v_scale, v.dtype)

    def slots(self, table: list[int], local: range) -> list[int]:
        """Cache slots (block * block_size + offset) of a request's local positions ``local``."""
        return [table[i // self.block_size] * self.block_size + i % self.block_size for i in local]

    def write(self, index: int, slots: list[int] | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``index``'s K/V (n, kv_heads, D) into cache slots ``slots`` (a list, or an int64 tensor on the
        runner's device)."""
        if len(slots) == 0:
            return
        at = slots if isinstance(slots, torch.Tensor) else torch.tensor(slots, dtype=torch.long, device=self.device)
        k, v = self.encode(index, k, v)
        self.k_cache[index].view(-1, *k.shape[1:]).index_copy_(0, at, k)
        self.v_cache[index].view(-1, *v.shape[1:]).index_copy_(0, at, v)

    def gather(self, index: int, table: list[int], count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's first ``count`` cached tokens of a request: K, V (count, kv_heads, head_dim)."""
        blocks = torch.tensor(table[: -(-count // self.block_size)], dtype=torch.long, device=self.device)
        blocks = blocks.clamp(min=0)  # entries given back under a sliding window: outside it, never attended
        k_scale, v_scale = self.kv_scale(index) or (None, None)
        dtype = self.model.embed_tokens.weight.dtype
        k = read_cache(self.k_cache[index], blocks, k_scale, dtype).flatten(0, 1)[:count]
        v = read_cache(self.v_cache[index], blocks, v_scale, dtype).flatten(0, 1)[:count]
        return k, v

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer's K and V (a copy on write)."""
        source = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        destination = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for cache in {id(c): c for c in self.k_cache + self.v_cache}.values():  # MLA: K and V are one buffer
            cache.index_copy_(0, destination, cache.index_select(0, source))

    def _pack(self, items: list[WorkItem]) -> tuple[torch.Tensor, torch.Tensor, list, StepAttention]:
        """This rank's tokens of ``items`` as one packed row: ids (1, T) and positions (T,) on the runner's device,
        spans (item, offset, local length), and the step's attention (each item by its kind)."""
        cp, cp_rank = self.mesh.cp, self.mesh.cp_rank
        ids, positions, spans = [], [], []  # spans: (item, offset, local length)
        for item in items:
            if item.kind == "ring":
                padded = padded_length(item.ring_len, cp, self.layout)
                full = torch.tensor(item.token_ids + [0] * (padded - item.ring_len))
                local = shard(full, cp, cp_rank, self.layout, dim=0).tolist()
                where = layout_positions(padded, cp, cp_rank, self.layout).tolist()
            else:
                local, where = item.token_ids, list(range(item.start, item.start + len(item.token_ids)))
            spans.append((item, len(ids), len(local)))
            ids += local
            positions += where
        kinds = {kind: [span for span in spans if span[0].kind == kind] for kind in ("paged", "decode", "ring")}
        attention = StepAttention(self, kinds["paged"], kinds["decode"], kinds["ring"])
        device = self.device
        return (torch.tensor([ids], dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device), spans, attention)

    def _reports(self, spans: list, hidden: torch.Tensor) -> dict:
        """{request_id: the state of the item's last position} for reported items this rank holds (a ring item: the
        rank holding its last real position), {("all", request_id): every row} for items marked report_all."""
        cp, cp_rank = self.mesh.cp, self.mesh.cp_rank
        reports = {}
        for item, offset, n in spans:
            if item.report_all and (item.kind == "paged" or item.kind == "decode" and cp_rank == 0):
                reports[("all", item.request_id)] = hidden[offset:offset + n]  # decode rows: the same on every rank
            if not item.report:
                continue
            if item.kind == "ring":
                last = item.ring_len - 1
                held = owned_prefill_positions(item.ring_len, cp, cp_rank, self.layout)
                if held and held[-1] == last:  # the rank holding the last real position reports it
                    reports[item.request_id] = hidden[offset + len(held) - 1]
            elif item.kind == "paged" or cp_rank == 0:  # decode rows are the same on every cp rank
                reports[item.request_id] = hidden[offset + n - 1]
        return reports

    @torch.no_grad()
    def mtp_step(self, items: list[WorkItem], plan: list[list[WorkItem]] | None = None) -> dict:
        """The model's first multi-token prediction module over this rank's items (possibly none): item positions
        start .. start + n - 1 read the states one depth down (``previous`` (n, hidden); a ring item: this rank's
        rows of the ring prefill the last ``step`` kept, ``keep_hidden``) and ``token_ids``, the tokens one place
        ahead; their K/V go to the module's cache (layer num_layers) as the item's kind places them.
        {request_id: the module's normed state (hidden,) at the item's last position} (its head's logits draft
        the token two places ahead of that position); a pass of decode-like items runs as the decode graph's MTP
        graph (``DecodeGraph.run``, with its ``LOGITS``).  On a mesh ``plan``: every ep group's items, as ``step``."""
        if self.decode_graph is not None and DecodeGraph.accepts(self, items, plan, mtp=True):
            return self.decode_graph.run(items, plan, mtp=True)
        ids, positions, spans, attention = self._pack(items)
        dtype, width = self.model.embed_tokens.weight.dtype, self.model.config.hidden_size
        previous = [self.kept.pop(item.request_id) if item.kind == "ring" else item.previous.to(self.device, dtype)
                    for item in items]
        previous = torch.cat(previous) if previous else torch.zeros(0, width, dtype=dtype, device=self.device)
        hidden = self.model.mtp_hidden_states(previous[None], ids, positions, attention)[0]
        return self._reports(spans, hidden)

    @torch.no_grad()
    def step(self, items: list[WorkItem], plan: list[list[WorkItem]] | None = None) -> dict:
        """Run this rank's items (possibly none); {request_id: hidden (hidden_size,)} for reported items held here
        (and {("all", request_id): hidden (n, hidden_size)} for items marked report_all).  The rows of ring items
        marked ``keep_hidden`` stay on this rank (``kept``) for the MTP pass that follows the step.  On a mesh
        ``plan``: every ep group's items, this rank's among them (whether the step runs as a decode graph is decided
        on all of them, the same way on every rank)."""
        self.kept, self.expert_counts = {}, None
        graph = self.decode_graph
        if graph is not None and DecodeGraph.accepts(self, items, plan):
            return graph.run(items, plan)
        if graph is not None and plan is None and self.mesh.size == 1 and not graph.mtp:
            # a step admitting a prompt beside running requests: their decode rows (and drafts) through the graph,
            # the prompt chunks through its prompt graphs where it runs them (``DecodeGraph.prefill``), the rest
            # eagerly (at 16 clients such a step took ~70 ms all eager, a graph step of 16-64 rows 4-8 ms)
            graphed = [DecodeGraph.accepts(self, [item]) for item in items]
            prompts = [not g and DecodeGraph.takes_prompt(self, item) for item, g in zip(items, graphed)]
            if (any(graphed) or any(prompts)) and not all(graphed):
                return self._split_step([item for item, g in zip(items, graphed) if g],
                                        [item for item, p in zip(items, prompts) if p],
                                        [item for item, g, p in zip(items, graphed, prompts) if not (g or p)])
        return self._eager_step(items)

    def _split_step(self, decoding: list[WorkItem], prompts: list[WorkItem], rest: list[WorkItem]) -> dict:
        """One process: ``decoding`` (items the decode graph accepts) as a graph step, then ``prompts`` (chunks its
        prompt graphs take) through those, then ``rest`` eagerly; the reports of all (the decode graph's ``LOGITS``
        cover its own items only) and the MoE counts of all."""
        graph, reports, counts = self.decode_graph, {}, []
        if decoding:
            reports |= graph.run(decoding)
            counts.append(self.expert_counts)
        if prompts:
            reports |= graph.prefill(prompts)
            counts.append(self.expert_counts)
        if rest:
            reports |= self._eager_step(rest)
            eager = [stats.tokens_per_expert for stats in self.model.moe_stats() if stats is not None]
            counts.append(torch.stack(eager) if eager else None)
        self.split_steps += sum(map(bool, (decoding, prompts, rest))) > 1
        if counts and all(c is not None and c.shape == counts[0].shape for c in counts):
            self.expert_counts = sum(c.to(counts[0]) for c in counts[1:]) + counts[0]
        else:
            self.expert_counts = None
        return reports

    def _eager_step(self, items: list[WorkItem]) -> dict:
        """``step``'s items through the model's eager forward."""
        copies = [c for item in items for c in item.copies or ()]
        if copies:
            self.copy_blocks(copies)
        ids, positions, spans, attention = self._pack(items)
        hidden = self.model.hidden_states(ids, positions, attention)[0]
        for item, offset, n in spans:
            if item.keep_hidden:
                self.kept[item.request_id] = hidden[offset:offset + n]
        return self._reports(spans, hidden)

