"""The zuko peer for B1, B2, B4 and B5 (see `experiments/README.md`).

zuko 1.6's `zuko.flows.CNF` is configured as close to our protocol as its constructor
allows: an MLP with hidden features (64, 64, 64) and tanh, atol = rtol = 1e-5, float32,
Adam at lr 1e-3, one CNF block over a standard normal base, exact trace or Hutchinson.
What cannot be matched without patching zuko (and zuko's numerics are not patched here):

- Time span: zuko integrates over [0, 1] (a `times` buffer, not a constructor option),
  not [0, 0.5].
- Vector field: a plain MLP on the concatenation [x, cos(k pi t), sin(k pi t)], k = 1..3
  (a sinusoidal time embedding, input width 2 + 6 = 8), instead of FFJORD's
  ConcatSquash layers, where t gates and shifts every hidden layer.
- Solver: zuko's own Dormand--Prince 5(4) loop in Python. Every attempted step costs 7
  evaluations (no first-same-as-last reuse), rejected ones included; the error norm is
  the max over the whole batch of |err| / (atol + rtol max(|x|, |y|)); the first trial
  step is the whole span; the step factor is 0.9 err^(-1/5) clipped to [0.1, 10]. The
  log-determinant is carried in the state scaled by 1e-2, which loosens its tolerance
  a hundredfold relative to the state's.
- Divergence: the exact trace via a batched VJP against the identity, or Hutchinson
  with one *Gaussian* probe per sample (`torch.randn_like`), drawn once per solve; the
  protocol's Rademacher probe is not offered.
- Gradients: zuko's "adaptive checkpoint adjoint". The forward solve stores its
  accepted states; the backward pass takes one Dopri5 step (6 evaluations, no error
  control) of the augmented adjoint system per stored step, backwards on the forward
  step grid and restarting the state from the stored checkpoint each step. Each
  backward evaluation is a network call plus a VJP through the network and the
  divergence (second-order autodiff).

NFE counts are calls of zuko's vector-field MLP, read off a forward hook: `nfe_fwd`
during the loss (the forward solve), `nfe_bwd` inside `loss.backward()`.

The data sampler (`cnftrace.datasets.toy_sample`, a jitted JAX function) is warmed up
once before the clock starts, so `first_step_s` is torch/zuko's own first-call cost;
drawing each batch is still inside every timed iteration.

Threads: torch gets one intra-op thread per core by default (`threads=None`). At these
sizes (batch 512, width 64) a second thread buys little, and when another process
competes for the cores torch's thread pool slows down several-fold; pass `threads=1`
to see that effect (the result records the count used).

Device: the CPU by default; `device="cuda"` (B1 and B4/B5's constructed densities, for
the GPU run `experiments/bench/gpu.py`) moves the model and each batch there and waits
for the device (`torch.cuda.synchronize`) before each step's clock stops.

B2 evaluates the test set in chunks of `eval_batch` under `torch.no_grad()`, with an
exact-trace copy of the model that is loaded with the trained weights at each
evaluation. zuko's error norm is a max over the chunk, so the chunk size changes the
evaluation's step count slightly (not its tolerance).
"""

import copy
import itertools
import math
import time

import jax
import numpy as np
import torch
import zuko

from cnftrace.datasets import toy_log_prob, toy_sample
from experiments import _common

SOLVER = (
    "zuko odeint: adaptive Dormand-Prince 5(4), 7 evals per attempted step, max-norm "
    "error control, atol = rtol = 1e-5, span [0, 1]; adaptive checkpoint adjoint"
)
NOTES = (
    "zuko.flows.CNF, MLP (2 + 6 time-embedding) -> 64 -> 64 -> 64 -> 2, tanh; "
    "time span [0, 1] (not 0.5); sinusoidal time embedding, not ConcatSquash; "
    "Hutchinson uses a Gaussian probe; log-det integrated at 1e-2 scale."
)


def _setup_torch(seed: int, threads: int | None) -> int:
    """Seed torch and set its intra-op threads (default: one per available core)."""
    threads = _common.cores() if threads is None else threads
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return threads


def _make_flow(exact: bool) -> zuko.flows.CNF:
    return zuko.flows.CNF(
        features=2,
        hidden_features=(_common.B1_WIDTH,) * _common.B1_DEPTH,
        activation=torch.nn.Tanh,
        atol=_common.B1_TOL,
        rtol=_common.B1_TOL,
        exact=exact,
    )


