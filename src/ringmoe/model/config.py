"""Model configuration: one dataclass, named presets, and reading transformers' config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..moe.layer import check_capacity_factor
from ..quant import QuantScheme, scheme_from_hf
from .rope import check_rope_scaling

__all__ = ["ModelConfig", "PRESETS", "preset", "config_from_hf"]

ARCHITECTURES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3")
LAYER_TYPES = ("full_attention", "sliding_attention")


# sizes beyond the largest published models by a wide margin: a config.json past them is refused before any
# allocation (a hostile or corrupt file asking for 1e8 layers would otherwise build them)
LIMITS = {"vocab_size": 2**22, "hidden_size": 2**16, "num_layers": 2**10, "num_heads": 2**10, "num_kv_heads": 2**10,
          "head_dim": 2**11, "ffn_size": 2**18, "num_experts": 2**14, "top_k": 2**8, "overlap_chunks": 2**8}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only MoE transformer: every layer is RMSNorm -> GQA attention -> RMSNorm -> MoE (or dense MLP).

    arch: the transformers family it reads and writes ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss").
    ffn_size is the hidden size of one expert.  Attention: ``qk_norm`` an RMSNorm on each query and key head
    before RoPE (Qwen3), ``qk_norm_full`` one over the whole query and key projections (OLMoE); ``qkv_bias`` /
    ``o_bias`` projection biases; ``attention_sinks`` a learned softmax-denominator logit per head (gpt-oss);
    ``sliding_window`` W: a query of a "sliding_attention" layer (``layer_types``; all layers when None) sees
    its last W positions, itself included.  MLP: ``dense_layers`` hold a dense SwiGLU of ``dense_ffn_size``
    instead of experts (Qwen MoE's mlp_only_layers / decoder_sparse_step); ``shared_ffn_size`` an always-on
    expert, ``shared_gated`` its sigmoid gate (Qwen2-MoE); ``router`` "softmax_topk" (softmax, then top-k) or
    "topk_softmax" (top-k logits, softmax over them: gpt-oss), ``router_bias``; ``expert_bias`` biases in
    the experts and ``swiglu_limit`` gpt-oss's clamped SwiGLU (gate and up interleaved in its checkpoints).
    ``rope_scaling``: transformers' rope_parameters beyond the theta (linear, yarn, llama3), as sorted items.
    DeepSeek-V3: ``kv_lora_rank`` > 0 selects multi-head latent attention (``model/mla.py``) with
    ``q_lora_rank`` (None: a plain q projection), ``qk_nope_head_dim``, ``qk_rope_head_dim`` and
    ``v_head_dim``; head_dim is then nope + rope and num_kv_heads = num_heads (the expanded K/V); router
    "sigmoid_bias" with ``n_group``, ``topk_group``, ``routed_scaling_factor``; ``mtp_layers`` multi-token
    prediction modules built after the last layer (``model/mtp.py``; config.json's num_nextn_predict_layers,
    loaded only when asked: ``load_checkpoint(..., mtp=True)``).
    capacity_factor None = dropless experts.  overlap_chunks (a runtime choice, like capacity): micro-batches
    pipelined through the expert-parallel exchanges so they travel while experts compute; results do not
    depend on it.
    """

    arch: str = "mixtral"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    ffn_size: int = 14336
    num_experts: int = 8
    top_k: int = 2
    normalize_topk: bool = True
    qk_norm: bool = False
    rope_theta: float = 1e6
    rms_eps: float = 1e-5
    tie_word_embeddings: bool = False
    capacity_factor: float | None = None
    overlap_chunks: int = 1
    qk_norm_full: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    dense_layers: tuple[int, ...] = ()
    dense_ffn_size: int = 0
    shared_ffn_size: int = 0
    shared_gated: bool = False
    router: str = "softmax_topk"
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    rope_scaling: tuple = ()
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    quantization: QuantScheme | None = None
    mtp_layers: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_size", "num_experts", "top_k", "overlap_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            if value > LIMITS[name]:
                raise ValueError(f"{name} = {value} is beyond what ringmoe accepts ({LIMITS[name]})")
        for name in ("dense_ffn_size", "shared_ffn_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= LIMITS["ffn_size"]:
                raise ValueError(f"{name} must be an int in [0, {LIMITS['ffn_size']}], got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")

        check_capacity_factor(self.capacity_factor)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                             or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types must name {self.num_layers} layers, each one of {LAYER_TYPES}")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers must lie in [0, {self.num_layers}), got {self.dense_layers}")
        if self.dense_layers and self.dense_ffn_size < 1:
            raise ValueError("dense_layers need dense_ffn_size >= 1")
        if self.router not in ("softmax_topk", "topk_softmax", "sigmoid_bias"):
            raise ValueError(f"router must be 'softmax_topk', 'topk_softmax' or 'sigmoid_bias', got {self.router!r}")
        if self.mla and (self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim
                         or self.num_kv_heads != self.num_heads or self.v_head_dim < 1 or self.qk_rope_head_dim % 2
                         or self.v_head_dim > self.head_dim):
            raise ValueError("MLA needs head_dim = qk_nope_head_dim + qk_rope_head_dim (even rope part), "
                             "num_kv_heads = num_heads and 1 <= v_head_dim <= head_dim")

        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or not 0 <= self.mtp_layers <= 8:
            raise ValueError(f"mtp_layers must be an int in [0, 8], got {self.mtp_layers!r}")
        if self.mtp_layers and self.arch != "deepseek_v3":
            raise ValueError(f"multi-token prediction layers are DeepSeek-V3's (num_nextn_predict_layers); "
                             f"arch {self.arch!r} has none")
        check_rope_scaling(dict(self.rope_scaling))

    def window(self, layer: int) -> tuple[int, int]:
        """flash-attn's window_size of ``layer``: (sliding_window - 1, 0) on sliding layers, else unbounded
        (the multi-token prediction blocks, ``layer`` >= num_layers, attend to every earlier position)."""
        if self.sliding_window is None or layer >= self.num_layers:
            return (-1, -1)
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return (-1, -1)
        return (self.sliding_window - 1, 0)

    @property
    def kv_values_per_token(self) -> int:
        """Values a paged KV cache holds per token: every layer's K and V (MLA: its latent and RoPE key, once), the
        multi-token prediction modules' layers included."""
        width = self.kv_lora_rank + self.qk_rope_head_dim if self.mla else 2 * self.num_kv_heads * self.head_dim
        return (self.num_layers + self.mtp_layers) * width

    def is_moe(self, layer: int) -> bool:
        return layer not in self.dense_layers
    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def params_per_layer(self) -> dict:
        """Parameter counts of one MoE layer: attention, router, one expert, shared experts, norms."""
        h, d = self.hidden_size, self.head_dim
        if self.mla:
            heads, rank, rope, v = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
            q = h * heads * d if self.q_lora_rank is None else self.q_lora_rank * (h + heads * d + 1)
            attention = q + h * (rank + rope) + rank + rank * heads * (self.qk_nope_head_dim + v) + heads * v * h
        else:
            attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + (2 * d if self.qk_norm else 0)
        shared = 3 * h * self.shared_ffn_size + (h if self.shared_gated else 0)
        return {"attention": attention, "router": h * self.num_experts, "expert": 3 * h * self.ffn_size,
                "shared": shared, "dense_mlp": 3 * h * self.dense_ffn_size, "norms": 2 * h}

    def params_with_experts(self, experts_per_layer: int) -> int:
        """Parameters of the model holding ``experts_per_layer`` experts in each MoE layer (a rank's share)."""
        layer = self.params_per_layer
        common = layer["attention"] + layer["norms"]
        moe = layer["router"] + layer["shared"] + experts_per_layer * layer["expert"]
        dense = len(self.dense_layers)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        h = self.hidden_size
        mtp = self.mtp_layers * (common + moe + 2 * h * h + 3 * h)  # + eh_proj and the enorm, hnorm, head norms
        return (self.num_layers * common + (self.num_layers - dense) * moe + dense * layer["dense_mlp"]
                + embeddings + h + mtp)  # + the final norm

    def weight_bytes(self, experts_per_layer: int, width: int) -> float:
        """Resident bytes of the weights of a rank holding ``experts_per_layer`` experts per MoE layer: float
        parts at ``width`` bytes a value, quantized parts at the scheme's bytes with their scales (mxfp4: the
        routed experts; fp8: every projection of attention, experts, shared experts and dense MLPs; the
        embeddings, head, norms and routers stay float in both, as the published checkpoints keep them)."""
        total = self.params_with_experts(experts_per_layer)
        if self.quantization is None:
            return total * width
        quantized = self._quantized_params(experts_per_layer)
        return (total - quantized) * width + quantized * self.quantization.bytes_per_value()

    def _quantized_params(self, experts_per_layer: int) -> int:
        """Values held quantized (``weight_bytes``'s split); 0 for a float model."""
        if self.quantization is None:
            return 0
        layer, dense = self.params_per_layer, len(self.dense_layers)
        moe_layers = self.num_layers - dense + self.mtp_layers
        quantized = moe_layers * experts_per_layer * layer["expert"]
        if self.quantization.method == "fp8":
            quantized += ((self.num_layers + self.mtp_layers) * layer["attention"] + moe_layers * layer["shared"]
                          + dense * layer["dense_mlp"])
        return quantized

    def prepacked_bytes(self, experts_per_layer: int, width: int) -> float:
        """Bytes of the second copies a CPU engine keeps of its float weight matrices (``ringmoe.prepacked``):
        every float value but the input embedding table's and the quantized ones (norms and routers, a few
        values, counted too: an upper bound)."""
        table = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return (self.params_with_experts(experts_per_layer) - table - self._quantized_params(experts_per_layer)) * width

    @property
    def num_params(self) -> int:
        return self.params_with_experts(self.num_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token touches (top_k experts per layer)."""
        return self.params_with_experts(self.top_k)


PRESETS: dict[str, ModelConfig] = {
    # tests: a few milliseconds per forward
    "tiny": ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        ffn_size=96, num_experts=4, top_k=2),
    # the demo: 4 CPU ranks prefill a few thousand tokens in seconds
    "small": ModelConfig(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                         ffn_size=512, num_experts=8, top_k=2),
    # `make demo` trains this one on the standard library's sources in about two minutes on 2 cores
    "demo": ModelConfig(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                        ffn_size=256, num_experts=8, top_k=2, rope_theta=1e4),
    # the demo's size in DeepSeek-V3's form (MLA, sigmoid router with groups, a shared expert, a dense first layer):
    # `ringmoe train --preset deepseek-v3-demo --mtp` trains it with a multi-token prediction module
    "deepseek-v3-demo": ModelConfig(arch="deepseek_v3", vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4,
                                    num_kv_heads=4, head_dim=48, ffn_size=128, num_experts=8, top_k=2,
                                    router="sigmoid_bias", n_group=2, topk_group=2, routed_scaling_factor=1.0,
                                    shared_ffn_size=128, dense_layers=(0,), dense_ffn_size=256, kv_lora_rank=64,
                                    q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                    rope_theta=1e4),
    # the other families at the tiny shape (tests, `ringmoe train --preset ...`)
    "gpt-oss-tiny": ModelConfig(arch="gpt_oss", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, ffn_size=96, num_experts=4, top_k=2, qkv_bias=True,
                                o_bias=True, attention_sinks=True, sliding_window=8,
                                layer_types=("sliding_attention", "full_attention"), router="topk_softmax",
                                router_bias=True, expert_bias=True, swiglu_limit=7.0, rope_theta=1.5e5,
                                rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0),
                                              ("original_max_position_embeddings", 4096), ("rope_type", "yarn"),
                                              ("truncate", False))),
    "qwen2-moe-tiny": ModelConfig(arch="qwen2_moe", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=16, ffn_size=96, num_experts=4, top_k=2,
                                  normalize_topk=False, qkv_bias=True, shared_ffn_size=64, shared_gated=True,
                                  dense_layers=(1,), dense_ffn_size=128),
    "olmoe-tiny": ModelConfig(arch="olmoe", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, ffn_size=96, num_experts=4, top_k=2, normalize_topk=False,
                              qk_norm_full=True),
    "qwen3-moe-dense-tiny": ModelConfig(arch="qwen3_moe", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                        num_kv_heads=2, head_dim=16, ffn_size=96, num_experts=4, top_k=2,
                                        qk_norm=True, dense_layers=(0,), dense_ffn_size=128),
    "deepseek-v3-tiny": ModelConfig(arch="deepseek_v3", vocab_size=128, hidden_size=64, num_layers=3, num_heads=4,
                                    num_kv_heads=4, head_dim=24, ffn_size=48, num_experts=8, top_k=2,
                                    router="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                    shared_ffn_size=48, dense_layers=(0,), dense_ffn_size=128, kv_lora_rank=32,
                                    q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    # published shapes (weights from the Hub via --checkpoint; the simulator uses the shapes)
    "mixtral-8x7b": ModelConfig(),
    # DeepSeek-V2-Lite's shapes in the DeepSeek-V3 architecture (MLA without q compression, 64 experts top-6)
    "deepseek-v2-lite": ModelConfig(arch="deepseek_v3", vocab_size=102400, hidden_size=2048, num_layers=27,
                                    num_heads=16, num_kv_heads=16, head_dim=192, ffn_size=1408, num_experts=64,
                                    top_k=6, router="sigmoid_bias", routed_scaling_factor=1.0, shared_ffn_size=2816,
                                    dense_layers=(0,), dense_ffn_size=10944, kv_lora_rank=512, q_lora_rank=None,
                                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    # DeepSeek-V3 (671B) as it ships: fp8 e4m3 with 128 x 128 block scales (`ringmoe simulate` sizes its mesh)
    "deepseek-v3": ModelConfig(arch="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
                               num_kv_heads=128, head_dim=192, ffn_size=2048, num_experts=256, top_k=8,
                               router="sigmoid_bias", routed_scaling_factor=2.5, n_group=8, topk_group=4,
                               shared_ffn_size=2048, dense_layers=(0, 1, 2), dense_ffn_size=18432, kv_lora_rank=512,
                               q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                               rope_theta=1e4, quantization=QuantScheme("fp8")),
    "qwen3-30b-a3b": ModelConfig(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                                 num_kv_heads=4, head_dim=128, ffn_size=768, num_experts=128, top_k=8,
                                 normalize_topk=True, qk_norm=True, rope_theta=1e6, rms_eps=1e-6),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


def _dense_layers(hf: dict, layers: int) -> tuple[int, ...]:
    """Qwen MoE's dense layers: those in mlp_only_layers, and those whose (index + 1) % decoder_sparse_step != 0."""
    step = hf.get("decoder_sparse_step", 1) or 1
    only = set(hf.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def _rope(hf: dict) -> tuple[float, tuple]:
    """(theta, scaling items) from rope_parameters (transformers v5) or rope_theta + rope_scaling (v4)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, ()
    rope["rope_type"] = kind
    rope.pop("type", None)
    return theta, tuple(sorted(rope.items()))


def _no_attention_bias(hf: dict, family: str) -> None:
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias=True is not supported for {family}")


def _mixtral(hf: dict) -> dict:
    _no_attention_bias(hf, "Mixtral")
    return dict(ffn_size=hf["intermediate_size"], num_experts=hf["num_local_experts"], normalize_topk=True)


def _gpt_oss(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", True))
    return dict(ffn_size=hf["intermediate_size"], num_experts=hf["num_local_experts"], normalize_topk=True,
                qkv_bias=bias, o_bias=bias, attention_sinks=True, router="topk_softmax", router_bias=True,
                expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=1.702)


def _deepseek_v3(hf: dict) -> dict:
    _no_attention_bias(hf, "DeepSeek-V3")
    nope, rope_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    first_dense = hf.get("first_k_dense_replace", 0)
    return dict(head_dim=nope + rope_dim, num_kv_heads=hf["num_attention_heads"], ffn_size=hf["moe_intermediate_size"],
                num_experts=hf["n_routed_experts"], normalize_topk=bool(hf.get("norm_topk_prob", True)),
                router="sigmoid_bias", n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                shared_ffn_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
                dense_layers=tuple(range(first_dense)), dense_ffn_size=hf["intermediate_size"] if first_dense else 0,
                kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank"), qk_nope_head_dim=nope,
                qk_rope_head_dim=rope_dim, v_head_dim=hf["v_head_dim"],
                rope_interleave=bool(hf.get("rope_interleave", True)),
                mtp_layers=int(hf.get("num_nextn_predict_layers") or 0))


def _olmoe(hf: dict) -> dict:
    if hf.get("clip_qkv") is not None:
        raise ValueError("OLMoE's clip_qkv is not supported")
    _no_attention_bias(hf, "OLMoE")
    return dict(ffn_size=hf["intermediate_size"], num_experts=hf["num_experts"],
                normalize_topk=bool(hf.get("norm_topk_prob", False)), qk_norm_full=True)


def _qwen_moe(hf: dict) -> dict:
    """What Qwen3-MoE and Qwen2-MoE share: their experts and dense layers."""
    dense = _dense_layers(hf, hf["num_hidden_layers"])
    return dict(ffn_size=hf["moe_intermediate_size"], num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                normalize_topk=bool(hf.get("norm_topk_prob", False)), dense_layers=dense,
                dense_ffn_size=hf.get("intermediate_size", 0) if dense else 0)


def _qwen3_moe(hf: dict) -> dict:
    _no_attention_bias(hf, "Qwen3-MoE")
    return dict(qk_norm=True, **_qwen_moe(hf))


def _qwen2_moe(hf: dict) -> dict:
    shared = hf.get("shared_expert_intermediate_size", 0)
    return dict(qkv_bias=bool(hf.get("qkv_bias", True)), shared_ffn_size=shared, shared_gated=bool(shared),
                **_qwen_moe(hf))


# what each family's config.json adds to the fields every family shares
_FAMILIES = {"mixtral": _mixtral, "gpt_oss": _gpt_oss, "deepseek_v3": _deepseek_v3, "olmoe": _olmoe,
             "qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe}


def _window(hf: dict, model_type: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types): Qwen configs carry a window that is off unless use_sliding_window."""
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") or None
    if model_type in ("mixtral", "qwen3_moe", "qwen2_moe") and not hf.get("use_sliding_window", model_type == "mixtral"):
        window = None
    layer_types = tuple(hf["layer_types"]) if hf.get("layer_types") and window else None
    if model_type in ("qwen3_moe", "qwen2_moe") and window and hf.get("max_window_layers", layers) < layers:
        layer_types = tuple("full_attention" if i < hf["max_window_layers"] else "sliding_attention"
                            for i in range(layers))
    return window, layer_types


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a transformers config.json dict.

    Families: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, gpt-oss and DeepSeek-V3 (``_FAMILIES``).  Raises ValueError for
    what this model does not implement (quantization methods other than fp8 block-wise and mxfp4, partial rotary, dynamic or longrope scaling, OLMoE's
    clip_qkv, ...).
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json model_type must be one of {ARCHITECTURES}, got {model_type!r}")
    quantization = hf.get("quantization_config")
    scheme = scheme_from_hf(quantization) if quantization else None
    theta, scaling = _rope(hf)
    if scaling and dict(scaling)["rope_type"] not in ("linear", "yarn", "llama3"):
        raise ValueError(f"RoPE scaling {dict(scaling)['rope_type']!r} is not supported (linear, yarn, llama3 are)")
    if dict(scaling).get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    heads = hf["num_attention_heads"]
    window, layer_types = _window(hf, model_type)
    common = dict(
        arch=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, top_k=hf["num_experts_per_tok"],
        rope_theta=theta, rope_scaling=scaling, rms_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=window,
        layer_types=layer_types, quantization=scheme,
    )
    return ModelConfig(**{**common, **_FAMILIES[model_type](hf)})
