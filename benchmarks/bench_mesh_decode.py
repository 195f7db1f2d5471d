"""The engine's decode step on a cp x ep mesh: eager vs the compiled decode graph, side by side.

Model: the small preset (4 layers, hidden 256, 8 experts top-2, vocab 4096), random weights (the same seed on
every rank), float32; each mesh runs as gloo ranks of one CPU thread each on this machine.  Each batch size B: B
requests with 64-token prompts are prefilled (by the ring under cp > 1), then every request decodes greedily (EOS
ignored) and the driver's wall time of ``--steps`` decode-only steps is recorded one by one; the median is reported.
The eager step (``decode_graph="off"``: the cp merge and the experts' variable all-to-alls of
``StepAttention`` / ``expert_parallel_forward``) and the compiled graph (``decode_graph="compiled"``: the same
exchanges as fixed-shape operators of the graph, ``parallel.graph_collectives``; its start-up compile time
reported) each run in their own spawn of the mesh, in turns over ``--rounds`` rounds (medians over rounds), so
a drift of the machine falls on both.  The greedy tokens of both are checked equal.

Writes benchmarks/results/mesh_decode.json and mesh_decode.png.

    python benchmarks/bench_mesh_decode.py [--meshes 1x2,2x1] [--batches 1,4,16] [--steps 24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe.model import MoETransformer, preset  # noqa: E402
from ringmoe.parallel import make_mesh  # noqa: E402
from ringmoe.parallel.launch import spawn  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402

PROMPT = 64


def mesh_rank(rank, world, cp, ep, mode, batch, steps):
    """One mesh's run: (median decode step seconds, compile seconds, graph steps, tokens) on the driver."""
    model = MoETransformer(preset("small"), make_mesh(cp, ep)).float()
    model.init_weights(7)
    engine = Engine(model, kv_cache_tokens=batch * (PROMPT + steps + 16), block_size=16, max_num_seqs=batch,
                    max_num_batched_tokens=batch * PROMPT, decode_graph=mode)
    if rank != 0:
        engine.run_worker()
        return None
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, model.config.vocab_size, (PROMPT,), generator=gen).tolist(), params)
           for _ in range(batch)]
    while any(engine.requests[i].num_computed < PROMPT + 1 for i in ids):  # every prompt in, a token decoded
        engine.step()
    times, finals = [], {}
    for _ in range(steps):
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        finals.update((out.request_id, out.output_ids) for out in outs if out.finished)
    while engine.has_unfinished:
        finals.update((out.request_id, out.output_ids) for out in engine.step() if out.finished)
    engine.shutdown()
    graph = engine.runner.decode_graph
    return (statistics.median(times), getattr(engine, "compile_seconds", 0.0), graph.steps if graph else 0,
            [finals[i] for i in ids])


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    meshes = list(data["meshes"])
    fig, axes = plt.subplots(1, len(meshes), figsize=(4.5 * len(meshes), 4), squeeze=False)
    for ax, mesh in zip(axes[0], meshes):
        rows = data["meshes"][mesh]
        batches = [row["batch"] for row in rows]
        ax.plot(batches, [row["eager_ms"] for row in rows], "o-", label="eager step")
        ax.plot(batches, [row["compiled_ms"] for row in rows], "s-", label="compiled decode graph")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (running requests)")
        ax.set_ylabel("decode step (ms, median)")
        ax.set_title(f"cp x ep = {mesh}")
        ax.legend()
    fig.suptitle("small preset, float32, gloo ranks of 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", default="1x2,2x1")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="mesh_decode")
    args = parser.parse_args()
    data = {"model": "small preset, float32", "prompt_tokens": PROMPT, "steps": args.steps, "rounds": args.rounds,
            "meshes": {}}
    for mesh in args.meshes.split(","):
        cp, ep = map(int, mesh.split("x"))
        rows = []
        for batch in map(int, args.batches.split(",")):
            runs = {"off": [], "compiled": []}
            for _ in range(args.rounds):
                for mode in runs:
                    runs[mode].append(spawn(mesh_rank, cp * ep, cp, ep, mode, batch, args.steps, timeout=1800)[0])
            eager, compiled = runs["off"], runs["compiled"]
            row = {"batch": batch,
                   "eager_ms": 1e3 * statistics.median(run[0] for run in eager),
                   "compiled_ms": 1e3 * statistics.median(run[0] for run in compiled),
                   "compile_s": statistics.median(run[1] for run in compiled),
                   "graph_steps": compiled[0][2],
                   "tokens_equal": all(run[3] == eager[0][3] for run in eager + compiled)}
            row["speedup"] = row["eager_ms"] / row["compiled_ms"]
            rows.append(row)
            print(mesh, row, flush=True)
        data["meshes"][mesh] = rows
    out = write_results(args.name, data)
    plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
