"""Loading quantized checkpoints as they ship, keeping the weights quantized.

FP8 block-wise (DeepSeek-V3, Qwen3-FP8): every ``X.weight`` stored as F8_E4M3 comes with its float32
``X.weight_scale_inv``; ringmoe's module at X becomes a ``QuantizedLinear`` (or, for ``experts.{e}.*``, the
layer's experts a ``QuantizedSwiGLUExperts``).  MXFP4 (gpt-oss): ``experts.gate_up_proj_blocks/_scales``
(E, 2F, H/32, 16) / (E, 2F, H/32) with gate and up rows interleaved, ``experts.down_proj_blocks/_scales``
(E, H, F/32, 16) / (E, H, F/32).  Which modules are quantized is read from the tensors' dtypes in the
safetensors headers, never guessed; codes and scales are checked against the weight's shape and each rank
reads only its own experts' codes and scales.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..moe.quantized_experts import QuantizedSwiGLUExperts
from ..quant import QuantizedLinear, QuantizedWeight, QuantScheme
from .checkpoint_names import EXPERT, ROLE, ringmoe_name

__all__ = ["QuantPlan", "plan_quantized", "build_quantized", "QuantizedReader"]

_MX_FUSED = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
_TORCH_DTYPE = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "U8": torch.uint8, "BF16": torch.bfloat16,
                "F16": torch.float16}


@dataclass
class QuantPlan:
    """What a checkpoint stores quantized: ringmoe paths of linear layers, and MoE layers whose experts are."""

    scheme: QuantScheme
    linears: set[str] = field(default_factory=set)
    expert_layers: set[int] = field(default_factory=set)


def plan_quantized(scheme: QuantScheme, dtypes: dict[str, str], num_layers: int) -> QuantPlan:
    """The plan from every tensor's safetensors dtype (name -> "F8_E4M3", "U8", ...) of a model of ``num_layers``
    layers; ValueError naming a quantized tensor without its scales, or in a place ringmoe does not quantize."""
    plan = QuantPlan(scheme)
    for name, dtype in dtypes.items():
        short = ringmoe_name(name, num_layers)
        if scheme.method == "fp8" and dtype == "F8_E4M3":
            if not name.endswith(".weight"):
                raise ValueError(f"checkpoint tensor {name!r} is F8_E4M3 but not a weight")
            if name + "_scale_inv" not in dtypes:
                raise ValueError(f"checkpoint tensor {name!r} is F8_E4M3 without its {name + '_scale_inv'!r}")
            if (m := EXPERT.search(short)) is not None:
                plan.expert_layers.add(int(m.group(1)))
            else:
                plan.linears.add(short.removesuffix(".weight"))
        elif scheme.method == "mxfp4" and (m := _MX_FUSED.search(short)) is not None:
            partner = name[: -len(m.group(3))] + ("scales" if m.group(3) == "blocks" else "blocks")
            if partner not in dtypes:
                raise ValueError(f"checkpoint tensor {name!r} has no {partner!r}")
            plan.expert_layers.add(int(m.group(1)))
    return plan


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` on ``old``'s device, its float tensors in ``old``'s dtype (codes and scales keep theirs)."""
    param = next(old.parameters())
    return new.to(device=param.device, dtype=param.dtype)


def build_quantized(model: nn.Module, plan: QuantPlan) -> None:
    """Swap the planned modules of ``model`` for their quantized forms, on the device and in the dtype of the
    modules they replace (idempotent: a module already quantized stays)."""
    config = model.config
    for path in sorted(plan.linears):
        parent_path, _, attr = path.rpartition(".")
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        if isinstance(module, QuantizedLinear):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"checkpoint stores {path!r} quantized, but ringmoe's {path!r} is not a linear layer")
        quantized = QuantizedLinear(module.in_features, module.out_features, module.bias is not None, plan.scheme)
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, _like(quantized, module))
    for index in sorted(plan.expert_layers):
        if not 0 <= index < config.num_layers + config.mtp_layers or not hasattr(
                model.decoder_layer(index).mlp, "slot_experts"):
            raise ValueError(f"checkpoint stores experts of layer {index} quantized, but that layer has no experts")
        mlp = model.decoder_layer(index).mlp
        if isinstance(mlp.experts, QuantizedSwiGLUExperts):
            continue
        try:
            experts = QuantizedSwiGLUExperts(plan.scheme, mlp.local_experts, config.hidden_size, config.ffn_size,
                                             config.expert_bias, config.swiglu_limit, config.swiglu_alpha)
        except ValueError as error:
            raise ValueError(f"layer {index}'s experts: {error}") from None
        mlp.experts = _like(experts, mlp.experts)


