"""The scale benchmark's figure (``benchmarks/e2e_scale.py``): tokens/s against batch, one panel per model,
one line per cell mode (ar, serial_tree, bole and any bole_fr<N>), each bole line labelled with its MAT."""

from __future__ import annotations

from pathlib import Path


def plot(doc: dict, path: Path) -> str | None:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return None
    models = list(dict.fromkeys(r["model"] for r in doc["rows"]))
    if not models:
        print("no rows: no plot", flush=True)
        return None
    # one colour per mode across the panels (their cells may run in different orders)
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["mode"] for r in doc["rows"]))}
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in doc["rows"] if r["model"] == model]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["batch"], r["tokens_per_s"], r["mat"]) for r in rows if r["mode"] == mode
                         and r["status"] == "ok")
            bad = sorted((r["status"], r["batch"]) for r in rows if r["mode"] == mode
                         and r["status"] in ("oom", "refused", "timeout"))
            failed = [f"{st}@{','.join(str(b) for s, b in bad if s == st)}" for st in dict.fromkeys(s for s, _ in bad)]
            if pts:
                mat = f", MAT {pts[0][2]:.2f} @b={pts[0][0]}" if mode != "ar" else ""
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[mode],
                        label=mode + mat + (f" ({', '.join(failed)})" if failed else ""))
            elif failed:  # no cell of the mode ran (serial_tree refused at every batch): said in the legend
                ax.plot([], [], marker="x", ls="none", color=colors[mode],
                        label=f"{mode}: no cell ran ({', '.join(failed)})")
        batches = sorted({r["batch"] for r in rows})
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s (greedy, prefill included)",
               title=model)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
