"""MoELayer: route, dispatch, run experts, combine; statistics of every call."""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from .balance import ReplicaPlan
from .dispatch import capacity_for, permute, plan_dispatch, unpermute
from .expert_parallel import expert_parallel_forward
from .experts import SharedExpert, SwiGLUExperts, activate
from ..operators import c_kernels
from ..parallel.graph_collectives import gather_rows_op, group_key, sum_rows_op
from .grouped_op import bind_experts, grouped_experts, is_registered, register_layer
from .hf import layer_from_hf
from .router import Router, Routing
from .stats import MoEStats

__all__ = ["MoELayer", "check_capacity_factor", "release_freed_c_experts"]

# forward_static's default switches, unless the experts run panel_gemm's C code (MoELayer.fit_static_forms):
# below this many token-expert assignments per expert, each assignment reads its expert's weights (measured with 8
# and 16 experts on 2 CPU threads: up to ~3-4 x num_experts assignments this beats every expert on every token,
# whose batched GEMMs of a few rows run far below the machine's rate) ...
GATHERED_PER_EXPERT = 4
# ... and from this many tokens the sorted GEMMs, below it every expert on every token
DENSE_BELOW = 32


def check_capacity_factor(capacity_factor) -> None:
    """None (dropless) or a finite number > 0; ValueError naming capacity_factor otherwise."""
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be a finite number > 0, or None (dropless), got {capacity_factor!r}")


