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


@pytest.mark.slow  # `make test-all`
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
                 "--eval-every", "3", "--save-every", "3", "--cp-mode", "auto", "--hw", "h200"]) == 0
    # no --vocab-size: tiny's 128 grows to a BPE's 259; --cp-mode auto asked the cost model and said why
    assert "--cp-mode auto on h200: ulysses" in capsys.readouterr().out
    assert (out / "hf" / "model.safetensors").is_file() and (out / "step-000006").is_dir()
    assert json.loads((out / "hf" / "config.json").read_text())["vocab_size"] == 259
    assert main(["train", "--out", str(tmp_path / "x"), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_with_mtp_exports_a_checkpoint_that_serves_mtp_drafts(tmp_path, capsys):
    """`ringmoe train --preset deepseek-v3-tiny --mtp` on an ep = 2 mesh: the metrics carry the MTP loss and its
    held-out figures, the export holds the MTP layer (num_nextn_predict_layers 1, model.layers.3.*), and the engine
    drafts with it, writing the text it writes without speculation; --mtp on a family without MTP is refused."""
    from safetensors import safe_open

    from ringmoe.serve import Engine, SamplingParams

    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 5)})
                              for i in range(200)))
    out = tmp_path / "mtp"
    assert main(["train", "--out", str(out), "--data", str(data), "--ep", "2", "--steps", "4", "--preset",
                 "deepseek-v3-tiny", "--mtp", "--mtp-lambda", "0.5", "--seqlen", "64", "--tokens-per-step", "256",
                 "--eval-every", "2", "--save-every", "4"]) == 0
    printed = capsys.readouterr().out
    assert "MTP: validation loss" in printed and "mtp val" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mtp_loss"] > 0 for r in rows) and 0 <= rows[-1]["mtp_draft_acceptance"] <= 1
    assert json.loads((out / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with safe_open(out / "hf" / "model.safetensors", "pt") as f:
        assert {"model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.7.up_proj.weight"} <= set(f.keys())
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = Engine.from_checkpoint(out / "hf").generate(["def f3(x):\n"], params)[0]
    engine = Engine.from_checkpoint(out / "hf", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert engine.generate(["def f3(x):\n"], params)[0].output_ids == plain.output_ids
    assert engine.spec_stats.num_draft_tokens > 0
    from tests.served import MODEL, Server, metric  # `ringmoe serve` drafts with the exported module too

    server = Server(out / "hf", 1, 1, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}')
    try:
        answer = server.client.completions.create(model=MODEL, prompt="def f3(x):\n", max_tokens=16, temperature=0,
                                                  extra_body={"ignore_eos": True})
        assert answer.choices[0].text == plain.text
        assert metric(server.url, "ringmoe:spec_decode_num_draft_tokens_total") > 0
    finally:
        server.stop()
    assert main(["train", "--out", str(tmp_path / "x"), "--preset", "tiny", "--mtp"]) == 2
    assert "--mtp trains DeepSeek-V3's multi-token prediction module" in capsys.readouterr().err


@pytest.mark.slow  # `make test-all`
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


def _corpus(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 5)})
                              for i in range(200)))
    return data


TWO_NODE_ARGS = ["--preset", "tiny", "--vocab-size", "300", "--seqlen", "64", "--tokens-per-step", "256",
                 "--steps", "3", "--eval-every", "3", "--save-every", "3", "--log-every", "1"]


def test_train_across_two_nodes_with_ulysses_inside_and_the_ring_across(tmp_path):
    """The README's multi-node recipe on loopback: two torchrun invocations (node ranks 0 and 1, two ranks each),
    cp = 4 as Ulysses 2 inside each node x the ring across the two; its losses equal one process's."""
    import os
    import subprocess
    import sys

    from ringmoe.parallel.launch import free_port

    data, out, port = _corpus(tmp_path), tmp_path / "nodes", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "ringmoe.cli", "train", "--launcher", "torchrun", "--out", str(out), "--data", str(data),
         "--cp", "4", "--cp-mode", "usp", "--ulysses-degree", "2", *TWO_NODE_ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for node in (0, 1)]
    try:
        logs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:  # never leave a node behind
            if node.poll() is None:
                node.kill()
                node.wait()
    assert all(node.returncode == 0 for node in nodes), "\n".join(log[-3000:] for log in logs)
    assert "ulysses 2 x ring 2" in logs[0]
    single = tmp_path / "single"
    assert main(["train", "--out", str(single), "--data", str(data), *TWO_NODE_ARGS]) == 0
    losses = [[json.loads(line)["loss"] for line in (o / "metrics.jsonl").read_text().splitlines()]
              for o in (out, single)]
    assert len(losses[0]) == 3 and max(abs(a - b) for a, b in zip(*losses)) < 1e-4, losses
    assert (out / "hf" / "model.safetensors").is_file()


def test_a_ulysses_group_that_would_span_two_nodes_is_refused(monkeypatch):
    from ringmoe.parallel.launch import join_torchrun

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="inside one node of 2 ranks"):
        join_torchrun(4, 1, ulysses=4)


def test_bad_sequence_parallel_options_are_refused(tmp_path):
    from ringmoe.train.run import TrainOptions, sequence_split, validate

    def options(**kw):
        return TrainOptions(out=str(tmp_path / "o"), preset="tiny", cp=4, **kw)
    with pytest.raises(ValueError, match="--ulysses-degree"):
        validate(options(cp_mode="usp"))
    with pytest.raises(ValueError, match="--ulysses-degree is for --cp-mode usp"):
        validate(options(cp_mode="ring", ulysses_degree=2))
    with pytest.raises(ValueError, match=r"q heads \(4\) must be divisible by the Ulysses degree \(8\)"):
        validate(TrainOptions(out=str(tmp_path / "o"), preset="tiny", cp=8, cp_mode="ulysses"))
    assert sequence_split(options(cp_mode="usp", ulysses_degree=2))[0] == 2
    assert sequence_split(options(cp_mode="ulysses"))[0] == 4
    with pytest.raises(ValueError, match="--cp-mode must be one of"):
        validate(options(cp_mode="auto"))  # the command line resolves auto before training starts
