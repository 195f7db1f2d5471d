"""Checkpoints: resume continues bitwise, a run killed during a save resumes from the last complete one, and
the exported folder is a transformers checkpoint with the same logits."""

from __future__ import annotations

import logging

import pytest
import torch

from ringmoe.model import MoETransformer, load_checkpoint
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn
from ringmoe.train import TrainConfig, Trainer
from ringmoe.train.checkpoint import export, latest, resume, save

from .test_loop import CONFIG, _stream

SETTINGS = TrainConfig(rows=4, lr=1e-2, warmup=2, steps=10, clip=0.5)


def _trainer(cp, ep, seed=5):
    model = MoETransformer(CONFIG, make_mesh(cp, ep)).double()
    model.init_weights(seed, std=0.2)
    return Trainer(model, SETTINGS, _stream())


def _state(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _uninterrupted(rank, world, cp, ep):
    trainer = _trainer(cp, ep)
    losses = [trainer.step()["loss"] for _ in range(4)]
    return losses, _state(trainer)


def _interrupted(rank, world, cp, ep, out):
    first = _trainer(cp, ep)
    losses = [first.step()["loss"] for _ in range(2)]
    save(first, out)
    second = _trainer(cp, ep, seed=99)  # other weights: everything must come from the checkpoint
    assert resume(second, out)
    losses += [second.step()["loss"] for _ in range(2)]
    return losses, _state(second)


@pytest.mark.parametrize("cp, ep", [(1, 1), (2, 2)])
def test_resume_continues_bitwise(cp, ep, tmp_path):
    want = spawn(_uninterrupted, cp * ep, cp, ep, timeout=120)
    got = spawn(_interrupted, cp * ep, cp, ep, str(tmp_path), timeout=120)
    for (want_losses, want_state), (got_losses, got_state) in zip(want, got):
        assert got_losses == want_losses
        assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)


def test_a_save_that_never_finished_is_ignored(tmp_path):
    trainer = _trainer(1, 1)
    trainer.step()
    trainer.step()
    done = save(trainer, tmp_path)
    (tmp_path / "step-000004.tmp").mkdir()  # a run killed while writing its next checkpoint
    (tmp_path / "step-000004.tmp" / "rank0.pt").write_bytes(b"half a file")
    assert latest(tmp_path) == done
    fresh = _trainer(1, 1, seed=7)
    assert resume(fresh, tmp_path) and fresh.step_count == 2


def _export_rank(rank, world, out):
    trainer = _trainer(1, 2)
    trainer.step()
    export(trainer.model, out, eos_token_id=0)
    return None


def test_export_from_a_mesh_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    spawn(_export_rank, 2, str(tmp_path / "hf"), timeout=120)
    ours = load_checkpoint(tmp_path / "hf", dtype=torch.float64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64,
                                                           attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-5  # RoPE and routing in float32 on their side
