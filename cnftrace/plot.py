"""Pictures of flows (needs matplotlib, the `plot` extra). Every function writes a
PNG atomically and returns its path."""

import io
import os

import jax.numpy as jnp
import numpy as np

from ._io import atomic_write
from .flows import AbstractFlow
from .training import log_prob_batched

# The square a 2-D density is drawn on, [-lim, lim]^2, and its pixels per side.
_LIM = 4.0
_RESOLUTION = 150
_GRID_BATCH = 5000  # grid points per compiled call


def density_grid(
    flow: AbstractFlow,
    *,
    lim: float = _LIM,
    resolution: int = _RESOLUTION,
    batch_size: int = _GRID_BATCH,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The flow's log-density, by the exact trace, on a grid.

    **Arguments:**

    - `flow`: a flow of 2-D samples (`event_shape == (2,)`).
    - `lim`: the grid covers `[-lim, lim]^2`.
    - `resolution`: points along each axis.
    - `batch_size`: grid points per solve.

    **Returns:**

    `(xs, ys, logp)`: the axes, each of shape `(resolution,)`, and the log-density
    of shape `(resolution, resolution)`, `logp[i, j]` at `(xs[j], ys[i])`.

    !!! example

        ```python
        import cnftrace.plot

        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, 2)
        xs, ys, logp = cnftrace.plot.density_grid(flow, resolution=20)
        ```
    """
    if flow.event_shape != (2,):
        raise ValueError(
            "density plots need a 2-D flow; this one has event shape "
            f"{flow.event_shape}."
        )
    xs = np.linspace(-lim, lim, resolution)
    grid = np.stack(np.meshgrid(xs, xs), axis=-1).reshape(-1, 2)
    grid = jnp.asarray(grid, jnp.result_type(float))
    logp = log_prob_batched(flow, grid, batch_size=batch_size)  # exact trace
    return xs, xs, logp.reshape(resolution, resolution)


def _atomic_savefig(fig, path: str) -> None:
    """Writes the figure atomically, in the format of `path`'s extension (PNG)."""
    buffer = io.BytesIO()
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    fig.savefig(buffer, format=fmt, dpi=110, bbox_inches="tight")
    atomic_write(path, buffer.getvalue())


def plot_flow_2d(
    flow: AbstractFlow,
    data: np.ndarray,
    samples: np.ndarray,
    path: str,
    *,
    lim: float = _LIM,
    resolution: int = _RESOLUTION,
    title: str | None = None,
) -> str:
    """Saves a three-panel PNG: the data, the learned density (exact trace), and samples
    from the flow; returns `path`.

    **Arguments:**

    - `flow`: a flow of 2-D samples.
    - `data`, `samples`: samples of the data `(n, 2)` and of the flow `(m, 2)`.
    - `path`: the PNG file to write.
    - `lim`, `resolution`: as for [`density_grid`][cnftrace.plot.density_grid].
    - `title`: an optional title above the panels.

    !!! example

        ```python
        import cnftrace.plot
        from cnftrace.datasets import toy_sample

        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, 2)
        data = toy_sample("8gaussians", jr.key(1), 1000)
        samples = flow.sample(jr.key(2), 1000)
        cnftrace.plot.plot_flow_2d(flow, data, samples, "flow.png", resolution=20)
        ```
    """
    plt = _pyplot()
    xs, ys, logp = density_grid(flow, lim=lim, resolution=resolution)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    kw = dict(bins=200, range=[[-lim, lim], [-lim, lim]], cmap="viridis")
    axes[0].hist2d(np.asarray(data)[:, 0], np.asarray(data)[:, 1], **kw)
    axes[0].set_title("data")
    axes[1].pcolormesh(xs, ys, np.exp(logp), cmap="viridis", shading="auto")
    axes[1].set_title("learned density (exact trace)")
    axes[2].hist2d(np.asarray(samples)[:, 0], np.asarray(samples)[:, 1], **kw)
    axes[2].set_title("samples")
    for ax in axes:
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        fig.suptitle(title)
    _atomic_savefig(fig, path)
    plt.close(fig)
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plotting needs matplotlib: `pip install 'cnftrace[plot]'`."
        ) from e
    return plt


