"""BHerd reproduction (``reproduce bherd``): the α sweep of Fig. 3a with FedAvg and GraB on the squared-hinge SVM.

Even vs odd digits (MNIST when ``--data-root`` holds its files, the bundled digits otherwise), N = 5 clients,
Cases 1–3 of docs/bherd.md §6 (``bherd1``/``bherd2``/``bherd3`` partitions), E = 1 local epoch, a fixed learning rate
and no momentum: on digits B = 10 and lr 0.003 (its ~270 samples per client give τ ≈ 27 steps), on MNIST the paper's
B = 100 and lr 1e-4 (τ ≈ 120). FedAvg (random reshuffling), BHerd-FedAvg with α ∈ {0.1, 0.3, 0.5, 0.7, 1.0} (fixed
order) and GraB-FedAvg, 10 seeds as in the paper, 60 rounds on digits (500 on MNIST). Loss is the global model's
train loss, accuracy its test accuracy (docs/bherd.md §6); each of the paper's four claims gets a verdict computed
from the seed-averaged curves by the criteria in ``CRITERIA``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pyfedkern.ops.herding import selection_size
from pyfedkern.reproduce import ONE_SEED, publish
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation, run_or_reuse
from pyfedkern.sim.plots import plot_curves

ALPHAS = (0.1, 0.3, 0.5, 0.7, 1.0)
VARIANTS = ("fedavg", *(f"bherd-{a:g}" for a in ALPHAS), "grab")
LABELS = {"fedavg": "FedAvg", "grab": "GraB-FedAvg", **{f"bherd-{a:g}": f"BHerd α = {a:g}" for a in ALPHAS}}
CASES = (1, 2, 3)


def variant_config(
    variant: str, case: int, seed: int, *, rounds: int, lr: float, batch: int, dataset: str, root: str | None
):
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
        batch_size=batch,
        local_epochs=1.0,
        lr=lr,
        rounds=rounds,
        seed=seed,
        threads=1,
        checkpoint_every=20,
    )


METRICS = ("train_loss", "test_loss", "test_acc")
TRACK_TOL = 0.02  # claim 1: α = 1's mean train loss within 2% of FedAvg's at every round
FAIL_RATIO = 1.10  # claim 3: α = 0.1 ends more than 10% above FedAvg's final train loss
NEAR = 0.02  # the table's second threshold: within 2% of FedAvg's final train loss
LITTLE_LOSS, LITTLE_ACC = 0.02, 0.01  # claim 4: GraB's final train loss < 2% below FedAvg's, test acc < 1 point above
CLAIMS = {
    "tracks": "α = 1 tracks FedAvg",
    "faster": "α from 1.0 down to 0.3 converges faster",
    "fails": "α = 0.1 fails to converge",
    "grab": "GraB gains little over FedAvg",
}
CRITERIA = {
    "tracks": f"α = 1's mean train loss is within {TRACK_TOL:.0%} of FedAvg's at every round",
    "faster": "α = 0.7, 0.5 and 0.3 each reach a train loss all four of α = 1.0, 0.7, 0.5, 0.3 reach (the highest "
    "of their final losses) in fewer rounds than α = 1",
    "fails": f"α = 0.1's final train loss is more than {FAIL_RATIO - 1:.0%} above FedAvg's",
    "grab": f"GraB's final train loss is less than {LITTLE_LOSS:.0%} below FedAvg's and its test accuracy less than "
    f"{100 * LITTLE_ACC:g} point above",
}


def mean_curve(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """Per-round means over seeds of the train loss (global model on the training set), test loss and test accuracy."""
    return [
        {"round": records[0]["round"], **{k: float(np.mean([r[k] for r in records])) for k in METRICS}}
        for records in zip(*runs, strict=True)
        if all("train_loss" in r for r in records)
    ]


def rounds_to_loss(curve: Sequence[dict], threshold: float) -> int | None:
    """The first round whose (mean) train loss is ≤ ``threshold`` (None if never)."""
    return next((m["round"] for m in curve if m["train_loss"] <= threshold), None)


def summarize(curves: dict[str, list[dict]], finals: dict[str, list[float]]) -> dict:
    """Final train loss (mean and std over seeds), final test accuracy, and the rounds to FedAvg's final train loss
    and to within ``NEAR`` of it."""
    threshold = curves["fedavg"][-1]["train_loss"]
    return {
        v: {
            "final_train_loss": c[-1]["train_loss"],
            "final_train_loss_std": float(np.std(finals[v], ddof=1)) if len(finals[v]) > 1 else None,
            "final_test_acc": c[-1]["test_acc"],
            "rounds_to_fedavg_final_loss": rounds_to_loss(c, threshold),
            "rounds_to_near_fedavg_final_loss": rounds_to_loss(c, (1 + NEAR) * threshold),
        }
        for v, c in curves.items()
    }


def run_case(case: int, args: argparse.Namespace, out: Path, quick: bool) -> dict:
    """Mean curves of every variant on one case, the clients' sizes |D_i| and ``summarize``'s numbers."""
    dataset = "mnist" if args.data_root else "digits"
    rounds = args.rounds or (5 if quick else (500 if dataset == "mnist" else 60))
    lr = args.lr or (1e-4 if dataset == "mnist" else 0.003)
    batch = args.batch_size or (100 if dataset == "mnist" else 10)
    curves, finals = {}, {}
    for variant in VARIANTS:
        configs = [
            variant_config(variant, case, seed, rounds=rounds, lr=lr, batch=batch, dataset=dataset, root=args.data_root)
            for seed in range(args.seeds)
        ]
        runs = [
            run_or_reuse(cfg, out / f"case{case}" / f"seed{cfg.seed}" / variant, progress=not args.no_progress)
            for cfg in configs
        ]
        curves[variant] = mean_curve(runs)
        finals[variant] = [run[-1]["train_loss"] for run in runs]
    sizes = [int(y.shape[0]) for y in Simulation(configs[0]).client_y]  # |D_i|, the same for every variant
    return {
        "case": case,
        "dataset": dataset,
        "rounds": rounds,
        "lr": lr,
        "batch": batch,
        "client_sizes": sizes,
        "curves": curves,
        "summary": summarize(curves, finals),
    }


SWEEP = [f"bherd-{a:g}" for a in (1.0, 0.7, 0.5, 0.3)]  # the α of claim 2


def sweep_rounds(case: dict) -> tuple[float, dict[str, int]]:
    """The highest final train loss of α = 1.0, 0.7, 0.5, 0.3 (a loss all four reach, by their last round at the
    latest) and the round each first reaches it."""
    common = max(case["summary"][v]["final_train_loss"] for v in SWEEP)
    return common, {v: rounds_to_loss(case["curves"][v], common) for v in SWEEP}


def case_verdicts(case: dict) -> dict[str, tuple[bool, str]]:
    """For each claim: whether this case's numbers support it (by ``CRITERIA``), and the numbers behind that."""
    s, curves = case["summary"], case["curves"]
    fedavg, low, grab = s["fedavg"], s["bherd-0.1"], s["grab"]
    gap = max(
        abs(a["train_loss"] - b["train_loss"]) / b["train_loss"]
        for a, b in zip(curves["bherd-1"], curves["fedavg"], strict=True)
    )
    common, rounds = sweep_rounds(case)
    sweep = list(rounds)
    faster = all(rounds[v] < rounds["bherd-1"] for v in sweep[1:])
    reached = ", ".join(f"α = {v.removeprefix('bherd-')}: {rounds[v]}" for v in sweep)
    finals = " / ".join(f"{s[v]['final_train_loss']:.4f}" for v in sweep)
    start = curves["fedavg"][0]["train_loss"]
    ratio = low["final_train_loss"] / fedavg["final_train_loss"]
    share = (start - low["final_train_loss"]) / (start - fedavg["final_train_loss"])
    lowest = min(curves["bherd-0.1"], key=lambda m: m["train_loss"])
    loss_change = grab["final_train_loss"] / fedavg["final_train_loss"] - 1
    acc_gain = grab["final_test_acc"] - fedavg["final_test_acc"]
    return {
        "tracks": (gap <= TRACK_TOL, f"largest gap {100 * gap:.1f}%"),
        "faster": (
            faster,
            f"rounds to train loss {common:.4f}, the highest of the four final losses: {reached}; final train loss "
            f"for α = 1.0 / 0.7 / 0.5 / 0.3: {finals} (FedAvg {fedavg['final_train_loss']:.4f})",
        ),
        "fails": (
            ratio > FAIL_RATIO,
            f"final train loss {low['final_train_loss']:.4f} = {ratio:.2f}× FedAvg's; lowest "
            f"{lowest['train_loss']:.4f} at round {lowest['round']}; it removes {100 * share:.0f}% of the loss FedAvg "
            "removes from round 0",
        ),
        "grab": (
            -loss_change < LITTLE_LOSS and acc_gain < LITTLE_ACC,
            f"final train loss {grab['final_train_loss']:.4f} vs FedAvg {fedavg['final_train_loss']:.4f} "
            f"({100 * loss_change:+.1f}%), test accuracy {100 * grab['final_test_acc']:.2f}% vs "
            f"{100 * fedavg['final_test_acc']:.2f}%",
        ),
    }


