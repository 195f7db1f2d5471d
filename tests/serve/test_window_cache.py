"""Sliding windows in the serving engine: blocks that fall out of every layer's window are given back
while a request decodes, and the tokens and logits stay those of the whole-sequence forward."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import MoETransformer, preset
from ringmoe.serve import Engine, SamplingParams

WINDOW, BLOCK = 6, 4


def _model(layer_types=None):
    config = preset("tiny").replace(sliding_window=WINDOW, layer_types=layer_types)
    model = MoETransformer(config).double()
    model.init_weights(3, std=0.3)
    return model


def _run(model, prompts, new, deterministic=False, chunk=64):
    engine = Engine(model, kv_cache_tokens=512, block_size=BLOCK, max_num_batched_tokens=chunk,
                    deterministic=deterministic)
    outputs, live = _drive(engine, prompts, new)
    return outputs, live, engine


def _drive(engine, prompts, new, decoded=0):
    """Greedy requests to the end, checking the blocks every step; (outputs, the most blocks a request held
    once ``decoded`` of its tokens past the prompt were computed)."""
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)) for p in prompts]
    live, final = 0, {}
    while engine.has_unfinished:
        final.update((out.request_id, out.output_ids) for out in engine.step() if out.finished)
        blocks = engine.groups[0].blocks
        blocks.check_integrity()
        live = max([live] + [blocks.live_blocks(i) for i in ids if i in blocks.owned
                             and engine.requests[i].num_computed > len(engine.requests[i].prompt_ids) + decoded])
    return [final[i] for i in ids], live


def _greedy_reference(model, prompt, new):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_out_of_window_blocks_are_freed_and_tokens_stay_exact():
    model = _model()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    outputs, live, engine = _run(model, prompts, 30)
    assert engine.window_reach == WINDOW - 1
    for prompt, out in zip(prompts, outputs):
        assert out == _greedy_reference(model, prompt, 30)
    # decoding, a request holds the blocks of its window (5 keys behind the query, here across at most 2
    # blocks) and the block being written: 3, where a full cache would hold up to 18
    assert live <= 3, live


def test_small_chunks_and_deterministic_mode_under_a_window():
    model = _model()
    prompt = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    want = _greedy_reference(model, prompt, 12)
    for deterministic in (False, True):
        outputs, live, _ = _run(model, [prompt], 12, deterministic=deterministic, chunk=5)
        assert outputs[0] == want
        assert live <= 3, live


def test_a_full_layer_keeps_every_block():
    model = _model(layer_types=("sliding_attention", "full_attention"))
    prompt = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    outputs, live, engine = _run(model, [prompt], 10)
    assert engine.window_reach is None
    assert outputs[0] == _greedy_reference(model, prompt, 10)
    assert live == -(-(30 + 10 - 1) // BLOCK)


def _mesh_rank(rank, world, cp, layout, prompts, new):
    from ringmoe.parallel import make_mesh

    mesh = make_mesh(cp, 1)
    config = preset("tiny").replace(sliding_window=WINDOW)
    model = MoETransformer(config, mesh, layout).double()
    model.init_weights(3, std=0.3)
    engine = Engine(model, kv_cache_tokens=256, block_size=BLOCK)
    if rank != 0:
        engine.run_worker()
        return None
    result = _drive(engine, prompts, new, decoded=8)
    engine.shutdown()
    return result


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_out_of_window_blocks_are_freed_on_every_cp_rank(layout):
    from ringmoe.parallel.launch import spawn

    model = _model()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 33)]
    outputs, live = spawn(_mesh_rank, 2, 2, layout, prompts, 24, timeout=120)[0]
    for prompt, out in zip(prompts, outputs):
        assert out == _greedy_reference(model, prompt, 24)
    # each cp rank keeps its part of the ring-prefilled prompt only while the window reaches it; after some
    # decoding a request holds a few blocks per rank, not its whole half of the sequence
    assert live <= 4, live
