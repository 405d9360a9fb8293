#!/usr/bin/env python3
"""plot_speed.py: docs/speed_h200.json (issue 5's table with provenance) as a bar chart, docs/speed_h200.png.

    python3 tools/plot_speed.py [--json docs/speed_h200.json] [--out docs/speed_h200.png]

Per step: the bandwidth floor, the goal, pydflash now, pydflash at the start of the speed work and the
reference (Z Lab's dflash, torch eager), in ms on a log scale, with now / floor printed over each bar.
Needs matplotlib (not a dependency of pydflash).
"""
import argparse
import json

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="docs/speed_h200.json")
    ap.add_argument("--out", default="docs/speed_h200.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(args.json))
    rows = data["rows"]
    series = [("floor", "floor_ms", "#999999"), ("goal", "goal_ms", "#4c9a2a"), ("pydflash now", "pydflash_ms", "#1f5fa8"),
              ("pydflash, start", "session_start_ms", "#9ec3e6"), ("reference", "reference_ms", "#d9822b")]
    x = np.arange(len(rows))
    width = 0.16
    fig, ax = plt.subplots(figsize=(max(11, 1.45 * len(rows) + 1), 5.2))
    for i, (label, key, color) in enumerate(series):
        values = [r.get(key) or np.nan for r in rows]
        bars = ax.bar(x + (i - 2) * width, values, width, label=label, color=color)
        if key == "pydflash_ms":
            for b, r in zip(bars, rows):
                ax.annotate(f"{r['pydflash_ms'] / r['floor_ms']:.2f}x floor", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.margins(y=0.25)  # room for the ratio labels over the tallest bars
    ax.set_ylabel("ms per step (log)")
    ax.set_xticks(x, [r["title"].replace(", ", ",\n") for r in rows], fontsize=8)
    ax.set_title(f"{data['device']}: batch 1, bf16, random weights at real shapes")
    ax.legend(fontsize=8, ncol=5, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
