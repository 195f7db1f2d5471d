"""Validate the cost model: this machine's measured runs, and published cluster figures.

1. Calibrate a "this machine" profile (2 gloo ranks x 1 thread, as the benchmarks run) and save it
   to results/hw_this_machine.json.
2. Predict the forward rows of results/ring.json (ring attention, 2 ranks, B=1 H=8 D=64 fp32, causal)
   and the rows of results/ep.json (EP layer forward, 2 ranks, 4096 tokens each, the shape its config gives),
   and report predicted / measured (target: within 25%).
3. Published setups: the context-parallel inference paper (Yang et al. 2024, arXiv 2411.01783:
   Llama3-405B prefill on 16 H100 nodes, CP over nodes and TP8 inside each, 1M tokens in 77 s and 128K
   in 3.8 s) and DeepEP's normal kernels (H800, 4096 tokens per rank, hidden 7168, top-8 of 256 experts,
   FP8 dispatch, BF16 combine: EP8 NVLink 153 / 158 GB/s, EP16 RDMA 43 / 43 GB/s, EP32 44 / 47 GB/s).
Writes results/sim.json and sim.png.

    python benchmarks/bench_sim.py
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, pyplot, write_results  # noqa: E402

from ringmoe.model import ModelConfig  # noqa: E402
from ringmoe.sim import PROFILES, Scenario, calibrate_this_machine, simulate  # noqa: E402
from ringmoe.sim.costs import rows_to_rank  # noqa: E402

RING_MODEL = ModelConfig(vocab_size=8, hidden_size=512, num_layers=1, num_heads=8, num_kv_heads=8, head_dim=64,
                         ffn_size=8, num_experts=1, top_k=1)
LLAMA3_405B = ModelConfig(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                          head_dim=128, ffn_size=53248, num_experts=1, top_k=1, rope_theta=5e5)
DEEPSEEK_V3_MOE = ModelConfig(vocab_size=8, hidden_size=7168, num_layers=1, num_heads=128, num_kv_heads=128,
                              head_dim=128, ffn_size=2048, num_experts=256, top_k=8)


def this_machine_rows(hw) -> list[dict]:
    rows = []
    ring = json.loads((RESULTS / "ring.json").read_text())
    for row in ring["rows"]:
        if not row["impl"].startswith("ring_") or row["mode"] != "fwd":
            continue
        layout = row["impl"].removeprefix("ring_")
        p = simulate(Scenario(RING_MODEL, hw, seqlen=row["n"], cp=2, layout=layout, element_bytes=4,
                              parts=("attention",)))
        rows.append({"what": f"ring {layout} N={row['n']} fwd", "measured_s": row["seconds"], "predicted_s": p.ring_s})
    ep = json.loads((RESULTS / "ep.json").read_text())
    shape = ep["config"]
    ep_model = ModelConfig(vocab_size=8, hidden_size=shape["hidden"], num_layers=1, num_heads=8, num_kv_heads=8,
                           head_dim=64, ffn_size=shape["ffn"], num_experts=shape["experts"], top_k=shape["top_k"])
    for key, chunks in (("balanced/serial", 1), ("balanced/overlap_2", 2), ("balanced/overlap_4", 4),
                        ("skewed/serial", 1), ("skewed/overlap_2", 2), ("skewed/replicas", 1)):
        measured = ep["summary"][key]
        p = simulate(Scenario(ep_model, hw, seqlen=shape["T_per_rank"], cp=1, ep=shape["world_size"],
                              batch=shape["world_size"], element_bytes=4, parts=("moe",),
                              skew=measured["rank_imbalance"], chunks=chunks))
        rows.append({"what": f"EP {key}", "measured_s": measured["seconds"], "predicted_s": max(p.moe_s)})
    for row in rows:
        row["ratio"] = row["predicted_s"] / row["measured_s"]
    return rows


def published_rows() -> list[dict]:
    h100 = PROFILES["h100"]
    # one CP rank = one node of 8 H100 running tensor parallel 8: 8x the compute, 8 NICs
    node = dataclasses.replace(h100, name="h100 node, TP8", matmul_flops=8 * h100.matmul_flops,
                               attention_flops=8 * h100.attention_flops, memory_bandwidth=8 * h100.memory_bandwidth,
                               inter_bandwidth=8 * h100.inter_bandwidth, devices_per_node=1)
    rows = []
    for tokens, published in ((1 << 20, 77.0), (1 << 17, 3.8)):
        p = simulate(Scenario(LLAMA3_405B, node, seqlen=tokens, cp=16, batch=1))
        rows.append({"what": f"CP paper: Llama3-405B prefill {tokens // 1024}K tokens, 16 nodes x 8 H100",
                     "published": published, "predicted": p.prefill_s, "unit": "s",
                     "exposed_comm": p.ring_exposed_fraction})
    h800 = PROFILES["h800"]
    for ep, published in ((8, (153.0, 158.0)), (16, (43.0, 43.0)), (32, (44.0, 47.0))):
        # dispatch FP8 (1 byte + one fp32 scale per 128 values), combine BF16
        p = simulate(Scenario(DEEPSEEK_V3_MOE, h800, seqlen=4096, cp=1, ep=ep, batch=ep, element_bytes=2,
                              dispatch_bytes=1 + 4 / 128, parts=("moe",)))
        per_dst = rows_to_rank(4096, 256, 8, 1 / ep)
        remote = [d for d in range(1, ep) if d // h800.devices_per_node != 0]
        local = [d for d in range(1, ep) if d // h800.devices_per_node == 0]
        bottleneck = remote if remote else local
        dispatch_bytes = per_dst * len(bottleneck) * 7168 * (1 + 4 / 128)
        combine_bytes = per_dst * len(bottleneck) * 7168 * 2
        link = "RDMA" if remote else "NVLink"
        dispatch_s = _phase_seconds(p, "dispatch")
        combine_s = _phase_seconds(p, "combine")
        rows.append({"what": f"DeepEP EP{ep} dispatch ({link} GB/s)", "published": published[0],
                     "predicted": dispatch_bytes / dispatch_s / 1e9, "unit": "GB/s"})
        rows.append({"what": f"DeepEP EP{ep} combine ({link} GB/s)", "published": published[1],
                     "predicted": combine_bytes / combine_s / 1e9, "unit": "GB/s"})
    for row in rows:
        row["ratio"] = row["predicted"] / row["published"]
    return rows


def _phase_seconds(p, phase: str) -> float:
    """Rank 0's span of one exchange: first transfer start to last transfer end (sent or received)."""
    spans = [t for t in p.timeline.tasks if t.name.startswith(phase) and ("->0" in t.name or f"{phase}0:0->" in t.name)]
    return max(t.end for t in spans) - min(t.start for t in spans)