class QuantizedReader:
    """Reads the quantized tensors of a checkpoint into a model built by ``build_quantized``.

    ``take(name, read)`` consumes a quantized tensor (a weight with its scales, or a scale read with its
    weight) and returns True, or returns False for a tensor it does not own; ``check_complete`` names what
    no tensor filled."""

    def __init__(self, model: nn.Module, plan: QuantPlan, dry_run: bool):
        self.model, self.plan, self.dry_run = model, plan, dry_run
        self.filled: set[tuple] = set()

    def take(self, name: str, read) -> bool:
        short = ringmoe_name(name, self.model.config.num_layers)
        if self.plan.scheme.method == "fp8":
            weight_name = name.removesuffix("_scale_inv")
            if weight_name != name and read.has(weight_name) and read.dtype(weight_name) == "F8_E4M3":
                return True  # read with its weight
            if read.dtype(name) != "F8_E4M3":
                return False
            if (m := EXPERT.search(short)) is not None:
                self._fp8_expert(name, read, int(m.group(1)), int(m.group(2)), ROLE[m.group(3)])
            else:
                self._fp8_linear(name, read, short.removesuffix(".weight"))
            return True
        if (m := _MX_FUSED.search(short)) is None:
            return False
        if m.group(3) == "blocks":
            self._mxfp4_experts(name, read, int(m.group(1)), m.group(2))
        return True

    def _read(self, names: tuple[str, str], read, index: int | None = None):
        """Codes and scales ``names`` (expert ``index`` of stacked tensors), their stored dtypes checked."""
        dtypes = (torch.float8_e4m3fn, torch.float32) if self.plan.scheme.method == "fp8" else (torch.uint8,) * 2
        for name, dtype in zip(names, dtypes):
            stored = read.dtype(name)
            if _TORCH_DTYPE.get(stored) != dtype:
                raise ValueError(f"checkpoint tensor {name!r} is {stored}, {self.plan.scheme.method} needs "
                                 f"{str(dtype).removeprefix('torch.')}")
        return read(names[0], index, raw=True), read(names[1], index, raw=True)

    def _put(self, target: QuantizedWeight, names: tuple[str, str], codes, scales, slots=(None,), rows=None):
        """Check codes and scales (``rows`` of them, when set) against ``target`` and copy them into each of
        ``slots`` (None: the whole weight; an int: that expert)."""
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
        codes_shape, _, scales_shape, _ = target.expected(None if slots == (None,) else 0)
        for name, tensor, want in ((names[0], codes, codes_shape), (names[1], scales, scales_shape)):
            if tuple(tensor.shape) != tuple(want):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}"
                                 f"{'' if rows is None else ' (the rows in use)'}, the {self.plan.scheme.method} "
                                 f"weight of shape {target.shape[-2:]} needs {tuple(want)}")
        if not self.dry_run:
            for slot in slots:
                try:
                    target.fill(codes, scales, slot)
                except ValueError as error:
                    raise ValueError(f"checkpoint tensor {names[0]!r} / {names[1]!r}: {error}") from None

    def _fp8_linear(self, name: str, read, path: str) -> None:
        names = (name, name + "_scale_inv")
        self._put(self.model.get_submodule(path).weight_q, names, *self._read(names, read))
        self.filled.add((path,))

    def _fp8_expert(self, name: str, read, layer: int, expert: int, role: str) -> None:
        mlp = self.model.decoder_layer(layer).mlp
        slots = tuple(slot for slot, e in enumerate(mlp.slot_experts) if e == expert)
        if not slots:
            return  # another rank's expert: never read
        target = {"gate": mlp.experts.gate_q, "up": mlp.experts.up_q, "down": mlp.experts.down_q}[role]
        names = (name, name + "_scale_inv")
        self._put(target, names, *self._read(names, read), slots)
        self.filled.add((layer, role, expert))

    def _mxfp4_experts(self, name: str, read, layer: int, kind: str) -> None:
        """gpt-oss's fused blocks: each local expert's slice; gate_up's rows interleave gate (even) and up (odd)."""
        mlp = self.model.decoder_layer(layer).mlp
        names = (name, name.removesuffix("blocks") + "scales")
        for slot, expert in enumerate(mlp.slot_experts):
            codes, scales = self._read(names, read, expert)
            if kind == "down_proj":
                self._put(mlp.experts.down_q, names, codes, scales, (slot,))
                self.filled.add((layer, "down", expert))
            else:
                self._put(mlp.experts.gate_q, names, codes, scales, (slot,), rows=slice(0, None, 2))
                self._put(mlp.experts.up_q, names, codes, scales, (slot,), rows=slice(1, None, 2))
                self.filled.update({(layer, "gate", expert), (layer, "up", expert)})

    def check_complete(self) -> None:
        missing = [path for path in sorted(self.plan.linears) if (path,) not in self.filled]
        for layer in sorted(self.plan.expert_layers):
            for expert in sorted(set(self.model.decoder_layer(layer).mlp.slot_experts)):
                missing += [f"layers.{layer} expert {expert} {role}" for role in ("gate", "up", "down")
                            if (layer, role, expert) not in self.filled]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} quantized weights, e.g. {missing[:3]}")

