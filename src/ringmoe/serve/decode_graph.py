"""The decode step as one compiled graph: a batch of one-token decodes padded to a bucket, run by torch.compile.

A step whose every item is one new token of a running request (the steady state of serving) is, apart
from its sizes, always the same computation.  ``DecodeGraph`` turns it into tensors and runs the model's
fixed-shape forward (``MoETransformer.hidden_states_static``) compiled once:

- each row's block table is padded to a power-of-two width, and on a GPU the batch to a bucket size (1, 2, 4,
  8, ... ``max_num_seqs``: CUDA graphs record one launch per shape); padding rows decode token 0 at position 0
  into the runner's scratch block (a block the block manager never hands out) and are dropped after.  On a
  CPU a step runs its own row count (``pads`` False): the compiled code takes the batch as a symbolic size, so
  every count of a range reuses one graph, and a batch of 20 padded to 32 would compute 60% more;
- the paged attention (``paged_decode``: blocks gathered by table, keys past a row's context masked, the
  row's own new key merged by the online softmax) is tensor ops inside the graph, as are the router and
  the experts (``MoELayer.forward_static``): no ``.item()`` / ``.tolist()`` in the layer stack; the graph only
  reads the cache: the rows' final states, every layer's new K/V and each MoE layer's assignments per expert over
  the real rows come out of it, and after it the K/V are written at each row's slot (``index_copy_``) and the
  counts become the MoE statistics, once per step (``ModelRunner.expert_counts``; a layer's ``last_stats`` are
  made from its row only when read).  The LM head and the greedy choice run inside the graph too
  (``HeadOutput``: a greedy request's token is the graph's, a sampled one draws from the graph's logits; a request
  verifying drafts takes the graph's choice for each of its rows), the head multiplying by its panel copy
  (``prepacked.DecodePanels``): measured in one process against the head applied eagerly after the graph (its
  oneDNN copy, then the batch's log-softmax and argmax), the small preset's step 1.12x / 1.13x / 1.11x / 1.03x
  faster at 2 / 8 / 32 / 64 rows (the graph's part grows by the head's product, the host's shrinks by more); before
  the products had panel copies in the graph only a batch of one (1.05-1.10x) and the rows of a speculating step
  (an engine verifying 4 drafts of the demo model 1.19x) took it.  The rows' integers (token, position, context
  length, real or padding, slot) travel as one (5, B) tensor: one copy from the host;
- torch.compile (inductor with its C++ wrapper on a CPU, so no Python runs between the graph's kernels; on a
  GPU CUDA graphs, one launch per step; no guards on the model's modules nor on globals: ``compile_options``) treats
  the batch and the table width as symbolic sizes: one graph for a batch of one, one per form of the experts above it
  (``MoELayer.forward_static``), each again for tables past ``LONG_SUM`` blocks if the cache holds that many
  (inductor's guard on the length of a sum), all compiled at start-up (``warm_up``): no serving step compiles;
  inductor keeps its compiled code in its on-disk cache, so a restart of the server recompiles quickly.

Speculative decoding: an item of a token and its k drafts (positions p .. p + k) becomes k + 1 rows that share
the request's block table and read its cache up to p - 1; the rows' new keys join causally within the item
(``paged_decode``'s ``fresh``: row j sees the item's rows 0 .. j, each row gathering the new keys of the
``band`` rows up to it), so the drafts are verified by the same
compiled graph as plain decodes, and the step reports every row's hidden state for the item.  A step none of whose
requests carries drafts (no n-gram matched) runs the graph of band 1, compiled at start-up too: with the band of
1 + k such a step of the demo model cost ~15% more (each row gathering, scoring and masking k new keys it never
sees); in one process the speculating engine's n-gram decoding at one request 1.12x faster.

On a cp x ep mesh every rank runs the step as its own graph (compiled at start-up on every rank, with the same
warm-up runs, which join the same collectives), with the exchanges inside it as operators
(``parallel.graph_collectives``): each cp rank attends to the positions it keeps (``TableAttention``: the cached
keys it reads and each window's first one come as rows of the inputs; a new key joins only on the rank that keeps
its position, the others write it to the scratch block) and the ranks' parts merge over the cp group, one
all-gather a layer; under expert parallelism each MoE layer gathers every ep rank's rows and routing and sends the
rows home summed over the ranks' experts (``MoELayer.forward_static``), so every rank of an ep group runs as many
rows as the largest group's step (a rank with no request runs padding rows only).  Whether a step runs as a graph
is decided on every ep group's items, the same way on every rank.  The LM head stays with the driver (it samples
for every ep group from the states the ranks send).  Inside the graph rather than between graphs: measured on this
machine (``bench_mesh_decode.py``), see ``graph_collectives`` for the ways not kept.

MLA (DeepSeek) runs in the graph too: its cache holds each token's latent and RoPE key once and the layers attend
in the latent space (``TableAttention.absorbed``), as the eager step does.  So does DeepSeek-V3's multi-token
prediction module when the engine drafts with it (``mtp``, ``mtp_drafter``).  On one process each step of the
model also runs the module over the step's rows (``_decode_step``'s ``draft``): row j of a request reads the row's
state and the graph's greedy token at row j, which is the token the request takes at position j + 1 wherever it
decodes greedily (an accepted draft equals it; the first rejected one is replaced by it), so the module's catch-up
on the step's accepted rows costs no pass of its own (the drafter checks the tokens and catches up separately
where they differ: sampled rows).  Measured (``bench_spec.py --only mtp``, the trained DeepSeek-tiny model, one
request, one draft): MTP's tokens/s against the plain compiled engine's 0.36x with the module's passes eager, 0.75x
with every pass a graph of its own (a step 1.7 ms, its catch-up pass 0.6 more), 0.81x fused.  The passes that remain
(a catch-up the step could not make, each chained draft past the first, every pass on a mesh) run the same step
function with the rows' states one depth down as one more input, which runs the module's layer instead of the
model's (a copy of the code of its own: ``compiled_step``): a catch-up as an item of several rows (the band's
causal mask), a chained draft as a row per request; the K/V go to the module's layer of the cache, and on one
process its head's greedy choice is made inside the graph.
Prompt chunks run as graphs of the same function too where the engine asks for it (``Engine(prefill_graph=True)``,
the default of ``ringmoe serve``; one CPU process, without MTP drafting): ``prefill`` calls it once per chunk (up to
``PREFILL_ROWS`` rows a call), the chunk's rows reading the request's cached keys like decode rows and each other's
new keys causally (``paged_decode``'s ``causal``: torch's CPU flash kernel inside the graph), without the LM head
(applied eagerly to the chunk's last row when a token is due).  Only chunks whose rows put every MoE layer's experts
in their sorted form (``prefill_from``: one graph for every chunk length) run so; shorter ones run eagerly.
Measured on the trained demo model (``bench_prefill.py``): a 192-token prompt's first token 1.7x sooner than
with the prompt eager beside the compiled decode graph (13.0 vs 22.3 ms).
Copies on write, prompt logprobs, the deterministic mode, capacity-bounded experts and expert replicas take the
eager path (``ModelRunner.step``); on one process (without MTP) a step that mixes such items with decodes and
prompt chunks runs the decodes (and their drafts) as a graph step, the chunks the graph takes through ``prefill``
and only the rest eagerly.
``compile=False`` runs the same padded fixed-shape step eagerly (what the equality tests compare against, and a
fallback).
"""

