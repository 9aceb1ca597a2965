"""The benchmark page's figures, drawn from the results' JSON files (nothing is
measured here): where a curve says more than a table.

- `b2_time_to_quality.png`: B2's exact-trace test NLL minus the floor against training
  seconds, cnftrace beside zuko (`results/benchmarks.json`, the suite's last B2).
- `b3_cost_vs_dimension.png`: B3's CPU microseconds per batched evaluation of f, of f
  with the Hutchinson divergence and with the exact divergence, against d, on log
  axes (`results/benchmarks.json`).
- `b5_gap_vs_dimension.png`: B5's gap to the true density against d, cnftrace's
  defaults beside zuko's NSF and CNF at cnftrace's training seconds
  (`results/b5_dims.json`, the rows of key 0).

    python -m experiments.plots              # writes docs/images/*.png
    python -m experiments.plots --out DIR
"""

import argparse
import json
import os

from experiments._common import (
    B5_MLE_STEPS,
    COLORS,
    DOCS_IMAGES,
    RESULTS,
    atomic_write,
    figure_bytes,
    gap_axes,
    plain_numbers,
    trained_by,
)


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _axes(plt, title: str):
    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def time_to_quality(plt, suite: dict):
    """B2: the gap to the floor against training seconds, one panel per data set."""
    b2 = suite["b2"]
    fig, axes = plt.subplots(
        1, len(b2), figsize=(9.6, 3.8), layout="constrained", squeeze=False
    )
    for ax, (data, systems) in zip(axes[0], b2.items()):
        for name in ("cnftrace", "zuko"):
            r = systems.get(name)
            if not r:
                continue
            seconds = [s for s, _ in r["curve"]]
            gaps = [nll - r["floor"] for _, nll in r["curve"]]
            ax.plot(seconds, gaps, "o-", ms=3, label=r["system"], color=COLORS[name])
        ticks = [0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1]
        xlabel, ylabel = "training seconds (2-core CPU)", "test NLL − entropy (nats)"
        gap_axes(plt, ax, (0.15, 0.05), ticks, xlabel, ylabel, f"B2, {data}")
    return fig


def cost_vs_dimension(plt, suite: dict):
    """B3: CPU microseconds per batched evaluation against the dimension."""
    rows = suite["b3"]["divergence"]
    dims = [r["dim"] for r in rows]
    fig, ax = _axes(plt, "B3: cost of one batched evaluation against dimension")
    for key, label in (
        ("f_us", "f alone"),
        ("hutchinson_us", "f + Hutchinson divergence (1 probe)"),
        ("exact_us", "f + exact divergence"),
    ):
        ax.plot(dims, [r[key] for r in rows], "o-", ms=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(dims, [str(d) for d in dims])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("dimension d")
    ax.set_ylabel("CPU µs per evaluation (batch 512)")
    ax.legend(fontsize=8)
    return fig


def gap_vs_dimension(plt, dims_rows: dict):
    """B5: the gap to the truth against d for cnftrace and zuko's two flows."""
    rows = sorted(
        (r for key, r in dims_rows.items() if "/" not in key), key=lambda r: r["dim"]
    )
    fig, ax = _axes(plt, "B5: gap to the true density, zuko at cnftrace's seconds")
    series = {"cnftrace": "cnftrace", "zuko NSF": "zuko_nsf", "zuko CNF": "zuko_cnf"}
    for label, key in series.items():
        points = [
            (r["dim"], r[key]["gap"], r[key]["gap_se"])
            for r in rows
            if isinstance(r.get(key), dict) and "gap" in r[key]
        ]
        if points:
            d, gap, se = zip(*points)
            ax.errorbar(
                d, gap, yerr=se, fmt="o-", ms=4, capsize=3, label=label,
                color=COLORS[label],
            )  # fmt: skip
    for r in rows:
        recipe = r["cnftrace"]["recipe"]
        if recipe["steps"] != B5_MLE_STEPS or trained_by(recipe):
            ax.annotate(
                f"{trained_by(recipe)}{recipe['steps']:,} steps",
                (r["dim"], r["cnftrace"]["gap"]),
                textcoords="offset points",
                xytext=(-8, -4),
                ha="right",
                fontsize=8,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_numbers(plt, ax.yaxis, [0.003, 0.01, 0.03, 0.1, 0.3, 1, 3])
    ax.set_xticks([r["dim"] for r in rows], [str(r["dim"]) for r in rows])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("dimension d")
    ax.set_ylabel("model NLL − true NLL (nats)")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DOCS_IMAGES, help="directory of the PNGs")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suite = _load("benchmarks.json")
    figures = {
        "b2_time_to_quality.png": time_to_quality(plt, suite),
        "b3_cost_vs_dimension.png": cost_vs_dimension(plt, suite),
        "b5_gap_vs_dimension.png": gap_vs_dimension(plt, _load("b5_dims.json")),
    }
    for name, fig in figures.items():
        path = os.path.join(args.out, name)
        atomic_write(path, figure_bytes(fig, dpi=110))
        plt.close(fig)
        print(f"wrote {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
