"""Rendering a `Report`: a rich table for the terminal, report.md, report.json and a heatmap.

The heatmap has one row of panels per KV-cache type and two panels per row — speedup over the
same base without speculation, and acceptance rate — each a grid of base quant types (rows) ×
draft quant types (columns), every cell annotated with its number. Unsupported cells are grey and
say "n/a"; a cell whose greedy output differed from the base's is marked "LOSSY". It is drawn with
matplotlib (Agg) as report.png, or written by hand as report.svg when matplotlib is absent.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from quantspec.outputs import atomic_file, write_json, write_text
from quantspec.report.matrix import CellResult, Report

__all__ = ["rich_table", "markdown", "heatmap", "write_outputs", "cell_summary"]

PNG_NAME, SVG_NAME, MD_NAME, JSON_NAME = "report.png", "report.svg", "report.md", "report.json"
_SPEEDUP_RANGE = (0.25, 4.0)  # log-symmetric colour range around 1.0×
_NA_COLOUR = "#d9d9d9"


def _axes(report: Report) -> tuple[list[str], list[str], list[str]]:
    c = report.config
    return list(c["base_quant_types"]), list(c["draft_quant_types"]), list(c["cachekv"])


def _fmt(v, spec: str, none: str = "–") -> str:
    return none if v is None else format(v, spec)


def cell_summary(r: CellResult) -> str:
    """Short text for a grid cell: `1.23× 87% ✓`, or `n/a`."""
    if not r.supported:
        return "n/a"
    mark = "✓" if r.lossless else "✗ lossy"
    return f"{_fmt(r.speedup, '.2f')}× {_fmt(None if r.acceptance_rate is None else 100 * r.acceptance_rate, '.0f')}% {mark}"


def _ppl(report: Report, base: str) -> str:
    p = report.perplexity.get(base, {})
    return _fmt(p.get("perplexity"), ".2f", "n/a")


# ---------------------------------------------------------------------------------------------
# terminal


def rich_table(report: Report):
    """A `rich.table.Table` with one row per cell."""
    from rich.table import Table

    c = report.config
    title = (f"quantspec report · {c['model']} · speculate {c['speculate_method']}"
             + (f" (draft {c['draft_model']})" if c.get("draft_model") else ""))
    t = Table(title=title, caption="speedup = tokens/s with speculation ÷ the same base without; "
                                   "lossless = identical greedy tokens")
    for col, just in (("base", "left"), ("draft", "left"), ("kv", "left"), ("lossless", "center"),
                      ("accept", "right"), ("mean len", "right"), ("tok/s", "right"), ("base tok/s", "right"),
                      ("speedup", "right"), ("peak MiB", "right"), ("base ppl", "right")):
        t.add_column(col, justify=just)
    for r in report.cells:
        if not r.supported:
            t.add_row(r.base, r.draft, r.cachekv, f"[red]unsupported[/]: [dim]{r.reason}[/]", *[""] * 6,
                      _ppl(report, r.base))
            continue
        speed = _fmt(r.speedup, ".2f") + "×"
        colour = "green" if (r.speedup or 0) >= 1 else "yellow"
        t.add_row(r.base, r.draft, r.cachekv, "[green]yes[/]" if r.lossless else "[red]NO[/]",
                  _fmt(None if r.acceptance_rate is None else 100 * r.acceptance_rate, ".0f") + "%",
                  _fmt(r.mean_accepted_length, ".2f"), _fmt(r.tokens_per_s, ".1f"), _fmt(r.base_tokens_per_s, ".1f"),
                  f"[{colour}]{speed}[/]", _fmt(r.peak_memory_mb, ".0f"), _ppl(report, r.base))
    return t


# ---------------------------------------------------------------------------------------------
# markdown


def markdown(report: Report, image_name: str | None = PNG_NAME) -> str:
    c, m = report.config, report.meta
    bases, drafts, kvs = _axes(report)
    lines = [f"# quantspec report: {c['model']}, speculate `{c['speculate_method']}`", ""]
    draft = c.get("draft_model")
    lines += [f"- base model: `{c['model']}`" + (f"; draft: `{draft}`" if draft else " (n-gram drafts, no draft model)"),
              f"- {m.get('num_prompts')} prompts, greedy, {c['max_new_tokens']} new tokens, "
              f"{c['speculate_max_draft_token_num']} draft tokens per step; device {m.get('device')}, "
              f"{m.get('threads')} thread(s), torch {m.get('torch')}",
              "- **speedup** = tokens/s with speculation ÷ tokens/s of the same base (same quant type, same KV "
              "cache) without; **accept** = accepted ÷ drafted tokens; **lossless** ✓ = greedy tokens identical "
              "to that base's for every prompt; **n/a** = not supported (reason below)", ""]
    if image_name:
        lines += [f"![speedup and acceptance per pair]({image_name})", ""]
    for kv in kvs:
        lines += [f"## KV cache: {kv}", "", "| base \\ draft | " + " | ".join(drafts) + " | base ppl |",
                  "|---|" + "---|" * len(drafts) + "---|"]
        for b in bases:
            row = [cell_summary(r) if (r := report.cell(b, d, kv)) else "" for d in drafts]
            lines.append(f"| **{b}** | " + " | ".join(row) + f" | {_ppl(report, b)} |")
        lines.append("")
    lines += ["## All cells", "", "| base | draft | kv | supported | lossless | accept | mean accepted len | tok/s | "
              "base tok/s | speedup | peak MiB | base MiB | draft MiB | base ppl |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.cells:
        if r.supported:
            lines.append(
                f"| {r.base} | {r.draft} | {r.cachekv} | yes | {'yes' if r.lossless else '**no**'} | "
                f"{_fmt(None if r.acceptance_rate is None else 100 * r.acceptance_rate, '.1f')}% | "
                f"{_fmt(r.mean_accepted_length, '.2f')} | {_fmt(r.tokens_per_s, '.1f')} | "
                f"{_fmt(r.base_tokens_per_s, '.1f')} | {_fmt(r.speedup, '.2f')}× | {_fmt(r.peak_memory_mb, '.0f')} | "
                f"{_fmt(r.base_artifact_mb, '.1f')} | {_fmt(r.draft_artifact_mb, '.1f')} | {_ppl(report, r.base)} |")
        else:
            lines.append(f"| {r.base} | {r.draft} | {r.cachekv} | no: {r.reason} | | | | | | | | "
                         f"{_fmt(r.base_artifact_mb, '.1f')} | {_fmt(r.draft_artifact_mb, '.1f')} | {_ppl(report, r.base)} |")
    lines += ["", "## Base perplexity (held-out text)", "", "| base | perplexity |", "|---|---|"]
    for b in bases:
        p = report.perplexity.get(b, {})
        lines.append(f"| {b} | {_fmt(p.get('perplexity'), '.3f', 'n/a: ' + str(p.get('reason')))} |")
    lines += ["", f"Peak memory: {m.get('peak_memory_note')}. Settings hash `{m.get('settings_hash')}`; "
              f"this run took {m.get('wall_s_this_run')} s.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# heatmap


def _grid(report: Report, kv: str, metric: str):
    bases, drafts, _ = _axes(report)
    vals, texts = [], []
    for b in bases:
        vrow, trow = [], []
        for d in drafts:
            r = report.cell(b, d, kv)
            if r is None or not r.supported:
                vrow.append(math.nan)
                trow.append("n/a")
                continue
            lossy = "" if r.lossless else "\nLOSSY"
            if metric == "speedup":
                v = r.speedup
                trow.append(f"{_fmt(v, '.2f')}×{lossy}")
            else:
                v = r.acceptance_rate
                trow.append(f"{_fmt(None if v is None else 100 * v, '.0f')}%\nlen {_fmt(r.mean_accepted_length, '.2f')}{lossy}")
            vrow.append(math.nan if v is None else float(v))
        vals.append(vrow)
        texts.append(trow)
    return vals, texts


def _short(model: str | None) -> str:
    """A zoo name as is; a path by its last component (titles stay one line)."""
    return Path(model).name if model and ("/" in model or "\\" in model) else str(model)


def _title(report: Report) -> str:
    c = report.config
    draft = f"draft {_short(c['draft_model'])}" if c.get("draft_model") else "n-gram drafts"
    return (f"quantspec report: {_short(c['model'])} · speculate {c['speculate_method']} ({draft}) · "
            f"{report.meta.get('num_prompts')} prompts × {c['max_new_tokens']} tokens, greedy")


def heatmap(report: Report, out_dir: Path) -> Path:
    """Write report.png (matplotlib) or report.svg (by hand); returns its path."""
    try:
        import matplotlib
    except ImportError:
        return _heatmap_svg(report, Path(out_dir) / SVG_NAME)
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    bases, drafts, kvs = _axes(report)
    w = max(4.0, 1.5 * len(drafts) + 2.2)
    h = max(2.4, 0.75 * len(bases) + 1.4)
    fig, axes = plt.subplots(len(kvs), 2, figsize=(2 * w, h * len(kvs) + 0.9), squeeze=False)
    speed_cmap = plt.get_cmap("RdYlGn").with_extremes(bad=_NA_COLOUR)
    acc_cmap = plt.get_cmap("Blues").with_extremes(bad=_NA_COLOUR)
    for i, kv in enumerate(kvs):
        for j, (metric, cmap) in enumerate((("speedup", speed_cmap), ("acceptance", acc_cmap))):
            _panel(fig, axes[i][j], report, kv, metric, cmap)
    fig.suptitle(_title(report) + "\ngrey n/a = unsupported (reason in report.md); LOSSY = greedy output differs "
                 "from the base's", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / PNG_NAME
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path


def _panel(fig, ax, report: Report, kv: str, metric: str, cmap) -> None:
    """One matplotlib panel: `metric` ("speedup" or "acceptance") of every (base, draft) pair at
    KV cache `kv`, each cell labelled, with its colour bar."""
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import NullLocator

    bases, drafts, _ = _axes(report)
    vals, texts = _grid(report, kv, metric)
    arr = np.ma.masked_invalid(np.array(vals, dtype=float))
    if metric == "speedup":
        norm = LogNorm(vmin=_SPEEDUP_RANGE[0], vmax=_SPEEDUP_RANGE[1])
        arr = np.ma.masked_invalid(np.clip(arr.filled(np.nan), *_SPEEDUP_RANGE))
        im = ax.imshow(arr, cmap=cmap, norm=norm, aspect="auto")
        label = "speedup vs same base, no speculation (1.0× = no gain)"
    else:
        im = ax.imshow(arr, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        label = "acceptance rate (accepted ÷ drafted)"
    ax.set_title(f"KV cache {kv}: {label}", fontsize=9)
    ax.set_xticks(range(len(drafts)), [f"draft {d}" for d in drafts], fontsize=8)
    ax.set_yticks(range(len(bases)), [f"base {b}" for b in bases], fontsize=8)
    ax.set_xticks(np.arange(-0.5, len(drafts), 1), minor=True)
    ax.set_yticks(np.arange(-0.5, len(bases), 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    for y in range(len(bases)):
        for x in range(len(drafts)):
            v = vals[y][x]
            dark = False
            if not math.isnan(v):
                rgba = im.cmap(im.norm(v))
                dark = (0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]) < 0.5
            ax.text(x, y, texts[y][x], ha="center", va="center", fontsize=9,
                    color="white" if dark else "black", fontweight="bold" if "LOSSY" in texts[y][x] else None)
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    cb.ax.tick_params(labelsize=7)
    if metric == "speedup":
        ticks = [t for t in (0.25, 0.5, 1.0, 2.0, 4.0)]
        cb.set_ticks(ticks, labels=[f"{t:g}×" for t in ticks])
        cb.ax.yaxis.set_minor_locator(NullLocator())


def _heatmap_svg(report: Report, path: Path) -> Path:
    """The same panels as the PNG, as a hand-written SVG (no matplotlib)."""
    bases, drafts, kvs = _axes(report)
    cw, ch, lw, top = 110, 44, 170, 60
    pw = lw + cw * len(drafts) + 30
    ph = 40 + ch * len(bases) + 20
    W, H = 2 * pw, top + ph * len(kvs)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="10" y="20" font-size="12">{html.escape(_title(report))}</text>',
           '<text x="10" y="38" fill="#555">grey n/a = unsupported (reason in report.md); LOSSY = output differs</text>']
    for i, kv in enumerate(kvs):
        for j, metric in enumerate(("speedup", "acceptance")):
            ox, oy = j * pw, top + i * ph
            out.append(f'<text x="{ox + 10}" y="{oy + 20}" font-weight="bold">KV cache {kv}: {metric}</text>')
            vals, texts = _grid(report, kv, metric)
            for x, d in enumerate(drafts):
                out.append(f'<text x="{ox + lw + x * cw + cw / 2}" y="{oy + 36}" text-anchor="middle">'
                           f'draft {html.escape(d)}</text>')
            for y, b in enumerate(bases):
                cy = oy + 40 + y * ch
                out.append(f'<text x="{ox + lw - 6}" y="{cy + ch / 2 + 4}" text-anchor="end">base {html.escape(b)}</text>')
                for x in range(len(drafts)):
                    v = vals[y][x]
                    if math.isnan(v):
                        fill = _NA_COLOUR
                    elif metric == "speedup":
                        t = max(-1.0, min(1.0, math.log2(v) / 2))  # −1 at 0.25×, +1 at 4×
                        fill = f"rgb({int(255 * min(1, 1 - t))},{int(255 * min(1, 1 + t))},120)"
                    else:
                        g = int(255 - 180 * max(0.0, min(1.0, v)))
                        fill = f"rgb({g},{g},255)"
                    cx = ox + lw + x * cw
                    out.append(f'<rect x="{cx}" y="{cy}" width="{cw - 2}" height="{ch - 2}" fill="{fill}"/>')
                    for k, line in enumerate(texts[y][x].split("\n")):
                        out.append(f'<text x="{cx + cw / 2}" y="{cy + 16 + 12 * k}" text-anchor="middle">'
                                   f'{html.escape(line)}</text>')
    out.append("</svg>")
    return write_text(path, "\n".join(out))


# ---------------------------------------------------------------------------------------------


def write_outputs(report: Report, out_dir: Path) -> dict[str, Path]:
    """report.json, the heatmap, report.md (which links the heatmap) into `out_dir`."""
    out_dir = Path(out_dir)
    paths = {"json": out_dir / JSON_NAME}
    write_json(paths["json"], report.to_dict())
    paths["image"] = heatmap(report, out_dir)
    paths["md"] = write_text(out_dir / MD_NAME, markdown(report, image_name=paths["image"].name))
    return paths


def load_report(path: str | Path) -> dict:
    """report.json as a dict (for tools and tests)."""
    return json.loads(Path(path).read_text())