class _CallCounter:
    """Counts calls of a module through a forward hook (one int increment a call)."""

    def __init__(self, module: torch.nn.Module):
        self.n = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.n += 1

    def remove(self) -> None:
        self._handle.remove()


def _batch(dataset: str, key, n: int, device: str = "cpu") -> torch.Tensor:
    # np.array copies JAX's read-only buffer into a writable float32 array.
    x = np.array(toy_sample(dataset, key, n, dtype=np.float32), dtype=np.float32)
    return torch.from_numpy(x).to(device)


def _sync(device: str) -> None:
    """Waits for the work queued on `device` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(flow, opt, x, counter) -> tuple[float, int, int]:
    """One Adam step on the mean NLL of `x`; returns (loss, nfe_fwd, nfe_bwd)."""
    n0 = counter.n
    loss = -flow().log_prob(x).mean()
    n1 = counter.n
    opt.zero_grad()
    loss.backward()
    n2 = counter.n
    opt.step()
    return loss.item(), n1 - n0, n2 - n1


def zuko_b1(
    exact: bool,
    iters: int = 120,
    batch: int = 512,
    seed: int = 0,
    threads: int | None = None,
    device: str = "cpu",
    max_seconds: float | None = None,
) -> dict:
    """B1: wall seconds per training iteration of zuko's CNF (data + forward +
    backward + Adam update), with NFE per iteration averaged over B1's window.
    `threads` is torch's intra-op thread count, by default one per core. With
    `max_seconds`, it stops after the iteration that passes that many seconds
    (`iters_done` says where; the window is then cut short as for a short run)."""
    if iters < 1:
        raise ValueError(f"iters must be positive; got {iters}.")
    threads = _setup_torch(seed, threads)
    flow = _make_flow(exact).to(device)
    opt = torch.optim.Adam(flow.parameters(), lr=_common.B1_LR)
    counter = _CallCounter(flow.transform.ode)
    key = jax.random.key(seed)
    _batch("8gaussians", jax.random.fold_in(key, 2**31 - 1), batch)  # warm the sampler

    times, nfe_fwd, nfe_bwd = [], [], []
    try:
        for i in range(iters):
            t0 = time.perf_counter()
            x = _batch("8gaussians", jax.random.fold_in(key, i), batch, device)
            _, nf, nb = _train_step(flow, opt, x, counter)
            _sync(device)
            times.append(time.perf_counter() - t0)
            nfe_fwd.append(nf)
            nfe_bwd.append(nb)
            if max_seconds is not None and sum(times) >= max_seconds:
                break
    finally:
        counter.remove()

    s_per_iter = _common.window_avg(times)
    return {
        "system": f"zuko {zuko.__version__}",
        "estimator": "exact" if exact else "hutchinson (gaussian probe)",
        "solver": SOLVER,
        "notes": NOTES,
        "s_per_iter": s_per_iter,
        "first_step_s": times[0],
        "nfe_fwd": float(_common.window_avg(nfe_fwd)),
        "nfe_bwd": float(_common.window_avg(nfe_bwd)),
        "iter_times": times,
        "iters_done": len(times),
        "threads": threads,
        "device": device,
    }


def _test_nll(eval_flow, x_test: torch.Tensor, eval_batch: int) -> float:
    """Exact-trace mean NLL of `x_test`, in chunks, without parameter gradients."""
    total = 0.0
    with torch.no_grad():
        for lo in range(0, x_test.shape[0], eval_batch):
            chunk = x_test[lo : lo + eval_batch]
            total += -eval_flow().log_prob(chunk).sum().item()
    return total / x_test.shape[0]


def zuko_b2(
    dataset: str,
    budget_s: float,
    eval_every_s: float = 15.0,
    test_size: int = 5000,
    batch: int = 512,
    seed: int = 0,
    lr: float = 1e-3,
    eval_batch: int = 1000,
    threads: int | None = None,
) -> dict:
    """B2: train zuko's CNF with Hutchinson and record the exact-trace test NLL every
    `eval_every_s` seconds of training time (evaluation not on the clock), until
    `budget_s` training seconds or a gap to the floor of at most 0.05 nats.

    Besides the curve, `time_to_gap` (training seconds at the first evaluation within
    each gap, or None), `best_gap` and `steps`, it returns the `floor` and the test
    set's own mean NLL under the true density (`test_true_nll`)."""
    tracker = _common.QualityCurve(dataset, eval_every_s)
    threads = _setup_torch(seed, threads)
    flow = _make_flow(exact=False)
    eval_flow = _make_flow(exact=True).eval()  # takes `flow`'s weights at each eval
    opt = torch.optim.Adam(flow.parameters(), lr=lr)
    counter = _CallCounter(flow.transform.ode)

    test_key = jax.random.key(_common.B2_TEST_SEED)
    x_test_np = np.array(
        toy_sample(dataset, test_key, test_size, dtype=np.float32), dtype=np.float32
    )
    x_test = torch.from_numpy(x_test_np)
    true_nll = -float(np.mean(np.asarray(toy_log_prob(dataset, x_test_np))))
    key = jax.random.key(seed)
    _batch(dataset, jax.random.fold_in(key, 2**31 - 1), batch)  # warm the sampler

    train_s = 0.0
    steps = 0
    try:
        while train_s < budget_s:
            t0 = time.perf_counter()
            x = _batch(dataset, jax.random.fold_in(key, steps), batch)
            _train_step(flow, opt, x, counter)
            train_s += time.perf_counter() - t0
            steps += 1
            if tracker.due(train_s, budget_s):
                eval_flow.load_state_dict(flow.state_dict())
                if tracker.record(train_s, _test_nll(eval_flow, x_test, eval_batch)):
                    break
    finally:
        counter.remove()

    return {
        "system": f"zuko {zuko.__version__}",
        "dataset": dataset,
        "solver": SOLVER,
        "notes": NOTES + " Trained with Hutchinson; test NLL with the exact trace.",
        **tracker.result(),
        "steps": steps,
        "test_true_nll": true_nll,
        "threads": threads,
    }


