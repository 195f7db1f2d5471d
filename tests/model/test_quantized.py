"""Quantized checkpoints as they ship: DeepSeek-V3 and Qwen3-MoE in FP8 block format, gpt-oss with MXFP4 experts.

Each fixture is a tiny transformers model whose weights are quantized here following the published layout
(codes + ``weight_scale_inv`` per 128 x 128 block; ``*_blocks`` + ``*_scales`` per 32 values), written as
safetensors with the ``quantization_config`` of config.json, while the transformers model gets the dequantized
weights: ringmoe's logits and greedy tokens, from the codes kept quantized, must equal it.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from ringmoe.model import check_checkpoint, load_checkpoint
from ringmoe.model.config import PRESETS
from ringmoe.moe.quantized_experts import QuantizedSwiGLUExperts
from ringmoe.parallel.launch import spawn
from ringmoe.quant import (QuantizedLinear, QuantScheme, dequantize_fp8, dequantize_mxfp4, quantize_fp8,
                           quantize_mxfp4, scheme_from_hf)
from tests.helpers import MESH_VOCAB, assert_generation_matches, assert_mesh_matches, mesh_rank_run

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, SEQ = MESH_VOCAB, 29
FLOAT_ONLY = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")  # kept float in the shipped checkpoints


def _deepseek():
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=200, kv_lora_rank=12,
        q_lora_rank=136, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1, n_group=2,
        topk_group=1, n_shared_experts=1, initializer_range=0.1, attn_implementation="eager",
        experts_implementation="eager")
    return transformers.DeepseekV3ForCausalLM(cfg)


def _qwen3():
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=160, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=40, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=136, norm_topk_prob=True, initializer_range=0.1,
                                      attn_implementation="eager", experts_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(cfg)


def _gpt_oss():
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                    intermediate_size=64, sliding_window=5, swiglu_limit=1.5, initializer_range=0.1,
                                    attn_implementation="eager", experts_implementation="eager")
    return transformers.GptOssForCausalLM(cfg)


def _fp8_tensors(state: dict) -> tuple[dict, dict]:
    """(the checkpoint's tensors: fp8 codes + weight_scale_inv, experts per expert; the dequantized state)."""
    stored, dequantized = {}, dict(state)
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix, f = name.rsplit(".", 1)[0], tensor.shape[1] // 2
            parts = {"down_proj": tensor} if name.endswith("down_proj") else {"gate_proj": tensor[:, :f],
                                                                              "up_proj": tensor[:, f:]}
            rebuilt = []
            for role, weights in parts.items():
                codes, scales = quantize_fp8(weights)
                rebuilt.append(dequantize_fp8(codes, scales, (128, 128)))
                for e in range(tensor.shape[0]):
                    stored[f"{prefix}.{e}.{role}.weight"] = codes[e].contiguous()
                    stored[f"{prefix}.{e}.{role}.weight_scale_inv"] = scales[e].contiguous()
            dequantized[name] = torch.cat(rebuilt, dim=1)
        elif name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in FLOAT_ONLY):
            codes, scales = quantize_fp8(tensor)
            stored[name], stored[name + "_scale_inv"] = codes, scales
            dequantized[name] = dequantize_fp8(codes, scales, (128, 128))
        else:
            stored[name] = tensor.contiguous()
    return stored, dequantized


def _mxfp4_tensors(state: dict) -> tuple[dict, dict]:
    """gpt-oss: experts' gate_up_proj (E, H, 2F) and down_proj (E, F, H) stored as blocks/scales of their
    (out, in) transposes, everything else float."""
    stored, dequantized = {}, dict(state)
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
            dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2)
        else:
            stored[name] = tensor.contiguous()
    return stored, dequantized


def _drawn(build, seed: int):
    """A tiny transformers model with random norms, biases, sinks and routing biases (never zeros or ones)."""
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    return model