from __future__ import annotations

import itertools
import time
import types
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..attention.paged import paged_decode
from ..attention.sinks import add_sinks
from ..float8 import decode_e4m3, encode_e4m3
from ..moe.layer import release_freed_c_experts
from ..parallel.graph_collectives import group_key, merge_over_group_op
from ..prepacked import DecodePanels
from .compiled_dispatch import CompiledDispatch
from .placement import local_count

__all__ = ["DRAFTED", "DecodeGraph", "HeadOutput", "LOGITS", "PREFILL_ROWS", "RowDrafts", "bucket"]

MIN_WIDTH = 2  # blocks per table row at least: a width of 1 would be a shape torch.compile specialises
# inductor compiles a float32 sum of more than this many terms as a chunked cascade sum, and guards the graph on
# the sum's length being at most this: the attention's longest sum runs over a row's blocks (``paged_decode``
# sums within each block first), so a table wider than this many blocks is another graph
LONG_SUM = 4096
# the most rows of a prompt chunk's graph call (``DecodeGraph.prefill``): its causal scores are (rows, rows) a head
PREFILL_ROWS = 512
FRESH_MASKS = 4096  # ``DecodeGraph._fresh``'s masks kept (cleared when full: a bound on the host memory they take)


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def compile_options(device: torch.device, mesh_size: int = 1) -> dict:
    """torch.compile's options for the decode step.  On a GPU each bucket's step is also recorded as a CUDA graph
    (one launch per step: what ``mode="reduce-overhead"`` does), but on a mesh (``mesh_size`` ranks): the step's
    collectives are operators whose kernels call the process group from Python (``graph_collectives``), which a
    graph replay would not run (not verified on GPUs: none was lent); on a CPU inductor writes the code between its
    kernels in C++ (its Python wrapper spends ~0.3 ms of a batch-1 step making views and checking strides).  The
    model's modules are not guarded: before each call torch.compile would otherwise check every parameter and
    module attribute it read (~0.1 ms), and a served model never changes them (torch >= 2.8).  Measured on 2
    CPU threads, both together: a batch-1 step 1.71 -> 1.49 ms (``bench_decode.py``).  Nor are the globals the
    traced code read (functions, module constants, the ``torch`` of each module, ~18 of them checked in Python):
    the graphs are made at ``warm_up`` and a serving process never rebinds them; a batch-1 step 1.06x (1.89 ->
    1.78 ms, in one process, an engine of each side by side).  Only the inputs (shapes, dtypes) and the ambient
    state (grad mode...) stay guarded."""
    options = {"triton.cudagraphs": mesh_size == 1} if device.type == "cuda" else {"cpp_wrapper": True}
    modules = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    globals_ = getattr(torch.compiler, "skip_guard_on_globals_unsafe", None)
    if modules is not None and globals_ is not None:
        options["guard_filter_fn"] = lambda entries: [keep_module and keep_global for keep_module, keep_global
                                                      in zip(modules(entries), globals_(entries))]
    elif modules is not None:
        options["guard_filter_fn"] = modules
    return options


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {mtp: its compiled ``_decode_step``}
_COPIES = itertools.count()


def compiled_step(model, mtp: bool = False) -> object:
    """``_decode_step`` compiled for ``model``: engines of one model share its graphs, another model never does;
    ``mtp``: the copy that runs the model's multi-token prediction module (its passes are graphs of their own).

    torch.compile keeps its graphs on the function's code object and, with the model's modules unguarded
    (``compile_options``), would run a graph traced for one model on another model of the same shapes, with the
    first one's constants: its experts' operator keys (the second model's steps of 32 rows and more computed
    with the first one's experts, measured), and any config value that is no tensor (RoPE base, router
    scaling...).  Each model gets its own copy of the code, so its own cache and its own recompile budget."""
    steps = _COMPILED.setdefault(model, {})
    if mtp not in steps:
        code = _decode_step.__code__.replace(co_name=f"_decode_step_{next(_COPIES)}{'_mtp' if mtp else ''}")
        function = types.FunctionType(code, _decode_step.__globals__, code.co_name)
        steps[mtp] = torch.compile(function, dynamic=True,
                                   options=compile_options(model.embed_tokens.weight.device, model.mesh.size))
    return steps[mtp]


