"""lm-eval scores a multiple-choice task through the server (`local-completions`: echo, logprobs, max_tokens 0,
batched token-id prompts) exactly as it scores it with transformers in process (`hf`): every per-choice
loglikelihood agrees to 1e-4 at float32."""

from __future__ import annotations

import json
import logging

import pytest

from ..served import MODEL, Server

QUESTIONS = [("The quick brown", [" fox", " dog", " café"], 0), ("def add(a, b):", ["\n    return a + b", " pass"], 0),
             ("naïve café", [" déjà vu", " 東京", " 🍣🍣"], 1), ("for i in range(10):", ["\n    total += i", " print"], 0),
             ("Größe: 12 €,", [" ½ kg", " 3 kg"], 0), ("Serving mixture-of-experts", [" models", " ranks", " x"], 2)]


def _task(folder) -> str:
    data = folder / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return "tiny_mc"


def _loglikelihoods(results) -> list[float]:
    return [float(resp[0][0]) for sample in results["samples"]["tiny_mc"] for resp in sample["resps"]]


@pytest.mark.slow  # `make test-all`
def test_lm_eval_local_completions_equals_hf(served_checkpoint, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    task = _task(tmp_path)
    manager = TaskManager(include_path=str(tmp_path))
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={served_checkpoint},dtype=float32",
                                 tasks=[task], task_manager=manager, log_samples=True, device="cpu")
    server = Server(served_checkpoint)
    try:
        served = lm_eval.simple_evaluate(
            model="local-completions", tasks=[task], task_manager=manager, log_samples=True,
            model_args=f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={served_checkpoint},"
                       f"tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1")
    finally:
        server.stop()
    want, got = _loglikelihoods(hf), _loglikelihoods(served)
    assert len(got) == len(want) == sum(len(c) for _, c, _ in QUESTIONS)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert len(set(round(x, 3) for x in want)) > 1  # the choices score differently: not a constant
    assert served["results"]["tiny_mc"]["acc,none"] == hf["results"]["tiny_mc"]["acc,none"]
