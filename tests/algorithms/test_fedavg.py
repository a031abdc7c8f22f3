"""FedAvg, FedProx and SCAFFOLD against closed forms on the quadratic problem F_i(x) = ½‖x − u_i‖²."""

import dataclasses

import numpy as np
import pytest
import torch

from pyfedkern.algorithms import ALGORITHMS, algorithm_class, make_algorithm
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation

# Each client holds exactly its u_i, so one full batch gives the exact gradient x − u_i.
QUAD = ExperimentConfig(
    dataset="quadratic:8,5",
    partition="natural",
    clients=8,
    model="quadratic",
    batch_size=1,
    local_steps=1,
    lr=0.3,
    rounds=3,
)


def _u(sim: Simulation) -> torch.Tensor:
    return torch.stack([sim.client_x[i][0] for i in range(sim.num_clients)]).double()


def test_fedavg_one_local_step_is_gradient_descent_on_the_average():
    sim = Simulation(QUAD)
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    u = _u(sim)
    x = algo.x.double().clone()
    for t in range(3):
        algo.round(t, sim)
        x = x - 0.3 * (x - u.mean(0))
        torch.testing.assert_close(algo.x.double(), x, rtol=1e-6, atol=1e-6)


def test_fedavg_many_local_steps_closed_form():
    """K steps of size η from x: x_i = u_i + (1 − η)^K (x − u_i); the average follows."""
    sim = Simulation(dataclasses.replace(QUAD, local_steps=4))
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    u = _u(sim)
    x = algo.x.double().clone()
    algo.round(0, sim)
    expect = (u + (0.7**4) * (x - u)).mean(0)
    torch.testing.assert_close(algo.x.double(), expect, rtol=1e-6, atol=1e-6)


def test_fedprox_with_mu_zero_is_fedavg_and_mu_shrinks_the_step():
    plain = Simulation(dataclasses.replace(QUAD, local_steps=3)).run()
    prox0 = Simulation(dataclasses.replace(QUAD, local_steps=3, algorithm="fedprox", algorithm_params={"mu": 0.0}))
    assert [m["test_loss"] for m in prox0.run()] == [m["test_loss"] for m in plain]
    sim = Simulation(dataclasses.replace(QUAD, local_steps=2, algorithm="fedprox", algorithm_params={"mu": 1.0}))
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    u, x = _u(sim), sim.initial_vector.double()
    y = x.clone().expand_as(u).clone()
    for _ in range(2):  # gradient (y − u) + μ(y − x)
        y = y - 0.3 * ((y - u) + 1.0 * (y - x))
    algo.round(0, sim)
    torch.testing.assert_close(algo.x.double(), y.mean(0), rtol=1e-6, atol=1e-6)


def test_scaffold_controls_are_gradients_and_c_is_their_mean():
    sim = Simulation(dataclasses.replace(QUAD, algorithm="scaffold", fraction=0.5, rounds=6))
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    u = _u(sim)
    x0 = algo.x.double().clone()
    clients = algo.round(0, sim).clients
    # With one local step and c = c_i = 0 at the start, c_i⁺ = (x − y_i)/η = ∇F_i(x) = x − u_i.
    for cid in clients:
        torch.testing.assert_close(algo.client_c[cid].double(), x0 - u[cid], rtol=1e-5, atol=1e-5)
    for t in range(1, 6):
        algo.round(t, sim)
        torch.testing.assert_close(algo.c, algo.client_c.data.mean(0), rtol=1e-5, atol=1e-6)


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="server_lr"):
        make_algorithm("fedavg", server_lr=0.0)
    with pytest.raises(ValueError, match="mu"):
        make_algorithm("fedprox", mu=float("nan"))
    with pytest.raises((TypeError, ValueError), match="nope"):
        make_algorithm("fedavg", nope=1)


# A value of the wrong type for each kind of hyper-parameter field (the string "false" is truthy).
WRONG_TYPE = {"bool": "false", "int": 2.0, "float": "0.1", "str": 3, "tuple[float, ...]": "0.5"}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_hyperparameter_of_the_wrong_type_is_a_type_error_naming_it(name):
    fields = algorithm_class(name).hyperparameters()
    assert {str(f.type) for f in fields.values()} <= set(WRONG_TYPE)  # a new kind of field needs its own check
    for field_name, f in fields.items():
        with pytest.raises(TypeError, match=f"{name}: {field_name} must be"):
            make_algorithm(name, **{field_name: WRONG_TYPE[str(f.type)]})
    make_algorithm(name)  # the defaults pass


def test_numpy_numbers_and_bools_are_accepted():
    algo = make_algorithm("fedprox", mu=np.float32(0.5), ref_compat=np.bool_(True))
    assert algo.mu == 0.5 and algo.ref_compat


def test_a_round_without_participants_leaves_the_model_and_reports_no_loss():
    sim = Simulation(QUAD)
    for name in ("fedavg", "scaffold", "fedspeed", "fedadam", "bherd"):
        algo = make_algorithm(name)
        algo.setup(sim, sim.initial_vector)
        algo.participants = lambda t, ctx: np.array([], dtype=np.int64)
        before = algo.global_model().clone()
        stats = algo.round(0, sim)
        assert np.isnan(stats.local_loss) and len(stats.clients) == 0, name
        torch.testing.assert_close(algo.global_model(), before, rtol=0, atol=0)


def test_setup_refuses_a_vector_that_is_not_the_models():
    sim = Simulation(QUAD)
    algo = make_algorithm("fedavg")
    x0 = sim.initial_vector
    with pytest.raises(ValueError, match=r"x0 must hold the model's 5 parameters \(torch.float32, cpu\), got 4"):
        algo.setup(sim, x0[:4])
    with pytest.raises(ValueError, match=r"got 5 values \(torch.float64"):
        algo.setup(sim, x0.double())
    with pytest.raises(TypeError, match="x0 must be a torch tensor"):
        algo.setup(sim, x0.numpy())


def test_fedavg_learns_digits():
    """The default experiment (digits, Dirichlet 0.3, 20 clients) learns: a short run clearly beats chance."""
    metrics = Simulation(ExperimentConfig(rounds=10)).run()
    assert metrics[-1]["test_acc"] > 0.6
    assert np.isfinite(metrics[-1]["local_loss"])
