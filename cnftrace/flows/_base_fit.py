"""`fit_base`: a base distribution fitted to training rows by EM (scikit-learn's
with BIC; Peel and McLachlan 2000 for Student-t tails), in float64 NumPy."""

import math

import jax.numpy as jnp
import numpy as np

from .._checks import check_int
from ._distributions import AbstractBase, StandardNormal
from ._mixtures import GaussianMixture, StudentT, StudentTMixture

# SciPy's special functions and root finder are imported in the functions that use
# them: a process that imports cnftrace without fitting a Student-t base (every
# command's start) then does not load them.

BASE_KINDS = ("auto", "normal", "mixture", "t-mixture", "student-t")
# The degrees of freedom EM starts from (the best of these).
_DF_GRID = (1.5, 2.0, 3.0, 5.0, 8.0, 15.0, 30.0, 100.0)
_DF_RANGE = (0.05, 1000.0)  # EM's degrees of freedom stay inside
_EM_STEPS = 200
_EM_TOL = 1e-8  # stop when the mean log-likelihood gains less per step
_REG = 1e-6  # added to each scale matrix's diagonal, as scikit-learn's `reg_covar`


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
    field starts at zero (`mlp_flow(..., base=base)`).

    **Arguments:**

    - `data`: the training rows, shape `(n, d)`, finite.
    - `validation`: held-out rows `(m, d)` for `kind="auto"`'s choice (without
        them, BIC on `data`).
    - `kind`: `"mixture"` (a Gaussian mixture, components chosen by BIC),
        `"t-mixture"` (that mixture with Student-t components, refitted by EM),
        `"student-t"` (a product of Student-t coordinates), `"normal"`, or
        `"auto"` (default: the mixture or the t-mixture, by validation NLL).
    - `max_components`, `covariance` (`"full"` or `"diag"`): the mixture's.
    - `max_rows`: fit on a seeded random subset of at most this many rows.
    - `seed`: the seed of the subset and of EM's starts.
    - `trainable`: whether the returned base is trained with the flow.
    - `dtype`: the parameters' dtype (JAX's default float if omitted).
    - `return_info`: also return a dict (`reason`, `kind`, `components`,
        `scores`).

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
        base = _fit_product_t(train, **settings)
        info["reason"] = base.describe()
    else:
        fitted, bic_line = _fit_mixture(train, max_components, covariance, seed)
        gm = GaussianMixture.from_sklearn(fitted, **settings)
        info["components"] = gm.n_components
        base = gm
        info["reason"] = f"{gm.describe()} ({bic_line})"
        if kind != "mixture":
            params = _fit_t_mixture(fitted, train)
            tm = StudentTMixture(*params, covariance=covariance, **settings)
            if kind == "t-mixture":
                base = tm
                info["reason"] = f"{tm.describe()} ({bic_line})"
            else:
                scores = _scores(fitted, params, train, val)
                base, info = _choose(gm, tm, scores, val is not None, bic_line, info)
    info["kind"] = _kind_of(base)
    return (base, info) if return_info else base


def base_template(
    kind: str, dim: int, components: int | None = None, *, dtype=None
) -> AbstractBase:
    """A base of `kind` (not `"auto"`) with placeholder values, to load fitted
    parameters into."""
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


