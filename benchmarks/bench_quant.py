"""Quantized weights kept quantized: resident bytes, accuracy and decode speed, beside transformers on the same files.

Two checkpoints as they ship, made here from random transformers models (the weights of a float checkpoint,
quantized by ``ringmoe`` and written by its exporter in the published layout):

- ``qwen3-moe`` in FP8 block-wise (e4m3 codes + one float32 scale per 128 x 128 block on every projection, the
  Qwen3-*-FP8 / DeepSeek-V3 format): hidden 512, 4 layers, 16 experts top-2, expert FFN 256, vocab 4096;
- ``gpt-oss`` with MXFP4 experts (two e2m1 codes a byte + one E8M0 scale per 32 values): same sizes.

For each: ringmoe serving the float checkpoint in float32 and bfloat16, ringmoe serving the quantized one
(codes held, each expert / projection dequantized when it runs), and transformers 5 loading the quantized
one on this CPU (it dequantizes FP8 and MXFP4 to the model dtype there: bfloat16, its default for these).
Reported:

- resident weight bytes (parameters and buffers of the loaded model);
- accuracy: the median over positions of |logits - ref| / |ref| (ref: the float checkpoint in float64) on
  4 x 64 random tokens, and the share of positions whose argmax agrees; plus the max |difference| between
  ringmoe's and transformers' float32 logits on the same quantized file (the formats read the same way);
- decode: ringmoe's engine step at batch 1 and 32 (64-token prompts, greedy, median of ``--steps`` steps;
  eager and the compiled decode graph), transformers' ``generate`` per new token at the same batches.

And, from the configs alone, the weight bytes per rank of DeepSeek-V3 (671B) and Qwen3-30B-A3B at
several expert-parallel sizes, bf16 against their shipped FP8.

The FP8 KV cache (``--kv-cache-dtype fp8``) on the qwen3-moe float checkpoint (float32) and on DeepSeek-V3-tiny's
latent cache: bytes per cached token (float32 / bfloat16 / fp8), the decode step with each cache at batch 1 and 32
(64-token prompts, eager steps) and at batch 8 with 1024-token prompts (where reading the cache weighs more; eager and
compiled), and accuracy:
teacher-forced on the fp8 engine's greedy tokens, the median relative logit error vs the float64 model, beside
the same model with K/V plainly cast to float8 (flash-attn's rule compares the two), and how many of 4 x 32 greedy
tokens equal the float cache's before the first difference.

Writes benchmarks/results/quant.json and quant.png.

    python benchmarks/bench_quant.py [--steps 32] [--batches 1,32]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import measure  # noqa: E402
from common import pyplot, write_results  # noqa: E402

from ringmoe.attention import flash_attn_func  # noqa: E402
from ringmoe.model import MoETransformer, load_checkpoint, preset, save_pretrained  # noqa: E402
from ringmoe.model.config import PRESETS  # noqa: E402
from ringmoe.quant import QuantScheme  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402

VOCAB, HIDDEN, LAYERS, EXPERTS, FFN = 4096, 512, 4, 16, 256


def _transformers_model(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, num_experts_per_tok=2)
    if family == "qwen3-moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=FFN, norm_topk_prob=True, attn_implementation="sdpa", **common))
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(  # sinks: transformers has only eager attention
        num_local_experts=EXPERTS, intermediate_size=FFN, sliding_window=128, attn_implementation="eager", **common))


def make_checkpoints(family: str, method: str, root: Path) -> tuple[Path, Path]:
    """(the float checkpoint, the same weights quantized in ``method``'s published layout)."""
    torch.manual_seed(0)
    model = _transformers_model(family)
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "float")
    save_pretrained(load_checkpoint(root / "float", quantization=method), root / method)
    return root / "float", root / method


