"""The demo's trained checkpoint: trained once into a staging folder, then reused from the cache."""

from __future__ import annotations

import json

from ringmoe.apps.demo_model import trained_demo_checkpoint
from ringmoe.serve import Engine, SamplingParams

TINY = dict(preset="tiny", vocab_size=300, seqlen=64, tokens_per_step=256, steps=3, warmup=1, eval_every=3,
            save_every=3, eval_sequences=2, max_bytes=200_000)


def test_trains_once_then_reuses_and_serves(tmp_path):
    folder = tmp_path / "demo"
    hf = trained_demo_checkpoint(folder, training=TINY)
    assert hf == folder / "hf" and (folder / ".complete").is_file()
    assert not (tmp_path / "demo.building").exists()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["val_loss"] > 0
    weights = (hf / "model.safetensors").stat().st_mtime_ns
    assert trained_demo_checkpoint(folder, training=TINY) == hf
    assert (hf / "model.safetensors").stat().st_mtime_ns == weights  # cached: not trained again
    trained_demo_checkpoint(folder, retrain=True, training=TINY)
    assert (hf / "model.safetensors").stat().st_mtime_ns != weights
    weights = (hf / "model.safetensors").stat().st_mtime_ns
    trained_demo_checkpoint(folder, training={**TINY, "lr": 1e-3})  # another recipe: the cached model is stale
    assert (hf / "model.safetensors").stat().st_mtime_ns != weights
    out = Engine.from_checkpoint(hf).generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].output_ids) == 4