def plot(data, path):
    plt = pyplot()
    local, published = data
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.barh([r["what"] for r in local], [r["ratio"] for r in local], color="tab:blue")
    left.axvspan(0.75, 1.25, color="tab:green", alpha=0.15, label="within 25%")
    left.axvline(1.0, color="k", lw=0.8)
    left.set_xlabel("predicted / measured")
    left.set_title("this machine (calibrated profile)")
    left.tick_params(axis="y", labelsize=7)
    left.legend(fontsize=7)
    right.barh([r["what"] for r in published], [r["ratio"] for r in published], color="tab:orange")
    right.axvline(1.0, color="k", lw=0.8)
    right.set_xlabel("predicted / published")
    right.set_title("published cluster figures (built-in profiles)")
    right.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    # this machine's speed drifts between minutes: the median of three calibrations, field by field
    runs = [calibrate_this_machine() for _ in range(3)]
    hw = dataclasses.replace(runs[0], **{f.name: statistics.median(getattr(r, f.name) for r in runs)
                                         for f in dataclasses.fields(runs[0]) if f.type in ("float", float)})
    hw.save(RESULTS / "hw_this_machine.json")
    local = this_machine_rows(hw)
    published = published_rows()
    for row in local:
        print(f"{row['what']:>32}: measured {row['measured_s']:.3f} s, predicted {row['predicted_s']:.3f} s, "
              f"ratio {row['ratio']:.2f}")
    for row in published:
        print(f"{row['what']:>60}: published {row['published']:g} {row['unit']}, predicted {row['predicted']:.1f}, "
              f"ratio {row['ratio']:.2f}")
    within = sum(0.75 <= r["ratio"] <= 1.25 for r in local)
    write_results("sim", {"hardware": dataclasses.asdict(hw), "this_machine": local, "published": published,
                          "this_machine_within_25pct": f"{within}/{len(local)}"}, plot, (local, published))


if __name__ == "__main__":
    main()
