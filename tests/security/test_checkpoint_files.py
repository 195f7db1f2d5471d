"""Checkpoint folders a user can hand the server: sizes bounded before any allocation, quantization methods
ringmoe does not implement and quantized tensors config.json does not describe refused in one line naming the
method or tensor (never cast as if they were weights), the memory estimate applied to
config.json, and every refusal before any rank starts (exit 2, one line)."""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
import torch

from ringmoe.cli import main
from ringmoe.model import check_checkpoint, load_checkpoint
from ringmoe.serve.service import ServeOptions, check_fits
from tests.helpers import save_tiny_mixtral

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Mixtral written by transformers (2 layers, 4 experts)."""
    return save_tiny_mixtral(tmp_path_factory.mktemp("mixtral"))


def _variant(checkpoint, tmp_path, config=None, tensors=None):
    """A copy of ``checkpoint`` with config.json fields replaced and tensors changed (name -> tensor or None)."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "ckpt"
    shutil.copytree(checkpoint, target)
    if config:
        data = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**data, **config}))
    if tensors:
        weights = load_file(target / "model.safetensors")
        for name, value in tensors.items():
            if value is None:
                weights.pop(name)
            else:
                weights[name] = value
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _serve_error(capsys, path) -> str:
    code = main(["serve", "--model", str(path), "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10**8), ("num_local_experts", 10**9),
                                          ("hidden_size", 2**40), ("vocab_size", 10**12)])
def test_absurd_sizes_are_refused_before_allocating(capsys, checkpoint, tmp_path, field, value):
    path = _variant(checkpoint, tmp_path, {field: value})
    start = time.monotonic()
    assert "beyond what ringmoe accepts" in _serve_error(capsys, path)
    assert time.monotonic() - start < 5


def test_a_quantization_config_is_refused_naming_the_method(capsys, checkpoint, tmp_path):
    path = _variant(checkpoint, tmp_path, {"quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert "quant_method 'gptq'" in _serve_error(capsys, path)


def test_fp8_weights_with_their_scales_are_refused_not_cast(capsys, checkpoint, tmp_path):
    """DeepSeek-V3's shipped layout without its quantization_config: float8 codes plus weight_scale_inv."""
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = torch.randn(32, 32).clamp(-4, 4).to(torch.float8_e4m3fn)
    path = _variant(checkpoint, tmp_path, tensors={name: weight, name + "_scale_inv": torch.ones(1, 1)})
    err = _serve_error(capsys, path)
    assert "quantized checkpoint" in err and "q_proj" in err
    with pytest.raises(ValueError, match="F8_E4M3"):
        load_checkpoint(path)


def test_a_stray_quantization_scale_is_refused(checkpoint, tmp_path):
    path = _variant(checkpoint, tmp_path, tensors={"model.layers.0.mlp.experts.0.w1.weight_scale_inv": torch.ones(1)})
    with pytest.raises(ValueError, match="quantization scale"):
        check_checkpoint(path)


def test_the_memory_estimate_applies_to_config_json(checkpoint):
    config = check_checkpoint(checkpoint)
    options = ServeOptions(model=str(checkpoint), kv_cache_tokens=2**20, cp=2, ep=2)
    need = check_fits(options, config, available=2**40)
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert need >= 4 * 2**20 * per_token  # four ranks' KV caches at least
    with pytest.raises(ValueError, match="KV cache"):
        check_fits(options, config, available=int(need))


def test_the_memory_estimate_counts_the_prepacked_copies(checkpoint):
    """float32 serving keeps a oneDNN copy of the float matrices (``ringmoe.prepacked``): the estimate counts it
    per rank and the refusal names the flag that drops it; --deterministic and --no-prepack-weights keep one copy."""
    config = check_checkpoint(checkpoint)
    def need(**options):
        return check_fits(ServeOptions(model=str(checkpoint), kv_cache_tokens=4096, cp=2, ep=2, **options), config,
                          available=2**40)
    copies = config.prepacked_bytes(config.num_experts // 2, 4)
    assert copies > 0
    assert need() - need(prepack_weights=False) == pytest.approx(4 * copies)
    assert need(deterministic=True) == need(prepack_weights=False)
    with pytest.raises(ValueError, match="prepacked weights.*--no-prepack-weights"):
        check_fits(ServeOptions(model=str(checkpoint), kv_cache_tokens=4096, cp=2, ep=2), config,
                   available=int(need(prepack_weights=False)))
