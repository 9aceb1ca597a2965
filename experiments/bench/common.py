"""The benchmark protocol of `shared/BENCHMARK.md`, in one place for every system.

B1 (toy training step): FFJORD's 8gaussians, 512 fresh samples per iteration, one CNF
block with a ConcatSquash-style MLP 2 -> 64 -> 64 -> 64 -> 2 (tanh), time span
[0, 0.5], an adaptive 5th-order Runge--Kutta solver at rtol = atol = 1e-5, Adam at
lr 1e-3, float32. Wall seconds per iteration averaged over iterations 21..120; the
first step (compile) timed on its own.

B2 (time to quality): same model and data, the exact-trace test NLL on 5,000 held-out
samples every 15 s of training time (evaluation time not counted), against the data's
true entropy.
"""

import math
import os

B1_BATCH = 512
B1_ITERS = 120
B1_WINDOW = (21, 120)  # 1-based, inclusive: the iterations that are averaged
B1_WIDTH = 64
B1_DEPTH = 3
B1_T1 = 0.5
B1_TOL = 1e-5
B1_LR = 1e-3

B2_EVAL_EVERY_S = 15.0
B2_TEST_SIZE = 5000
B2_TEST_SEED = 2024
B2_GAPS = (0.15, 0.05)
# BENCHMARK.md's floors: 8 well-separated Gaussians (sigma = 0.5 / 1.414), and the
# checkerboard's uniform density on an area of 32.
B2_FLOOR = {
    "8gaussians": math.log(8) + math.log(2 * math.pi * math.e * (0.5 / 1.414) ** 2),
    "checkerboard": math.log(32),
}


def window_values(values: list[float]) -> list[float]:
    """B1's window of a per-iteration series: iterations 21..120 (1-based), or, for a
    shorter run (a smoke test), iterations min(21, len) to the end."""
    if not values:
        raise ValueError("no iterations to average.")
    lo, hi = B1_WINDOW
    lo = min(lo, len(values))
    return values[lo - 1 : hi]


def window_avg(values: list[float]) -> float:
    """The mean of `window_values(values)`."""
    sel = window_values(values)
    return sum(sel) / len(sel)


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class QualityCurve:
    """B2's bookkeeping, the same for every system: when to evaluate (every
    `eval_every_s` seconds of training time), the curve of test NLLs, the training
    time of the first evaluation within each of `B2_GAPS` of the floor, the best gap,
    and whether to stop (the smallest gap reached)."""

    def __init__(self, dataset: str, eval_every_s: float):
        if dataset not in B2_FLOOR:
            raise ValueError(f"dataset must be one of {sorted(B2_FLOOR)}.")
        self.floor = B2_FLOOR[dataset]
        self.eval_every_s = eval_every_s
        self.next_eval = eval_every_s
        self.curve: list[tuple[float, float]] = []
        self.time_to_gap: dict[float, float | None] = dict.fromkeys(
            sorted(B2_GAPS, reverse=True)
        )
        self.best_gap = math.inf

    def due(self, train_s: float, budget_s: float) -> bool:
        return train_s >= self.next_eval or train_s >= budget_s

    def record(self, train_s: float, nll: float) -> bool:
        """Adds an evaluation; returns whether the smallest gap has been reached."""
        self.curve.append((train_s, nll))
        gap = nll - self.floor
        self.best_gap = min(self.best_gap, gap)
        for g, seconds in self.time_to_gap.items():
            if seconds is None and gap <= g:
                self.time_to_gap[g] = train_s
        while self.next_eval <= train_s:
            self.next_eval += self.eval_every_s
        return gap <= min(B2_GAPS)

    def result(self) -> dict:
        return {
            "curve": self.curve,
            "time_to_gap": self.time_to_gap,
            "best_gap": self.best_gap,
            "floor": self.floor,
        }