class TableAttention:
    """The ``AttentionBackend`` of a decode batch: row r attends to the blocks ``tables[r]`` (``contexts[r]`` keys,
    its own included), the new keys of the rows ``fresh[r]`` marks among them; the rows' new K/V are collected in
    ``new_kv`` (the step writes them into the cache after the graph).  kv_scales: per layer (k_scale, v_scale) of
    an FP8 cache, or None.

    On a cp rank (``merge_group``: the cp group's key, ``graph_collectives.group_key``) the cache holds the positions
    this rank keeps: row r reads ``cached[r]`` of its cached keys, from ``firsts[w][r]`` under a window of w keys
    (``paged_decode``'s ``cached`` and ``first``), and the new keys ``fresh`` marks are those this rank keeps; the
    ranks' partial results merge over the group (one all-gather a layer), then the sinks join.

    fresh None (one process): the rows are one prompt chunk, consecutive positions of one request, each seeing the
    chunk's new keys up to its own (``paged_decode``'s ``causal``).

    absorbed (MLA): the cache holds each token's latent and RoPE key once (the layer attends in the latent space,
    its keys and values the same vectors): ``new_kv`` keeps them once per layer."""

    latent_ring = False

    def __init__(self, model, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], tables: torch.Tensor,
                 contexts: torch.Tensor, fresh: torch.Tensor, kv_scales: list | None,
                 cached: torch.Tensor | None = None, firsts: dict | None = None, merge_group: int | None = None,
                 absorbed: bool = False):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.tables, self.contexts, self.fresh, self.kv_scales = tables, contexts, fresh, kv_scales
        self.cached, self.firsts, self.merge_group, self.absorbed = cached, firsts, merge_group, absorbed
        self.new_kv: list[tuple[torch.Tensor, ...]] = []  # per layer: K, V (B, Hkv, D) as cached (MLA: K alone)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, B, H, D), k, v (1, B, Hkv, D) -> (1, B, H, D)."""
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        options = self.model.attention_options(layer)
        length = self.tables.shape[1] * k_cache.shape[1]
        # the cache is read as it was before this step and each row's own K/V joins at its last position; the
        # new K/V leave the graph and are written after it: a compiled write into the cache copies the whole
        # cache (its input), and a read after a write searches the written slots for every key it gathers
        # (MLA: the keys are the values, one latent scale used twice: the cache keeps them once, encoded once)
        own, scales = ((k[0],) if self.absorbed else (k[0], v[0])), None
        if self.kv_scales is not None:  # the row's own K/V as a later step will read them: their e4m3 round trip
            scales = self.kv_scales[layer]
            codes = tuple(encode_e4m3(x, scale) for x, scale in zip(own, scales))
            own = tuple(decode_e4m3(code, scale, k.dtype) for code, scale in zip(codes, scales))
        self.new_kv.append(codes if self.kv_scales is not None else own)
        own = own * 2 if self.absorbed else own  # (keys, values)
        window = options["window_size"][0]
        if self.merge_group is None:
            return paged_decode(q[0], k_cache, v_cache, self.tables, self.contexts, length, window, options["sinks"],
                                new=own, kv_scales=scales, fresh=self.fresh, by_block=True,
                                causal=self.fresh is None)[None]
        out, lse = paged_decode(q[0], k_cache, v_cache, self.tables, self.contexts, length, window, new=own,
                                kv_scales=scales, fresh=self.fresh, by_block=True, cached=self.cached,
                                first=self.firsts.get(window), return_lse=True)
        out, lse = merge_over_group_op(out, lse, self.merge_group)
        if options["sinks"] is not None:  # once, after the ranks' parts are merged
            out = add_sinks(out[None], lse.T[None], options["sinks"])[0][0]
        return out.to(q.dtype)[None]


LOGITS = "logits"  # a graph step that applied the LM head reports its ``HeadOutput`` under this key


DRAFTED = "drafted"  # a graph step that also ran the MTP module over its rows reports its ``RowDrafts`` under this key


class RowDrafts(NamedTuple):
    """The MTP module's part of a step that ran it over the step's rows (``_decode_step``'s ``draft``), in the
    rows' order (``HeadOutput.spans``): each row's module state (rows, hidden) and its head's greedy choice."""

    states: torch.Tensor
    tokens: list[int]


class HeadOutput(NamedTuple):
    """The LM head's part of a graph step: every row's logits (rows, vocab) float32 and the greedy choice the
    graph made per row: the first index of the row's largest logit and that logit's log-probability (NaN where the
    row holds a NaN or +inf, or only -inf: no choice); ``spans``: per request id, its item's first row and row
    count (a token and its drafts)."""

    logits: torch.Tensor
    tokens: list[int]
    logprobs: list[float]
    spans: dict[str, tuple[int, int]]

    def last_rows(self, request_ids: list[str]) -> tuple[torch.Tensor, list[tuple[int, float]]]:
        """The logits (n, vocab) and greedy (token, log-probability) of each request's last row."""
        rows = [sum(self.spans[request_id]) - 1 for request_id in request_ids]
        logits = self.logits if rows == list(range(self.logits.shape[0])) else self.logits[rows]
        return logits, [(self.tokens[row], self.logprobs[row]) for row in rows]


# the rows of the step's int64 inputs (``DecodeGraph.run`` packs them into one tensor: one copy from the host); on a
# cp rank two more kinds follow: the cached keys a row reads here, and per window the first of them inside it
IDS, POSITIONS, CONTEXTS, REAL, SLOTS, CACHED = range(6)


