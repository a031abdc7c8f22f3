"""FedPBC reproduction (``reproduce fedpbc``): the quadratic bias experiment and a Table 1 of link patterns.

1. Quadratic (Sec. 7.1, specs/fedpbc.md): m = 100, d = 100, F_i = ½‖x − u_i‖², exact local GD (s = 100, η = 1e-4),
   T = 2500 rounds, Bernoulli links with p0 for clients 1–50 and p1 for 51–100 at (p0, p1) ∈ {(0.5, 0.5),
   (0.5, 0.9), (0.1, 0.9)}, 3 seeds. Plot of ‖x^t − x*‖ for FedAvg and FedPBC, and FedAvg's measured limit (the
   server model averaged over the second half of the rounds and the seeds) next to Proposition 1's formula.
2. Digits (SVHN / CIFAR-10 are not bundled, so the table uses digits): m = 100 clients of equal size with
   Dirichlet(0.1) label mixes (``dirichlet-equal:0.1``), an MLP, s = 5 local steps of batch 16, η_t = 0.05/√(t/10+1),
   p_i from the log-normal construction (σ0 = 10, δ = 0.02), γ = 0.3, P = 40, cycle length 100; every link
   pattern and method (FedPBC, FedAvg, FedAvg-all, FedAU, known p, MIFA; F3AST is not implemented), 3 seeds, 80
   rounds instead of 4000, accuracy = mean over the last three evaluations (every 10 rounds).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pyfedkern.reproduce import update_docs_section
from pyfedkern.sim.engine import ExperimentConfig, Simulation
from pyfedkern.sim.links import PATTERNS, make_links
from pyfedkern.sim.pbc_quadratic import fedavg_limit, quadratic_targets, simulate_quadratic
from pyfedkern.sim.results import read_metrics

PROB_PAIRS = ((0.5, 0.5), (0.5, 0.9), (0.1, 0.9))
METHODS = ("fedpbc", "fedavg-links", "fedavg-all", "fedau", "fedavg-known-p", "mifa")
LABELS = {
    "fedpbc": "FedPBC",
    "fedavg-links": "FedAvg",
    "fedavg-all": "FedAvg-all",
    "fedau": "FedAU",
    "fedavg-known-p": "known p",
    "mifa": "MIFA",
}
MEMORY_FREE = ("fedavg-links", "fedavg-all", "fedau", "fedavg-known-p")  # MIFA keeps m stale updates
PATTERN_LABELS = {
    "bernoulli": "Bern inv",
    "bernoulli-tv": "Bern var",
    "markov": "Markov hom",
    "markov-tv": "Markov non-hom",
    "cyclic": "Cyclic no reset",
    "cyclic-reset": "Cyclic reset",
}
# The paper's Table 1 test accuracy % on CIFAR-10 (FedPBC, FedAvg, FedAvg-all, FedAU, known p, MIFA).
PAPER_CIFAR = {
    "bernoulli": (66.3, 58.7, 48.7, 65.9, 60.1, 67.1),
    "bernoulli-tv": (65.0, 56.2, 43.2, 63.5, 61.2, 65.5),
    "markov": (66.5, 57.9, 48.0, 66.4, 60.0, 65.9),
    "markov-tv": (64.9, 58.0, 43.8, 65.1, 59.0, 65.6),
    "cyclic": (65.2, 56.0, 48.1, 63.1, 58.0, 58.7),
    "cyclic-reset": (64.0, 55.1, 42.4, 61.7, 59.1, 64.3),
}


# Part 1: the quadratic -------------------------------------------------------------------------------------------


def quadratic_experiment(
    seeds: Sequence[int], rounds: int, *, lr: float = 1e-4, steps: int = 100, m: int = 100, d: int = 100
) -> list[dict]:
    """Per (p0, p1): FedAvg's measured limit error and formula error, FedPBC's final errors, the mean curves."""
    rows = []
    for p0, p1 in PROB_PAIRS:
        probs = np.array([p0] * (m // 2) + [p1] * (m - m // 2))
        curves = {"fedavg": [], "fedpbc": []}
        limits, pbc_final, pbc_mean_final, formula = [], [], [], []
        for seed in seeds:
            u = quadratic_targets(m, d, seed)
            optimum = u.mean(0)
            for method in ("fedavg", "fedpbc"):
                links = make_links("bernoulli", m, probs=probs, seed=seed)
                run = simulate_quadratic(method, u, links, lr=lr, steps=steps, rounds=rounds)
                curves[method].append(run.server_error)
                if method == "fedavg":
                    limits.append(run.late_average)
                else:
                    pbc_final.append(run.server_error[-1])
                    pbc_mean_final.append(run.mean_error[-1])
            formula.append(float(np.linalg.norm(fedavg_limit(u, probs) - optimum)))
        measured = [
            float(np.linalg.norm(limit - quadratic_targets(m, d, s).mean(0)))
            for limit, s in zip(limits, seeds, strict=True)
        ]
        rows.append(
            {
                "p0": p0,
                "p1": p1,
                "fedavg_bias_measured": float(np.mean(measured)),
                "fedavg_bias_formula": float(np.mean(formula)),
                "fedpbc_server_error": float(np.mean(pbc_final)),
                "fedpbc_mean_model_error": float(np.mean(pbc_mean_final)),
                "curves": {k: np.mean(v, axis=0).tolist() for k, v in curves.items()},
            }
        )
    return rows


def plot_quadratic(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4.6 * len(rows), 3.6), squeeze=False, sharey=True)
    for ax, row in zip(axes[0], rows, strict=True):
        for method, style in (("fedavg", "-"), ("fedpbc", "--")):
            curve = np.asarray(row["curves"][method])
            start = min(50, len(curve) - 1)  # the paper plots from round 50 on
            label = "FedAvg" if method == "fedavg" else "FedPBC"
            ax.semilogy(np.arange(start, len(curve)) + 1, curve[start:], style, label=label)
        ax.axhline(row["fedavg_bias_formula"], color="gray", lw=0.8, ls=":", label="Prop. 1 FedAvg bias")
        ax.set_title(f"p0 = {row['p0']:g}, p1 = {row['p1']:g}")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("‖x^t − x*‖ (server)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def quadratic_table(rows: list[dict]) -> str:
    lines = [
        "| p0 | p1 | FedAvg ‖lim x − x*‖ measured | Prop. 1 formula | FedPBC server ‖x^T − x*‖ "
        "| FedPBC ‖x̄^T − x*‖ (mean of all client models) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['p0']:g} | {r['p1']:g} | {r['fedavg_bias_measured']:.4f} | {r['fedavg_bias_formula']:.4f} "
            f"| {r['fedpbc_server_error']:.2e} | {r['fedpbc_mean_model_error']:.2e} |"
        )
    return "\n".join(lines) + "\n"


# Part 2: Table 1 on digits ---------------------------------------------------------------------------------------


def table_config(method: str, pattern: str, seed: int, rounds: int, clients: int) -> ExperimentConfig:
    return ExperimentConfig(
        algorithm=method,
        algorithm_params={"links": pattern, "gamma": 0.3, "period": 40, "cycle_length": 100},
        dataset="digits",
        partition="dirichlet-equal:0.1",
        clients=clients,
        model="mlp",
        rounds=rounds,
        batch_size=16,
        local_steps=5,
        lr=0.05,
        lr_schedule="invsqrt:10",
        eval_every=10,
        seed=seed,
        checkpoint_every=20,
    )


def _run(config: ExperimentConfig, run_dir: Path, progress: bool) -> list[dict]:
    if (run_dir / "summary.json").exists():
        return read_metrics(run_dir)
    return Simulation(config).run(run_dir, resume=(run_dir / "metrics.jsonl").exists(), progress=progress)


def late_accuracy(metrics: Sequence[dict], key: str, last: int = 3) -> float:
    """Mean of ``key`` over the last ``last`` evaluated rounds (the paper averages its last 100 rounds)."""
    values = [m[key] for m in metrics if m.get(key) is not None]
    if not values:
        raise ValueError(f"no round has {key!r}")
    return float(np.mean(values[-last:]))


def run_table(out: Path, seeds: Sequence[int], rounds: int, clients: int, progress: bool) -> list[dict]:
    rows = []
    for pattern in PATTERNS:
        for method in METHODS:
            train, test = [], []
            for seed in seeds:
                run_dir = out / "digits" / pattern / f"seed{seed}" / method
                metrics = _run(table_config(method, pattern, seed, rounds, clients), run_dir, progress)
                train.append(late_accuracy(metrics, "train_acc"))
                test.append(late_accuracy(metrics, "test_acc"))
            rows.append({"pattern": pattern, "method": method, "train_acc": train, "test_acc": test})
            print(f"{pattern} {LABELS[method]}: test {np.mean(test):.4f}", flush=True)
    return rows


def results_table(rows: list[dict]) -> str:
    """Laid out like the paper's Table 1: train/test accuracy % (mean over seeds) per pattern and method."""
    lines = [
        "| pattern | " + " | ".join(LABELS[m] for m in METHODS) + " |",
        "|---|" + "---:|" * len(METHODS),
    ]
    for pattern in PATTERNS:
        cells = []
        for method in METHODS:
            r = next(r for r in rows if (r["pattern"], r["method"]) == (pattern, method))
            cells.append(f"{100 * np.mean(r['train_acc']):.1f}/{100 * np.mean(r['test_acc']):.1f}")
        lines.append(f"| {PATTERN_LABELS[pattern]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict]) -> str:
    """Per pattern: FedPBC's test accuracy minus the best memory-free baseline's, and its rank among all six."""
    lines, leads = [], 0
    for pattern in PATTERNS:
        acc = {r["method"]: float(np.mean(r["test_acc"])) for r in rows if r["pattern"] == pattern}
        best_free = max(MEMORY_FREE, key=acc.get)
        gap = 100 * (acc["fedpbc"] - acc[best_free])
        leads += gap > 0
        rank = 1 + sum(acc[m] > acc["fedpbc"] for m in METHODS)
        lines.append(
            f"- {PATTERN_LABELS[pattern]}: FedPBC {100 * acc['fedpbc']:.1f}%, best memory-free baseline "
            f"{LABELS[best_free]} {100 * acc[best_free]:.1f}% ({gap:+.1f} pp); FedPBC − FedAvg "
            f"{100 * (acc['fedpbc'] - acc['fedavg-links']):+.1f} pp; MIFA {100 * acc['mifa']:.1f}%; FedPBC ranks "
            f"{rank} of {len(METHODS)}."
        )
    lines.insert(0, f"**FedPBC leads the memory-free methods in {leads} of {len(PATTERNS)} link patterns.**")
    return "\n".join(lines) + "\n"


# Report and entry point ------------------------------------------------------------------------------------------


def _parse(argv: Sequence[str], quick: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pyfedkern reproduce fedpbc", allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=1 if quick else 3, help="seeds (default 3, quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="digits rounds (default 80, quick 10)")
    parser.add_argument("--quadratic-rounds", type=int, default=None, help="default 2500, quick 200")
    parser.add_argument("--clients", type=int, default=100, help="digits clients m (default 100)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(argv))
    for name in ("seeds", "rounds", "quadratic_rounds", "clients"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _markdown(quad: list[dict], rows: list[dict], args: argparse.Namespace, images: list[str], quick: bool) -> str:
    q_rounds = args.quadratic_rounds or (200 if quick else 2500)
    rounds = args.rounds or (10 if quick else 80)
    seeds = args.seeds
    paper_fedpbc = ", ".join(f"{PATTERN_LABELS[p]} {v[0]:.1f} vs FedAvg {v[1]:.1f}" for p, v in PAPER_CIFAR.items())
    return "\n".join(
        [
            "## FedPBC (Xiang et al., postponed broadcast under unreliable uplinks)",
            "",
            f"`pyfedkern reproduce fedpbc{' --quick' if quick else ''}`.",
            "",
            "### Quadratic: FedAvg's bias and FedPBC",
            "",
            f"m = 100, d = 100, F_i = ½‖x − u_i‖², u_i ∼ N((i/1000)·1, 0.01·I), x^0 = 0, exact local GD with s = 100 "
            f"steps of η = 1e-4, {q_rounds} rounds, Bernoulli links (p0 for clients 1–50, p1 for 51–100), {seeds} "
            "seed(s). FedAvg's limit is measured as its server model averaged over the second half of the rounds "
            "(and the seeds' errors averaged); the formula is Proposition 1 (with B excluding client i, see the "
            "spec).",
            "",
            quadratic_table(quad),
            f"![quadratic]({images[0]})",
            "",
            "The paper (Fig. 3) shows FedAvg stalling at a distance that grows with p0 ≠ p1 and FedPBC reaching "
            "≈1e-3 whether or not p0 = p1. The measured FedAvg limits match the formula to the digits above; "
            "FedPBC's server error is the O(η·s) bias of a constant step (it halves when η·s halves, "
            "tests/algorithms), and the mean of all client models reaches x*.",
            "",
            "### Table 1 on digits",
            "",
            f"m = {args.clients} clients with equal data and Dirichlet(0.1) label mixes (`dirichlet-equal:0.1`), MLP, "
            "s = 5 local steps of batch 16, η_t = 0.05/√(t/10 + 1), p_i from the log-normal construction "
            f"(σ0 = 10, δ = 0.02), γ = 0.3, P = 40, cycle length 100, {rounds} rounds (the paper: 4000 on SVHN), "
            f"{seeds} seed(s); train/test accuracy % of the server model, averaged over the last three evaluations "
            "(every 10 rounds; the paper averages its last 100 rounds). F3AST is not implemented. SVHN and CIFAR-10 "
            "are not bundled; the paper's numbers are for them.",
            "",
            results_table(rows),
            verdict(rows),
            f"The paper's CIFAR-10 test accuracy: {paper_fedpbc} (FedPBC leads the memory-free methods in all six "
            "patterns but one, by ≈0.2 pp there).",
            "",
            "How to read our table: it is a short, untuned run. The paper trains 4000–10000 rounds and picks η0 and "
            "η_g per method by accuracy at round 500; here every method uses the same η0 = 0.05 and η_g = 1 for "
            f"{rounds} rounds. Under that budget the update's scale decides the ranking: 'known p' divides each "
            "update by p_i (δ = 0.02 allows up to 50×), so it takes far larger steps; FedAvg-all divides by m and "
            "barely moves; FedPBC's server model is the mean of the active clients' own models, which under "
            "Dirichlet(0.1) labels and low p_i drift apart between their rare uploads. The quadratic part, where the "
            "dynamics are exact, matches the paper; this digits table does not, and we do not claim FedPBC's lead "
            "from it.",
        ]
    )


def main(argv: Sequence[str], *, out: Path, quick: bool, docs: str | None) -> int:
    """Run both parts into ``out``; write ``out/report.md`` and, with ``docs``, the fedpbc section there."""
    args = _parse(argv, quick)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seeds))
    quad = quadratic_experiment(seeds, args.quadratic_rounds or (200 if quick else 2500))
    plot = plot_quadratic(quad, out / "quadratic.png")
    print(quadratic_table(quad))
    rows = run_table(out, seeds, args.rounds or (10 if quick else 80), args.clients, not args.no_progress)
    summary = [{k: v for k, v in r.items() if k != "curves"} for r in quad]
    (out / "results.json").write_text(json.dumps({"quadratic": summary, "table": rows}, indent=2))
    (out / "report.md").write_text(_markdown(quad, rows, args, [plot.name], quick))
    print(results_table(rows))
    print(verdict(rows))
    print(f"report: {out / 'report.md'}")
    if docs:
        img = Path(docs).parent / "img"
        img.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plot, img / "fedpbc-quadratic.png")
        update_docs_section(docs, "fedpbc", _markdown(quad, rows, args, ["img/fedpbc-quadratic.png"], quick))
        print(f"updated the fedpbc section of {docs}")
    return 0
