"""Run under torchrun by tests/sim/test_distributed.py: every case of a JSON file twice on the same ranks.

Usage: ``torchrun --standalone --nproc-per-node N tests/sim/distributed_cases.py CASES.json OUT.json``. CASES.json
holds ``cases`` (a case name → ExperimentConfig fields), ``resumed`` (case names also run to their next-to-last
round in a run directory under ``runs`` and then resumed to the last) and ``runs``; rank 0 writes OUT.json: per
case, the metrics of both runs (and of the resumed one) and, per rank, the rows of each of the algorithm's client
stores, the clients the rank owns and whether it trains only those (client state kept).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from pyfedkern.algorithms import ClientStore
from pyfedkern.sim import distributed
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation


def main(cases_path: str, out_path: str) -> None:
    spec = json.loads(open(cases_path).read())
    cases = spec["cases"]
    devices = {fields.get("device", "cpu") for fields in cases.values()}
    distributed.init_process_group(distributed.rank_device(devices.pop()))
    results = {}
    for name, fields in cases.items():
        config = ExperimentConfig(**fields)
        results[name] = {}
        if name in spec["resumed"]:
            run_dir = os.path.join(spec["runs"], name)
            for rounds, resume in ((config.rounds - 1, False), (config.rounds, True)):
                sim = Simulation(dataclasses.replace(config, rounds=rounds))
                sim.team = distributed.init_team(sim)
                results[name]["resumed"] = sim.run(run_dir, resume=resume)
        runs = []
        for _ in range(2):
            sim = Simulation(config)
            sim.team = distributed.init_team(sim)
            runs.append(sim.run())
        stores = {
            key: value.data.shape[0] for key, value in vars(sim.algorithm).items() if isinstance(value, ClientStore)
        }
        team = sim.team
        ranks = team.gather({"stores": stores, "owned": team.owned.tolist(), "fixed_owners": team.fixed_owners})
        results[name].update(runs=runs, ranks=ranks)
    if sim.team.rank == 0:
        with open(out_path, "w") as file:
            json.dump(results, file)
    distributed.close_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
