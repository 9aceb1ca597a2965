"""B5's real tables and their classical baselines: measurement tables that installed
packages ship (scikit-learn's bundled CSVs, matplotlib's sample data; nothing is
downloaded), a CSV writer that keeps every value exactly, and the baselines a user would
fit first (a full-covariance Gaussian, a Gaussian mixture chosen by BIC, a KDE with a
cross-validated bandwidth), each returning per-row test log-densities."""

import csv
import os

import numpy as np

from experiments._common import atomic_write

GMM_COMPONENTS = range(1, 9)
KDE_BANDWIDTHS = np.logspace(-2, 0.5, 26)  # in the units of the rows given


def _sklearn_table(name: str):
    import sklearn.datasets as skd

    if name == "diabetes":
        bunch = skd.load_diabetes(scaled=False)  # diabetes_data_raw.csv.gz
    else:
        bunch = getattr(skd, f"load_{name}")()
    return np.asarray(bunch.data, np.float64), list(bunch.feature_names)


def _iris():
    return _sklearn_table("iris")


def _wine():
    return _sklearn_table("wine")


def _breast_cancer():
    return _sklearn_table("breast_cancer")


def _diabetes():
    data, names = _sklearn_table("diabetes")
    keep = [j for j, n in enumerate(names) if n != "sex"]
    return data[:, keep], [names[j] for j in keep]


def _sample_data(name: str) -> str:
    import matplotlib

    return os.path.join(matplotlib.get_data_path(), "sample_data", name)


STOCKS = ("IBM", "AAPL", "MSFT", "XRX", "ADBE", "^GSPC", "^IXIC")


def _stocks():
    with open(_sample_data("Stocks.csv"), newline="") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("#")]
    header, rows = rows[0], rows[1:]
    cols = [header.index(name) for name in STOCKS]
    prices = [[float(r[j]) for j in cols] for r in rows if all(r[j] for j in cols)]
    # The last row repeats the one before (the month's close, written twice).
    prices = np.asarray(
        [p for i, p in enumerate(prices) if i == 0 or p != prices[i - 1]]
    )
    return 100 * np.diff(np.log(prices), axis=0), [f"{n} monthly %" for n in STOCKS]


def _goog():
    with np.load(_sample_data("goog.npz")) as f:
        p = f["price_data"]
    data = np.stack(
        [
            100 * np.diff(np.log(p["adj_close"])),
            100 * np.log(p["high"] / p["low"])[1:],
            np.log10(p["volume"].astype(np.float64))[1:],
        ],
        axis=1,
    )
    return data, ["return %", "high/low range %", "log10 volume"]


def _statsmodels(name: str):
    import statsmodels.api as sm

    return getattr(sm.datasets, name).load_pandas().data


def _engel():
    frame = _statsmodels("engel")
    return frame.to_numpy(np.float64), ["income", "food expenditure"]


MACRO = ("realgdp", "realcons", "realinv", "realgovt", "realdpi", "cpi", "m1")


def _macro():
    frame = _statsmodels("macrodata")
    levels = frame[list(MACRO)].to_numpy(np.float64)
    return 100 * np.diff(np.log(levels), axis=0), [f"{n} growth %" for n in MACRO]


def _vega(name: str):
    from vega_datasets import local_data

    return getattr(local_data, name)()


CARS = ("Miles_per_Gallon", "Displacement", "Horsepower", "Weight_in_lbs")
CARS += ("Acceleration",)


def _cars():
    frame = _vega("cars")[list(CARS)].dropna()
    return frame.to_numpy(np.float64), list(CARS)


def _seattle():
    columns = ["precipitation", "temp_max", "temp_min", "wind"]
    return _vega("seattle_weather")[columns].to_numpy(np.float64), columns


def _airports():
    columns = ["latitude", "longitude"]
    return _vega("airports")[columns].to_numpy(np.float64), columns


