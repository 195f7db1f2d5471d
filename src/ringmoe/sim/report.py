"""What ``ringmoe simulate`` prints and draws: a per-layer table and two sweeps."""

from __future__ import annotations

import dataclasses

from .simulate import Prediction, Scenario, simulate

__all__ = ["summary_rows", "sweep_cp", "sweep_tokens", "plot"]


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def summary_rows(p: Prediction) -> list[tuple[str, str]]:
    s, c = p.scenario, p.scenario.config
    steps = p.attention_step_s
    slow = max(range(len(steps)), key=lambda r: sum(steps[r])) if steps and steps[0] else 0
    rows = [
        ("mesh", f"cp={s.cp} x ep={s.ep} = {s.cp * s.ep} devices, {s.hw.name}, {s.layout}, batch {s.rows}"),
        ("tokens per rank", f"{p.tokens_per_rank:,} (sequence {s.seqlen:,})"),
        ("prefill (all layers)", f"{p.prefill_s:.3f} s  ({c.num_layers} x {_ms(p.layer_s)} per layer)"),
        ("per layer, slowest rank", ", ".join(f"{k.removesuffix('_s')} {_ms(v)}" for k, v in p.breakdown.items())),
    ]
    if s.cp > 1:
        rows += [
            ("attention per ring step (slowest rank)", " ".join(f"{x * 1e3:.2f}" for x in steps[slow]) + " ms"),
            ("attention imbalance (max/mean)", f"{p.attention_imbalance:.3f}"),
            ("K/V bytes per ring step", _gb(p.kv_bytes_per_step)),
            ("exposed ring communication (worst rank)", f"{p.ring_exposed_fraction:.1%}"),
            ("tokens per rank for full overlap", f"{p.min_tokens_for_overlap:,.0f} "
             f"({'met' if p.tokens_per_rank >= p.min_tokens_for_overlap else 'NOT met'})"),
        ]
    if s.ep > 1:
        rows += [
            ("dispatch / combine bytes per rank", f"{_gb(max(p.dispatch_bytes))} / {_gb(max(p.combine_bytes))}"),
            ("dispatch span per rank", _ms(max(p.dispatch_s))),
            ("expert compute per rank (min / max)", f"{_ms(min(p.expert_s))} / {_ms(max(p.expert_s))}"),
            ("straggler (slowest experts end - mean)", _ms(p.straggler_s)),
        ]
    m = p.memory
    rows.append(("memory per rank", f"{_gb(m['total'])}: weights {_gb(m['weights'])}, KV cache {_gb(m['kv_cache'])}, "
                 f"K/V in flight {_gb(m['kv_in_flight'])}, activations {_gb(m['activations'])}"))
    if s.hw.memory_bytes and m["total"] > s.hw.memory_bytes:
        rows.append(("WARNING", f"needs {_gb(m['total'])} per device, the device has {_gb(s.hw.memory_bytes)}"))
    return rows


def sweep_cp(s: Scenario, max_cp: int) -> list[Prediction]:
    """The same job at cp = 1, 2, 4, ... max_cp (sequence length fixed)."""
    out, cp = [], 1
    while cp <= max_cp:
        if s.seqlen % (2 * cp) == 0:
            out.append(simulate(dataclasses.replace(s, cp=cp)))
        cp *= 2
    return out


def sweep_tokens(s: Scenario, points: int = 9) -> list[Prediction]:
    """Attention only, the scenario's cp, tokens per rank from 1/16 to 16x the overlap threshold."""
    base = simulate(dataclasses.replace(s, parts=("attention",)))
    threshold = base.min_tokens_for_overlap
    out = []
    for i in range(points):
        per_rank = threshold * 2 ** (-4 + 8 * i / (points - 1))
        unit = 2 * s.cp
        seqlen = max(unit, int(round(per_rank * s.cp / unit)) * unit)
        out.append(simulate(dataclasses.replace(s, seqlen=seqlen, parts=("attention",))))
    return out


def plot(by_cp: list[Prediction], by_tokens: list[Prediction], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cps = [str(p.scenario.cp) for p in by_cp]
    bottom = [0.0] * len(by_cp)
    for key in ("projections_s", "attention_s", "moe_s"):
        values = [p.breakdown[key] * p.scenario.config.num_layers for p in by_cp]
        left.bar(cps, values, bottom=bottom, label=key.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    s = by_cp[-1].scenario
    left.set_xlabel("cp (context-parallel degree)")
    left.set_ylabel("prefill seconds, slowest rank")
    left.set_title(f"{s.seqlen:,} tokens, ep={s.ep}, {s.hw.name}")
    left.legend()
    right.semilogx([p.tokens_per_rank for p in by_tokens], [100 * p.ring_exposed_fraction for p in by_tokens], "o-")
    right.axvline(by_tokens[0].min_tokens_for_overlap, color="k", ls="--", lw=0.8, label="closed-form threshold")
    right.set_xlabel("tokens per rank")
    right.set_ylabel("exposed ring communication, %")
    right.set_title(f"cp={by_tokens[0].scenario.cp}: when K/V transfers hide")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
