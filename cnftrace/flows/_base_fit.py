"""`fit_base`: a base distribution fitted to training rows by the classical methods,
so that a flow whose field starts at zero starts as the classical model.

A Gaussian mixture is fitted by scikit-learn's EM with the number of components chosen
by BIC; Student-t tails are fitted by maximum likelihood from there (a grid over the
degrees of freedom, then Adam on every parameter); `"auto"` keeps the candidate with
the best validation NLL. All of it runs in float64 on the host, or in JAX without an
ODE solve: seconds, next to the flow's minutes of training.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._checks import check_int
from ._distributions import (
    AbstractBase,
    GaussianMixture,
    StandardNormal,
    StudentT,
    StudentTMixture,
)

BASE_KINDS = ("auto", "normal", "mixture", "t-mixture", "student-t")
# The degrees of freedom tried before Student-t tails are refined by gradient: from
# very heavy (a variance-free 1.5) to nearly Gaussian.
_DF_GRID = (1.5, 2.0, 3.0, 5.0, 8.0, 15.0, 30.0, 100.0)
_REFINE_STEPS = 300
_REFINE_LR = 0.02


def fit_base(
    data,
    *,
    validation=None,
    kind: str = "auto",
    max_components: int = 8,
    covariance: str = "full",
    max_rows: int = 100_000,
    seed: int = 0,
    trainable: bool = True,
    dtype=None,
    return_info: bool = False,
):
    """A base distribution fitted to the training rows `data`, for a flow whose
    field starts at zero (`mlp_flow(..., base=base)`): the flow then starts as this
    classical model, and training keeps what validation prefers.

    **Arguments:**

    - `data`: the training rows, shape `(n, d)`, finite.
    - `validation`: held-out rows `(m, d)`, used by `kind="auto"` to choose
        between candidates (without them, by BIC on `data`).
    - `kind`:
        - `"mixture"`: a Gaussian mixture (scikit-learn's EM, three starts), the
          number of components (1 to `max_components`, at most one per two rows)
          chosen by BIC;
        - `"t-mixture"`: that mixture with Student-t components, their degrees of
          freedom and every other parameter then fitted by maximum likelihood;
        - `"student-t"`: a product of Student-t distributions, one per coordinate;
        - `"normal"`: the standard normal (no fitting);
        - `"auto"` (default): the mixture or the t-mixture, whichever has the
          better validation NLL: heavy tails where the data have them, the
          Gaussian mixture where they do not.
    - `max_components`, `covariance` (`"full"` or `"diag"`): the mixture's.
    - `max_rows`: fit on a seeded random subset of at most this many rows.
    - `seed`: the seed of the subset and of EM's starts.
    - `trainable`: whether the returned base is trained with the flow.
    - `dtype`: the parameters' dtype (JAX's default float if omitted).
    - `return_info`: also return a dict: `reason` (one line saying what was
        chosen and why), `kind`, `components`, and each candidate's mean
        validation NLL (`scores`).

    **Returns:**

    An [`AbstractBase`][cnftrace.AbstractBase] over vectors of size `d`; with
    `return_info`, `(base, info)`.

    !!! example

        ```python
        rng = np.random.default_rng(0)
        rows = np.concatenate([rng.normal(-3, 1, (200, 2)), rng.normal(3, 1, (200, 2))])
        base = cnftrace.fit_base(rows[:300], validation=rows[300:])
        flow = cnftrace.mlp_flow(2, key=jr.key(0), base=base)  # starts as the base
        print(base.describe())
        ```
    """
    if kind not in BASE_KINDS:
        raise ValueError(f"`kind` must be one of {BASE_KINDS}; got {kind!r}.")
    check_int("max_components", max_components)
    check_int("max_rows", max_rows)
    if covariance not in ("full", "diag"):
        raise ValueError(f"`covariance` must be 'full' or 'diag'; got {covariance!r}.")
    train = _rows("data", data, None)
    d = train.shape[1]
    val = None if validation is None else _rows("validation", validation, d)
    if train.shape[0] > max_rows:
        rng = np.random.default_rng(seed)
        train = train[np.sort(rng.choice(train.shape[0], max_rows, replace=False))]
    dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
    settings = dict(trainable=trainable, dtype=dtype)
    info: dict = {"kind": kind, "scores": {}}
    if kind == "normal":
        base = StandardNormal(d)
        info["reason"] = "standard normal"
    elif kind == "student-t":
        base = _fit_product_t(train, val, **settings)
        info["reason"] = base.describe()
    else:
        gm, bic_line = _fit_mixture(train, max_components, covariance, seed, **settings)
        info["components"] = gm.n_components
        base = gm
        info["reason"] = f"{gm.describe()} ({bic_line})"
        if kind != "mixture":
            tm = _fit_t_mixture(gm, train, val)
            if kind == "t-mixture":
                base = tm
                info["reason"] = f"{tm.describe()} ({bic_line})"
            else:
                base, info = _choose(gm, tm, train, val, bic_line, info)
    info["kind"] = _kind_of(base)
    return (base, info) if return_info else base


def base_template(
    kind: str, dim: int, components: int | None = None, *, dtype=None
) -> AbstractBase:
    """A base of `kind` (not `"auto"`) over vectors of size `dim` with `components`
    components (for the mixtures): its structure, with placeholder values, for
    loading fitted parameters into (a run's checkpoints)."""
    if kind == "normal":
        return StandardNormal(dim)
    if kind == "student-t":
        return StudentT(dim=dim, dtype=dtype)
    if kind not in ("mixture", "t-mixture"):
        raise ValueError(f"no base template of kind {kind!r}.")
    check_int("components", components)
    k = components
    args = (np.ones(k), np.zeros((k, dim)), np.tile(np.eye(dim), (k, 1, 1)))
    if kind == "mixture":
        return GaussianMixture(*args, dtype=dtype)
    return StudentTMixture(*args, dtype=dtype)


def _kind_of(base: AbstractBase) -> str:
    return {
        StandardNormal: "normal",
        GaussianMixture: "mixture",
        StudentTMixture: "t-mixture",
        StudentT: "student-t",
    }[type(base)]


def _rows(name: str, data, d: int | None) -> np.ndarray:
    rows = np.asarray(data, np.float64)
    if rows.ndim != 2 or rows.shape[0] < 2:
        raise ValueError(
            f"`{name}` must be rows of shape (n, d) with n >= 2; got shape "
            f"{rows.shape}."
        )
    if d is not None and rows.shape[1] != d:
        raise ValueError(
            f"`{name}` has {rows.shape[1]} columns, but the training rows have {d}."
        )
    if not np.isfinite(rows).all():
        raise ValueError(f"`{name}` contains NaN or inf; remove those rows first.")
    return rows


def _fit_mixture(train, max_components, covariance, seed, *, trainable, dtype):
    """The BIC-chosen Gaussian mixture of 1 to `max_components` components (at
    most one per two rows) and a line saying so."""
    from sklearn.mixture import GaussianMixture as SklearnMixture

    best, scores = None, {}
    top = max(1, min(max_components, train.shape[0] // 2))
    for k in range(1, top + 1):
        fitted = SklearnMixture(
            k, covariance_type=covariance, n_init=3, random_state=seed
        ).fit(train)
        scores[k] = float(fitted.bic(train))
        if best is None or scores[k] < scores[best[0]]:
            best = (k, fitted)
    k, fitted = best
    line = f"BIC over 1-{top} components" if top > 1 else "one component"
    base = GaussianMixture.from_sklearn(fitted, trainable=trainable, dtype=dtype)
    return base, line


def _mean_nll(base: AbstractBase, rows) -> float:
    return -float(np.mean(np.asarray(base.log_prob(jnp.asarray(rows)), np.float64)))


def _refine(base: AbstractBase, train, val) -> AbstractBase:
    """`base` after full-batch Adam on its training NLL (every parameter, frozen or
    not): the parameters with the best validation NLL where `val` is given, else the
    last."""
    params, static = eqx.partition(base, eqx.is_inexact_array)
    x = jnp.asarray(train, jax.tree_util.tree_leaves(params)[0].dtype)
    optimizer = optax.adam(_REFINE_LR)

    def loss(p):
        # `_log_prob` skips a frozen base's stop-gradient: this is its fit.
        return -jnp.mean(eqx.combine(p, static)._log_prob(x))

    @jax.jit
    def step(p, state):
        value, grad = jax.value_and_grad(loss)(p)
        updates, state = optimizer.update(grad, state, p)
        return optax.apply_updates(p, updates), state, value

    state = optimizer.init(params)
    best_params, best = params, math.inf
    for _ in range(_REFINE_STEPS):
        params, state, _ = step(params, state)
        if val is not None:
            score = _mean_nll(eqx.combine(params, static), val)
            if math.isfinite(score) and score < best:
                best_params, best = params, score
    return eqx.combine(best_params if val is not None else params, static)


def _fit_t_mixture(gm: GaussianMixture, train, val) -> StudentTMixture:
    """Student-t components from the Gaussian mixture `gm`: the degrees of freedom
    of `_DF_GRID` with the best training NLL (every component alike), then every
    parameter refined by maximum likelihood."""
    candidates = [StudentTMixture.from_gaussian(gm, df) for df in _DF_GRID]
    start = min(candidates, key=lambda b: _mean_nll(b, train))
    return _refine(start, train, val)


def _fit_product_t(train, val, *, trainable, dtype) -> StudentT:
    """Independent Student-t coordinates from each column's median and scale, the
    degrees of freedom of `_DF_GRID` with the best training NLL, then refined."""
    loc = np.median(train, axis=0)
    scale = np.maximum(np.std(train, axis=0), 1e-12)
    candidates = [
        StudentT(loc, scale, df, trainable=trainable, dtype=dtype) for df in _DF_GRID
    ]
    start = min(candidates, key=lambda b: _mean_nll(b, train))
    return _refine(start, train, val)


def _choose(gm, tm, train, val, bic_line, info):
    """The Gaussian or the Student-t mixture, by validation NLL (by BIC on the
    training rows without validation rows), with the reason."""
    if val is not None:
        scores = {"mixture": _mean_nll(gm, val), "t-mixture": _mean_nll(tm, val)}
        how = "validation NLL"
    else:
        # BIC per row; the t-mixture has one more parameter per component.
        n = train.shape[0]
        scores = {
            "mixture": 2 * _mean_nll(gm, train),
            "t-mixture": 2 * _mean_nll(tm, train) + tm.n_components * math.log(n) / n,
        }
        how = "BIC per row"
    chosen = min(scores, key=scores.get)
    base = tm if chosen == "t-mixture" else gm
    other = "Gaussian" if chosen == "t-mixture" else "Student-t"
    reason = (
        f"{base.describe()} ({bic_line}; {how} {scores[chosen]:.4f} against "
        f"{scores['mixture' if chosen == 't-mixture' else 't-mixture']:.4f} with "
        f"{other} components)"
    )
    return base, dict(info, scores=scores, reason=reason)


__all__ = ["BASE_KINDS", "base_template", "fit_base"]