def resident_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def accuracy(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    logits, reference = logits.double(), reference.double()
    rel = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
    return {"median_rel_error": rel.median().item(),
            "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()}


def transformers_decode(model, batch: int, new: int) -> float:
    """Seconds per generated token of ``generate`` at ``batch`` (64-token prompts; prefill subtracted)."""
    ids = torch.randint(0, VOCAB, (batch, 64), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)

    def run(tokens):
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=0)
        return time.perf_counter() - start

    run(2)
    return statistics.median((run(new) - run(1)) / (new - 1) for _ in range(3))


def bench_family(family: str, method: str, batches: list[int], steps: int) -> dict:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        float_path, quant_path = make_checkpoints(family, method, Path(tmp))
        ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            reference = load_checkpoint(float_path, dtype=torch.float64)(ids)
            variants = {"ringmoe float32": load_checkpoint(float_path, dtype=torch.float32),
                        "ringmoe bfloat16": load_checkpoint(float_path, dtype=torch.bfloat16),
                        f"ringmoe {method}": load_checkpoint(quant_path)}
            cls = getattr(transformers, "Qwen3MoeForCausalLM" if family == "qwen3-moe" else "GptOssForCausalLM")
            peer = cls.from_pretrained(quant_path, dtype=torch.bfloat16).eval()
            peer32 = cls.from_pretrained(quant_path, dtype=torch.float32).eval()
            same_file = (peer32(ids).logits - variants[f"ringmoe {method}"](ids)).abs().max().item()
            del peer32
            rows = []
            for name, model in variants.items():
                model.eval()
                rows.append({"variant": name, "weight_bytes": resident_bytes(model),
                             **accuracy(model(ids), reference)})
            rows.append({"variant": f"transformers {method} (dequantized to bfloat16 on CPU)",
                         "weight_bytes": resident_bytes(peer), **accuracy(peer(ids).logits, reference)})
        for row in rows:
            print(f"{family:9s} {row['variant']:48s} {row['weight_bytes'] / 2**20:7.1f} MiB, median rel error "
                  f"{row['median_rel_error']:.4f}, top-1 agreement {row['top1_agreement']:.3f}")
        print(f"{family:9s} ringmoe vs transformers on the same {method} file (float32): max |diff| {same_file:.2e}")
        decode = []
        for name, model in variants.items():
            for batch in batches:
                for mode in ("off", "compiled"):
                    torch._dynamo.reset()  # each engine compiles afresh, as in its own server process
                    row = measure(model, batch, steps, mode, max_num_seqs=batch)  # compiles buckets <= batch
                    decode.append({"variant": name, "batch": batch, "mode": mode, "step_ms": row["step_ms"],
                                   "tokens_per_s": row["tokens_per_s"], "compile_s": row["compile_s"]})
                    print(f"{family:9s} {name:20s} batch {batch:3d} {mode:8s} {row['step_ms']:7.2f} ms/step")
        for batch in batches:
            seconds = transformers_decode(peer, batch, 17)
            decode.append({"variant": f"transformers {method} (bfloat16)", "batch": batch, "mode": "generate",
                           "step_ms": 1e3 * seconds, "tokens_per_s": batch / seconds, "compile_s": 0.0})
            print(f"{family:9s} transformers generate batch {batch:3d}: {1e3 * seconds:7.2f} ms/token step")
    return {"family": family, "method": method, "memory_and_accuracy": rows, "decode": decode,
            "ringmoe_vs_transformers_same_file_max_abs_diff": same_file}


class PlainFp8Attention:
    """Dense attention on K/V cast to float8_e4m3fn and back (scale 1): plain PyTorch on an fp8 cache."""

    latent_ring = False

    def __init__(self, model):
        self.model, self.absorbed = model, model.config.mla

    def attend(self, layer, q, k, v):
        k, v = (t.to(torch.float8_e4m3fn).to(q.dtype) for t in (k, v))
        return flash_attn_func(q, k, v, causal=True, **self.model.attention_options(layer))


def greedy(model, prompts, new: int, **options) -> tuple[list[list[int]], list[torch.Tensor]]:
    engine = Engine(model, return_logits=True, **options)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)) for p in prompts]
    outs = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            outs[out.request_id].append(out)
    return [outs[i][-1].output_ids for i in ids], [torch.stack([o.logits for o in outs[i]]) for i in ids]