def plot_samples(
    data: np.ndarray,
    samples: np.ndarray,
    path: str,
    *,
    names: list[str] | None = None,
    max_columns: int = 4,
    title: str | None = None,
) -> str:
    """Saves a grid comparing samples of a flow with the data: each column's
    histograms on the diagonal, the data below it and the samples above, for the
    first `max_columns` columns; returns `path`.

    **Arguments:**

    - `data`, `samples`: the data `(n, dim)` and samples of the flow `(m, dim)`.
    - `path`: the PNG file to write.
    - `names`: the columns' names, for the axes.
    - `max_columns`: how many of the first columns to show.
    - `title`: an optional first line of the title.

    !!! example

        ```python
        import cnftrace.plot

        scale = jnp.array([[1.0, 10.0, 100.0]])
        data = jr.normal(jr.key(0), (500, 3)) * scale
        samples = jr.normal(jr.key(1), (500, 3)) * scale
        cnftrace.plot.plot_samples(data, samples, "pairs.png", names=["a", "b", "c"])
        ```
    """
    data, samples = np.asarray(data), np.asarray(samples)
    if data.ndim != 2 or samples.ndim != 2 or data.shape[1] != samples.shape[1]:
        raise ValueError(
            "`data` and `samples` must be tables (n, dim) with the same columns; got "
            f"shapes {data.shape} and {samples.shape}."
        )
    plt = _pyplot()
    dim = data.shape[1]
    k = min(dim, max_columns)
    names = list(names) if names is not None else [f"column {j}" for j in range(k)]
    fig, axes = plt.subplots(
        k, k, figsize=(2.6 * k, 2.6 * k), squeeze=False, layout="constrained"
    )
    for i in range(k):
        for j in range(k):
            ax = axes[i, j]
            if i == j:
                bins = np.histogram_bin_edges(data[:, i], bins=30)
                ax.hist(data[:, i], bins=bins, density=True, alpha=0.5, label="data")
                ax.hist(
                    samples[:, i], bins=bins, density=True, alpha=0.5, label="samples"
                )
            else:
                points = data if i > j else samples
                color = "C0" if i > j else "C1"
                ax.scatter(points[:, j], points[:, i], s=3, alpha=0.5, c=color)
            if i == k - 1:
                ax.set_xlabel(names[j])
            if j == 0:
                ax.set_ylabel(names[i])
    axes[0, 0].legend(fontsize="small")
    layout = "data (below the diagonal) and samples (above)"
    if dim > k:
        layout += f", the first {k} of {dim} columns"
    fig.suptitle(f"{title}\n{layout}" if title else layout)
    _atomic_savefig(fig, path)
    plt.close(fig)
    return path


def plot_training_curves(
    records: list[dict] | dict[str, list],
    path: str,
    *,
    entropy: float | None = None,
) -> str:
    """Saves training curves (training and validation NLL, NFE per solve) against
    the step as a PNG; returns `path`.

    **Arguments:**

    - `records`: the `history` that [`fit`][cnftrace.fit] returns, or a list of
        records (the lines of a run's `metrics.jsonl`).
    - `path`: the PNG file to write.
    - `entropy`: the data's true entropy, drawn as a horizontal line, if known.

    !!! example

        ```python
        import cnftrace.plot

        history = {"step": [1, 2, 3], "loss": [3.1, 3.0, 2.9], "nfe": [20, 22, 26]}
        cnftrace.plot.plot_training_curves(history, "training.png", entropy=2.83)
        ```
    """
    plt = _pyplot()
    if isinstance(records, dict):
        keys = ("step", "loss", "nfe")
        missing = [k for k in keys if k not in records]
        if missing:
            raise ValueError(
                f"`records` is a dict without {missing}; pass the history that "
                "`cnftrace.fit` returns, or a list of records."
            )
        validations = [
            {"step": step, "val_nll": nll, "val_stderr": err}
            for step, nll, err in zip(
                records.get("val_step", ()),
                records.get("val_nll", ()),
                records.get("val_stderr", ()),
            )
        ]
        records = [dict(zip(keys, row)) for row in zip(*(records[k] for k in keys))]
    else:
        validations = [r for r in records if r.get("val_nll") is not None]
        records = [r for r in records if "loss" in r]
    if not records:
        raise ValueError("`records` is empty: there is nothing to plot.")
    steps = np.array([r["step"] for r in records])
    loss = np.array([r["loss"] for r in records], dtype=float)
    fig, (ax_loss, ax_nfe) = plt.subplots(1, 2, figsize=(10, 3.5), layout="constrained")
    ax_loss.plot(steps, loss, lw=0.6, alpha=0.35, color="C0", label="training NLL")
    window = max(1, len(loss) // 50)
    if window > 1:  # each step's loss is a noisy estimate: its running mean
        mean = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax_loss.plot(
            steps[window - 1 :],
            mean,
            lw=1.2,
            color="C0",
            label=f"training NLL, mean of {window} steps",
        )
    if validations:
        ax_loss.errorbar(
            [v["step"] for v in validations],
            [v["val_nll"] for v in validations],
            yerr=[v.get("val_stderr") or 0.0 for v in validations],
            fmt="o",
            ms=3,
            lw=0.8,
            color="C3",
            label="validation NLL",
        )
    if entropy is not None:
        ax_loss.axhline(entropy, color="k", ls="--", lw=0.8, label="true entropy")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("nats")
    ax_loss.legend()
    ax_nfe.plot(steps, [r["nfe"] for r in records], lw=0.8)
    ax_nfe.set_xlabel("step")
    ax_nfe.set_ylabel("NFE per forward solve")
    _atomic_savefig(fig, path)
    plt.close(fig)
    return path


def plot_image_grid(
    images: np.ndarray, path: str, *, ncols: int = 8, title: str | None = None
) -> str:
    """Saves a grid of grey-scale images as a PNG; returns `path`.

    **Arguments:**

    - `images`: shape `(n, h, w)`, values in `[0, 1]` (dark is 1).
    - `path`: the PNG file to write.
    - `ncols`: images per row.
    - `title`: an optional title above the grid.

    !!! example

        ```python
        import cnftrace.plot

        images = jr.uniform(jr.key(0), (16, 8, 8))
        cnftrace.plot.plot_image_grid(images, "grid.png", ncols=8)
        ```
    """
    plt = _pyplot()
    images = np.asarray(images)
    if images.ndim != 3:
        raise ValueError(f"`images` must have shape (n, h, w); got {images.shape}.")
    n = images.shape[0]
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * 0.9, nrows * 0.9))
    for i, ax in enumerate(np.atleast_1d(axes).ravel()):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i], cmap="gray_r", vmin=0, vmax=1)
    if title:
        fig.suptitle(title)
    _atomic_savefig(fig, path)
    plt.close(fig)
    return path