def verdicts(per_case: dict[int, dict[str, tuple[bool, str]]]) -> dict[str, tuple[bool, list[int]]]:
    """Per claim, from ``case_verdicts`` of each case: (we agree, the cases where it holds); we agree only when it
    holds in every case."""
    holds = {claim: [k for k, v in per_case.items() if v[claim][0]] for claim in CLAIMS}
    return {claim: (len(where) == len(per_case), where) for claim, where in holds.items()}


def _where(cases: list[int]) -> str:
    if not cases:
        return "holds in no case"
    return f"holds only in Case{'s' if len(cases) > 1 else ''} {', '.join(map(str, cases))}"


def findings(cases: list[dict]) -> str:
    """The paper's four claims: per claim the criterion, each case's numbers, and our verdict; then a summary."""
    per_case = {c["case"]: case_verdicts(c) for c in cases}
    overall = verdicts(per_case)
    lines = []
    for i, (claim, text) in enumerate(CLAIMS.items(), start=1):
        agree, where = overall[claim]
        verdict = "agree" if agree else f"disagree ({_where(where)})"
        lines.append(f"{i}. **{text} — {verdict}.** Criterion: {CRITERIA[claim]}.")
        for k, v in per_case.items():
            lines.append(f"   - Case {k}: {'holds' if v[claim][0] else 'does not hold'} — {v[claim][1]}.")
    notes = {}
    if all(all(r["bherd-1"] < r[v] for v in SWEEP[1:]) for r in (sweep_rounds(c)[1] for c in cases)):
        notes["faster"] = ", and instead α = 1 is the fastest of the four in every case"
    disagree = [
        f"{CLAIMS[c]} ({_where(where)}{notes.get(c, '')})" for c, (agree, where) in overall.items() if not agree
    ]
    if disagree:
        summary = (
            f"**In short, we disagree with the paper on {len(disagree)} of its 4 claims:** "
            f"{'; '.join(disagree)}. We agree with the rest."
            if len(disagree) < len(CLAIMS)
            else f"**In short, we disagree with the paper on all 4 claims:** {'; '.join(disagree)}."
        )
    else:
        summary = "**In short, our numbers agree with all four of the paper's claims.**"
    return "\n".join([*lines, "", summary]) + "\n"


