"""The report of ``gpu_check.py``: JSON + markdown files (rewritten after every section) and
the Figure 3 scatter plot."""

from __future__ import annotations

import json
import os
from pathlib import Path


def plot_figure3(points: dict, path: Path, stats: dict) -> tuple[str | None, dict]:
    """Scatter of rollout vs training probabilities, one panel per head pairing (M1's Figure 3)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return None, {"plot": f"matplotlib not importable ({e}); the numbers above are complete"}
    fig, axes = plt.subplots(1, len(points), figsize=(4 * len(points), 4), squeeze=False)
    for ax, (name, (x, y)) in zip(axes[0], points.items()):
        ax.scatter(x, y, s=2, alpha=0.3)
        ax.set_aspect("equal")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.5)
        ax.set_title(f"{name}\ncorr {stats[name]['prob_pearson']:.4f}", fontsize=8)
        ax.set_xlabel("rollout (sampler) probability")
        ax.set_ylabel("training probability")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name, {}


def write_report(report: dict, out: Path) -> None:
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str)),
                       ("gpu_check.md", markdown(report))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


def _f(x, spec=".3g") -> str:
    return "—" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def markdown(report: dict) -> str:
    meta, secs = report["meta"], report["sections"]
    lines = [f"# GPU check ({'tiny, ' if meta['tiny'] else ''}{meta['started']})", "",
             f"`{meta['command']}` — {meta['total_s']:.0f} s in all", ""]
    for name, sec in secs.items():
        lines += [f"## {name}: {sec['status']} ({sec['seconds']:.1f} s)", ""]
        if sec["status"] != "ok":
            lines += [f"`{sec['error']}`", ""]
        r = sec.get("results")
        if r:
            try:  # a stopped section's partial results may lack what its table needs
                lines += RENDER.get(name, _generic)(r)
            except (KeyError, TypeError, IndexError):
                lines += _generic(r)
        if sec["null_reasons"]:
            lines += ["null: " + "; ".join(f"`{k}`: {v}" for k, v in sec["null_reasons"].items()), ""]
    return "\n".join(lines)


def _generic(r: dict) -> list[str]:
    """Scalars as a line each; a list of dicts (``rows``) as a table; nested dicts flattened one level."""
    lines = []
    for k, v in r.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            cols = list(dict.fromkeys(c for x in v for c in x))
            lines += ["", f"{k}:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_f(x.get(c)) for c in cols) + " |" for x in v]
            lines.append("")
        elif isinstance(v, dict):
            lines.append(f"* {k}: " + ", ".join(f"{a} = {_f(b) if not isinstance(b, (dict, list)) else b}"
                                                for a, b in v.items()))
        else:
            lines.append(f"* {k}: {_f(v)}")
    return lines + [""]


def _environment(r: dict) -> list[str]:
    return [f"{r['device']}; " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
            f"peak bf16 {_f(r['peak_bf16_tflops'])} TFLOP/s ({r['peak_source']}); measured "
            f"{r['matmul']['dtype']} {r['matmul']['n']}³ matmul {_f(r['matmul']['tflops'])} TFLOP/s", ""]


def _lm_head(r: dict) -> list[str]:
    lines = [f"V={r['vocab']}, N={r['tokens']}, H={r['hidden']}, chunk {r['chunk']}; bf16 inputs; "
             f"one fp32 [N, V] block = {r['fp32_logits_gib']:.2f} GiB", "",
             "| mode | variant | s (median) | peak extra GiB | max abs err vs fp64 | error |",
             "|---|---|---|---|---|---|"]
    return lines + [f"| {x['mode']} | {x['variant']} | {_f(x['seconds'], '.4g')} | {_f(x['peak_extra_gib'])} | "
                    f"{_f(x['max_abs_err_vs_fp64'])} | {x.get('error', '')} |" for x in r["rows"]] + [""]


def _precision(r: dict) -> list[str]:
    lines = [f"AdamW lr {r['lr']}, {r['steps']} steps of {r['rows']} x {r['length']} tokens", "",
             "| variant | params | param GiB | Adam state GiB | peak GiB | s/step | frac changed per step | "
             "frac of bf16 view changed |", "|---|---|---|---|---|---|---|---|"]
    for v in ("fp32 master + bf16 autocast", "pure bf16"):
        x = r[v]
        lines.append(f"| {v} ({x['param_dtype']}) | {x['params'] / 1e6:.1f}M | {_f(x['param_gib'])} | "
                     f"{_f(x['optimizer_state_gib'])} | {_f(x['peak_gib'])} | {_f(x['step_seconds'])} | "
                     f"{', '.join(_f(c) for c in x['frac_changed_after_step'])} | "
                     f"{', '.join(_f(c) for c in x['frac_bf16_view_changed_after_step'])} |")
    return lines + [""]


def _agreement(r: dict) -> list[str]:
    lines = [f"{r['rows']} rows x {r['new_tokens']} sampled tokens, bf16 weights, logit std {r['logit_std']}; "
             f"sampler: {r['sampler']}; plot: {r.get('plot') or '—'}", "",
             "| sampler / trainer head | tokens | prob Pearson | log p Pearson | mean abs Δlog p | max abs Δlog p | "
             "median rollout p |", "|---|---|---|---|---|---|---|"]
    return lines + [f"| {k} | {x['tokens']} | {_f(x['prob_pearson'], '.5f')} | {_f(x['logp_pearson'], '.5f')} | "
                    f"{_f(x['mean_abs_dlogp'])} | {_f(x['max_abs_dlogp'])} | {_f(x['median_rollout_prob'])} |"
                    for k, x in r["pairs"].items()] + [""]


def _rl(r: dict) -> list[str]:
    lines = [f"{r['params'] / 1e6:.1f}M params ({r['precision']}), {r['rows']} rows x <= {r['max_new_tokens']} new "
             f"tokens (mean {_f(r['mean_response_length'])}), K={r['updates_per_batch']}, {r['measured_steps']} "
             f"measured step(s) after a {r['warmup_step_s']:.1f} s warm-up", "",
             "| step s | sample s (generate s) | logp_old s | update s | sampling tok/s | update tok/s | "
             "MFU generate | MFU logp_old | MFU update | peak GiB sample / logp_old / update |", "|" + "---|" * 10,
             f"| {_f(r['step_s'])} | {_f(r['sample_s'])} ({_f(r['generate_s'])}) | {_f(r['logp_old_s'])} | "
             f"{_f(r['update_s'])} | {_f(r['sampling_tokens_per_s'], '.4g')} | {_f(r['update_tokens_per_s'], '.4g')} | "
             + " | ".join(_f(r["mfu"][k], ".1%") for k in ("generate", "logp_old", "update"))
             + " | " + " / ".join(_f(r["peak_gib_by_phase"].get(k)) for k in ("sample", "logp_old", "update"))
             + " |", ""]
    if "dynamo" in r:
        lines += [f"torch.compile (cispo.models.compile; compiled decoder: {r['compiled_decoder']}): "
                  f"{r['dynamo']['unique_graphs']} graph(s), {r['dynamo']['graph_breaks']} graph break(s); the "
                  "warm-up step includes compiling", ""]
    return lines


RENDER = {"environment": _environment, "lm_head": _lm_head, "precision": _precision,
          "logprob_agreement": _agreement, "rl_eager": _rl, "rl_compiled": _rl}
