"""BHerd reproduction (``reproduce bherd``): the α sweep of Fig. 3a with FedAvg and GraB on the squared-hinge SVM.

Even vs odd digits (MNIST when ``--data-root`` holds its files, the bundled digits otherwise), N = 5 clients,
Cases 1–3 of specs/bherd.md (``bherd1``/``bherd2``/``bherd3`` partitions), E = 1 local epoch, B = 10 (the best
batch of Fig. 3c), a fixed learning rate (0.003 on digits, whose 270 samples per client give τ ≈ 27 steps; the
paper's 1e-4 on raw MNIST with τ ≈ 120), no momentum. FedAvg (random reshuffling), BHerd-FedAvg with α ∈ {0.1, 0.3,
0.5, 0.7, 1.0} (fixed order) and GraB-FedAvg, 3 seeds (the paper averages 10 runs), 60 rounds on digits (500 on
MNIST).
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
from pyfedkern.sim.plots import plot_curves
from pyfedkern.sim.results import read_metrics

ALPHAS = (0.1, 0.3, 0.5, 0.7, 1.0)
VARIANTS = ("fedavg", *(f"bherd-{a:g}" for a in ALPHAS), "grab")
LABELS = {"fedavg": "FedAvg", "grab": "GraB-FedAvg", **{f"bherd-{a:g}": f"BHerd α = {a:g}" for a in ALPHAS}}
CASES = (1, 2, 3)


def variant_config(variant: str, case: int, seed: int, *, rounds: int, lr: float, dataset: str, root: str | None):
    """The ExperimentConfig of one variant ("fedavg", "bherd-<α>" or "grab") on Case ``case``."""
    if variant.startswith("bherd-"):
        algorithm, params = "bherd", {"alpha": float(variant.removeprefix("bherd-"))}
    else:
        algorithm, params = variant, {}
    return ExperimentConfig(
        algorithm=algorithm,
        algorithm_params=params,
        dataset=dataset,
        data_root=root,
        parity=True,
        model="svm",
        clients=5,
        partition=f"bherd{case}",
        batch_size=10,
        local_epochs=1.0,
        lr=lr,
        rounds=rounds,
        seed=seed,
        threads=1,
        checkpoint_every=20,
    )


def mean_curve(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """Per-round mean test loss and accuracy over seeds."""
    return [
        {
            "round": records[0]["round"],
            "test_loss": float(np.mean([r["test_loss"] for r in records])),
            "test_acc": float(np.mean([r["test_acc"] for r in records])),
        }
        for records in zip(*runs, strict=True)
        if all("test_loss" in r for r in records)
    ]


def rounds_to_loss(curve: Sequence[dict], threshold: float) -> int | None:
    """The first round whose (mean) test loss is ≤ ``threshold`` (None if never)."""
    return next((m["round"] for m in curve if m["test_loss"] <= threshold), None)


def _run(config: ExperimentConfig, run_dir: Path, progress: bool) -> list[dict]:
    if (run_dir / "summary.json").exists():
        return read_metrics(run_dir)
    return Simulation(config).run(run_dir, resume=(run_dir / "metrics.jsonl").exists(), progress=progress)


def run_case(case: int, args: argparse.Namespace, out: Path, quick: bool) -> dict:
    """Mean curves of every variant on one case, with rounds to FedAvg's final loss and final numbers."""
    dataset = "mnist" if args.data_root else "digits"
    rounds = args.rounds or (5 if quick else (500 if dataset == "mnist" else 60))
    lr = args.lr or (1e-4 if dataset == "mnist" else 0.003)
    curves = {}
    for variant in VARIANTS:
        runs = [
            _run(
                variant_config(variant, case, seed, rounds=rounds, lr=lr, dataset=dataset, root=args.data_root),
                out / f"case{case}" / f"seed{seed}" / variant,
                not args.no_progress,
            )
            for seed in range(args.seeds)
        ]
        curves[variant] = mean_curve(runs)
    threshold = curves["fedavg"][-1]["test_loss"]
    summary = {
        v: {
            "final_loss": c[-1]["test_loss"],
            "final_acc": c[-1]["test_acc"],
            "rounds_to_fedavg_final_loss": rounds_to_loss(c, threshold),
        }
        for v, c in curves.items()
    }
    return {"case": case, "dataset": dataset, "rounds": rounds, "lr": lr, "curves": curves, "summary": summary}


def _rounds(summary: dict) -> dict:
    return {v: s["rounds_to_fedavg_final_loss"] for v, s in summary.items()}


