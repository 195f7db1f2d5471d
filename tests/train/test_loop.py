"""Optimizer steps on cp x ep meshes equal one process (float64): packed documents, clipping, balancing."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import MoETransformer, preset
from ringmoe.model.attention_backend import UlyssesAttention
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn
from ringmoe.train import PackedStream, TrainConfig, Trainer
from ringmoe.train.data import next_token_labels

CONFIG = preset("tiny")


def _stream():
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 9, 30, 4, 17, 2, 40, 11, 6, 25, 3, 13]  # documents shorter and longer than a sequence
    docs = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    return PackedStream(docs, seqlen=24)


def _run(rank, world, cp, ep, layout, balance, steps, config=CONFIG, mla_ring="auto", ulysses=1):
    mesh = make_mesh(cp, ep, ulysses=ulysses)
    model = MoETransformer(config, mesh, layout).double()
    model.mla_ring = mla_ring
    if ulysses > 1:  # the layers attend through Ulysses (and the ring across, under USP)
        assert isinstance(model.causal_attention(), UlyssesAttention)
    model.init_weights(5, std=0.2)
    trainer = Trainer(model, TrainConfig(rows=4, lr=1e-2, warmup=2, steps=10, clip=0.05, balance=balance,
                                         aux_coef=0.1, z_coef=0.01, bias_rate=0.05), _stream())
    history = [trainer.step() for _ in range(steps)]
    state = {}
    for name, param in model.named_parameters():
        value = param.detach().clone()
        if name in model.expert_parameters():  # every expert, gathered over the ep group
            layer = model.decoder_layer(int(name.split(".")[1]))
            full = torch.zeros(config.num_experts, *value.shape[1:], dtype=value.dtype)
            full[layer.mlp.slot_experts] = value
            if mesh.ep_group is not None:
                torch.distributed.all_reduce(full, group=mesh.ep_group)
            value = full
        state[name] = value
    biases = [layer.mlp.router.correction_bias.clone() for _, layer in model.moe_layers(with_mtp=True)]
    return history, state, biases


@pytest.mark.parametrize("cp, ep, layout", [(2, 1, "zigzag"), (1, 2, "zigzag"), (2, 2, "striped"), (3, 1, "zigzag")])
@pytest.mark.parametrize("balance", ["aux", "bias"])
def test_steps_on_a_mesh_equal_one_process(cp, ep, layout, balance):
    want_history, want_state, want_bias = spawn(_run, 1, 1, 1, layout, balance, 3, timeout=120)[0]
    results = spawn(_run, cp * ep, cp, ep, layout, balance, 3, timeout=240)
    assert all(h["grad_norm"] > 0.05 for h in want_history)  # clipping was active on every step
    for history, state, bias in results:
        for got, want in zip(history, want_history):
            for key in ("loss", "aux", "z", "grad_norm"):
                assert abs(got[key] - want[key]) < 1e-10, (key, got[key], want[key])
        for name, value in state.items():
            assert (value - want_state[name]).abs().max() < 1e-10, name
        for got, want in zip(bias, want_bias):
            assert torch.equal(got, want)
    if balance == "bias":
        assert any(b.abs().sum() > 0 for b in want_bias)


@pytest.mark.parametrize("family", ["gpt-oss-tiny", "qwen2-moe-tiny", "olmoe-tiny", "qwen3-moe-dense-tiny",
                                    "deepseek-v3-tiny"])
def test_other_families_step_on_a_mesh_as_on_one_process(family):
    """gpt-oss: sinks' gradients summed over the cp ranks, windows inside packed documents through the ring,
    biases; Qwen2-MoE: the gated shared expert and a dense layer; OLMoE: qk-norm over whole projections."""
    config = preset(family)
    want_history, want_state, _ = spawn(_run, 1, 1, 1, "zigzag", "aux", 2, config, timeout=120)[0]
    for history, state, _ in spawn(_run, 4, 2, 2, "zigzag", "aux", 2, config, timeout=240):
        for got, want in zip(history, want_history):
            assert abs(got["loss"] - want["loss"]) < 1e-10 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-10
        for name, value in state.items():
            assert (value - want_state[name]).abs().max() < 1e-10, name
    if config.attention_sinks:  # the sinks moved from their initial values: their gradient reached them
        start = MoETransformer(config).double()
        start.init_weights(5, std=0.2)
        initial = dict(start.named_parameters())
        sinks = [n for n in want_state if n.endswith("sinks")]
        assert sinks and all((want_state[n] - initial[n]).abs().min() > 1e-6 for n in sinks)


@pytest.mark.parametrize("family, cp, ep, ulysses, mla_ring", [
    ("tiny", 2, 1, 2, "auto"), ("tiny", 4, 1, 2, "auto"), ("gpt-oss-tiny", 2, 2, 2, "auto"),
    ("deepseek-v3-tiny", 4, 1, 4, "expanded"), ("deepseek-v3-tiny", 4, 1, 2, "latent")])
def test_ulysses_and_hybrid_steps_equal_one_process(family, cp, ep, ulysses, mla_ring):
    """Packed documents through Ulysses (4 ranks: K/V heads repeated) and Ulysses x ring; gpt-oss's sinks (each
    rank's heads' share, summed) and windows; DeepSeek's MLA with its K/V expanded over 4 heads, and with latents
    gathered in each Ulysses pair and carried by the ring across (dW_kvb rows summed)."""
    config = preset(family)
    want_history, want_state, _ = spawn(_run, 1, 1, 1, "zigzag", "aux", 2, config, timeout=120)[0]
    for history, state, _ in spawn(_run, cp * ep, cp, ep, "zigzag", "aux", 2, config, mla_ring, ulysses, timeout=240):
        for got, want in zip(history, want_history):
            assert abs(got["loss"] - want["loss"]) < 1e-10 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-10
        for name, value in state.items():
            assert (value - want_state[name]).abs().max() < 1e-10, name


def test_deepseek_steps_with_the_latent_ring_equal_one_process():
    """MLA training under cp = 2 with the ring carrying latents over packed documents (dW_kvb summed)."""
    config = preset("deepseek-v3-tiny")
    want_history, want_state, _ = spawn(_run, 1, 1, 1, "zigzag", "bias", 2, config, timeout=120)[0]
    for history, state, _ in spawn(_run, 2, 2, 1, "zigzag", "bias", 2, config, "latent", timeout=240):
        for got, want in zip(history, want_history):
            assert abs(got["loss"] - want["loss"]) < 1e-10 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-10
        for name, value in state.items():
            assert (value - want_state[name]).abs().max() < 1e-10, name


@pytest.mark.parametrize("cp, ep", [(2, 2), (3, 1)])
def test_multi_token_prediction_steps_on_a_mesh_equal_one_process(cp, ep):
    """DeepSeek-V3 with its MTP module: the MTP loss (the token two places ahead, inside packed documents, the
    sharded next tokens as its inputs), the module's experts over the ep group and its router's bias: every rank's
    losses, gradients' norm, weights and biases equal one process's (float64)."""
    config = preset("deepseek-v3-tiny").replace(mtp_layers=1)
    want_history, want_state, want_bias = spawn(_run, 1, 1, 1, "zigzag", "bias", 2, config, timeout=120)[0]
    assert all(h["mtp_loss"] > 0 for h in want_history) and len(want_bias) == 3  # two main MoE layers + MTP
    assert any(name.startswith("mtp_layers.3.mlp.experts") for name in want_state)
    for history, state, bias in spawn(_run, cp * ep, cp, ep, "zigzag", "bias", 2, config, timeout=240):
        for got, want in zip(history, want_history):
            for key in ("loss", "mtp_loss", "grad_norm"):
                assert abs(got[key] - want[key]) < 1e-10, key
        for name, value in state.items():
            assert (value - want_state[name]).abs().max() < 1e-10, name
        for got, want in zip(bias, want_bias):
            assert torch.equal(got, want)


def test_the_mtp_loss_is_the_cross_entropy_two_tokens_ahead():
    """One process, float64: the trainer's MTP loss equals the mean cross entropy, over positions whose token two
    places ahead lies in their document, of lm_head(MTP(h_i, Emb(t_{i+1}))) against t_{i+2}; the step's loss is
    the main loss + lambda x that (no balancing terms: balance "none", z 0)."""
    import torch.nn.functional as F

    config = preset("deepseek-v3-tiny").replace(mtp_layers=1)
    model = MoETransformer(config).double()
    model.init_weights(7, std=0.2)
    trainer = Trainer(model, TrainConfig(rows=2, balance="none", z_coef=0.0, mtp_lambda=0.25), _stream())
    batch = trainer._local_batch()
    with torch.no_grad():
        lm, mtp = trainer._losses(batch)
        want_lm, want_mtp, count_lm, count_mtp = 0.0, 0.0, 0, 0
        for row in range(2):  # each sequence on its own, each document on its own: dense causal attention
            ids, cu = trainer.stream.sequence(row)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                doc = ids[a:b][None]
                hidden = model.hidden_states(doc, torch.arange(b - a))
                want_lm += F.cross_entropy(model.lm_head(hidden[0, :-1]), doc[0, 1:], reduction="sum")
                count_lm += b - a - 1
                if b - a > 2:
                    mtp_hidden = model.mtp_hidden_states(hidden[:, :-1], doc[:, 1:], torch.arange(b - a - 1),
                                                         model.causal_attention())
                    want_mtp += F.cross_entropy(model.lm_head(mtp_hidden[0, :-1]), doc[0, 2:], reduction="sum")
                    count_mtp += b - a - 2
    assert abs(float(lm) - float(want_lm) / count_lm) < 1e-10
    assert abs(float(mtp) - float(want_mtp) / count_mtp) < 1e-10
    assert batch.valid == [count_lm, count_mtp]


def test_labels_stay_inside_documents():
    ids = torch.arange(10)
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    assert next_token_labels(ids, cu).tolist() == [1, 2, -100, -100, 5, 6, 7, 8, 9, -100]
    assert next_token_labels(ids, cu, 2).tolist() == [2, -100, -100, -100, 6, 7, 8, 9, -100, -100]
    stream = _stream()
    seq, bounds = stream.sequence(1)
    assert bounds[0] == 0 and bounds[-1] == 24 and (bounds[1:] > bounds[:-1]).all()


def test_the_stream_visits_every_cut_once_per_pass_in_a_seeded_order():
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 1000, (int(n),), generator=gen).tolist()
            for n in torch.randint(5, 300, (40,), generator=gen)]
    stream, again = PackedStream(docs, seqlen=16, eos_id=1000), PackedStream(docs, seqlen=16, eos_id=1000)
    n = stream.num_sequences
    cuts = {tuple(stream.tokens[16 * i:16 * (i + 1)].tolist()): i for i in range(n)}  # stream order: cut i
    visited = [cuts[tuple(stream.sequence(i)[0].tolist())] for i in range(n)]
    assert sorted(visited) == list(range(n))                   # every cut once per pass
    assert sum(b == a + 1 for a, b in zip(visited, visited[1:])) < n // 4  # not in stream order
    assert stream.sequence(n + 3)[0].equal(stream.sequence(3)[0])  # the next pass repeats it
    batch, same = stream.batch(7, 5), again.batch(7, 5)  # a pure function of the position: resumable
    assert batch.ids.equal(same.ids) and all(a.equal(b) for a, b in zip(batch.cu_seqlens, same.cu_seqlens))
    for i, cut in enumerate(visited):  # the document boundaries travel with their cut
        starts = [int(s) - 16 * cut for s in stream.starts if 16 * cut < s < 16 * (cut + 1)]
        assert stream.sequence(i)[1].tolist() == [0, *starts, 16]
    in_order = PackedStream(docs, seqlen=16, eos_id=1000, shuffle_seed=None)
    assert all(in_order.sequence(i)[0].equal(in_order.tokens[16 * i:16 * (i + 1)]) for i in range(n))


def _gradients(rank, world, cp, ep, checkpointing):
    mesh = make_mesh(cp, ep)
    model = MoETransformer(CONFIG, mesh).double()
    model.init_weights(5, std=0.2)
    trainer = Trainer(model, TrainConfig(rows=4, clip=1e9, activation_checkpointing=checkpointing), _stream())
    trainer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cp, ep", [(1, 1), (2, 2)])
def test_activation_checkpointing_gives_the_same_step(cp, ep):
    plain = spawn(_gradients, cp * ep, cp, ep, False, timeout=120)
    recomputed = spawn(_gradients, cp * ep, cp, ep, True, timeout=120)
    for a, b in zip(plain, recomputed):
        assert all((a[n] - b[n]).abs().max() < 1e-12 for n in a)


def test_bf16_autocast_trains_with_float32_master_weights():
    model = MoETransformer(CONFIG)
    model.init_weights(5, std=0.2)
    trainer = Trainer(model, TrainConfig(rows=4, lr=1e-2, warmup=1, bf16=True), _stream())
    losses = [trainer.step()["loss"] for _ in range(8)]
    assert model.embed_tokens.weight.dtype == torch.float32
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    with pytest.raises(ValueError, match="float32 master weights"):
        Trainer(MoETransformer(CONFIG).double(), TrainConfig(bf16=True), _stream())
