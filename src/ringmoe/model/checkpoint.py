"""Loading transformers-format checkpoints (config.json + safetensors) onto a mesh.

Supported: MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM and
GptOssForCausalLM, with experts stored
per expert (``experts.{e}.w1/w2/w3`` or ``gate_proj/up_proj/down_proj``, as
the Hub's checkpoints and ``save_pretrained`` write them) or fused
(``experts.gate_up_proj`` (E, 2F, H), ``experts.down_proj`` (E, H, F)).
Each rank reads only the tensors it holds: the replicated ones and its own
experts (safetensors are memory-mapped, so other experts' bytes are never
touched).  Pickled ``.bin`` checkpoints are refused: they can run code.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..jsonio import read_json
from ..parallel.mesh import Mesh
from .checkpoint_names import EXPERT, FUSED, ROLE, expect_shape, is_loaded, ringmoe_name
from .config import ModelConfig, config_from_hf
from .quantize import quantize_model, requested_scheme
from .quantized_loading import QuantizedReader, build_quantized, plan_quantized
from .transformer import MoETransformer

__all__ = ["load_config", "load_checkpoint", "load_weights", "check_checkpoint", "LoadReport"]

@dataclass
class LoadReport:
    """What one rank read: tensor names (an expert slice reads as 'name[e]') and bytes."""

    tensors: list[str] = field(default_factory=list)
    bytes_read: int = 0


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist" if not path.exists()
                         else f"checkpoint {str(path)!r} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has no config.json")
    try:
        return config_from_hf(read_json(config_file))
    except KeyError as missing:
        raise ValueError(f"{str(config_file)!r} lacks the field {missing}") from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{str(config_file)!r}: {error}") from None


def _open_safetensors(file: Path):
    from safetensors import safe_open

    if not file.is_file():
        raise ValueError(f"checkpoint shard {str(file)!r} is missing")
    try:
        return safe_open(file, framework="pt")
    except Exception as error:  # safetensors raises its own error type for corrupt headers
        raise ValueError(f"{str(file)!r} is not a valid safetensors file ({error})") from None


def _mtp_layers_present(path: Path, config: ModelConfig) -> int:
    """How many of config.json's num_nextn_predict_layers the checkpoint holds (transformers writes the field, 1 by
    default for DeepSeek-V3, but never the layers: only checkpoints as DeepSeek ships them have them)."""
    files = _tensor_files(path)
    return sum(1 for k in range(config.mtp_layers) if f"model.layers.{config.num_layers + k}.eh_proj.weight" in files)


def _model_files(path: Path, config: ModelConfig) -> dict[str, Path]:
    """``_tensor_files`` without the tensors a model of ``config`` does not read (``is_loaded``)."""
    return {name: file for name, file in _tensor_files(path).items()
            if is_loaded(name, config.num_layers, config.mtp_layers)}


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no weight_map of tensor names to files")
        for file in sorted(set(weight_map.values())):
            if not (path / file).is_file():
                raise ValueError(f"{str(index)!r} points at {file!r}, which is missing from {str(path)!r}")
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(f"{str(path)!r} holds only pickled weights (.bin/.pt); ringmoe loads safetensors only "
                         f"(convert with transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise ValueError(f"{str(path)!r} has no model.safetensors or model.safetensors.index.json")


def check_checkpoint(path: str | Path) -> ModelConfig:
    """Validate a checkpoint without reading its weights: config, files, and every tensor's shape.

    Builds the whole model on the meta device (no memory) and runs the loader in dry-run mode,
    which reads only safetensors headers.  Raises ValueError naming the file or tensor at fault.
    """
    config = load_config(path)
    config = config.replace(mtp_layers=_mtp_layers_present(Path(path), config))
    with torch.device("meta"):
        model = MoETransformer(config)
    load_weights(model, path, dry_run=True)
    return config


# safetensors dtypes a weight may have; float8 codes, packed integers and the like are quantized formats whose
# scales ringmoe does not apply: casting their codes to float would compute garbage without a word
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_QUANTIZATION_SUFFIXES = ("weight_scale_inv", "weight_scale", "_scales", "_blocks", "input_scale")


def _check_float(name: str, dtype: str, file: Path) -> None:
    """Refuse a tensor read as a float weight that is not one (quantized tensors go through quantized_loading,
    and only where config.json's quantization_config says the checkpoint is quantized)."""
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} in {str(file)!r} is {dtype}: a quantized checkpoint tensor "
                         f"that config.json's quantization_config does not describe (ringmoe loads fp8 block-wise "
                         f"and mxfp4 checkpoints with theirs; other weights must be {', '.join(_FLOAT_DTYPES)})")
    if name.endswith(_QUANTIZATION_SUFFIXES):
        raise ValueError(f"checkpoint tensor {name!r} in {str(file)!r} is a quantization scale that belongs to no "
                         f"quantized weight: a quantized checkpoint tensor config.json does not describe")


