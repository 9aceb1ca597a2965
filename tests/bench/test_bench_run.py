"""The one-command benchmark suite (experiments/bench/run.py) on tiny settings: it
writes a report with the targets table, B1's rows and the compute floor, atomically."""

import json
import os

import pytest

from experiments.bench import run


@pytest.mark.slow  # compiles B1's training step twice
def test_quick_b1_report(tmp_path, capsys):
    out = os.path.join(tmp_path, "docs", "benchmarks.md")
    assert run.main(["--quick", "--only", "b1", "--out", out]) == 0
    with open(out) as f:
        report = f.read()
    assert "## Targets" in report and "## B1" in report and "Compute floor" in report
    assert "B1 hutchinson s/iter ≤ 0.035" in report
    assert "| hutchinson | cnftrace" in report and "| exact | cnftrace" in report
    # TFP's row, or the line saying how to install it.
    assert "| TFP / cnftrace |" in report
    assert "| hutchinson | TFP (JAX) " in report or "TFP (JAX) peer not run" in report
    raw = json.load(open(os.path.splitext(out)[0] + ".json"))
    for est in ("hutchinson", "exact"):
        ours = raw["b1"][est]["cnftrace"]
        assert ours["s_per_iter"] > 0 and ours["first_step_s"] > 0
        # Tsit5: 6 evaluations a step, the first evaluation, the heuristic's one.
        assert (ours["nfe_fwd"] - 2) % 6 == 0
        assert ours["nfe_bwd"] == ours["nfe_fwd"] - 1
        assert ours["floor_s"] > 0
    assert sorted(os.listdir(os.path.dirname(out))) == [
        "benchmarks.json",
        "benchmarks.md",
    ]  # no temporary files left behind
    assert "wrote" in capsys.readouterr().out


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit):
        run.main(["--only", "b5"])
    with pytest.raises(SystemExit):
        run.main(["--only", "b1", "--repeats", "0"])


def _fake_b1(system: str, s_per_iter: float) -> dict:
    return {
        "system": system,
        "s_per_iter": s_per_iter,
        "first_step_s": 10 * s_per_iter,
        "nfe_fwd": 26.0,
        "nfe_bwd": 25.0,
    }


def test_b1_markdown_lists_each_run_and_the_medians():
    """With the systems alternated twice, B1's table gives each system's medians and
    both ratios, then every run in order; a peer that is not installed says so."""
    rounds = [
        {
            "cnftrace": _fake_b1("cnftrace 0", a),
            "zuko": None,
            "tfp": _fake_b1("TFP (JAX) 0", b),
        }
        for a, b in ((0.1, 0.2), (0.3, 0.4))
    ]
    entry = {n: run._median_run([r[n] for r in rounds]) for n in run.B1_SYSTEMS}
    assert entry["cnftrace"]["s_per_iter"] == pytest.approx(0.2)
    assert entry["cnftrace"]["repeats"] == 2 and entry["zuko"] is None
    entry["cnftrace"]["costs"] = {"f": 1e-4, "f_div": 2e-4, "grad_f_div": 1e-3}
    entry["cnftrace"]["floor_s"] = 0.05
    entry["runs"] = rounds
    text = run.b1_markdown({"hutchinson": entry})
    header = text.splitlines()[0]
    assert header.endswith("| zuko / cnftrace | TFP / cnftrace |")
    columns = header.count("|")
    median_row = "| hutchinson | cnftrace 0 | 0.2000 | 2.00 | 26.0 | 25.0 | — | 1.50× |"
    assert median_row in text
    assert "| hutchinson | zuko peer not run" in text and "`pip install" in text
    assert "| hutchinson | 1 | cnftrace 0 | 0.1000 |" in text
    assert "| hutchinson | 2 | TFP (JAX) 0 | 0.4000 |" in text
    for line in text.split("\n\n")[0].splitlines():
        assert line.count("|") == columns, line


def test_quick_b2_objectives_report(tmp_path):
    out = os.path.join(tmp_path, "benchmarks.md")
    assert run.main(["--quick", "--only", "b2fm", "--out", out]) == 0
    report = open(out).read()
    assert "## B2 by training objective" in report
    raw = json.load(open(os.path.splitext(out)[0] + ".json"))["b2fm"]["8gaussians"]
    for objective in ("mle", "fm", "ot-fm"):
        r = raw[objective]
        assert f"| 8gaussians | {objective} |" in report
        assert r["settings"]["objective"] == objective
        assert r["nfe_log_prob"] > 2 and r["nfe_sample"] > 2 and r["steps"] > 0
        assert r["curve"] and r["system"].startswith("cnftrace ")
    assert raw["fm"]["system"].endswith("(fm)")


