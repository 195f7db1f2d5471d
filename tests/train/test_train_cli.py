"""`ringmoe train` end to end: the standard library's sources in, a model that beats the unigram entropy,
a transformers checkpoint that transformers and the serving engine load, and --resume."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ringmoe.cli import main
from ringmoe.model import load_checkpoint

ARGS = ["--preset", "tiny", "--vocab-size", "384", "--seqlen", "128", "--tokens-per-step", "2048", "--lr", "2e-2",
        "--warmup", "10", "--balance", "bias", "--eval-every", "100", "--save-every", "150"]


def test_train_export_serve_and_resume(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "300", *ARGS]) == 0
    summary = capsys.readouterr().out
    val = float(summary.split("validation loss ")[1].split()[0])
    unigram = float(summary.split("unigram entropy ")[1].split(")")[0])
    assert val < unigram - 0.2, summary  # it learned more than token frequencies
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 301)) and (out / "loss.png").stat().st_size > 5000
    # the export: transformers and ringmoe agree, and the serving engine writes text with its tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float64, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    ours = load_checkpoint(out / "hf", dtype=torch.float64)
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() < 1e-4
        want, got = ids[0].tolist(), ids[0].tolist()
        for _ in range(8):  # greedy tokens: transformers recomputing the sequence vs ringmoe's
            want.append(int(hf(torch.tensor([want])).logits[0, -1].argmax()))
            got.append(int(ours(torch.tensor([got]))[0, -1].argmax()))
        assert got == want
    from ringmoe.serve import Engine, SamplingParams

    text = Engine.from_checkpoint(out / "hf").generate(["def "], SamplingParams(temperature=0, max_tokens=12))[0].text
    assert text
    # resume: 10 more steps continue the count and the metrics
    assert main(["train", "--out", str(out), "--steps", "310", "--resume", *ARGS]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-10:] == list(range(301, 311))


def test_train_on_a_mesh_from_a_jsonl(tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 5)})
                              for i in range(200)))
    out = tmp_path / "mesh"
    assert main(["train", "--out", str(out), "--data", str(data), "--cp", "2", "--ep", "2", "--steps", "6",
                 "--preset", "tiny", "--seqlen", "64", "--tokens-per-step", "256",
                 "--eval-every", "3", "--save-every", "3"]) == 0  # no --vocab-size: tiny's 128 grows to a BPE's 259
    assert (out / "hf" / "model.safetensors").is_file() and (out / "step-000006").is_dir()
    assert json.loads((out / "hf" / "config.json").read_text())["vocab_size"] == 259
    assert main(["train", "--out", str(tmp_path / "x"), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_under_torchrun(tmp_path):
    import subprocess
    import sys

    from ringmoe.parallel.launch import free_port

    out = tmp_path / "tr"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "ringmoe.cli", "train", "--launcher", "torchrun", "--out", str(out),
         "--cp", "1", "--ep", "2", "--steps", "4", "--preset", "tiny", "--vocab-size", "300", "--seqlen", "64",
         "--tokens-per-step", "256", "--eval-every", "2", "--save-every", "2"],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "hf" / "model.safetensors").is_file() and (out / "step-000004").is_dir()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