class _Reader:
    """Reads tensors (or, dry_run, only their header shapes as meta tensors) from open safetensors files."""

    def __init__(self, files: dict[str, Path], handles: dict, dry_run: bool, report: LoadReport):
        self.files, self.handles, self.dry_run, self.report = files, handles, dry_run, report

    def has(self, name: str) -> bool:
        return name in self.files

    def dtype(self, name: str) -> str:
        return self.handles[self.files[name]].get_slice(name).get_dtype()

    def __call__(self, name: str, index: int | None = None, raw: bool = False) -> torch.Tensor:
        """Tensor ``name`` (its slice ``index`` along the first dim: one expert of a fused tensor); a float
        weight unless ``raw`` (quantized codes and scales, read as stored)."""
        handle = self.handles[self.files[name]]
        if not raw:
            _check_float(name, self.dtype(name), self.files[name])
        if self.dry_run:
            shape = handle.get_slice(name).get_shape()
            if index is not None:
                if not shape or not 0 <= index < shape[0]:
                    raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(shape)} has no expert {index}")
                shape = shape[1:]
            return torch.empty(shape, device="meta")
        try:
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        except Exception as error:  # truncated data behind a valid header
            raise ValueError(f"cannot read tensor {name!r} from {str(self.files[name])!r}: {error}") from None
        self.report.tensors.append(name if index is None else f"{name}[{index}]")
        self.report.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _layer_of(model: MoETransformer, name: str, number: int):
    if not 0 <= number < model.config.num_layers + model.config.mtp_layers:
        raise ValueError(f"checkpoint tensor {name!r} belongs to layer {number}, but config.json has "
                         f"{model.config.num_layers} layers")
    return model.decoder_layer(number)


def _stack_experts(model: MoETransformer, experts: dict, dry_run: bool) -> set[str]:
    """Copy each MoE layer's local experts (collected per (layer, role) and expert) into its stacked weights
    (only the biases where the experts are quantized: their codes are read by quantized_loading); the
    parameter names filled."""
    config, filled = model.config, set()
    for index, layer in model.moe_layers(with_mtp=True):
        mine = layer.mlp.experts
        quantized = not isinstance(mine.gate_up, nn.Parameter)
        roles = (() if quantized else ("gate", "up", "down")) + (
            ("gate_bias", "up_bias", "down_bias") if config.expert_bias else ())
        try:
            stacked = {role: torch.stack([experts[(index, role)][e] for e in layer.mlp.slot_experts])
                       for role in roles}
        except KeyError as missing:
            raise ValueError(f"checkpoint lacks the weights of layer {index}'s expert {missing}") from None
        if not dry_run:
            if not quantized:
                mine.gate_up.copy_(torch.cat([stacked["gate"], stacked["up"]], dim=1))
                mine.down.copy_(stacked["down"])
            if config.expert_bias:
                mine.gate_up_bias.copy_(torch.cat([stacked["gate_bias"], stacked["up_bias"]], dim=1))
                mine.down_bias.copy_(stacked["down_bias"])
        filled.update(f"{model.layer_name(index)}.mlp.experts.{p}" for p, _ in mine.named_parameters())
    return filled


@torch.no_grad()
def load_weights(model: MoETransformer, path: str | Path, dry_run: bool = False) -> LoadReport:
    """Copy the checkpoint's tensors into ``model`` (its own experts only). Returns what was read.

    dry_run: read only the headers (tensor shapes) and check them; nothing is copied.
    Raises ValueError naming the tensor or file that does not fit the model's config.
    """
    path = Path(path)
    config = model.config
    files = _model_files(path, config)
    params, expert_params = dict(model.named_parameters()), model.expert_parameters()
    h, f = config.hidden_size, config.ffn_size
    report, filled = LoadReport(), set()
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # (layer, gate|up|down) -> expert -> weight
    quantized = None
    with contextlib.ExitStack() as stack:
        read = _Reader(files, {file: stack.enter_context(_open_safetensors(file)) for file in set(files.values())},
                       dry_run, report)
        if config.quantization is not None:
            plan = plan_quantized(config.quantization, {name: read.dtype(name) for name in files}, config.num_layers)
            build_quantized(model, plan)
            quantized = QuantizedReader(model, plan, dry_run)
            params, expert_params = dict(model.named_parameters()), model.expert_parameters()
        for name in files:
            if quantized is not None and quantized.take(name, read):
                continue
            if name.endswith(_QUANTIZATION_SUFFIXES):
                _check_float(name, read.dtype(name), files[name])
            short = ringmoe_name(name, config.num_layers)
            if short.endswith(".mlp.gate.e_score_correction_bias"):  # DeepSeek-V3's selection bias (a buffer)
                bias = read(name)
                expect_shape(name, bias, (config.num_experts,))
                if not dry_run:
                    _layer_of(model, name, int(short.split(".")[1])).mlp.router.correction_bias.copy_(bias.float())
            elif (m := EXPERT.search(short)) is not None:
                layer, expert, kind = int(m.group(1)), int(m.group(2)), ROLE[m.group(3)]
                if expert in _layer_of(model, name, layer).mlp.slot_experts:
                    weight = read(name)
                    expect_shape(name, weight, (h, f) if kind == "down" else (f, h))
                    experts.setdefault((layer, kind), {})[expert] = weight
            elif (m := FUSED.search(short)) is not None:
                layer, kind, bias = int(m.group(1)), m.group(2), m.group(3) is not None
                for expert in _layer_of(model, name, layer).mlp.slot_experts:
                    for role, part in _fused_parts(config, f"{name}[{expert}]", read(name, expert), kind, bias):
                        experts.setdefault((layer, role), {})[expert] = part
            elif short in params and short not in expert_params:
                weight = read(name)
                expect_shape(name, weight, params[short].shape)
                if not dry_run:
                    params[short].copy_(weight)
                filled.add(short)
    if config.tie_word_embeddings:
        filled.add("lm_head.weight")
    filled |= _stack_experts(model, experts, dry_run)
    if quantized is not None:
        quantized.check_complete()
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return report


