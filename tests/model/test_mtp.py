"""DeepSeek-V3's multi-token prediction module: the paper's equations around transformers' own decoder layer, loading
the checkpoint layer past the last (as DeepSeek ships it), export and re-import, and what is read when MTP is off."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringmoe.model import MoETransformer, load_checkpoint, preset, save_pretrained
from ringmoe.model.checkpoint import check_checkpoint

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, SEQ, LAYERS = 96, 23, 3


def _hf_config(layers: int, first_dense: int):
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48, kv_lora_rank=12,
        q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=first_dense,
        n_group=2, topk_group=1, n_shared_experts=1, initializer_range=0.2, attn_implementation="eager",
        experts_implementation="eager")


def _shipped_checkpoint(path, seed=0):
    """A DeepSeek-V3 checkpoint with one MTP layer as the published ones hold it: transformers writes 4 layers, the
    4th becomes the MTP block (model.layers.3.*) beside enorm, hnorm, eh_proj, shared_head.norm and the copies of
    the embedding and head; config.json says 3 layers and num_nextn_predict_layers 1."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(_hf_config(LAYERS + 1, 1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    extra = {"enorm.weight": 0.5 + torch.rand(32, generator=gen), "hnorm.weight": 0.5 + torch.rand(32, generator=gen),
             "eh_proj.weight": 0.2 * torch.randn(32, 64, generator=gen),
             "shared_head.norm.weight": 0.5 + torch.rand(32, generator=gen),
             "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
             "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    tensors.update({f"model.layers.{LAYERS}.{k}": v.contiguous() for k, v in extra.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    state = dict(model.state_dict())  # transformers' own names (fused experts) for the reference models
    state.update({f"model.layers.{LAYERS}.{k}": v for k, v in extra.items()})
    return {k: v.double() for k, v in state.items()}


def _rms(x, weight, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_the_mtp_module_is_the_papers_equations_around_a_deepseek_layer(tmp_path):
    """h'_i = W_eh [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)], then transformers' DeepseekV3 decoder layer (the checkpoint's
    layer 3: MLA, MoE with its shared expert and selection bias) and the shared head's norm: ringmoe's module, read
    from the shipped layout, gives those states and logits (float64; transformers turns RoPE in float32)."""
    tensors = _shipped_checkpoint(tmp_path)
    ours = load_checkpoint(tmp_path, dtype=torch.float64, mtp=True)
    assert ours.config.mtp_layers == 1 and list(ours.mtp_layers) == [str(LAYERS)]
    ids = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(2))
    tokens, ahead, positions = ids[:, :-1], ids[:, 1:], torch.arange(SEQ)
    # the main model: transformers with the first 3 layers
    main = transformers.DeepseekV3ForCausalLM(_hf_config(LAYERS, 1)).double().eval()
    main.load_state_dict({k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{LAYERS}.")},
                         strict=False)
    # the MTP block: transformers' model of one MoE layer holding layer 3's weights, its final norm the shared head's
    block = transformers.DeepseekV3ForCausalLM(_hf_config(1, 0)).double().eval()
    prefix = f"model.layers.{LAYERS}."
    block.load_state_dict({("model.layers.0." + k[len(prefix):]): v for k, v in tensors.items()
                           if k.startswith(prefix) and k[len(prefix):].startswith(("self_attn", "mlp", "input_",
                                                                                   "post_attention"))}
                          | {"model.norm.weight": tensors[prefix + "shared_head.norm.weight"],
                             "model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
                             "lm_head.weight": tensors["lm_head.weight"]})
    with torch.no_grad():
        h = main.model(tokens).last_hidden_state
        x = torch.cat([_rms(main.model.embed_tokens(ahead), tensors[prefix + "enorm.weight"]),
                       _rms(h, tensors[prefix + "hnorm.weight"])], dim=-1) @ tensors[prefix + "eh_proj.weight"].T
        want = block.model(inputs_embeds=x, position_ids=positions[None]).last_hidden_state
        hidden = ours.hidden_states(tokens)
        got = ours.mtp_hidden_states(hidden, ahead, positions, ours.causal_attention())
    assert (hidden - h).abs().max() < 1e-5
    assert (got - want).abs().max() < 1e-5
    assert (ours.lm_head(got) - block.lm_head(want)).abs().max() < 1e-5
    # causal: the state at position i reads tokens up to i + 1 only
    changed = ahead.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % VOCAB
    with torch.no_grad():
        again = ours.mtp_hidden_states(hidden, changed, positions, ours.causal_attention())
    assert (again[0, :10] - got[0, :10]).abs().max() < 1e-12 and (again[0, 10:] - got[0, 10:]).abs().max() > 1e-3


def test_a_checkpoint_with_an_mtp_layer_loads_without_it_unless_asked(tmp_path):
    """Without mtp=True the layer past the last is not read (its bytes untouched) and the model equals transformers'
    3 layers; with it, every MTP tensor is read except the copies of the embedding and head."""
    _shipped_checkpoint(tmp_path)
    plain = load_checkpoint(tmp_path, dtype=torch.float64)
    assert plain.config.mtp_layers == 0 and not list(plain.mtp_layers)
    assert not any(f"layers.{LAYERS}." in name for name in plain.load_report.tensors)
    full = load_checkpoint(tmp_path, dtype=torch.float64, mtp=True)
    read = [name for name in full.load_report.tensors if f"layers.{LAYERS}." in name]
    assert f"model.layers.{LAYERS}.eh_proj.weight" in read and f"model.layers.{LAYERS}.mlp.gate.weight" in read
    assert not any("embed_tokens" in name or "shared_head.head" in name for name in read)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(plain(ids), full(ids))
    assert check_checkpoint(tmp_path).mtp_layers == 1  # the dry run checks the MTP layer's shapes too


def test_export_and_import_keep_the_mtp_layer(tmp_path):
    """save_pretrained writes the module as DeepSeek's layer past the last (with the embedding and head copies and
    num_nextn_predict_layers); loading it back with mtp=True gives every weight and buffer bit for bit, also for an
    fp8 model; a model without MTP refuses mtp=True naming the config field."""
    config = preset("deepseek-v3-tiny").replace(mtp_layers=1)
    model = MoETransformer(config).double()
    model.init_weights(3, std=0.2)
    for layer in model.mtp_layers.values():  # float32 values: the loader reads the bias in float32, as transformers
        layer.mlp.router.correction_bias.copy_(0.3 * torch.randn(8).float())
    save_pretrained(model, tmp_path / "float")
    names = load_file(tmp_path / "float" / "model.safetensors").keys()
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "mlp.experts.7.down_proj.weight",
                   "mlp.gate.e_score_correction_bias", "self_attn.kv_a_proj_with_mqa.weight"):
        assert f"model.layers.3.{suffix}" in names, suffix
    assert json.loads((tmp_path / "float" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = load_checkpoint(tmp_path / "float", dtype=torch.float64, mtp=True)
    assert back.state_dict().keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    # kept quantized: the MTP block's projections and experts as fp8 codes and block scales, round trip exact
    fp8 = load_checkpoint(tmp_path / "float", dtype=torch.float64, mtp=True, quantization="fp8")
    assert type(fp8.mtp_layers["3"].mlp.experts).__name__ == "QuantizedSwiGLUExperts"
    save_pretrained(fp8, tmp_path / "fp8")
    again = load_checkpoint(tmp_path / "fp8", dtype=torch.float64, mtp=True)
    for name, value in fp8.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    save_pretrained(MoETransformer(preset("deepseek-v3-tiny")), tmp_path / "plain")
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        load_checkpoint(tmp_path / "plain", mtp=True)