def _save(build, method: str | None, path, seed: int = 0):
    """A tiny transformers model saved under ``path`` in ``method``'s format (None: float, as transformers
    writes it); returns it (dequantized, float64)."""
    model = _drawn(build, seed)
    model.save_pretrained(path)
    if method is None:
        return model.double().eval()
    stored, dequantized = (_fp8_tensors if method == "fp8" else _mxfp4_tensors)(model.state_dict())
    model.load_state_dict(dequantized)
    (path / "model.safetensors").unlink()
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = QuantScheme(method).to_hf()
    (path / "config.json").write_text(json.dumps(config))
    return model.double().eval()


# -- the formats --------------------------------------------------------------------------------------------------

def test_fp8_blocks_round_trip_and_agree_with_transformers_dequantization():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = torch.randn(200, 150, generator=torch.Generator().manual_seed(5)) * 0.05
    codes, scales = quantize_fp8(weight)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (2, 2)  # full and partial blocks
    ours = dequantize_fp8(codes, scales, (128, 128))
    theirs = _dequantize_fp8_weight(codes, scales, [128, 128], torch.float32)
    assert torch.equal(ours, theirs)
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of its block's largest magnitude scale
    block_max = weight.abs().max()
    assert (ours - weight).abs().max() <= block_max * 2.0**-4


def test_mxfp4_round_trip_and_agrees_with_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(6)) * 0.1
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (3, 40, 3, 16) and blocks.dtype == torch.uint8 and scales.shape == (3, 40, 3)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out): gpt-oss's layout
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(ours)), ours)  # representable values come back exactly
    group_max = weight.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    assert ((ours - weight).unflatten(-1, (-1, 32)).abs() <= group_max / 4 + 1e-12).all()


def test_quantization_configs_ringmoe_does_not_implement_are_refused_by_name():
    assert scheme_from_hf({"quant_method": "fp8", "weight_block_size": [128, 128]}) == QuantScheme("fp8")
    assert scheme_from_hf({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}).method == "mxfp4"
    for config, words in [({"quant_method": "gptq", "bits": 4}, "'gptq'"),
                          ({"quant_method": "fp8", "weight_block_size": None}, "per-tensor"),
                          ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
                          ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
                           "static")]:
        with pytest.raises(ValueError, match=words):
            scheme_from_hf(config)


def test_the_memory_estimate_counts_the_quantized_bytes():
    v3 = PRESETS["deepseek-v3"]
    assert 670e9 < v3.num_params < 672e9
    fp8, bf16 = v3.weight_bytes(v3.num_experts, 1), v3.replace(quantization=None).weight_bytes(v3.num_experts, 2)
    assert 0.5 < fp8 / bf16 < 0.51  # 1 byte and a block scale per value, beside the float embeddings and norms


# -- whole checkpoints ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,method", [("deepseek", "fp8"), ("qwen3", "fp8"), ("gpt-oss", "mxfp4")])
def test_quantized_checkpoints_compute_what_transformers_computes_on_the_dequantized_weights(family, method,
                                                                                             tmp_path):
    build = {"deepseek": _deepseek, "qwen3": _qwen3, "gpt-oss": _gpt_oss}[family]
    hf = _save(build, method, tmp_path)
    assert check_checkpoint(tmp_path).quantization == QuantScheme(method)
    ours = load_checkpoint(tmp_path, dtype=torch.float64)
    experts = [m for m in ours.modules() if isinstance(m, QuantizedSwiGLUExperts)]
    linears = [m for m in ours.modules() if isinstance(m, QuantizedLinear)]
    assert experts and (linears if method == "fp8" else not linears)
    # nothing quantized is held as floats: the codes are 1 byte (fp8) or half a byte (mxfp4) per value
    assert all(m.gate_q.codes.dtype == torch.uint8 for m in experts)
    assert not any(p.dim() == 3 and p.shape[-1] == ours.config.hidden_size for p in ours.parameters())
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    # DeepSeek-V3 routes in float32 in transformers (sigmoid scores): agreement to float32 resolution
    assert_generation_matches(hf, ours, ids, 5, 1e-5, 1e-5)


