"""Test accuracy of FedAvg under each Byzantine attack, with the weighted mean and with each robust aggregator, on
the bundled digits (a small run: 20 clients, all taking part, 15 rounds, 20 % of each round's clients attacking).

Usage: python bench/robust_attacks.py [--out docs/img/robust-attacks.png] > table.md

Writes a grouped bar chart (one group per attack, one bar per aggregator: the final test accuracy) and prints the
same numbers as a markdown table. docs/robust.md shows both.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation

CONFIG = ExperimentConfig(
    dataset="digits",
    clients=20,
    partition="dirichlet:1.0",
    model="mlp",
    rounds=15,
    lr=0.1,
    local_epochs=1.0,
    batch_size=16,
    eval_every=15,
    eval_train_max=0,
    threads=1,
    batched=True,
    seed=0,
)
ATTACKS = ["none", "signflip:0.2", "gaussian:0.2,1", "scale:0.2,-10", "alie:0.2", "ipm:0.2,2"]
AGGREGATORS = ["mean", "median", "trimmed:0.2", "krum:4", "multikrum:4,10", "bulyan:4", "geomed", "cclip:0.25,3"]


def accuracy(aggregator: str, attack: str) -> float:
    """The final test accuracy of one run."""
    cfg = dataclasses.replace(CONFIG, aggregator=aggregator, attack=None if attack == "none" else attack)
    return float(Simulation(cfg).run()[-1]["test_acc"])


def plot(results: dict[tuple[str, str], float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(AGGREGATORS)
    fig, ax = plt.subplots(figsize=(11, 4))
    for j, aggregator in enumerate(AGGREGATORS):
        xs = [i + (j - (len(AGGREGATORS) - 1) / 2) * width for i in range(len(ATTACKS))]
        ax.bar(xs, [results[aggregator, attack] for attack in ATTACKS], width, label=aggregator)
    ax.set_xticks(range(len(ATTACKS)), ATTACKS)
    ax.set_ylabel("test accuracy after 15 rounds")
    ax.set_ylim(0, 1)
    ax.set_title("FedAvg on digits (20 clients, 20 % attacking each round): aggregators under attack")
    ax.legend(ncol=4, fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/robust-attacks.png", help="the PNG to write")
    args = parser.parse_args(argv)
    results = {}
    for attack in ATTACKS:
        for aggregator in AGGREGATORS:
            results[aggregator, attack] = accuracy(aggregator, attack)
            print(f"{attack:>16} {aggregator:>16} {results[aggregator, attack]:.3f}", file=sys.stderr)
    plot(results, args.out)
    print("| aggregator | " + " | ".join(ATTACKS) + " |")
    print("|---|" + "---:|" * len(ATTACKS))
    for aggregator in AGGREGATORS:
        print(f"| {aggregator} | " + " | ".join(f"{results[aggregator, a]:.3f}" for a in ATTACKS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