def test_quick_b4_report(tmp_path):
    """B4 on one density in a few steps: cnftrace's gap beside zuko's (or the reason
    zuko did not run), in the report and its JSON."""
    out = os.path.join(tmp_path, "benchmarks.md")
    assert run.main(["--quick", "--only", "b4", "--out", out]) == 0
    report = open(out).read()
    assert "## B4: quality per step and per second, beside zuko" in report
    assert "| product5 | 5 | 3 × 64 |" in report
    row = json.load(open(os.path.splitext(out)[0] + ".json"))["b4"]["product5"]
    ours = row["cnftrace"]
    assert ours["train_s"] > 0 and ours["gap_se"] > 0
    # An untrained-ish flow is far from the truth, and the gap is a KL: positive.
    assert ours["gap"] > 0.05
    assert ("missing" in row["zuko"]) or row["zuko"]["gap"] > 0.05


def test_first_step_report_and_arguments():
    from experiments.bench import first_step

    fake = {
        "hutchinson": {
            "cold": {"first_step_s": 4.2, "since_start_s": 6.0},
            "warm": [{"first_step_s": 1.7, "since_start_s": 3.1}],
        }
    }
    lines = first_step.markdown(fake).splitlines()
    assert lines[2] == "| hutchinson | cold | 4.20 | 6.00 | ≤ 5 s: met |"
    assert lines[3] == "| hutchinson | warm | 1.70 | 3.10 | ≤ 1 s: **missed** |"
    for bad in (["--estimators", "exact,nope"], ["--warm-runs", "0"]):
        with pytest.raises(SystemExit):
            first_step.main(bad)


def test_b4_saves_each_density_and_keeps_earlier_rows(tmp_path, monkeypatch):
    """`python -m experiments.bench.b4` writes each density's row as soon as it is
    done, keeping the rows of an earlier run it does not redo: a run stopped halfway
    loses nothing it finished."""
    from experiments.bench import b4

    stem = str(tmp_path / "b4")
    ours = {"system": "cnftrace", "train_s": 10.0, "gap": 0.01, "gap_se": 0.001}
    peer = {"system": "zuko", "train_s": 50.0, "gap": 0.02, "gap_se": 0.002}
    peer["at_cnftrace_s"] = {"seconds": 10.0, "step": 40, "gap": 0.09, "gap_se": 0.01}
    old = {"dim": 5, "steps": 3, "batch": 8, "n_test": 10, "measured": "then"}
    with open(stem + ".json", "w") as f:
        json.dump({"product5": dict(old, cnftrace=ours, zuko={"missing": "x"})}, f)

    def fake_run_b4(names, steps, batch, test_size, on_row, equal_seconds_only):
        assert names == ("rings", "8gaussians") and not equal_seconds_only
        row = dict(old, dim=2, measured="now", cnftrace=ours, zuko=peer)
        on_row("rings", row)
        raise KeyboardInterrupt  # stopped before 8gaussians

    monkeypatch.setattr(b4, "run_b4", fake_run_b4)
    with pytest.raises(KeyboardInterrupt):
        b4.main(["--densities", "rings,8gaussians", "--out", stem])
    saved = json.load(open(stem + ".json"))
    assert list(saved) == ["product5", "rings"]  # B4's order, the old row kept
    assert saved["rings"]["measured"] == "now"
    md = open(stem + ".md").read()
    assert "| product5 | 5 | 3 × 8 |" in md and "| then |" in md
    assert "| rings | 2 | 3 × 8 | 0.0100 ± 0.0010 |" in md
    assert "0.0900 ± 0.0100 (40) | cnftrace | cnftrace | now |" in md
    with pytest.raises(SystemExit):
        b4.main(["--densities", "moons", "--out", stem])

    # zuko stopped at cnftrace's seconds: an equal-seconds figure, no equal-steps one.
    def stopped_run_b4(names, steps, batch, test_size, on_row, equal_seconds_only):
        assert equal_seconds_only
        at = {"seconds": 10.0, "step": 41, "gap": 0.3, "gap_se": 0.01}
        short = dict(peer, gap=None, gap_se=None, at_cnftrace_s=at)
        on_row("mixture12", dict(old, dim=12, cnftrace=ours, zuko=short))

    monkeypatch.setattr(b4, "run_b4", stopped_run_b4)
    b4.main(["--densities", "mixture12", "--equal-seconds-only", "--out", stem])
    md = open(stem + ".md").read()
    assert list(json.load(open(stem + ".json"))) == ["product5", "mixture12", "rings"]
    assert (
        "| — (stopped at cnftrace's seconds) | 50 | 0.3000 ± 0.0100 (41) | not run "
        "| cnftrace |" in md
    )