# name -> (loader, where it comes from, what the table holds)
TABLES = {
    "iris": (_iris, "scikit-learn iris.csv", "four flower measurements (cm)"),
    "wine": (_wine, "scikit-learn wine_data.csv", "13 chemical measurements"),
    "breast_cancer": (
        _breast_cancer,
        "scikit-learn breast_cancer.csv",
        "30 features of cell nuclei images",
    ),
    "diabetes": (
        _diabetes,
        "scikit-learn diabetes_data_raw.csv.gz",
        "age, BMI, blood pressure, six serum measurements (the binary sex column "
        "left out: a continuous density on two values has no finite optimum)",
    ),
    "stocks": (
        _stocks,
        "matplotlib sample_data/Stocks.csv",
        "monthly log returns (%) 1990-2022 of the seven series quoted throughout "
        "(IBM, AAPL, MSFT, XRX, ADBE, S&P 500, Nasdaq); prices are a trending "
        "series, not draws from one density",
    ),
    "goog": (
        _goog,
        "matplotlib sample_data/goog.npz",
        "Google's daily log return (%), intraday high/low range (%) and log10 "
        "volume, 2004-2008",
    ),
    # Added for issue 42 (the bench extra installs statsmodels and vega_datasets).
    "engel": (
        _engel,
        "statsmodels datasets.engel",
        "Belgian households' income and food expenditure, 1857 (heavy right tails)",
    ),
    "macro": (
        _macro,
        "statsmodels datasets.macrodata",
        "US quarterly growth (%) of real GDP, consumption, investment, government "
        "spending, disposable income, CPI and M1, 1959-2009",
    ),
    "cars": (
        _cars,
        "vega_datasets cars.json",
        "mpg, displacement, horsepower, weight and acceleration of 392 cars (rows "
        "with a missing value left out)",
    ),
    "seattle": (
        _seattle,
        "vega_datasets seattle-weather.csv",
        "Seattle's daily precipitation (zero on most days), maximum and minimum "
        "temperature and wind, 2012-2015",
    ),
    "airports": (
        _airports,
        "vega_datasets airports.csv",
        "latitude and longitude of 3,376 US airports (clustered by geography)",
    ),
}


def write_csv(path: str, data: np.ndarray, names) -> None:
    """The table as a CSV under a header, every value written exactly (17 digits)."""
    lines = [",".join(n.replace(",", ";") for n in names)]
    lines += [",".join(f"{v:.17g}" for v in row) for row in data]
    atomic_write(path, ("\n".join(lines) + "\n").encode())


def summary(logp: np.ndarray) -> dict:
    """The mean NLL of per-row log-densities and its standard error."""
    nll = -np.asarray(logp, np.float64)
    return {
        "nll": float(nll.mean()),
        "stderr": float(nll.std(ddof=1) / len(nll) ** 0.5),
    }


def gaussian_log_prob(train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per-row log-densities of `test` under the full-covariance Gaussian fitted to
    `train` by maximum likelihood, with 1e-6 added to the covariance's diagonal (as
    `cnftrace.datasets.gaussian_baseline_nll` does), in float64."""
    mean = train.mean(axis=0)
    cov = np.cov(train, rowvar=False, bias=True).reshape(train.shape[1], -1)
    chol = np.linalg.cholesky(cov + 1e-6 * np.eye(train.shape[1]))
    z = np.linalg.solve(chol, (test - mean).T).T
    log_det = 2 * np.sum(np.log(np.diag(chol)))
    return (
        -0.5 * np.sum(z**2, axis=1)
        - 0.5 * log_det
        - 0.5 * z.shape[1] * np.log(2 * np.pi)
    )


def gmm_bic(train: np.ndarray, test: np.ndarray, seed: int = 0) -> dict:
    """A full-covariance Gaussian mixture of 1-8 components (at most one per two
    training rows), the count chosen by BIC on `train`; per-row log-densities of
    `test` (in the units of the rows given)."""
    from sklearn.mixture import GaussianMixture

    fits = {}
    for k in GMM_COMPONENTS:
        if k > train.shape[0] // 2:
            break
        gmm = GaussianMixture(k, covariance_type="full", n_init=3, random_state=seed)
        fits[k] = gmm.fit(train)
    bic = {k: float(g.bic(train)) for k, g in fits.items()}
    k = min(bic, key=bic.get)
    return {"components": k, "bic": bic, "test_logp": fits[k].score_samples(test)}


def kde_cv(train: np.ndarray, test: np.ndarray, seed: int = 0) -> dict:
    """A Gaussian-kernel density estimate of `train`, its bandwidth (of
    `KDE_BANDWIDTHS`) chosen by 5-fold cross-validated log-likelihood on `train`;
    per-row log-densities of `test`. `at_edge` says the choice is the grid's end."""
    from sklearn.model_selection import GridSearchCV, KFold
    from sklearn.neighbors import KernelDensity

    search = GridSearchCV(
        KernelDensity(kernel="gaussian"),
        {"bandwidth": KDE_BANDWIDTHS},
        cv=KFold(5, shuffle=True, random_state=seed),
    ).fit(train)
    h = float(search.best_params_["bandwidth"])
    edge = h in (KDE_BANDWIDTHS[0], KDE_BANDWIDTHS[-1])
    kde = search.best_estimator_
    return {"bandwidth": h, "at_edge": edge, "test_logp": kde.score_samples(test)}