def windows(model) -> list[int]:
    """The distinct sliding windows (keys to the left) of the model's layers, in order: on a cp rank each has its
    row of the step's inputs (the first cached key inside it)."""
    lefts = {model.attention_options(layer)["window_size"][0] for layer in range(len(model.layers))}
    return sorted(left for left in lefts if left >= 0)


def _decode_step(model, meta, tables, fresh, kv_buffer, kv_scales, rope_freqs, merge_group=None, head=True,
                 previous=None, draft=False):
    """meta (5, B) int64: per row its token, position, context length (keys it sees, its own included), 1 for a real row
    (0: padding) and cache slot (read after the graph); on a cp rank (merge_group: the cp group's key) (6 + windows,
    B): then the cached keys the row reads here and, per window (``windows``), the first of them inside it;
    tables (B, width) int64; fresh (B, band) bool
    (``paged_decode``'s); kv_buffer: the runner's cache (layers, 2 (K, V; MLA: 1), blocks, block size, kv heads,
    head dim); rope_freqs: the model's ``rope_frequencies``.  -> (hidden (B, hidden); logits (B, vocab) float32, each
    row's greedy token (B,) int64 and its log-probability (B,) float32 (``HeadOutput``); the MoE layers' expert
    counts over the real rows (moe layers, experts) int64 (None without MoE layers), every layer's new K and V as
    the cache stores them (layers, 2 (MLA: 1, the latent and RoPE key), B, kv heads, head dim)); without ``head``
    (a mesh: the driver applies it to the states every rank sends) None for the head's three.  previous (B, hidden):
    the rows are a pass of the model's first multi-token prediction module (``mtp_drafter``), each row reading this
    state one depth down and its token one place ahead; the module's layer alone (its K/V and its MoE counts) in
    the outputs, the hidden states the module's normed ones (the shared head's input).  draft (with ``head``): the
    step's rows also run the MTP module, each row reading its own state and its greedy token as the token one place
    ahead (``MTPDrafter``'s catch-up where the request took those tokens): its K/V join the outputs' layers (last)
    and its counts theirs, and two more outputs: its states (B, hidden) and its head's greedy choice per row (B,)
    int64 (else None).  Few outputs, each a
    whole tensor: the caller pays host time per tensor a compiled graph returns (the 26 outputs this step had,
    routings and K/V apart, cost ~10% of a batch-1 step)."""
    cached = firsts = None
    if merge_group is not None:
        cached = meta[CACHED]
        firsts = {left: meta[CACHED + 1 + i] for i, left in enumerate(windows(model))}
    # the runner's cache as one input: each layer's K and V are views made inside the graph (passed in as views of
    # the buffer, each would bring its storage offset as one more symbolic size to convert at every call)
    attention = TableAttention(model, kv_buffer[:, 0], kv_buffer[:, -1], tables, meta[CONTEXTS], fresh, kv_scales,
                               cached, firsts, merge_group, absorbed=kv_buffer.shape[1] == 1)
    if previous is None:
        hidden, routings = model.hidden_states_static(meta[IDS], meta[POSITIONS], attention, rope_freqs)
    else:
        hidden, routings = model.mtp_hidden_states_static(previous, meta[IDS], meta[POSITIONS], attention, rope_freqs)
    logits = tokens = logprobs = None
    if head:
        logits = model.lm_head(hidden).float()
        tokens = logits.max(dim=-1).indices  # the first index of the largest value (a NaN's, if the row has one)
        # the sampler's log-probability (``plain_batch``): NaN where the row holds a NaN or +inf (inf - inf), or
        # only -inf: NaN marks a row with no choice
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    real = meta[REAL]
    states = drafts = None
    if draft:  # the module over the step's rows, as its catch-up on them would run were their greedy tokens taken
        states, routing = model.mtp_hidden_states_static(hidden, tokens, meta[POSITIONS], attention, rope_freqs)
        routings = routings + routing
        drafts = model.lm_head(states).float().max(dim=-1).indices
    counts = [(F.one_hot(r.topk_idx, r.probs.shape[-1]) * real[:, None, None]).sum((0, 1)) for r in routings]
    new_kv = torch.stack([torch.stack(pair) for pair in attention.new_kv])
    return hidden, logits, tokens, logprobs, torch.stack(counts) if counts else None, new_kv, states, drafts