@pytest.mark.parametrize("family,method,cp,ep", [("deepseek", "fp8", 1, 2), ("gpt-oss", "mxfp4", 2, 2)])
def test_quantized_checkpoints_on_a_mesh_match_transformers(family, method, cp, ep, tmp_path):
    hf = _save({"deepseek": _deepseek, "gpt-oss": _gpt_oss}[family], method, tmp_path, seed=4)
    results = spawn(mesh_rank_run, cp * ep, str(tmp_path), cp, ep, 3, timeout=180)
    assert_mesh_matches(hf, results, cp, ep, 3, logits_tol=1e-5)


def _rank_reads(rank, world, path):
    from ringmoe.parallel import make_mesh

    model = load_checkpoint(path, make_mesh(1, world))
    return sorted(model.load_report.tensors), sorted(set(model.layers[1].mlp.slot_experts))


def test_each_rank_reads_only_its_experts_codes_and_scales(tmp_path):
    _save(_gpt_oss, "mxfp4", tmp_path)
    for tensors, experts in spawn(_rank_reads, 2, str(tmp_path), timeout=120):
        read = {t for t in tensors if "experts" in t and t.endswith("]")}
        assert read == {f"model.layers.{layer}.mlp.experts.{kind}[{e}]" for layer in (0, 1) for e in experts
                        for kind in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                     "down_proj_scales", "gate_up_proj_bias", "down_proj_bias")}


