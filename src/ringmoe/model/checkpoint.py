"""Loading transformers-format checkpoints (config.json + safetensors) onto a mesh.

Supported: MixtralForCausalLM and Qwen3MoeForCausalLM, with experts stored
per expert (``experts.{e}.w1/w2/w3`` or ``gate_proj/up_proj/down_proj``, as
the Hub's checkpoints and ``save_pretrained`` write them) or fused
(``experts.gate_up_proj`` (E, 2F, H), ``experts.down_proj`` (E, H, F)).
Each rank reads only the tensors it holds: the replicated ones and its own
experts (safetensors are memory-mapped, so other experts' bytes are never
touched).  Pickled ``.bin`` checkpoints are refused: they can run code.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..parallel.mesh import Mesh
from .config import ModelConfig, config_from_hf
from .transformer import MoETransformer

__all__ = ["load_config", "load_checkpoint", "load_weights", "LoadReport"]

_MOE = r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
_ROUTER = re.compile(_MOE + r"gate\.weight$")
_EXPERT = re.compile(_MOE + r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(_MOE + r"experts\.(gate_up_proj|down_proj)$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


@dataclass
class LoadReport:
    """What one rank read: tensor names (an expert slice reads as 'name[e]') and bytes."""

    tensors: list[str] = field(default_factory=list)
    bytes_read: int = 0


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has no config.json")
    return config_from_hf(json.loads(config_file.read_text()))


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(f"{str(path)!r} holds only pickled weights (.bin/.pt); ringmoe loads safetensors only")
    raise ValueError(f"{str(path)!r} has no model.safetensors or model.safetensors.index.json")


@torch.no_grad()
def load_weights(model: MoETransformer, path: str | Path) -> LoadReport:
    """Copy the checkpoint's tensors into ``model`` (its own experts only). Returns what was read."""
    from safetensors import safe_open

    path = Path(path)
    files = _tensor_files(path)
    params = dict(model.named_parameters())
    expert_params = model.expert_parameters()
    report = LoadReport()
    filled: set[str] = set()
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # (layer, gate|up|down) -> expert -> weight
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt")) for file in set(files.values())}

        def read(name, index=None):
            handle = handles[files[name]]
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
            report.tensors.append(name if index is None else f"{name}[{index}]")
            report.bytes_read += tensor.numel() * tensor.element_size()
            return tensor

        for name in files:
            short = name.removeprefix("model.")
            if (m := _ROUTER.search(short)) is not None:
                short = f"layers.{m.group(1)}.mlp.router.weight"
            if (m := _EXPERT.search(short)) is not None:
                layer, expert, kind = int(m.group(1)), int(m.group(2)), _ROLE[m.group(3)]
                if expert in model.layers[layer].mlp.slot_experts:
                    experts.setdefault((layer, kind), {})[expert] = read(name)
            elif (m := _FUSED.search(short)) is not None:
                layer, kind = int(m.group(1)), m.group(2)
                for expert in model.layers[layer].mlp.slot_experts:
                    weight = read(name, expert)
                    if kind == "down_proj":
                        experts.setdefault((layer, "down"), {})[expert] = weight
                    else:
                        gate, up = weight.chunk(2, dim=0)
                        experts.setdefault((layer, "gate"), {})[expert] = gate
                        experts.setdefault((layer, "up"), {})[expert] = up
            elif short in params and short not in expert_params:
                params[short].copy_(read(name))
                filled.add(short)
    if model.config.tie_word_embeddings:
        filled.add("lm_head.weight")
    for index, layer in enumerate(model.layers):
        try:
            gate = [experts[(index, "gate")][e] for e in layer.mlp.slot_experts]
            up = [experts[(index, "up")][e] for e in layer.mlp.slot_experts]
            down = [experts[(index, "down")][e] for e in layer.mlp.slot_experts]
        except KeyError as missing:
            raise ValueError(f"checkpoint lacks the weights of layer {index}'s expert {missing}") from None
        layer.mlp.experts.gate_up.copy_(torch.cat([torch.stack(gate), torch.stack(up)], dim=1))
        layer.mlp.experts.down.copy_(torch.stack(down))
        filled.update(f"layers.{index}.mlp.experts.{p}" for p in ("gate_up", "down"))
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return report


def load_checkpoint(path: str | Path, mesh: Mesh | None = None, layout: str = "zigzag", backend: str = "auto",
                    dtype: torch.dtype | None = None, capacity_factor: float | None = None,
                    overlap_chunks: int = 1) -> MoETransformer:
    """Build the model a checkpoint directory describes on ``mesh`` and load its weights.

    dtype: parameters' dtype (default: the default dtype).  capacity_factor, overlap_chunks: the
    runtime fields of ``ModelConfig``.  The result's logits equal transformers' model of the same checkpoint.
    """
    config = load_config(path).replace(capacity_factor=capacity_factor, overlap_chunks=overlap_chunks)
    model = MoETransformer(config, mesh, layout, backend)
    if dtype is not None:
        model = model.to(dtype)
    model.load_report = load_weights(model, path)  # what this rank read
    return model