def _b4_flow(dim: int) -> zuko.flows.CNF:
    """B4's zuko model: hidden (64, 64, 64), tanh, span [0, 0.5], exact trace, zuko's
    own tolerances."""
    flow = zuko.flows.CNF(
        features=dim, hidden_features=(64, 64, 64), activation=torch.nn.Tanh
    )
    flow.transform.times = torch.tensor((0.0, 0.5))
    return flow


def _nsf(dim: int) -> zuko.flows.NSF:
    """The discrete flow of B4 and B5, what a user of zuko would pick first: neural
    spline flow, 5 transforms, hidden (64, 64), 8 bins."""
    return zuko.flows.NSF(dim, transforms=5, hidden_features=(64, 64), bins=8)


MODELS = {"cnf": _b4_flow, "nsf": _nsf}
MODEL_NOTES = {
    "cnf": "zuko.flows.CNF, hidden (64, 64, 64), tanh, span [0, 0.5], exact trace, "
    "atol 1e-6, rtol 1e-5",
    "nsf": "zuko.flows.NSF(d, transforms=5, hidden_features=(64, 64), bins=8)",
}


def _log_prob_chunks(flow, x: torch.Tensor, chunk: int = 2000) -> np.ndarray:
    out = []
    with torch.no_grad():
        for lo in range(0, x.shape[0], chunk):
            out.append(flow().log_prob(x[lo : lo + chunk]).double().cpu().numpy())
    return np.concatenate(out)