def _rewrite(path, change):
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_bad_scales_and_missing_scales_are_refused_naming_the_tensor(tmp_path):
    _save(_deepseek, "fp8", tmp_path)
    name = "model.layers.1.self_attn.q_a_proj.weight_scale_inv"

    def wrong_shape(tensors):
        tensors[name] = torch.ones(1, 1)

    _rewrite(tmp_path, wrong_shape)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r".*\(1, 1\).*\(2, 2\)"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="q_a_proj"):
        check_checkpoint(tmp_path)

    def no_scale(tensors):
        del tensors[name]

    _rewrite(tmp_path, no_scale)
    with pytest.raises(ValueError, match="without its"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("method,name", [("fp8", "model.layers.1.self_attn.o_proj.weight"),
                                         ("fp8", "model.layers.1.self_attn.o_proj.weight_scale_inv"),
                                         ("mxfp4", "model.layers.0.mlp.experts.down_proj_scales")])
def test_nan_codes_and_scales_are_refused_naming_the_tensor(method, name, tmp_path):
    """e4m3fn's NaN code (0x7F / 0xFF), a NaN float32 scale, E8M0's NaN scale (0xFF)."""
    _save(_qwen3 if method == "fp8" else _gpt_oss, method, tmp_path)

    def poison(tensors):
        flat = tensors[name].view(-1)
        if flat.dtype == torch.float32:
            flat[3] = float("nan")
        else:
            flat.view(torch.uint8)[3] = 0xFF

    _rewrite(tmp_path, poison)
    with pytest.raises(ValueError, match=name.removesuffix("_scale_inv").replace(".", r"\.") + ".*NaN"):
        load_checkpoint(tmp_path)


def test_an_engine_serves_a_quantized_checkpoint_with_the_dequantized_models_tokens(tmp_path):
    from ringmoe.serve import Engine, SamplingParams

    hf = _save(_deepseek, "fp8", tmp_path)
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 13, dtype=torch.long), max_new_tokens=6,
                       do_sample=False, pad_token_id=0)[0, 13:].tolist()
    for graph in ("off", "static"):
        engine = Engine.from_checkpoint(tmp_path, dtype=torch.float64, kv_cache_tokens=256, decode_graph=graph)
        outs = engine.generate([prompt, prompt[:7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert outs[0].output_ids == want, graph


@pytest.mark.parametrize("family,method", [("deepseek", "fp8"), ("gpt-oss", "mxfp4")])
def test_export_keeps_the_quantized_format(family, method, tmp_path):
    from safetensors.torch import load_file

    from ringmoe.model import save_pretrained

    _save({"deepseek": _deepseek, "gpt-oss": _gpt_oss}[family], method, tmp_path / "in")
    model = load_checkpoint(tmp_path / "in")
    save_pretrained(model, tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    shipped = load_file(tmp_path / "in" / "model.safetensors")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == method
    quantized = [name for name, t in shipped.items() if t.dtype in (torch.float8_e4m3fn, torch.uint8)]
    assert quantized and all(torch.equal(written[name].view(torch.uint8), shipped[name].view(torch.uint8))
                             for name in quantized)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    assert torch.equal(load_checkpoint(tmp_path / "out")(ids), model(ids))



# -- quantizing a float checkpoint on the fly -------------------------------------------------------------------

@pytest.mark.parametrize("family,method", [("deepseek", "fp8"), ("gpt-oss", "mxfp4")])
def test_a_float_checkpoint_quantized_on_the_fly_holds_the_bytes_the_shipped_format_holds(family, method, tmp_path):
    from ringmoe.serve import Engine, SamplingParams

    build = {"deepseek": _deepseek, "gpt-oss": _gpt_oss}[family]
    _save(build, method, tmp_path / "shipped", seed=7)
    _save(build, None, tmp_path / "float", seed=7)
    shipped = load_checkpoint(tmp_path / "shipped")
    online = load_checkpoint(tmp_path / "float", quantization=method)
    assert online.config.quantization == QuantScheme(method)
    want, got = shipped.state_dict(), online.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    kinds = [sorted({type(m).__name__ for m in model.modules()}) for model in (shipped, online)]
    assert kinds[0] == kinds[1] and "QuantizedSwiGLUExperts" in kinds[1]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(8))
    exact = load_checkpoint(tmp_path / "float")(ids)
    error = ((online(ids) - exact).norm(dim=-1) / exact.norm(dim=-1)).median()
    # quantized (not the float weights), within the format's error: e4m3 rounds each value to 2^-4 of its size,
    # e2m1 to 2^-2 of its group's largest (measured on these random tiny models: 8% and 10%)
    assert 0.01 < error < 0.2
    # served through the engine: the shipped checkpoint's greedy tokens, decode graph or not
    prompt, params = ids[0, :11].tolist(), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = Engine.from_checkpoint(tmp_path / "shipped", kv_cache_tokens=128).generate([prompt], params)[0].output_ids
    for graph in ("off", "static"):
        engine = Engine.from_checkpoint(tmp_path / "float", quantization=method, kv_cache_tokens=128,
                                        decode_graph=graph)
        assert engine.model.config.quantization == QuantScheme(method)
        assert engine.generate([prompt], params)[0].output_ids == want, graph


def test_quantization_requests_that_cannot_apply_are_refused_naming_the_flag(tmp_path):
    from ringmoe.model.quantize import requested_scheme
    from ringmoe.serve.service import ServeOptions, validate

    _save(_deepseek, "fp8", tmp_path / "fp8")
    _save(_qwen3, None, tmp_path / "qwen3")
    with pytest.raises(ValueError, match="--quantization 'mxfp4': the checkpoint ships 'fp8'"):
        validate(ServeOptions(model=str(tmp_path / "fp8"), quantization="mxfp4", kv_cache_tokens=64))
    assert load_checkpoint(tmp_path / "fp8", quantization="fp8").config.quantization == QuantScheme("fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_checkpoint(tmp_path / "qwen3", quantization="int4")
    config = check_checkpoint(tmp_path / "qwen3")
    assert requested_scheme(config, None) is None and requested_scheme(config, "fp8") == QuantScheme("fp8")
    with pytest.raises(ValueError, match="ffn_size 136 is not a multiple of 32"):
        requested_scheme(config, "mxfp4")


def test_ringmoe_serve_quantization_serves_the_quantized_models_answers(served_checkpoint):
    """`ringmoe serve --quantization fp8` on a float checkpoint, over HTTP with the openai client: the greedy
    answers of the in-process engine that quantized the same checkpoint."""
    from ringmoe.serve import Engine, SamplingParams
    from tests.served import served_greedy_texts

    prompts, params = ["def add(a, b):", "The quick brown"], SamplingParams(temperature=0, max_tokens=10,
                                                                            ignore_eos=True)
    want = [o.text for o in Engine.from_checkpoint(served_checkpoint, quantization="fp8",
                                                   kv_cache_tokens=256).generate(prompts, params)]
    assert served_greedy_texts(served_checkpoint, ("--quantization", "fp8"), prompts, 10) == want