def findings(cases: list[dict]) -> str:
    """The paper's four qualitative claims, each checked per case with the numbers."""
    lines = []
    for c in cases:
        s, curves, n = c["summary"], c["curves"], c["rounds"]
        gap = max(
            abs(a["test_loss"] - b["test_loss"]) / b["test_loss"]
            for a, b in zip(curves["bherd-1"], curves["fedavg"], strict=True)
        )
        faster = [f"bherd-{a:g}" for a in (0.3, 0.5, 0.7)]
        rtt = {v: "never" if x is None else str(x) for v, x in _rounds(s).items()}
        speed = ", ".join(f"α = {v.removeprefix('bherd-')}: {rtt[v]}" for v in [*faster, "bherd-1"])
        fails = s["bherd-0.1"]["final_loss"] > s["fedavg"]["final_loss"]
        lines += [
            f"- **Case {c['case']}.** (1) α = 1 vs FedAvg: largest relative test-loss gap over the {n} rounds "
            f"{100 * gap:.1f}%. (2) Rounds to reach FedAvg's final loss {s['fedavg']['final_loss']:.4f} "
            f"(FedAvg itself: {n}): {speed}. (3) α = 0.1: final loss {s['bherd-0.1']['final_loss']:.4f}, accuracy "
            f"{100 * s['bherd-0.1']['final_acc']:.2f}% vs FedAvg {100 * s['fedavg']['final_acc']:.2f}% — "
            f"{'worse than FedAvg' if fails else 'not worse than FedAvg'}. (4) GraB: final loss "
            f"{s['grab']['final_loss']:.4f}, rounds to FedAvg's final loss {rtt['grab']}."
        ]
    return "\n".join(lines) + "\n"


def results_table(cases: list[dict]) -> str:
    lines = [
        "| case | method | final test loss | final test acc % | rounds to FedAvg's final loss |",
        "|---:|---|---:|---:|---:|",
    ]
    for c in cases:
        for v in VARIANTS:
            s = c["summary"][v]
            r = s["rounds_to_fedavg_final_loss"]
            lines.append(
                f"| {c['case']} | {LABELS[v]} | {s['final_loss']:.4f} | {100 * s['final_acc']:.2f} "
                f"| {'–' if r is None else r} |"
            )
    return "\n".join(lines) + "\n"


def _parse(argv: Sequence[str], quick: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pyfedkern reproduce bherd", allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=1 if quick else 3, help="seeds (default 3, quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="default: digits 60, MNIST 500 (quick 5)")
    parser.add_argument("--lr", type=float, default=None, help="default: digits 0.003, MNIST 1e-4")
    parser.add_argument("--data-root", default=None, help="directory with the MNIST idx files (else digits)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(argv))
    if args.seeds < 1 or (args.rounds is not None and args.rounds < 1):
        parser.error("--seeds and --rounds must be >= 1")
    if args.lr is not None and not args.lr > 0:
        parser.error("--lr must be > 0")
    return args


def _markdown(cases: list[dict], args: argparse.Namespace, images: list[str], quick: bool) -> str:
    c0 = cases[0]
    return "\n".join(
        [
            "## BHerd (greedy herding of local gradients)",
            "",
            f"`pyfedkern reproduce bherd{' --quick' if quick else ''}`: the α sweep of Fig. 3a with FedAvg and "
            f"GraB-FedAvg on the squared-hinge SVM, even vs odd {c0['dataset']}, N = 5 clients, Cases 1–3 "
            f"(specs/bherd.md), E = 1, B = 10, fixed lr {c0['lr']:g}, no momentum, {c0['rounds']} rounds, "
            f"{args.seeds} seed(s) averaged (the paper: MNIST, lr 1e-4, 500 rounds, 10 runs). FedAvg reshuffles "
            "each epoch; BHerd and GraB keep a fixed order, as in the paper.",
            "",
            results_table(cases),
            *[f"![{Path(i).stem}]({i})" for i in images],
            "",
            "### The paper's findings, checked",
            "",
            "The paper (Fig. 3a) reports: α = 1 tracks FedAvg; α from 1.0 down to 0.3 converges faster; α = 0.1 "
            "fails; GraB gains little. What we measured:",
            "",
            findings(cases),
        ]
    )


def main(argv: Sequence[str], *, out: Path, quick: bool, docs: str | None) -> int:
    """Run the three cases into ``out``; write ``out/report.md`` and, with ``docs``, the bherd section there."""
    args = _parse(argv, quick)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cases, plots = [], []
    for case in CASES:
        result = run_case(case, args, out, quick)
        cases.append(result)
        title = f"SVM, even vs odd {result['dataset']}, Case {case}, mean of {args.seeds} seed(s)"
        curves = {LABELS[v]: c for v, c in result["curves"].items()}
        plots.append(plot_curves(curves, out / f"case{case}.png", title=title))
        print(f"case {case}: " + ", ".join(f"{LABELS[v]} {s['final_loss']:.4f}" for v, s in result["summary"].items()))
    (out / "results.json").write_text(json.dumps([{k: v for k, v in c.items() if k != "curves"} for c in cases]))
    (out / "report.md").write_text(_markdown(cases, args, [p.name for p in plots], quick))
    print(results_table(cases))
    print(findings(cases))
    if docs:
        img = Path(docs).parent / "img"
        img.mkdir(parents=True, exist_ok=True)
        names = [f"bherd-{p.name}" for p in plots]
        for plot, name in zip(plots, names, strict=True):
            shutil.copyfile(plot, img / name)
        update_docs_section(docs, "bherd", _markdown(cases, args, [f"img/{n}" for n in names], quick))
        print(f"updated the bherd section of {docs}")
    return 0