class MoELayer(nn.Module):
    """A sparse mixture-of-experts SwiGLU block.

    x (..., hidden_size) -> y (..., hidden_size), same dtype.
    router: "softmax_topk" | "topk_softmax" | "sigmoid_bias" (``router_bias``: a bias on its logits);
    capacity_factor None = dropless.  expert_bias, swiglu_limit, swiglu_alpha: gpt-oss's experts.
    shared_ffn_size > 0 adds a shared expert (gated as in Qwen2-MoE if shared_gated).
    group: expert-parallel process group (None or size 1 = all experts local); each
    rank then holds num_experts / P experts and exchanges tokens by all-to-all.
    overlap_chunks: micro-batches pipelined through the exchanges (expert parallelism).
    Setting ``sync_exchanges = True`` keeps the chunks but waits for each exchange at once
    (the same work without overlap: what benchmarks compare against).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        router: str = "softmax_topk",
        normalize_topk: bool = True,
        capacity_factor: float | None = None,
        group=None,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_ffn_size: int = 0,
        shared_gated: bool = False,
        overlap_chunks: int = 1,
        replicas: ReplicaPlan | None = None,
        router_bias: bool = False,
        expert_bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
    ):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_experts", num_experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_capacity_factor(capacity_factor)
        self.group = group
        self.ep_size, self.ep_rank = 1, 0
        if group is not None:
            self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
            self.group_key = group_key(group)  # how a compiled step's exchanges find the group (``forward_static``)
            if num_experts % self.ep_size:
                raise ValueError(
                    f"num_experts ({num_experts}) must be divisible by the expert-parallel group size ({self.ep_size})"
                )
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.local_experts = num_experts // self.ep_size
        self.expert_offset = self.ep_rank * self.local_experts
        self.replica_plan = replicas
        self.slot_experts = list(range(self.expert_offset, self.expert_offset + self.local_experts))
        if replicas is not None:
            self._place_replicas(replicas, capacity_factor)
        self.physical_experts = self.ep_size * self.local_experts
        self.capacity_factor = capacity_factor
        if not isinstance(overlap_chunks, int) or overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be a positive int, got {overlap_chunks!r}")
        self.overlap_chunks = overlap_chunks
        self.sync_exchanges = False
        self.router = Router(hidden_size, num_experts, top_k, router, normalize_topk, n_group, topk_group,
                             routed_scaling_factor, bias=router_bias)
        self.experts = SwiGLUExperts(self.local_experts, hidden_size, ffn_size, expert_bias, swiglu_limit, swiglu_alpha)
        self.shared = SharedExpert(hidden_size, shared_ffn_size, shared_gated) if shared_ffn_size else None
        self.last_stats: MoEStats | None = None
        # forward_static's switches: below ``gathered_below`` token-expert assignments each reads its expert's
        # weights, from ``dense_below`` tokens the sorted GEMMs (fit_static_forms: the defaults until the
        # experts have panel copies)
        self.gathered_below, self.dense_below = GATHERED_PER_EXPERT * num_experts, DENSE_BELOW
        self.op_key = register_layer(self)  # how a compiled graph's ``grouped_experts`` finds this layer
        # what ``bind_c_experts`` handed to the operator's C kernel (the tensors and versions), and under which key
        self._c_bound = self._c_bound_key = None

    def _place_replicas(self, replicas: ReplicaPlan, capacity_factor: float | None) -> None:
        """This rank's slots under a replica plan (hot experts copied to several ranks)."""
        if self.group is None or replicas.num_ranks != self.ep_size or replicas.num_experts != self.num_experts:
            raise ValueError(f"replicas must plan {self.num_experts} experts over the group's {self.ep_size} ranks, "
                             f"got {replicas.num_experts} experts over {replicas.num_ranks} ranks")
        if capacity_factor is not None:
            raise ValueError("replicas need the dropless mode (capacity_factor=None)")
        self.local_experts = replicas.slots_per_rank
        self.slot_experts = list(replicas.slots[self.ep_rank])
        self.replica_table = replicas.table()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be (..., hidden_size={self.hidden_size}), got {shape}")
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
        if x.dtype != self.experts.dtype:
            raise TypeError(f"x is {x.dtype} but the layer's weights are {self.experts.dtype}: "
                            f"convert one of them (layer.to(dtype) or x.to(dtype))")
        flat = x.reshape(-1, self.hidden_size)
        tokens = flat.shape[0]
        routing = self.router(flat)
        if self.ep_size > 1:
            y = expert_parallel_forward(self, flat, routing)
            if self.shared is not None:
                y = y + self.shared(flat)
            return y.to(x.dtype).reshape(x.shape)
        capacity = None
        if self.capacity_factor is not None:
            capacity = capacity_for(self.capacity_factor, tokens, self.top_k, self.num_experts)
        y, self.last_stats = self._local_experts(flat, routing, capacity)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.to(x.dtype).reshape(x.shape)

    def _local_experts(self, flat: torch.Tensor, routing: Routing, capacity: int | None):
        """The routed part of the output (T, H) from this rank's experts, tokens sorted by expert (one GEMM
        pair per expert, dropless; or the padded (E, C, H) buffer under a capacity); and its statistics."""
        if capacity is None:
            fused = self._routed_in_one_call(flat, routing.topk_idx, routing.topk_weight)
            if fused is not None:
                y, counts = fused
                return y, MoEStats(tokens_per_expert=counts, routed_per_expert=counts, dropped_assignments=0,
                                   dropped_tokens=0, routing=routing, num_experts=self.num_experts)
        plan = plan_dispatch(routing.topk_idx, routing.topk_weight, self.num_experts, capacity)
        expert_in = permute(flat, plan, self.num_experts)
        if capacity is None:
            expert_out = self.experts.grouped(expert_in, plan.counts.tolist())
        else:
            expert_out = self.experts.padded(expert_in)
        return unpermute(expert_out, plan, routing.topk_weight, flat.shape[0]), self._stats(routing, plan)

    def _routed_in_one_call(self, flat: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor):
        """(y, counts) of the dropless routed part through the experts' single fused call where they have one
        (``SwiGLUExperts.routed``: panel_gemm's C code), else None."""
        routed = getattr(self.experts, "routed", None)
        return None if routed is None else routed(flat, topk_idx, topk_weight)

    def register_op(self) -> None:
        """Make ``op_key`` name this layer (a deep copy of a layer carries its original's key): call outside
        torch.compile, before tracing ``forward_static`` (the decode graph does)."""
        if not is_registered(self.op_key, self):
            self.op_key = register_layer(self)

    def bind_c_experts(self) -> bool:
        """Hand this layer's panel copies to the C kernel of ``grouped_experts`` (``ringmoe.operators``), so a
        compiled graph runs the layer's sorted GEMMs without entering Python: where the C kernels are registered
        and the experts have current panel copies (``SwiGLUExperts.c_binding``); otherwise any earlier binding is
        undone (the operator's Python kernel runs the layer, checking its copies at every call).  True when bound.
        Call outside torch.compile: the decode graph does at start-up, and again when ``c_binding_current`` says the
        weights changed since."""
        release_freed_c_experts()
        self.register_op()
        binding = getattr(self.experts, "c_binding", None)
        binding = binding() if binding is not None and c_kernels() else None
        if binding is None:
            if self._c_bound is not None:
                _unbind_c_experts(self.op_key)
            self._c_bound = None
            return False
        bind_experts(self.op_key, *binding)
        if self._c_bound_key != self.op_key:  # the key's binding released with the layer
            weakref.finalize(self, _FREED_KEYS.append, self.op_key).atexit = False
            self._c_bound_key = self.op_key
        self._c_bound = self.experts.weights_versions()
        return True

    def c_binding_current(self) -> bool:
        """Is this layer not bound, or bound to its experts' tensors as they are (same tensors, same versions)."""
        if self._c_bound is None:
            return True
        now = self.experts.weights_versions()
        return len(now) == len(self._c_bound) and all(
            t is b and version == bound_version for (t, version), (b, bound_version) in zip(now, self._c_bound))

    def grouped_local(self, flat: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """The dropless sorted GEMMs of ``forward`` for a given routing: (T, H) (``grouped_op``'s body)."""
        fused = self._routed_in_one_call(flat, topk_idx, topk_weight)
        if fused is not None:
            return fused[0]
        plan = plan_dispatch(topk_idx, topk_weight, self.local_experts, None)  # (ids of this rank's experts)
        expert_out = self.experts.grouped(permute(flat, plan, self.local_experts), plan.counts.tolist())
        return unpermute(expert_out, plan, topk_weight, flat.shape[0])

    @property
    def static_ready(self) -> bool:
        """The layer can run ``forward_static``: dropless, one slot per expert (no replicas)."""
        return self.capacity_factor is None and self.replica_plan is None

    def fit_static_forms(self) -> None:
        """Set ``forward_static``'s switches for the way this layer's experts run now.  Where they run
        ``panel_gemm``'s C code (the stacks were prepacked on a CPU with AVX2: the whole routed part is one call,
        ``SwiGLUExperts.routed``) the sorted GEMMs win from a few tokens on: measured in one process, a compiled
        decode step of the small preset (8 experts, top-2) against the per-assignment products 0.80x / 0.92x at
        batch 1 / 2, 1.02-1.12x at 4, 1.11x at 8, 1.35x at 12, and against every expert on every token 1.26x /
        1.40x at 16 / 24; so the per-assignment products stop at ``num_experts`` assignments and the dense form
        is skipped.  The switches only move down to those values (a test or a caller that set lower ones keeps
        them); elsewhere they stay as they are (the defaults: per assignment below ``GATHERED_PER_EXPERT`` x
        num_experts assignments, dense below ``DENSE_BELOW`` tokens; ``benchmarks/bench_decode.py``).  The decode
        graph calls it before tracing."""
        ready = getattr(self.experts, "grouped_kernel_ready", None)
        if ready is not None and ready():
            self.gathered_below = min(self.gathered_below, self.num_experts)
            self.dense_below = min(self.dense_below, -(-self.gathered_below // self.top_k))

    def static_form_edges(self) -> tuple[int, int]:
        """The token counts from which ``forward_static`` changes form: the first past the gathered products, and
        ``dense_below`` (a compiled step is traced once per form)."""
        return -(-self.gathered_below // self.top_k), self.dense_below

    def forward_static(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """The same function as ``forward`` in fixed-shape tensor ops (no host synchronisation, no shape that
        depends on the routing): what a compiled decode step runs.  x (T, H) -> (y (T, H), the routing).

        Few assignments (T * top_k < ``gathered_below``, 4 x num_experts): each assignment's expert weights are
        applied as a matrix-vector product where they lie (the experts in use are read, as in ``forward``).  Then
        up to ``dense_below`` tokens (experts whose ``dense_decode`` is False, e.g. quantized ones, take the
        gathered products there too: compiled, each chosen expert is dequantized inside its product, where the
        dense form would dequantize every expert every step): every expert runs on every token and the outputs
        are summed with the combine weights, zero for the experts a token did not pick (num_experts / top_k times
        the arithmetic, but one batched GEMM per projection and no data-dependent shape).  More tokens: the
        sorted per-expert GEMMs of ``forward`` as one opaque operator of the graph (``grouped_op``: their split
        depends on the routing, which a traced graph cannot express), where the dense form's extra arithmetic
        would cost more.  Dropless only, without replicas (``static_ready``); ``record`` turns the routing of the real
        rows and their counts per expert (the decode step's graph computes them) into ``last_stats``.

        Under expert parallelism every rank of the group passes the same number of rows T (a decode step pads its
        batch to the group's largest): the rows and their routing are gathered from every rank (one all-gather),
        each rank applies its experts to the assignments they hold among all P x T rows (the others weighted 0:
        fixed shapes, whatever the routing), and each rank's rows come home summed over the ranks' parts (one
        all-to-all): both exchanges are operators of the compiled graph (``parallel.graph_collectives``).  The
        routing returned is this rank's rows'."""
        if not torch.compiler.is_compiling():
            self.register_op()
        routing = self.router(x)
        if self.ep_size == 1:
            y = self._routed_static(x, routing.topk_idx, routing.topk_weight)
        else:
            k = routing.topk_idx.shape[1]
            # the rows, their experts and weights in one message, at least float32 (the ids exact, the weights whole)
            wide = torch.promote_types(x.dtype, torch.float32)
            packed = torch.cat([x.to(wide), routing.topk_idx.to(wide), routing.topk_weight.to(wide)], dim=1)
            every = gather_rows_op(packed, self.group_key)                                   # (P T, H + 2k)
            rows, chosen, weights = every.split([self.hidden_size, k, k], dim=1)
            rows = rows.to(x.dtype).contiguous()  # (the experts' C kernel reads whole rows)
            local = chosen.long() - self.expert_offset
            held = (local >= 0) & (local < self.local_experts)
            parts = self._routed_static(rows, local.clamp(0, self.local_experts - 1),
                                        torch.where(held, weights, torch.zeros_like(weights)))
            y = sum_rows_op(parts, self.group_key)                                           # (T, H)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.to(x.dtype), routing

    def _routed_static(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """``forward_static``'s routed part (T, H) of this rank's experts: x (T, H), topk_idx (T, k) int64 local
        expert ids, topk_weight (T, k) (0 for an assignment no expert here holds)."""
        tokens, k = topk_idx.shape
        experts = self.experts
        if tokens * k < self.gathered_below or (not experts.dense_decode and tokens < self.dense_below):
            # matrix-vector products written as multiply-and-sum: compiled, each is one kernel that reads the
            # chosen expert's weights where they lie (a gather then a GEMM would copy them first)
            chosen = topk_idx.reshape(-1)
            rows = x.repeat_interleave(k, dim=0)                                               # (T k, H)
            gate_up, down = experts.gathered(chosen)                                 # (T k, 2F, H), (T k, H, F)
            h = (gate_up * rows[:, None, :]).sum(-1)                                           # (T k, 2F)
            if experts.gate_up_bias is not None:
                h = h + experts.gate_up_bias.index_select(0, chosen)
            a = activate(h, experts.limit, experts.alpha)                                      # (T k, F)
            y = (down * a[:, None, :]).sum(-1)                                                 # (T k, H)
            if experts.down_bias is not None:
                y = y + experts.down_bias.index_select(0, chosen)
            return (y.view(tokens, k, -1) * topk_weight.to(y.dtype)[..., None]).sum(1)
        if tokens >= self.dense_below:
            return grouped_experts(x, topk_idx, topk_weight, self.op_key)
        every = experts.padded(x.expand(self.local_experts, *x.shape))                       # (E, T, H)
        combine = torch.zeros(tokens, self.local_experts, dtype=every.dtype, device=x.device)
        combine.scatter_add_(1, topk_idx, topk_weight.to(every.dtype))  # (add: two of a row's held-0 ids may meet)
        return torch.einsum("eth,te->th", every, combine)

    @property
    def last_stats(self) -> MoEStats | None:
        """What the last forward did (``MoEStats``; None before any).  Counts ``record`` took become one when first
        read: a serving engine reads a decode step's counts of every layer at once (``ModelRunner.expert_counts``)
        and would otherwise pay ~5 us a layer a step for records nobody reads."""
        if self._recorded_counts is not None:
            counts, self._recorded_counts = self._recorded_counts, None
            self._last_stats = MoEStats(tokens_per_expert=counts, routed_per_expert=counts, dropped_assignments=0,
                                        dropped_tokens=0, routing=None, num_experts=self.num_experts)
        return self._last_stats

    @last_stats.setter
    def last_stats(self, stats: MoEStats | None) -> None:
        self._recorded_counts, self._last_stats = None, stats

    def record(self, counts: torch.Tensor) -> None:
        """``last_stats`` of a ``forward_static`` call from its real rows' assignments per expert, counts (E,)
        int64 (dropless; the decode step counts them inside its graph and keeps the routing there: serving reads
        the counts only, and each tensor a graph returns costs its caller host time).  Stored past
        ``nn.Module.__setattr__`` (a plain attribute: its checks for parameters, buffers and modules cost a decode
        step ~3 us a layer)."""
        self.__dict__["_recorded_counts"] = counts

    @torch.no_grad()
    def load_expert_weights(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Fill this rank's expert slots from the logical weights gate_up (E, 2F, H), down (E, H, F)."""
        index = torch.tensor(self.slot_experts, device=gate_up.device)
        self.experts.gate_up.copy_(gate_up.index_select(0, index))
        self.experts.down.copy_(down.index_select(0, index.to(down.device)))

    @torch.no_grad()
    def sync_replica_grads(self) -> None:
        """Sum the gradients of every replica of an expert over the group, so the copies stay identical."""
        if self.replica_plan is None:
            return
        index = torch.tensor(self.slot_experts, device=self.experts.gate_up.device)
        for param in self.experts.parameters():
            if param.grad is None:
                continue
            total = param.grad.new_zeros(self.num_experts, *param.shape[1:])
            total.index_add_(0, index, param.grad)
            dist.all_reduce(total, group=self.group)
            param.grad.copy_(total.index_select(0, index))

    def __getstate__(self):
        # last_stats holds graph tensors (aux_loss): not part of the module's state (copy, pickle)
        state = super().__getstate__()
        state["_last_stats"] = state["_recorded_counts"] = None
        state["_c_bound"] = state["_c_bound_key"] = None  # a copy binds under its own key (``bind_c_experts``)
        return state

    def _stats(self, routing, plan) -> MoEStats:
        return MoEStats(tokens_per_expert=plan.counts, routed_per_expert=plan.routed,
                        dropped_assignments=plan.dropped_assignments, dropped_tokens=plan.dropped_tokens,
                        routing=routing, num_experts=self.num_experts)

    # -- transformers interop -------------------------------------------------------
    @classmethod
    def from_hf(cls, block: nn.Module, capacity_factor: float | None = None) -> "MoELayer":
        """A layer with the weights and routing of transformers' MixtralSparseMoeBlock,
        Qwen3MoeSparseMoeBlock or DeepseekV3MoE (fused v5 experts or v4 per-expert modules)."""

        return layer_from_hf(cls, block, capacity_factor)


# the keys of layers freed since their experts were bound: a finalizer only notes the key (it may run while
# torch.compile traces, whose fake or meta tensors an operator call would meet), and the C kernel's references are
# released at the next safe point (``release_freed_c_experts``: before a binding, before a decode graph's step)
_FREED_KEYS: list[int] = []


def release_freed_c_experts() -> None:
    """Release the C kernel's references to the panel copies of the layers freed since the last call."""
    while _FREED_KEYS:
        _unbind_c_experts(_FREED_KEYS.pop())


def _unbind_c_experts(key: int) -> None:
    """Release the C kernel's references to layer ``key``'s panel copies."""
    empty = torch.empty(0, device="cpu")
    bind_experts(key, empty, empty, empty, empty, 0, -1.0, 1.0)
