"""What is exact in which dtype: the cp=2 x ep=2 mesh vs one process, float64 / float32 / bfloat16.

Same random weights (small preset) and prompts; greedy generation on 4 local ranks and on one
process, both compared with the float64 single process.  Writes benchmarks/results/dtypes.json.
"""

from __future__ import annotations

import argparse

import torch

from common import write_results
from ringmoe.model import MoETransformer, preset
from ringmoe.serve import generate
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def run(rank, world, dtype_name, cp, ep, seqlen, new_tokens):
    torch.manual_seed(0)
    mesh = make_mesh(cp, ep)
    model = MoETransformer(preset("small"), mesh)
    model.init_weights(0)
    model = model.to(DTYPES[dtype_name])
    prompt = torch.randint(0, model.config.vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt, new_tokens, return_logits=True)
    return {"tokens": out.tokens.tolist(), "logits": out.logits.double()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    oracle = spawn(run, 1, "float64", 1, 1, args.seqlen, args.new_tokens)[0]
    rows = []
    for name in DTYPES:
        single = spawn(run, 1, name, 1, 1, args.seqlen, args.new_tokens, threads_per_rank=2)[0]
        mesh = spawn(run, 4, name, 2, 2, args.seqlen, args.new_tokens, timeout=900)[0]
        first = mesh["logits"][:, 0]  # the prefill's logits: same inputs on both sides
        row = {
            "dtype": name,
            "mesh_vs_single_first_logits_max_abs": (first - single["logits"][:, 0]).abs().max().item(),
            "single_vs_float64_first_logits_max_abs": (single["logits"][:, 0] - oracle["logits"][:, 0]).abs().max().item(),
            "mesh_vs_float64_first_logits_max_abs": (first - oracle["logits"][:, 0]).abs().max().item(),
            "tokens_equal_mesh_vs_single": sum(a == b for ra, rb in zip(mesh["tokens"], single["tokens"])
                                               for a, b in zip(ra, rb)),
            "tokens_total": len(mesh["tokens"]) * len(mesh["tokens"][0]),
        }
        rows.append(row)
        print(row)
    write_results("dtypes", {"seqlen": args.seqlen, "new_tokens": args.new_tokens, "rows": rows})


if __name__ == "__main__":
    main()