class DecodeGraph:
    """Runs the decode-only steps of a ``ModelRunner`` (see the module's docstring)."""

    def __init__(self, runner, compile: bool = True):
        self.runner = runner
        self.compiled = compile
        self.pads = runner.device.type == "cuda"  # batches padded to buckets (see the module's docstring)
        mesh = runner.mesh
        self.cp, self.cp_rank, self.layout = mesh.cp, mesh.cp_rank, runner.layout
        # a cp rank attends to the keys it keeps, and the ranks' parts merge over the cp group (``TableAttention``)
        self.merge_group = group_key(mesh.cp_group) if mesh.cp > 1 else None
        self.windows = windows(runner.model) if mesh.cp > 1 else []  # each a row of the step's inputs
        self.head = mesh.size == 1  # the LM head in the graph (a mesh: the driver applies it, ``_decode_step``)
        model = runner.model
        self.moe_blocks = [layer.mlp for _, layer in model.moe_layers()]
        # the multi-token prediction module's MoE block (its passes run as graphs too: ``mtp``)
        self.mtp_blocks = [layer.mlp for index, layer in model.moe_layers(with_mtp=True) if index >= len(model.layers)]
        for block in self.moe_blocks + self.mtp_blocks:  # the experts' operator finds these layers (not a copy's)
            block.register_op()
            block.fit_static_forms()  # the switch between the experts' forms, for the products they run now
            block.bind_c_experts()  # their panel copies to the operator's C kernel, where it runs
        # the fewest rows of a step that runs the experts' operator (the steps where its bindings must be current)
        self.operator_rows = min((block.static_form_edges()[1] for block in self.moe_blocks + self.mtp_blocks),
                                 default=None)
        # the projections' panel copies, which the compiled step multiplies by (``prepacked.DecodePanels``)
        self.panels = DecodePanels(runner.model) if compile else None
        self.rope_freqs = runner.model.rope_frequencies(runner.device)  # an input of every step: computed once
        torch._dynamo.mark_static(self.rope_freqs)
        # every size symbolic: one graph serves every bucket of two rows or more and every table width
        # (a batch of one is specialised by torch.compile: its own graph)
        self.fn = compiled_step(model) if compile else _decode_step
        # on a CPU each graph is called without torch.compile's entry once a step of its shapes ran through it
        # (``compiled_dispatch``; on a GPU the entry stays: that way is not verified there)
        self.dispatch = CompiledDispatch(self.fn) if compile and runner.device.type == "cpu" else None
        # when the engine drafts with the multi-token prediction module (it sets ``mtp``), the steps run it over
        # their rows (``mtp_in_steps``) and its other passes (a catch-up a step could not make, each chained draft,
        # every pass on a mesh) run as graphs of their own, warmed up too
        self.mtp = False
        self.mtp_fn = compiled_step(model, mtp=True) if compile and len(model.mtp_layers) else _decode_step
        self.mtp_dispatch = CompiledDispatch(self.mtp_fn) if self.dispatch is not None and len(model.mtp_layers) \
            else None
        # the cache's sizes are constants of the graph, but for its number of blocks (engines of one model share
        # its graphs): a symbolic size is one more integer to convert at each call
        for dim in (0, 1, 3, 4, 5):
            torch._dynamo.mark_static(runner.kv_buffer, dim)
        buffer = runner.kv_buffer
        # where a step's new K/V go: the model's layers of the buffer (the MTP modules' follow), K and V, every
        # slot (blocks * block size), kv heads, head dim; one view made once (a step writes into it by slot)
        self._slots = buffer.view(*buffer.shape[:2], -1, *buffer.shape[4:])
        self.layers = len(model.layers)  # the model's layers of the buffer (the first MTP module's follows)
        self.device = buffer.device
        if runner.kv_buffer.device.type == "cuda":  # CUDA graphs copy an input into their own memory at each replay
            torch._dynamo.mark_static_address(runner.kv_buffer)  # unless its address is fixed: the whole cache
        # new keys a row may see: its own and those of the band - 1 rows before it (its item's token and drafts);
        # the engine sets 1 + its drafts per request before ``warm_up`` (a constant of the compiled graph)
        self.band = 1
        self.steps = 0  # decode steps run through the graph
        self.drafts_verified = 0  # speculative draft tokens the graph has verified
        self.mtp_passes = 0  # passes of the MTP module run through the graph
        # prompt chunks run as graphs too (``prefill``) when the engine sets this: the most rows of one call (a longer
        # chunk runs as several calls); 0: prompt chunks run eagerly
        self.prefill_rows = 0
        self.prefill_calls = 0  # graph calls that ran prompt rows
        self._masks: dict[tuple, torch.Tensor] = {}  # ``_fresh``'s masks made so far (at most FRESH_MASKS)
        self._tables: tuple[list, torch.Tensor | None] = ([], None)  # the last step's tables: as lists, as a tensor

    @torch.no_grad()
    def warm_up(self, max_rows: int) -> float:
        """Compile now rather than at the first requests: every bucket up to ``max_rows`` runs once (most
        reuse one graph; the experts' forms switch with the row count), with a short table and, when the cache
        holds more than ``LONG_SUM`` blocks, each form once more with a table wider than that (a serving step
        would otherwise compile for seconds when the first context grows past it); with a band past one (an engine
        that speculates) the same again for the steps that carry no drafts (band 1: ``run``), up to ``max_rows`` /
        band rows; with ``mtp`` the module's passes the same way (its catch-up on a verified step's rows, its
        chained drafts one row a request); seconds taken.  The rows decode into the scratch block only: no
        request's cache is touched."""
        start = time.perf_counter()
        runs = self._warm_up_runs(max_rows, self.band)
        if self.band > 1:
            runs += self._warm_up_runs(max(1, max_rows // self.band), 1)
        if self.prefill_rows:  # prompt chunks (``prefill``): one graph, the experts in their sorted form
            # (rows other than the short table's width 3: torch.compile would take the two for one size)
            runs += [(max(self.prefill_from, 4), width, 0) for _, width, _ in self._warm_up_runs(1, 0)]
        # the model's float attributes (norms' eps, RoPE's base...) traced as constants of the graph, not as inputs
        # made into tensors at every call (~2-3 us each; only tracing reads the flag: the graphs are made here)
        with torch._dynamo.config.patch(specialize_float=True):
            for mtp in (False, True) if self.mtp else (False,):
                for rows, width, band in dict.fromkeys(runs):
                    self._run_scratch(rows, width, band, mtp)
        return time.perf_counter() - start

    def _warm_up_runs(self, max_rows: int, band: int) -> list[tuple[int, int, int]]:
        """``warm_up``'s steps (rows, table width, band) for one band."""
        runner = self.runner
        sizes = self.warm_up_sizes(max_rows)
        # a width no bucket of rows has: torch.compile would otherwise take the two sizes for one symbol (duck
        # sizing) and recompile at the first step where they differ
        runs = [(rows, 3, band) for rows in sizes]
        if runner.scratch_block > LONG_SUM:
            width = LONG_SUM + 1
            while width in sizes or width in runner.k_cache[0].shape:  # no other size of the inputs (duck sizing)
                width += 1
            # each form's graph once: its first row count (a batch of one, then each side of the experts' switches)
            firsts = {1, 2} | {edge for block in self.moe_blocks for edge in block.static_form_edges()}
            runs += [(next(size for size in sizes if size >= first), width, band) for first in sorted(firsts)
                     if first <= sizes[-1]]
        return runs

    def _run_scratch(self, rows: int, width: int, band: int, mtp: bool = False) -> None:
        """One step (``mtp``: a pass of the MTP module) of ``rows`` padding rows with tables of ``width`` blocks, all
        in the scratch block (on a cp rank each sees its own key only; on a mesh every rank runs the same ones: they
        join the step's collectives)."""
        runner, scratch = self.runner, self.runner.scratch_block
        meta = torch.zeros(CACHED + 1 + len(self.windows) if self.cp > 1 else CACHED, rows, dtype=torch.long,
                           device=runner.device)
        meta[CONTEXTS], meta[REAL], meta[SLOTS] = 1, 1, scratch * runner.block_size
        tables = torch.full((rows, width), scratch, dtype=torch.long, device=runner.device)
        torch._dynamo.mark_static(meta, 0)
        if band == 0:  # a prompt chunk (``prefill``): positions 0 .. rows - 1 of one sequence, no head
            meta[POSITIONS] = torch.arange(rows, device=runner.device)
            meta[CONTEXTS] = meta[POSITIONS] + 1
            self.call(runner.model, meta, tables, None, runner.kv_buffer, runner.kv_scales, self.rope_freqs,
                      None, False, None, False)
            return
        fresh = self._fresh(list(range(rows)), band, [True] * rows if self.cp > 1 else None)
        self.call(runner.model, meta, tables, fresh, runner.kv_buffer, runner.kv_scales, self.rope_freqs,
                  self.merge_group, self.head, self._previous([], rows) if mtp else None, self.mtp_in_steps and not mtp,
                  mtp=mtp)

    @property
    def mtp_in_steps(self) -> bool:
        """The model's steps also run the MTP module over their rows (``_decode_step``'s ``draft``): an engine
        drafting with it, on one process (the graph applies the head, whose greedy tokens the module reads)."""
        return self.mtp and self.head

    def _previous(self, items: list, rows: int) -> torch.Tensor:
        """An MTP pass's states one depth down: the items' ``previous`` rows, then zeros up to ``rows`` (rows,
        hidden) in the model's dtype, on the runner's device."""
        embedding = self.runner.model.embed_tokens.weight
        states = [item.previous.to(self.device, embedding.dtype) for item in items]
        pad = rows - sum(len(state) for state in states)
        states.append(torch.zeros(pad, embedding.shape[1], dtype=embedding.dtype, device=self.device))
        previous = torch.cat(states) if len(states) > 1 else states[0]
        torch._dynamo.mark_static(previous, 1)  # the hidden size: a constant of the graph
        return previous

    def call(self, *args, mtp: bool = False):
        """The step's function (``_decode_step``'s arguments; ``mtp``: its copy for the MTP module's passes, whose
        ``previous`` is given): compiled, on a CPU through a ``CompiledDispatch`` keyed by what its graphs' guards
        read (rows, table width, band, grad mode: the other inputs' shapes and dtypes are the engine's constants)."""
        fn, dispatch = (self.mtp_fn, self.mtp_dispatch) if mtp else (self.fn, self.dispatch)
        if dispatch is None:
            return fn(*args)
        meta, tables, fresh = args[1:4]
        band = 0 if fresh is None else fresh.shape[1]  # 0: a prompt chunk (causal rows)
        return dispatch((meta.shape[1], tables.shape[1], band, torch.is_grad_enabled()), args)

    def warm_up_sizes(self, max_rows: int) -> list[int]:
        """The batch sizes ``warm_up`` runs: every bucket, and without padding also each side of every switch
        between the experts' forms (``MoELayer.forward_static``), so no step meets a graph not yet compiled."""
        sizes = {bucket(n) for n in range(1, max_rows + 1)}
        if not self.pads:
            for block in self.moe_blocks:
                for edge in block.static_form_edges():
                    sizes |= {edge - 1, edge}
        return sorted(size for size in sizes if 1 <= size <= max_rows)

    def _fresh(self, group: list[int], band: int, kept: list[bool] | None = None) -> torch.Tensor:
        """(rows, band) bool on the runner's device: row r sees the new key of row r - j when both rows are of one
        item (``group``: each row's item, padding rows each their own) and, on a cp rank, this rank keeps row r - j's
        position (``kept``, per row).  Band 1 (no drafts) on one rank: all True.  Kept for the steps of the same rows
        and items that follow (read only by the graph)."""
        rows = len(group)
        # (a steady load repeats its steps' shapes: made once each)
        key = ((rows,) if band == 1 else (band, *group)) + (() if kept is None else ("kept", *kept))
        fresh = self._masks.get(key)
        if fresh is not None:
            return fresh
        if band == 1 and kept is None:
            fresh = torch.ones(rows, 1, dtype=torch.bool, device=self.device)
        else:  # (~50 us of small tensor ops: a drafting step's host time, were it made at every step)
            item = torch.tensor(group)
            back = torch.arange(rows)[:, None] - torch.arange(band)
            fresh = (back >= 0) & (item[back.clamp(min=0)] == item[:, None])
            if kept is not None:
                fresh &= torch.tensor(kept)[back.clamp(min=0)]
            fresh = fresh.to(self.device)
            torch._dynamo.mark_static(fresh, 1)  # the band is the engine's: a constant of the graph
        if len(self._masks) >= FRESH_MASKS:
            self._masks.clear()
        self._masks[key] = fresh
        return fresh

    @staticmethod
    def accepts(runner, items: list, plan: list[list] | None = None, mtp: bool = False) -> bool:
        """Every item one generated token (and its drafts, if any, no more than the graph's band holds) of a paged
        request (on a cp rank: a sharded decode), nothing else asked of the step.  On a mesh ``plan``: every ep
        group's items (each rank decides on all of them: the same answer everywhere, as the collectives need).
        ``mtp``: a pass of the MTP module (the engine drafting with it: ``mtp`` set), every item at most a band's
        rows of a paged request (a sharded decode) with the states it reads (not a prompt chunk's nor a ring's)."""
        graph = runner.decode_graph  # (and its MoE layers still dropless: no capacity set on one since)
        groups = [items] if plan is None else plan
        if not any(groups) or runner.deterministic or (mtp and not graph.mtp) or not all(
                block.static_ready for block in (graph.mtp_blocks if mtp else graph.moe_blocks)):
            return False
        if mtp:
            return all(item.kind == ("decode" if graph.cp > 1 else "paged") and item.previous is not None
                       and 1 <= len(item.token_ids) <= graph.band and not item.copies
                       for group in groups for item in group)
        # (every row of an item reported where it has drafts, or where the MTP module reads them: ``mtp``)
        return all((item.kind == "decode" if graph.cp > 1 else item.kind == "paged" and (item.generated or item.drafts))
                   and len(item.token_ids) == 1 + item.drafts <= graph.band and not item.copies
                   and (item.report_all == bool(item.drafts) or graph.mtp) for group in groups for item in group)

    @staticmethod
    def takes_prompt(runner, item) -> bool:
        """Does ``prefill`` run this item: a prompt chunk of ``prefill_from`` tokens or more of a paged request, with
        nothing else asked of it (no prompt logprobs, no copy on write), outside the deterministic mode.  Prompt
        graphs are on (``prefill_rows``) only where the engine set them: one CPU process, not drafting with an MTP
        module (its passes read the prompt's states)."""
        graph = runner.decode_graph
        return (graph.prefill_rows > 0 and not runner.deterministic
                and item.kind == "paged" and not item.generated and not item.drafts
                and not item.report_all and not item.copies and not item.keep_hidden
                and len(item.token_ids) >= graph.prefill_from and all(block.static_ready for block in graph.moe_blocks))

    @property
    def prefill_from(self) -> int:
        """The fewest rows of a prompt chunk ``prefill`` runs: where every MoE layer's experts take their sorted form
        (``MoELayer.forward_static``), so one graph serves every chunk (shorter ones run eagerly), and two at least
        (torch.compile makes a graph of its own for one row)."""
        return max([2] + [edge for block in self.moe_blocks for edge in block.static_form_edges()])

    def prefill(self, items: list) -> dict:
        """Prompt chunks (each ``takes_prompt``) as graph steps, one request's rows a call (at most ``prefill_rows``:
        a longer chunk is cut into near-equal parts, each reading the K/V the part before wrote): a row sees its
        chunk's keys up to its own (``TableAttention``'s causal rows) and the request's cached keys before the
        chunk, and the graph applies no LM head.  {request_id: hidden (hidden_size,)} of the last row of each
        reported item, as ``ModelRunner.step``; the MoE counts of every call in ``runner.expert_counts``."""
        runner, block_size, scratch = self.runner, self.runner.block_size, self.runner.scratch_block
        reports, total = {}, None
        for item in items:
            tokens, table = item.token_ids, item.tables[0]
            parts = -(-len(tokens) // self.prefill_rows)
            bounds = [item.start + len(tokens) * i // parts for i in range(parts + 1)]
            for start, end in zip(bounds, bounds[1:]):
                blocks = table[:-(-start // block_size)]  # the request's keys before the part
                width = max(MIN_WIDTH, bucket(max(len(blocks), 1)))
                positions = list(range(start, end))
                meta = torch.tensor([tokens[start - item.start:end - item.start], positions,
                                     [p + 1 for p in positions], [1] * len(positions),
                                     runner.slots(table, range(start, end))], dtype=torch.long, device=self.device)
                torch._dynamo.mark_static(meta, 0)
                self._refresh(end - start)
                tables = torch.tensor([blocks + [scratch] * (width - len(blocks))], dtype=torch.long,
                                      device=self.device).clamp_(min=0).expand(len(positions), width).contiguous()
                hidden, _, _, _, counts, new_kv, _, _ = self.call(
                    runner.model, meta, tables, None, runner.kv_buffer, runner.kv_scales, self.rope_freqs, None, False,
                    None, False)
                self._store(self._slots[:self.layers], meta, new_kv, self.moe_blocks, counts)
                if counts is not None:
                    total = counts if total is None else total + counts
                self.prefill_calls += 1
            if item.report:
                reports[item.request_id] = hidden[-1]
        runner.expert_counts = total
        return reports

    def _refresh(self, rows: int) -> None:
        """Before a graph call of ``rows`` rows: what the graph reads outside its inputs made current (the
        projections' panel copies, the C experts' bindings where the call runs the experts' operator)."""
        if self.panels is not None:
            self.panels.refresh()  # weights changed since they were packed: packed again
        release_freed_c_experts()  # (the C experts' references to layers freed since, released here, not in tracing)
        if self.operator_rows is not None and rows >= self.operator_rows:
            for block in self.moe_blocks + self.mtp_blocks:  # weights changed since they were bound: bound anew
                if not block.c_binding_current():  # (or unbound: stale)
                    block.bind_c_experts()

    @staticmethod
    def _store(written: torch.Tensor, meta: torch.Tensor, new_kv: torch.Tensor, blocks: list,
               counts: torch.Tensor | None) -> None:
        """After a graph call: every layer's K and V at the rows' slots in one write (new_kv (layers, 2 or 1, B, kv
        heads, D) into ``written``, the buffer's layers the call computed, (layers, 2, blocks * block_size, kv heads,
        D)), and each MoE block's counts over the real rows (moe layers, experts) recorded in ``blocks``."""
        written.index_copy_(2, meta[SLOTS], new_kv)
        if counts is not None:
            for block, count in zip(blocks, counts.unbind()):
                block.record(count)

    def run(self, items: list, plan: list[list] | None = None, mtp: bool = False) -> dict:
        """{request_id: hidden (hidden_size,)} of the reported items, and {("all", request_id): hidden (1 + k,
        hidden_size)} of the items with k drafts (or read by the MTP module), as ``ModelRunner.step`` (``mtp``: a
        pass of the MTP module, as ``ModelRunner.mtp_step``); and on one process {LOGITS: the ``HeadOutput`` of the
        LM head the graph applied} and, where the step ran the MTP module over its rows, {DRAFTED: its
        ``RowDrafts``}.  On a mesh ``plan`` holds every ep group's items: each rank runs as many rows as the largest
        group (its MoE layers' exchanges take the same shapes from every rank), and on a cp rank only cp rank 0
        reports (every cp rank computes the same rows)."""
        runner = self.runner
        block_size, scratch = runner.block_size, runner.scratch_block
        cp, cp_rank = self.cp, self.cp_rank
        ids, positions, slots, owner, cached = [], [], [], [], []  # per row; cached: per item
        kept, reads, firsts = [], [], [[] for _ in self.windows]  # per row, on a cp rank
        for i, item in enumerate(items):
            table = item.tables[cp_rank]
            # a row reads from the cache only the keys before its item (the item's own rows join as new keys)
            before = item.start if cp == 1 else local_count(item.ring_len, item.start, cp, cp_rank, self.layout)
            cached.append(table[:-(-before // block_size)])
            for j, token in enumerate(item.token_ids):
                position = item.start + j
                ids.append(token)
                positions.append(position)
                owner.append(i)
                # a cp rank keeps the generated positions round-robin, each at its local index; the others' K/V go
                # to the scratch block
                mine = cp == 1 or position % cp == cp_rank
                local = position if cp == 1 else local_count(item.ring_len, position, cp, cp_rank, self.layout)
                slots.append(table[local // block_size] * block_size + local % block_size if mine
                             else scratch * block_size)
                if cp == 1:
                    continue
                kept.append(mine)
                reads.append(before)
                for row, left in zip(firsts, self.windows):  # this rank's keys are in position order
                    row.append(local_count(item.ring_len, max(0, position - left), cp, cp_rank, self.layout))
        real = len(ids)
        rows = real if plan is None else max(sum(len(item.token_ids) for item in group) for group in plan)
        rows = bucket(rows) if self.pads else rows
        pad = rows - real
        width = max(MIN_WIDTH, bucket(max(map(len, cached), default=1)))
        tables = [cached[i] + [scratch] * (width - len(cached[i])) for i in owner] + [[scratch] * width] * pad
        # padding rows decode token 0 at position 0 into the scratch block
        # (made by torch.tensor: its storage 64-byte aligned, as inductor's code assumes of an input, which it
        # would copy otherwise; a tensor over a Python array's buffer is not)
        meta = [ids + [0] * pad, positions + [0] * pad, [p + 1 for p in positions] + [1] * pad,
                [1] * real + [0] * pad, slots + [scratch * block_size] * pad]
        if cp > 1:
            meta += [row + [0] * pad for row in [reads, *firsts]]
        meta = torch.tensor(meta, dtype=torch.long, device=self.device)
        # a step with no drafts runs the graph of band 1 (compiled too: ``warm_up``); its rows see their own key only
        band = 1 if real == len(items) else self.band
        fresh = self._fresh(owner + list(range(len(items), len(items) + pad)), band,  # padding rows: own items
                            kept + [True] * pad if cp > 1 else None)
        # the last step's tables tensor serves again while no request took a new block (the graph only reads it);
        # -1 (outside the window) clamped to a real block
        if tables != self._tables[0]:
            self._tables = (tables, torch.tensor(tables, dtype=torch.long, device=self.device).clamp_(min=0))
        tables = self._tables[1]
        torch._dynamo.mark_static(meta, 0)  # its five rows: a constant (a symbolic size costs a conversion a call)
        self._refresh(rows)
        draft = self.mtp_in_steps and not mtp
        hidden, logits, tokens, logprobs, counts, new_kv, states, drafts = self.call(
            runner.model, meta, tables, fresh, runner.kv_buffer, runner.kv_scales, self.rope_freqs, self.merge_group,
            self.head, self._previous(items, rows) if mtp else None, draft, mtp=mtp)
        written = self._slots[self.layers:self.layers + 1] if mtp else self._slots[:self.layers + draft]
        blocks = self.mtp_blocks if mtp else self.moe_blocks + (self.mtp_blocks if draft else [])
        self._store(written, meta, new_kv, blocks, counts)
        if mtp:
            self.mtp_passes += 1
        else:
            runner.expert_counts = counts[:len(self.moe_blocks)] if draft and counts is not None else counts
            self.steps += 1
            self.drafts_verified += real - len(items)
        reports, first, spans = {}, 0, {}
        for item in items if cp_rank == 0 else ():
            count = len(item.token_ids)
            spans[item.request_id] = (first, count)
            if item.drafts or item.report_all:
                reports[("all", item.request_id)] = hidden[first:first + count]
            if item.report:
                reports[item.request_id] = hidden[first + count - 1]
            first += count
        if self.head:
            reports[LOGITS] = HeadOutput(logits, tokens.tolist(), logprobs.tolist(), spans)
        if draft:
            reports[DRAFTED] = RowDrafts(states, drafts.tolist())
        return reports