def results_table(cases: list[dict]) -> str:
    lines = [
        "| case | method | final train loss ± std (seeds) | final test acc % | rounds to FedAvg's final train loss "
        f"| rounds to within {NEAR:.0%} of it |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for c in cases:
        for v in VARIANTS:
            s = c["summary"][v]
            rounds = [s["rounds_to_fedavg_final_loss"], s["rounds_to_near_fedavg_final_loss"]]
            lines.append(
                f"| {c['case']} | {LABELS[v]} | {s['final_train_loss']:.4f}{_spread(s['final_train_loss_std'])} "
                f"| {100 * s['final_test_acc']:.2f} | "
                + " | ".join("never" if r is None else str(r) for r in rounds)
                + " |"
            )
    return "\n".join(lines) + "\n"


def _spread(std: float | None) -> str:
    """`` ± std`` of the seeds, nothing for one seed (None)."""
    if std is None:
        return ""
    return f" ± {std:.5f}" if std >= 5e-6 else " ± < 0.00001"


def _seeds(n: int) -> str:
    return f"{n} seed{'s' if n > 1 else ''}"


def _span(values: Sequence[int]) -> str:
    return f"{min(values)}–{max(values)}" if min(values) != max(values) else f"{values[0]}"


def batch_note(case: dict) -> str:
    """Why the batch size is what it is, with the local steps τ_i = ⌊|D_i|/B⌋ it gives."""
    b, sizes = case["batch"], case["client_sizes"]
    steps = f"τ_i = {_span([n // b for n in sizes])} local steps per client per round"
    if b == 100:
        return f"**Batch size.** B = 100, the paper's default ({steps})."
    note = f"**Batch size.** B = {b}, not the paper's default B = 100 ({steps})."
    few = [n // 100 for n in sizes]
    if max(few) < 10:
        picks = sorted({selection_size(min(few), a) for a in ALPHAS if a < 1})
        note += (
            f" The {case['dataset']} clients hold only {_span(sizes)} training samples each, so B = 100 would leave "
            f"τ_i = {_span(few)}, too few for herding to have a choice: at τ = {min(few)} every α < 1 selects "
            f"{' or '.join(map(str, picks))} of the {min(few)} gradients."
        )
    if b == 10:
        note += " B = 10 is also the best batch size the paper's Fig. 3c finds for Cases 1–2 (50 for Case 3)."
    return note


def _parse(argv: Sequence[str], quick: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pyfedkern reproduce bherd", allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=1 if quick else 10, help="seeds (default 10, quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="default: digits 60, MNIST 500 (quick 5)")
    parser.add_argument("--lr", type=float, default=None, help="default: digits 0.003, MNIST 1e-4")
    parser.add_argument("--batch-size", type=int, default=None, help="default: digits 10, MNIST 100")
    parser.add_argument("--data-root", default=None, help="directory with the MNIST idx files (else digits)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(argv))
    if args.seeds < 1 or any(x is not None and x < 1 for x in (args.rounds, args.batch_size)):
        parser.error("--seeds, --rounds and --batch-size must be >= 1")
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
            f"GraB-FedAvg on the squared-hinge SVM (λ = 0.1), even vs odd {c0['dataset']}, N = 5 clients, Cases 1–3 "
            f"(docs/bherd.md §6), E = 1, B = {c0['batch']}, fixed lr {c0['lr']:g}, no momentum, {c0['rounds']} rounds, "
            f"{_seeds(args.seeds)} averaged (the paper: MNIST, B = 100, lr 1e-4, 500 rounds, 10 runs). FedAvg "
            "reshuffles each epoch; BHerd and GraB keep a fixed order, as in the paper. As in the paper's reference "
            "code, the loss is the global model's on the training set (all of it on digits, at most 10,000 samples "
            "on MNIST) and the accuracy is on the test set.",
            "",
            batch_note(c0),
            "",
            results_table(cases),
            *[f"![{Path(i).stem}]({i})" for i in images],
            "",
            "### The paper's findings, checked",
            "",
            "The paper (Fig. 3a) reports four things: α = 1 tracks FedAvg; α from 1.0 down to 0.3 converges faster; "
            "α = 0.1 fails to converge; GraB gains little. For each, the criterion we apply to the seed-averaged "
            "curves, the numbers per case, and our verdict (we agree only when the claim holds in all three cases):",
            "",
            findings(cases) if args.seeds > 1 else ONE_SEED,
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
        title = f"SVM, even vs odd {result['dataset']}, Case {case}, mean of {_seeds(args.seeds)}"
        curves = {LABELS[v]: c for v, c in result["curves"].items()}
        plots.append(plot_curves(curves, out / f"case{case}.png", metrics=("train_loss", "test_acc"), title=title))
        finals = ", ".join(f"{LABELS[v]} {s['final_train_loss']:.4f}" for v, s in result["summary"].items())
        print(f"case {case} final train loss: {finals}")
    (out / "results.json").write_text(json.dumps([{k: v for k, v in c.items() if k != "curves"} for c in cases]))
    (out / "report.md").write_text(_markdown(cases, args, [p.name for p in plots], quick))
    print(results_table(cases))
    print(findings(cases) if args.seeds > 1 else ONE_SEED)
    if docs:
        publish(docs, "bherd", plots, lambda paths: _markdown(cases, args, paths, quick))
    return 0