def _fit_mixture(train, max_components, covariance, seed):
    """scikit-learn's Gaussian mixture of 1 to `max_components` components (at most
    one per two rows) with the least BIC, and a line saying so."""
    from sklearn.mixture import GaussianMixture as SklearnMixture
    from threadpoolctl import threadpool_limits

    best, scores = None, {}
    top = max(1, min(max_components, train.shape[0] // 2))
    # One BLAS thread: spinning BLAS threads are far slower on busy cores.
    with threadpool_limits(1):
        for k in range(1, top + 1):
            fitted = SklearnMixture(
                k, covariance_type=covariance, n_init=3, random_state=seed
            ).fit(train)
            scores[k] = float(fitted.bic(train))
            if best is None or scores[k] < scores[best[0]]:
                best = (k, fitted)
    line = f"BIC over 1-{max(scores)} components" if top > 1 else "one component"
    return best[1], line


def _t_mixture_nll(rows, params) -> float:
    """The mean NLL of `rows` under a Student-t mixture `(weights, means, scale
    matrices or variances, df)`, in float64 NumPy."""
    from scipy import special

    weights, means, covs, df = params
    if covs.ndim == 2:  # variances
        covs = np.stack([np.diag(c) for c in covs])
    logp, _ = _t_log_density(rows, means, np.linalg.cholesky(covs), df)
    return -float(np.mean(special.logsumexp(logp + np.log(weights), axis=1)))


def _scores(fitted, params, train, val) -> dict[str, float]:
    """Each candidate's mean validation NLL (without validation rows, its BIC per
    training row, halved: the t-mixture has one more parameter per component)."""
    if val is not None:
        return {
            "mixture": -float(np.mean(fitted.score_samples(val))),
            "t-mixture": _t_mixture_nll(val, params),
        }
    n = train.shape[0]
    return {
        "mixture": -float(np.mean(fitted.score_samples(train))),
        "t-mixture": _t_mixture_nll(train, params)
        + 0.5 * len(params[0]) * math.log(n) / n,
    }


def _t_log_density(x, means, chols, df):
    """`(log densities (n, k) of each Student-t component, squared Mahalanobis
    distances (n, k))` in float64 NumPy."""
    from scipy import special

    n, d = x.shape
    k = means.shape[0]
    r2 = np.empty((n, k))
    log_det = np.empty(k)
    for j in range(k):
        white = np.linalg.solve(chols[j], (x - means[j]).T)  # triangular: small d
        r2[:, j] = np.sum(white**2, axis=0)
        log_det[j] = np.sum(np.log(np.diag(chols[j])))
    logp = (
        special.gammaln(0.5 * (df + d))
        - special.gammaln(0.5 * df)
        - 0.5 * d * np.log(df * math.pi)
        - log_det
        - 0.5 * (df + d) * np.log1p(r2 / df)
    )
    return logp, r2


def _t_mixture_em(x, weights, means, covs, df, diagonal: bool = False):
    """`(weights, means, scale matrices, df)` of a Student-t mixture fitted by EM
    (with ECM for `df`) from the given parameters."""
    from scipy import optimize, special

    n, d = x.shape
    weights, means, covs = weights.copy(), means.copy(), covs.copy()
    df = np.asarray(df, np.float64).copy()
    last = -math.inf
    for _ in range(_EM_STEPS):
        chols = np.linalg.cholesky(covs)
        logp, r2 = _t_log_density(x, means, chols, df)
        joint = logp + np.log(weights)
        total = special.logsumexp(joint, axis=1)
        mean_ll = float(np.mean(total))
        if mean_ll - last < _EM_TOL:
            break
        last = mean_ll
        tau = np.exp(joint - total[:, None])  # responsibilities (n, k)
        u = (df + d) / (df + r2)  # each point's weight in its component's scale
        n_k = np.maximum(tau.sum(axis=0), 1e-12)
        weights = n_k / n
        for j in range(means.shape[0]):
            tu = tau[:, j] * u[:, j]
            means[j] = tu @ x / max(tu.sum(), 1e-300)
            diff = x - means[j]
            covs[j] = (diff * tu[:, None]).T @ diff / n_k[j] + _REG * np.eye(d)
            if diagonal:
                covs[j] = np.diag(np.diag(covs[j]))
            # ECM: the degrees of freedom solve the score equation given u.
            c = 1 + np.sum(tau[:, j] * (np.log(u[:, j]) - u[:, j])) / n_k[j]
            c += special.digamma(0.5 * (df[j] + d)) - np.log(0.5 * (df[j] + d))

            def score(v, c=c):
                return -special.digamma(0.5 * v) + np.log(0.5 * v) + c

            low, high = _DF_RANGE
            if score(high) > 0:  # no root in range: as Gaussian as allowed
                df[j] = high
            elif score(low) < 0:
                df[j] = low
            else:
                df[j] = optimize.brentq(score, low, high, xtol=1e-6)
    return weights, means, covs, df


def _fit_t_mixture(fitted, train):
    """`(weights, means, scale matrices, df)` of a Student-t mixture fitted by EM
    from the Gaussian mixture `fitted` (variances for a diagonal one)."""
    diagonal = fitted.covariance_type == "diag"
    weights = np.asarray(fitted.weights_, np.float64)
    means = np.asarray(fitted.means_, np.float64)
    covs = np.asarray(fitted.covariances_, np.float64)
    if diagonal:
        covs = np.stack([np.diag(c) for c in covs])
    nll = [
        _t_mixture_nll(train, (weights, means, covs, np.full(len(weights), df)))
        for df in _DF_GRID
    ]
    start = np.full(len(weights), _DF_GRID[int(np.argmin(nll))])
    weights, means, covs, df = _t_mixture_em(
        train, weights, means, covs, start, diagonal
    )
    if diagonal:
        covs = np.stack([np.diag(c) for c in covs])
    return weights, means, covs, df


def _fit_product_t(train, *, trainable, dtype) -> StudentT:
    """Independent Student-t coordinates, each fitted by the same EM."""
    d = train.shape[1]
    loc, scale, df = np.empty(d), np.empty(d), np.empty(d)
    for j in range(d):
        column = train[:, j : j + 1]
        var = np.maximum(column.var(), 1e-12)
        start = [np.ones(1), column.mean(0, keepdims=True), np.full((1, 1, 1), var)]
        best = max(
            _DF_GRID,
            key=lambda v, s=start: np.mean(
                _t_log_density(column, s[1], np.sqrt(s[2]), np.full(1, v))[0]
            ),
        )
        _, mean, cov, nu = _t_mixture_em(column, *start, np.full(1, best))
        loc[j], scale[j], df[j] = mean[0, 0], math.sqrt(cov[0, 0, 0]), nu[0]
    return StudentT(loc, scale, df, trainable=trainable, dtype=dtype)


def _choose(gm, tm, scores, validated: bool, bic_line, info):
    """The Gaussian or the Student-t mixture, by `scores`, with the reason."""
    how = "validation NLL" if validated else "BIC per row"
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