def zuko_b4(
    sample,
    dim: int,
    steps: int | None,
    batch: int,
    test: np.ndarray,
    eval_at_s: tuple[float, ...] = (),
    seed: int = 0,
    lr: float = 1e-3,
    threads: int | None = None,
    max_train_s: float | None = None,
    model: str = "cnf",
    device: str = "cpu",
    final_test: np.ndarray | None = None,
) -> dict:
    """B4 and B5: train zuko's CNF (or, with `model="nsf"`, its NSF) for `steps` steps
    of `batch` samples from `sample(key, n)` (a JAX sampler, the same as cnftrace's),
    with the exact per-sample log-densities of `test` at each training second in
    `eval_at_s` and at the end (evaluations off the clock). Each evaluation is made
    after the first step that reaches its second: `at_s` holds (second asked for,
    steps done, log-densities) and `at_train_s` the training seconds then spent.
    With `max_train_s`, training stops once that many seconds are spent
    (`steps_done` says where); `steps=None` trains until then. `final_test`: more
    points scored at the end only (`final_test_logp`; B5's test set, where `test`
    draws its curve). `device`: where zuko trains and evaluates."""
    if steps is None and max_train_s is None:
        raise ValueError("give `steps`, `max_train_s` or both.")
    threads = _setup_torch(seed, threads)
    flow = MODELS[model](dim).to(device)
    opt = torch.optim.Adam(flow.parameters(), lr=lr)
    x_test = torch.from_numpy(np.array(test, dtype=np.float32)).to(device)
    key = jax.random.fold_in(jax.random.key(seed), 1)
    np.asarray(sample(key, batch))  # the sampler's compile, not on the clock
    pending = sorted(eval_at_s)
    at_s, at_train_s = [], []
    train_s = 0.0
    for i in itertools.count() if steps is None else range(steps):
        t0 = time.perf_counter()
        x = np.array(sample(jax.random.fold_in(key, i), batch), dtype=np.float32)
        x = torch.from_numpy(x).to(device)
        loss = -flow().log_prob(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _sync(device)
        train_s += time.perf_counter() - t0
        while pending and train_s >= pending[0]:
            at_s.append((pending.pop(0), i + 1, _log_prob_chunks(flow, x_test)))
            at_train_s.append(train_s)
        if max_train_s is not None and train_s >= max_train_s:
            break
    final_test_logp = None
    if final_test is not None:
        x_final = torch.from_numpy(np.array(final_test, dtype=np.float32)).to(device)
        final_test_logp = _log_prob_chunks(flow, x_final)
    return {
        "system": f"zuko {zuko.__version__}",
        "model": MODEL_NOTES[model],
        "steps_done": i + 1,
        "train_s": train_s,
        "final_logp": _log_prob_chunks(flow, x_test),
        "final_test_logp": final_test_logp,
        "at_s": at_s,
        "at_train_s": at_train_s,
        "threads": threads,
        "device": device,
    }


def zuko_table_nsf(
    train: np.ndarray,
    val: np.ndarray,
    test: np.ndarray,
    budget_s: float,
    batch: int = 512,
    seed: int = 0,
    lr: float = 1e-3,
    val_every: int = 100,
    patience: int = 10,
    threads: int | None = None,
) -> dict:
    """B5's real files: zuko's NSF trained on the rows of `train` (min(`batch`, rows)
    drawn without replacement each step, Adam at `lr`) for `budget_s` training
    seconds, validated on `val` every `val_every` steps and at the end (off the
    clock), stopping early after `patience` validations without improvement; the
    parameters with the best validation NLL are scored. Returns the per-row
    log-densities of `test` (float64, in the units of the rows given), the steps and
    seconds spent and the best validation step and NLL."""
    threads = _setup_torch(seed, threads)
    rng = np.random.default_rng(seed)
    flow = _nsf(train.shape[1])
    opt = torch.optim.Adam(flow.parameters(), lr=lr)
    x_train = torch.from_numpy(np.asarray(train, np.float32))
    x_val = torch.from_numpy(np.asarray(val, np.float32))
    n, size = x_train.shape[0], min(batch, x_train.shape[0])
    best = (math.inf, 0, copy.deepcopy(flow.state_dict()))
    train_s, step, waited = 0.0, 0, 0
    while train_s < budget_s and waited < patience:
        t0 = time.perf_counter()
        x = x_train[torch.from_numpy(rng.choice(n, size=size, replace=False))]
        loss = -flow().log_prob(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_s += time.perf_counter() - t0
        step += 1
        if step % val_every == 0 or train_s >= budget_s:
            nll = float(-_log_prob_chunks(flow, x_val).mean())
            if nll < best[0]:  # NaN never is
                best, waited = (nll, step, copy.deepcopy(flow.state_dict())), 0
            else:
                waited += 1
    flow.load_state_dict(best[2])
    x_test = torch.from_numpy(np.asarray(test, np.float32))
    return {
        "system": f"zuko {zuko.__version__}",
        "model": MODEL_NOTES["nsf"],
        "steps_done": step,
        "train_s": train_s,
        "best_step": best[1],
        "best_val_nll": best[0],
        "test_logp": _log_prob_chunks(flow, x_test),
        "threads": threads,
    }


if __name__ == "__main__":
    for exact in (True, False):
        r = zuko_b1(exact, iters=25)
        print(
            f"{r['system']} {r['estimator']}: {r['s_per_iter']:.3f} s/iter, first "
            f"{r['first_step_s']:.3f} s, NFE fwd {r['nfe_fwd']:.1f} "
            f"bwd {r['nfe_bwd']:.1f}"
        )
    r = zuko_b2("8gaussians", budget_s=10.0, eval_every_s=5.0, test_size=1000)
    print(r["curve"], r["time_to_gap"], f"best gap {r['best_gap']:.3f}")
