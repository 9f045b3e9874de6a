"""The benchmark chart: speedup per category per method (the headline), decode speed per method,
and acceptance per category. Drawn on matplotlib's Agg canvas directly, so no GUI backend is
ever touched and the global pyplot state stays alone."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from ondevice.speedtest.peers import SPEC
from ondevice.speedtest.report import ALL, staging_file

PALETTE = ["#3b6fb6", "#e07b39", "#3a9e6f", "#c4484f", "#8a63b8", "#9c7a4a", "#d16fb0"]
PLAIN_COLOR = "#8c8c8c"


def _colors(methods: list[str]) -> dict[str, str]:
    """Each ondevice method its own colour; a peer takes the colour of its ondevice counterpart
    (mlx-lm: plain, mlx-lm-spec: chain; each fixed K its own) and is told apart by hatching."""
    out = {"plain": PLAIN_COLOR}
    ours = [m for m in methods if m != "plain" and not m.startswith("mlx-lm")]
    out.update({m: PALETTE[i % len(PALETTE)] for i, m in enumerate(ours)})
    out["mlx-lm"] = PLAIN_COLOR
    out[SPEC] = out.get("chain", PALETTE[0])
    fixed_k = [m for m in methods if m.startswith(f"{SPEC}:")]  # one colour per K
    out.update({m: PALETTE[(len(ours) + i) % len(PALETTE)] for i, m in enumerate(fixed_k)})
    return out


def _hatch(method: str) -> str | None:
    return "//" if method.startswith("mlx-lm") else None


def _grouped(ax, cats, methods, value, colors, fmt, labels=True):
    n = max(len(methods), 1)
    width = 0.8 / n
    for i, m in enumerate(methods):
        xs, ys = [], []
        for j, c in enumerate(cats):
            v = value(m, c)
            if v is not None:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(v)
        bars = ax.bar(
            xs,
            ys,
            width * 0.92,
            label=m,
            color=colors[m],
            hatch=_hatch(m),
            edgecolor="white",
            linewidth=0,
        )
        if labels and len(cats) * n <= 40:  # labels stay readable only on modest charts
            ax.bar_label(bars, [format(y, fmt) for y in ys], fontsize=7, padding=2)
    ax.set_xticks(range(len(cats)))
    tilt = len(cats) > 6
    ax.set_xticklabels(cats, rotation=20 if tilt else 0, ha="right" if tilt else "center")
    if cats and cats[-1] == ALL and len(cats) > 1:  # set the overall group apart
        ax.axvline(len(cats) - 1.5, color="#cccccc", lw=1)
        ax.get_xticklabels()[-1].set_fontweight("bold")
    ax.spines[["top", "right"]].set_visible(False)


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    agg = results["aggregates"]
    methods = list(agg)
    colors = _colors(methods)
    cats = [c for c in agg.get("plain", {}) if c != ALL] + [ALL]

    fig = Figure(figsize=(13, 8.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.25, 1], width_ratios=[1, 1.6])
    _speedup_panel(fig.add_subplot(grid[0, :]), agg, cats, colors)
    _speed_panel(fig.add_subplot(grid[1, 0]), agg, colors)
    _acceptance_panel(fig.add_subplot(grid[1, 1]), agg, cats, colors)
    fig.suptitle(_title(results), fontsize=12, fontweight="bold", ha="left", x=0.01)
    bad = results.get("mismatches") or []
    if bad:
        which = sorted({b["method"] for b in bad})
        fig.text(
            0.99,
            0.995,
            f"GREEDY MISMATCH: {', '.join(which)} ({len(bad)} prompts)",
            color="#c00000",
            ha="right",
            va="top",
            fontsize=11,
            fontweight="bold",
        )
    _save(fig, path)


def _speedup_panel(ax, agg: dict[str, Any], cats: list[str], colors: dict[str, str]) -> None:
    """The headline: how much faster than the verifier alone, per category."""
    fast = [m for m in agg if m != "plain"]
    _grouped(ax, cats, fast, lambda m, c: agg[m].get(c, {}).get("speedup"), colors, ".2f")
    ax.axhline(1.0, color="#333333", lw=1, ls="--", label="plain decoding = 1.0")
    ax.set_ylabel("speedup over plain decoding (x)")
    ax.set_title(
        "Speedup per category (decode tokens/s relative to the verifier alone, same run)",
        fontsize=10,
        loc="left",
    )
    if fast:
        ax.legend(frameon=False, ncols=min(len(fast) + 1, 6), loc="upper left", fontsize=8)
    ax.margins(y=0.15)


def _speed_panel(ax, agg: dict[str, Any], colors: dict[str, str]) -> None:
    """Absolute speed per method, overall."""
    tps = [(m, agg[m].get(ALL, {}).get("tokens_per_second") or 0.0) for m in agg]
    bars = ax.barh(
        [m for m, _ in tps],
        [v for _, v in tps],
        color=[colors[m] for m, _ in tps],
        hatch=[_hatch(m) for m, _ in tps],
        edgecolor="white",
        linewidth=0,
    )
    ax.bar_label(bars, [f"{v:.1f}" for _, v in tps], fontsize=8, padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s (all prompts)")
    ax.set_title("Speed", fontsize=10, loc="left")
    ax.spines[["top", "right"]].set_visible(False)
    ax.margins(x=0.18)


def _acceptance_panel(ax, agg: dict[str, Any], cats: list[str], colors: dict[str, str]) -> None:
    """How often the verifier agreed with the draft, per category, for the drafting methods."""
    spec = [m for m in agg if m != "plain" and agg[m].get(ALL, {}).get("drafted")]
    if not spec:
        ax.axis("off")
        ax.text(0.5, 0.5, "no drafting method run", ha="center", va="center")
        return
    _grouped(
        ax,
        cats,
        spec,
        lambda m, c: agg[m].get(c, {}).get("acceptance_rate"),
        colors,
        ".2f",
        labels=len(cats) * len(spec) <= 24,
    )
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("acceptance rate")
    lens = ", ".join(
        f"{m} {agg[m][ALL]['mean_accepted_length']:.2f}"
        for m in spec
        if agg[m][ALL].get("mean_accepted_length")
    )
    ax.set_title(
        textwrap.fill(f"Draft acceptance per category (tokens per verifier pass: {lens})", 90),
        fontsize=10,
        loc="left",
    )


def _title(results: dict[str, Any]) -> str:
    models = results.get("models", {})
    v = models.get("verifier", {}).get("name", "?")
    d = (models.get("draft") or {}).get("name")
    s = results.get("settings", {})
    m = results.get("machine", {})
    blas = "OpenBLAS preloaded" if m.get("blas", {}).get("openblas_preloaded") else ""
    device = str(m.get("mlx_device", "")).replace("Device(", "MLX ").split(",")[0]
    where = " · ".join(x for x in (m.get("cpu"), f"{m.get('cpu_count')} cores", device, blas) if x)
    temp = s.get("temperature", 0)
    mode = "greedy" if not temp else f"temperature {temp}"
    pair = f"{v}  +  draft {d}" if d else v
    n = results.get("prompts", {}).get("count", 0)
    return (
        f"ondevice bench: {pair}\n{n} prompt{'' if n == 1 else 's'}, "
        f"{s.get('max_tokens')} new tokens, {mode}   |   {where}"
    )


def _save(fig, path: Path) -> None:
    tmp = staging_file(path)
    try:
        fig.savefig(tmp, format="png")  # format given: the staging name has no .png suffix
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
