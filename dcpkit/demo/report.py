"""The demo's report as text (what rank 0 prints)."""

from __future__ import annotations

import math
from typing import Any

from .numerics import unit_roundoff
from .timing import GRAPH_LAYERS


def _fmt_us(entry: Any) -> str:
    if isinstance(entry, dict) and "median_us" in entry:
        return f"{entry['median_us']:.1f}"
    return "n/a"


def _speedup(direct: Any, nccl: Any) -> str:
    try:
        return f"{nccl['median_us'] / direct['median_us']:.1f}x"
    except (KeyError, TypeError, ZeroDivisionError):
        return "n/a"


def format_report(report: dict[str, Any]) -> str:
    """The report as text (what rank 0 prints)."""
    c = report["check"]
    lengths = report["context_lengths"]
    W = report["world_size"]
    gpus = report["gpus"]
    n_gpus = report.get("distinct_gpus", W)
    gpu_text = f"{n_gpus} x {gpus[0]}" if all(g == gpus[0] for g in gpus) else ", ".join(gpus)
    if n_gpus < W:
        gpu_text += " (ranks share GPUs: a functional run, timings mean nothing)"
    paths = report["paths"]
    u_exp = -int(round(math.log2(unit_roundoff(report["dtype"]))))
    tensors = " (torch tensors)" if report.get("tensors") == "torch" else ""
    reference = (
        "torch scaled_dot_product_attention (fp32)"
        if report.get("tensors") == "torch"
        else "fp32 attention"
    )
    lines = [
        "dcpkit demo: one MLA decode attention layer with decode context parallelism" + tensors,
        f"  model      {report['model']}: {report['num_heads']} query heads "
        f"({report['heads_per_rank']} per rank), one latent KV head of width {report['qk_dim']}",
        f"             ({report['kv_lora_rank']} latent + {report['rope_dim']} rope), values = "
        f"its first {report['v_dim']} columns",
        f"  dtype      {report['dtype']}; softmax scale 1/sqrt({report['qk_dim']}) = "
        f"{report['softmax_scale']:.6f}; partial attention in fp32",
        f"  batch      {report['batch']} sequences of {', '.join(map(str, lengths))} context "
        f"tokens;",
        f"             token i on rank i mod {W} ({report['kv_rows_per_rank']} KV rows per "
        f"sequence per rank)",
        f"  world      {W} ranks on {gpu_text}",
        "  paths      "
        + "   ".join(
            f"{op}: {paths.get(op, '?')}" for op in ("q_gather", "lse_reduce", "kv_gather")
        )
        + ("" if report.get("paths_agree", True) else "   (ranks disagree!)"),
    ]
    if report.get("nccl_path"):
        lines.append(f"             NCCL path: {report['nccl_path']}")
    lines += [
        f"  check      q_gather bit-exact: {'yes' if c['q_gather_bit_exact'] else 'NO'}   "
        f"kv_gather bit-exact: {'yes' if c['kv_gather_bit_exact'] else 'NO'}   "
        f"non-finite outputs: {c['nonfinite_outputs']}",
        f"             output vs {reference} over the whole KV:",
        f"             max abs error {c['max_abs_error']:.2e}   tolerance "
        f"{c['tolerance_abs']:.2e} (= 2 u max|V| + 1e-3, u = 2^-{u_exp}, max|V| = "
        f"{c['v_max']:.2f})",
        f"             max rel error {c['max_rel_error']:.2e} (max abs error / max |reference|)",
    ]
    if c["verdict"] != "PASS":
        w = c["worst"]
        lines.append(
            f"             worst: rank {w['rank']}, sequence {w['sequence']}, head "
            f"{w['head']}, column {w['column']}"
        )
    lines.append(f"  verdict    {c['verdict']}")
    timing = report.get("timing") or {}
    if timing:
        d, n = timing.get("direct", {}), timing.get("nccl", {})
        reps = next(
            (
                e.get("repeats")
                for t in (d, n)
                for e in (t.get("eager") or {}).values()
                if isinstance(e, dict) and "repeats" in e
            ),
            None,
        )
        lines.append(
            "  timing     µs per call, communication only (the partial attention is not timed);"
        )
        lines.append(
            f"             median over {reps if reps else 'the'} repeats of the max over "
            f"ranks; speedup = nccl / direct"
        )
        graph_head = f"CUDA graph ({GRAPH_LAYERS} layers)"
        lines.append(f"             {'':<12}{'eager':^27}   {graph_head:^27}")
        lines.append(
            f"             {'step':<12}{'direct':>9}{'nccl':>9}{'speedup':>9}   "
            f"{'direct':>9}{'nccl':>9}{'speedup':>9}"
        )
        for step in ("q_gather", "lse_reduce", "layer"):
            de, ne = d.get("eager", {}).get(step), n.get("eager", {}).get(step)
            dg, ng = d.get("graph", {}).get(step), n.get("graph", {}).get(step)
            label = "layer (both)" if step == "layer" else step
            lines.append(
                f"             {label:<12}{_fmt_us(de):>9}{_fmt_us(ne):>9}"
                f"{_speedup(de, ne):>9}   {_fmt_us(dg):>9}{_fmt_us(ng):>9}"
                f"{_speedup(dg, ng):>9}"
            )
        for policy in ("direct", "nccl"):
            t = timing.get(policy, {})
            if "error" in t:
                lines.append(f"             {policy} path unavailable: {t['error']}")
            if "skipped" in t:
                lines.append(f"             {policy} path not timed: {t['skipped']}")
            for step, g in (t.get("graph") or {}).items():
                if isinstance(g, dict) and "error" in g:
                    lines.append(f"             {policy} graph of {step} failed: {g['error']}")
            tp = t.get("paths")
            if tp and any(not str(v).startswith(policy) for v in tp.values()):
                lines.append(f"             note: the {policy} timings ran on paths {tp}")
    return "\n".join(line.rstrip() for line in lines)