def kv_accuracy(model, exact) -> dict:
    """The fp8 cache's logits vs the float64 model, teacher-forced on its own greedy tokens, beside plain fp8 K/V."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (48, 64, 80, 96)]
    tokens, logits = greedy(model, prompts, 32, kv_cache_dtype="fp8")
    float_tokens, _ = greedy(model, prompts, 32)
    ours, plain, want = [], [], []
    with torch.no_grad():
        for prompt, out, got in zip(prompts, tokens, logits):
            ids = torch.tensor([prompt + out[:-1]])
            rows = slice(len(prompt) - 1, None)
            want.append(exact(ids)[0, rows])
            ours.append(got.double())
            plain.append(model(ids, attention=PlainFp8Attention(model))[0, rows].double())
    reference = torch.cat(want)
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(tokens, float_tokens)]
    return {"fp8_cache": accuracy(torch.cat(ours), reference), "plain_fp8_kv": accuracy(torch.cat(plain), reference),
            "max_abs_error_fp8_cache": (torch.cat(ours) - reference).abs().max().item(),
            "max_abs_error_plain_fp8_kv": (torch.cat(plain) - reference).abs().max().item(),
            "greedy_tokens_equal_before_first_difference": same, "greedy_tokens_per_request": 32}


def bench_kv_cache(path: Path | None, batches: list[int], steps: int) -> dict:
    """The FP8 KV cache against the float32 one: bytes, accuracy, decode steps (see the module's docstring)."""
    if path is None:  # DeepSeek-V3-tiny's latent cache
        name = "deepseek-v3-tiny"
        model = MoETransformer(preset(name))
        model.init_weights(0)
        model, exact = model.float().eval(), copy.deepcopy(model).double().eval()
    else:
        name = "qwen3-moe"
        model, exact = load_checkpoint(path, dtype=torch.float32), load_checkpoint(path, dtype=torch.float64)
    row = {"model": name, "bytes_per_token": {}, "decode": []}
    for cache in ("auto", "fp8"):
        engine = Engine(model, kv_cache_tokens=64, kv_cache_dtype=cache)
        row["bytes_per_token"]["float32" if cache == "auto" else "fp8"] = engine.runner.bytes_per_token
    row["bytes_per_token"]["bfloat16"] = row["bytes_per_token"]["float32"] // 2
    row["accuracy"] = kv_accuracy(model, exact)
    # eager steps at every shape, the compiled step where the cache weighs most (each compile takes minutes here)
    runs = [(batch, 64, "off") for batch in batches] + [(8, 1024, "off"), (8, 1024, "compiled")]
    for batch, prompt, mode in runs if path is not None else []:
        for cache in ("auto", "fp8"):
            torch._dynamo.reset()
            result = measure(model, batch, steps, mode, max_num_seqs=batch, prompt=prompt, kv_cache_dtype=cache)
            row["decode"].append({"kv_cache_dtype": cache, "batch": batch, "prompt": prompt, "mode": mode,
                                  "step_ms": result["step_ms"], "tokens_per_s": result["tokens_per_s"]})
            print(f"kv cache {cache:4s} batch {batch:3d} prompt {prompt:5d} {mode:8s} {result['step_ms']:7.2f} ms")
    acc = row["accuracy"]
    print(f"{name}: bytes/token {row['bytes_per_token']}; median rel logit error fp8 cache "
          f"{acc['fp8_cache']['median_rel_error']:.4f} vs plain fp8 K/V {acc['plain_fp8_kv']['median_rel_error']:.4f}; "
          f"greedy tokens equal before the first difference {acc['greedy_tokens_equal_before_first_difference']}")
    return row


def published_models() -> list[dict]:
    """Weight bytes per rank of shipped FP8 models against bf16, from their configs (experts split over ep)."""
    rows = []
    for name, eps in (("deepseek-v3", (8, 16, 32)), ("qwen3-30b-a3b", (1, 2, 4))):
        config = PRESETS[name]
        fp8, bf16 = config.replace(quantization=QuantScheme("fp8")), config.replace(quantization=None)
        for ep in eps:
            experts = config.num_experts // ep
            rows.append({"model": name, "ep": ep, "bf16_gb": bf16.weight_bytes(experts, 2) / 1e9,
                         "fp8_gb": fp8.weight_bytes(experts, 2) / 1e9})
    return rows


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for family in data["families"]:
        rows = family["memory_and_accuracy"]
        axes[0].scatter([r["weight_bytes"] / 2**20 for r in rows], [r["median_rel_error"] for r in rows])
        for r in rows:
            axes[0].annotate(f"{family['family']}: {r['variant'].split(' (')[0]}", (r["weight_bytes"] / 2**20,
                             r["median_rel_error"]), fontsize=6)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("resident weights (MiB)")
    axes[0].set_ylabel("median relative logit error vs float64")
    axes[0].set_title("memory vs accuracy")
    labels, values = [], []
    for family in data["families"]:
        for r in family["decode"]:
            if r["mode"] in ("compiled", "generate"):
                labels.append(f"{family['family']} {r['variant'].split(' (')[0]} b{r['batch']}")
                values.append(r["step_ms"])
    axes[1].barh(labels, values)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("ms per decode step (ringmoe compiled; transformers generate)")
    axes[1].tick_params(axis="y", labelsize=6)
    rows = [r for r in (data.get("kv_cache") or [{}])[0].get("decode", [])]
    shapes = sorted({(r["batch"], r["prompt"], r["mode"]) for r in rows})
    for offset, cache in ((-0.2, "auto"), (0.2, "fp8")):
        ms = [next(r["step_ms"] for r in rows if (r["batch"], r["prompt"], r["mode"]) == s
                   and r["kv_cache_dtype"] == cache) for s in shapes]
        axes[2].bar([i + offset for i in range(len(shapes))], ms, width=0.4,
                    label="float32 KV cache" if cache == "auto" else "fp8 KV cache (1/4 of the bytes)")
    axes[2].set_xticks(range(len(shapes)), [f"b{b} p{p}\n{m}" for b, p, m in shapes], fontsize=7)
    axes[2].set_ylabel("ms per decode step (qwen3-moe, float32)")
    axes[2].set_title("FP8 KV cache")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--only", choices=["weights", "kv"], default=None, help="one part (the other is kept from "
                        "the last quant.json)")
    parser.add_argument("--families", default="qwen3-moe,gpt-oss", help="the weight formats' families to run (the "
                        "others are kept from the last quant.json)")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(2)
    batches = [int(b) for b in args.batches.split(",")]
    last = Path(__file__).resolve().parent / "results" / "quant.json"
    chosen = args.families.split(",")
    kept = json.loads(last.read_text()) if (args.only or len(chosen) < 2) and last.is_file() else {}
    old = {f["family"]: f for f in kept.get("families", [])}
    families = []
    for family, method in (("qwen3-moe", "fp8"), ("gpt-oss", "mxfp4")):
        run = args.only != "kv" and family in chosen
        families.append(bench_family(family, method, batches, args.steps) if run else old[family])
    if args.only == "weights":
        kv_cache = kept.get("kv_cache")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            float_path, _ = make_checkpoints("qwen3-moe", "fp8", Path(tmp))
            kv_cache = [bench_kv_cache(float_path, batches, args.steps), bench_kv_cache(None, batches, args.steps)]
    data = {"sizes": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "experts": EXPERTS, "expert_ffn": FFN},
            "threads": 2, "families": families, "published_models": published_models(), "kv_cache": kv_cache}
    for row in data["published_models"]:
        print(f"{row['model']:14s} ep {row['ep']:2d}: bf16 {row['bf16_gb']:7.1f} GB/rank, "
              f"fp8 {row['fp8_gb']:7.1f} GB/rank")
    out = write_results("quant", data)
    plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