def _fused_parts(config: ModelConfig, name: str, tensor: torch.Tensor, kind: str, bias: bool):
    """[(role, tensor)] of one expert's slice of a fused tensor, in ringmoe's (out, in) orientation.

    transformers v5 (Mixtral, Qwen): gate_up_proj (2F, H) = [gate; up], down_proj (H, F).  gpt-oss:
    gate_up_proj (H, 2F) with gate and up interleaved (columns 0, 2, 4... gate; 1, 3, 5... up), its bias
    (2F,) interleaved the same way, down_proj (F, H), down_proj_bias (H,).
    """
    h, f = config.hidden_size, config.ffn_size
    gpt_oss = config.arch == "gpt_oss"
    if kind == "down_proj":
        if bias:
            expect_shape(name, tensor, (h,))
            return [("down_bias", tensor)]
        expect_shape(name, tensor, (f, h) if gpt_oss else (h, f))
        return [("down", tensor.t() if gpt_oss else tensor)]
    if bias:
        expect_shape(name, tensor, (2 * f,))
        return [("gate_bias", tensor[0::2]), ("up_bias", tensor[1::2])]
    if gpt_oss:
        expect_shape(name, tensor, (h, 2 * f))
        return [("gate", tensor[:, 0::2].t()), ("up", tensor[:, 1::2].t())]
    expect_shape(name, tensor, (2 * f, h))
    gate, up = tensor.chunk(2, dim=0)
    return [("gate", gate), ("up", up)]


def load_checkpoint(path: str | Path, mesh: Mesh | None = None, layout: str = "zigzag", backend: str = "auto",
                    dtype: torch.dtype | None = None, capacity_factor: float | None = None,
                    overlap_chunks: int = 1, quantization: str | None = None, mtp: bool = False) -> MoETransformer:
    """Build the model a checkpoint directory describes on ``mesh`` and load its weights.

    dtype: parameters' dtype (default: the default dtype).  capacity_factor, overlap_chunks: the
    runtime fields of ``ModelConfig``.  The result's logits equal transformers' model of the same checkpoint.
    quantization: "fp8" or "mxfp4" quantizes a float checkpoint once loaded (``quantize_model``; the float
    weights exist until then); a checkpoint that ships quantized loads as it is (the same method, else ValueError).
    mtp: also build and load the checkpoint's multi-token prediction modules (DeepSeek-V3's
    num_nextn_predict_layers; ValueError when it has none); without it they are not read.
    """
    config = load_config(path)
    config = config.replace(mtp_layers=_mtp_layers_present(Path(path), config) if mtp else 0)
    if mtp and not config.mtp_layers:
        raise ValueError(f"checkpoint {str(path)!r} has no multi-token prediction layer (config.json's "
                         f"num_nextn_predict_layers is 0 or absent, or its layer's tensors are not there)")
    config = config.replace(capacity_factor=capacity_factor, overlap_chunks=overlap_chunks)
    scheme = requested_scheme(config, quantization)
    if config.quantization is None:
        model = MoETransformer(config, mesh, layout, backend)
    else:
        # built without memory, the quantized modules swapped in, then allocated: the float form of the
        # quantized weights never exists.  Every buffer of the model is zero at init (routers' selection bias).
        files = _model_files(Path(path), config)
        with contextlib.ExitStack() as stack:
            handles = {file: stack.enter_context(_open_safetensors(file)) for file in set(files.values())}
            plan = plan_quantized(config.quantization,
                                  {name: handles[file].get_slice(name).get_dtype() for name, file in files.items()},
                                  config.num_layers)
        with torch.device("meta"):
            model = MoETransformer(config, mesh, layout, backend)
            build_quantized(model, plan)
        model = model.to_empty(device=torch.get_default_device())
        for buffer in model.buffers():
            buffer.zero_()
    if dtype is not None:
        model = model.to(dtype)
    model.load_report = load_weights(model, path)  # what this rank read
    if scheme is not None:
        quantize_model(model, scheme)
    return model
