"""Model configuration: one dataclass, named presets, and reading transformers' config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ModelConfig", "PRESETS", "preset", "config_from_hf"]

ARCHITECTURES = ("mixtral", "qwen3_moe")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only MoE transformer: every layer is RMSNorm -> GQA attention -> RMSNorm -> MoE.

    arch: "mixtral" or "qwen3_moe" (Qwen3 adds an RMSNorm on each query and key head
    before RoPE, ``qk_norm``).  ffn_size is the hidden size of one expert.
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

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_size", "num_experts", "top_k", "overlap_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        from ..moe.layer import check_capacity_factor

        check_capacity_factor(self.capacity_factor)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def params_per_layer(self) -> dict:
        """Parameter counts of one layer: attention, router, one expert, norms."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + (2 * d if self.qk_norm else 0)
        return {"attention": attention, "router": h * self.num_experts, "expert": 3 * h * self.ffn_size,
                "norms": 2 * h}

    def _params(self, experts_per_layer: int) -> int:
        layer = self.params_per_layer
        per_layer = layer["attention"] + layer["router"] + layer["norms"] + experts_per_layer * layer["expert"]
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size  # + the final norm

    @property
    def num_params(self) -> int:
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token touches (top_k experts per layer)."""
        return self._params(self.top_k)


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
    # published shapes (weights from the Hub via --checkpoint; the simulator uses the shapes)
    "mixtral-8x7b": ModelConfig(),
    "qwen3-30b-a3b": ModelConfig(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                                 num_kv_heads=4, head_dim=128, ffn_size=768, num_experts=128, top_k=8,
                                 normalize_topk=True, qk_norm=True, rope_theta=1e6, rms_eps=1e-6),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a transformers config.json dict (MixtralForCausalLM or Qwen3MoeForCausalLM).

    Raises ValueError for what this model does not implement (sliding windows,
    dense layers between MoE layers, biases, non-default RoPE scaling).
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json model_type must be one of {ARCHITECTURES}, got {model_type!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"only default RoPE is supported, got rope_type {rope.get('rope_type')!r}")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise ValueError(f"sliding-window attention is not supported (sliding_window={hf['sliding_window']})")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported")
    heads = hf["num_attention_heads"]
    common = dict(
        arch=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, top_k=hf["num_experts_per_tok"],
        rope_theta=float(theta), rms_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if model_type == "mixtral":
        return ModelConfig(ffn_size=hf["intermediate_size"], num_experts=hf["num_local_experts"],
                           normalize_topk=True, qk_norm=False, **common)
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("Qwen3-MoE checkpoints with dense layers (mlp_only_layers, decoder_sparse_step) are not supported")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return ModelConfig(ffn_size=hf["moe_intermediate_size"], num_experts=experts,
                       normalize_topk=bool(hf.get("norm_topk_prob", False)), qk_norm=True, **common)
