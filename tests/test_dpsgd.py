"""Local DP-SGD (pyfedkern.dpsgd): book-keeping clipped sums against per-sample gradients (Opacus and a plain
per-sample loop), the noise stream, and misuse."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyfedkern.dpsgd import DPSGD, units
from pyfedkern.models import build_model


def _clip_reference(per_sample: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """Σ_n min(1, C/‖g_n‖)·g_n from per-sample gradients [B, *shape] of each parameter (plain torch)."""
    B = per_sample[0].shape[0]
    norms = torch.stack([g.reshape(B, -1).square().sum(1) for g in per_sample]).sum(0).sqrt()
    factors = torch.clamp(clip / norms, max=1.0)
    return [torch.einsum("b,b...->...", factors, g) for g in per_sample]


def _loop_per_sample(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample gradients of cross-entropy, one backward per sample."""
    params = [p for p in model.parameters() if p.requires_grad]
    per = [torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params) for i in range(len(x))]
    return [torch.stack([g[j] for g in per]) for j in range(len(params))]


class _Tokens(nn.Module):
    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=padding_idx)
        self.conv = nn.Conv1d(6, 5, 3, padding="same")
        self.norm = nn.LayerNorm(5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(x).transpose(1, 2)).transpose(1, 2)
        return self.out(self.norm(h).mean(1))


class _Image(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding="same", bias=False)
        self.conv1 = nn.Conv1d(4, 4, 2, stride=2, dilation=1)
        self.out = nn.Linear(4 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(torch.relu(self.norm(self.conv(x))))
        return self.out(self.conv1(h.flatten(2)).flatten(1))


class _Recurrent(nn.Module):
    def __init__(self, cell: type) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 4)
        self.rnn = cell(4, 5, 2, batch_first=True)
        self.out = nn.Linear(5 * (1 + self.rnn.bidirectional), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.out(h[:, -1])


def _tokens(B: int, T: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    ids[0, :2] = ids[0, 2]  # repeated tokens within a sample
    return ids


CASES = {
    "tokens": (_Tokens, lambda: _tokens(7, 6, 11, 1)),
    "image": (_Image, lambda: torch.randn(7, 3, 8, 8, dtype=torch.float64)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_clipped_sum_equals_opacus(case, clip):
    """σ = 0: the book-keeping sum equals Opacus 1.6's GradSampleModule per-sample gradients, clipped (Linear,
    Conv1d, Conv2d, Embedding, LayerNorm, GroupNorm; clipped and unclipped)."""
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(0)
    build, inputs = CASES[case]
    model = build().double()
    x, y = inputs(), torch.randint(0, 3, (7,))
    sums, norms, _ = DPSGD(clip, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    wrapped = opacus.GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(wrapped(x), y, reduction="sum").backward()
    per_sample = [p.grad_sample for p in model.parameters()]
    wrapped._close()
    expected = _clip_reference(per_sample, clip)
    for got, want in zip(sums, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    want_norms = torch.stack([g.reshape(7, -1).square().sum(1) for g in per_sample]).sum(0).sqrt()
    torch.testing.assert_close(norms, want_norms, rtol=1e-10, atol=1e-12)


def test_embedding_padding_row_has_no_gradient():
    """A padding_idx row gets no gradient, as in torch's own backward (Opacus 1.6 gives it one)."""
    torch.manual_seed(5)
    model = _Tokens(padding_idx=0).double()
    x, y = _tokens(6, 5, 11, 4), torch.randint(0, 3, (6,))
    x[1, 3] = 0
    sums, _, _ = DPSGD(0.2, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    for got, want in zip(sums, _clip_reference(_loop_per_sample(model, x, y), 0.2), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert not sums[0][0].any()


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, "bidirectional"])
def test_recurrent_layers_equal_per_sample_loop(cell, caplog):
    """LSTM and GRU (book-kept from their gate gradients) and a bidirectional GRU (torch.func, named in a log line)
    equal one backward per sample."""
    bidirectional = cell == "bidirectional"
    if bidirectional:
        cell = functools.partial(nn.GRU, bidirectional=True)
    torch.manual_seed(1)
    model = _Recurrent(cell).double()
    x, y = _tokens(5, 6, 9, 2), torch.randint(0, 3, (5,))
    with caplog.at_level(logging.INFO, logger="pyfedkern"):
        sums, _, _ = DPSGD(0.1, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    for got, want in zip(sums, _clip_reference(_loop_per_sample(model, x, y), 0.1), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    logged = any("torch.func" in r.message and "GRU" in r.message for r in caplog.records)
    assert logged == bidirectional


def test_lstm_clipped_sum_equals_opacus_dplstm():
    """σ = 0: an LSTM's book-kept clipped sum equals Opacus 1.6's DPLSTM under GradSampleModule, clipped."""
    opacus = pytest.importorskip("opacus")
    from opacus.validators import ModuleValidator

    torch.manual_seed(6)
    model = _Recurrent(nn.LSTM).double()
    x, y = _tokens(6, 7, 9, 5), torch.randint(0, 3, (6,))
    twin = ModuleValidator.fix(model).double()
    twin.load_state_dict(model.state_dict(), strict=False)
    assert type(twin.rnn).__name__ == "DPLSTM"
    torch.testing.assert_close(twin(x), model(x), rtol=1e-12, atol=1e-12)
    sums, norms, _ = DPSGD(0.05, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    wrapped = opacus.GradSampleModule(twin, loss_reduction="sum")
    F.cross_entropy(wrapped(x), y, reduction="sum").backward()
    per_sample = dict(twin.named_parameters())
    ours = dict(zip([n for n, _ in model.named_parameters()], sums, strict=True))
    grad_samples = [per_sample[n].grad_sample for n in ours]
    wrapped._close()
    for (name, got), want in zip(ours.items(), _clip_reference(grad_samples, 0.05), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
    want_norms = torch.stack([g.reshape(6, -1).square().sum(1) for g in grad_samples]).sum(0)
    torch.testing.assert_close(norms, want_norms.sqrt(), rtol=1e-10, atol=1e-12)


def test_batched_lstm_equals_the_loop():
    """The batched path (per-sample gradients of the LSTM, row by row) equals the loop's book-kept LSTM."""
    torch.manual_seed(9)
    model = _Recurrent(nn.LSTM).double()
    k, B = 3, 4
    params = {
        n: torch.stack([p.detach() + 0.1 * torch.randn_like(p) for _ in range(k)]) for n, p in model.named_parameters()
    }
    xb, yb = torch.stack([_tokens(B, 6, 9, r) for r in range(k)]), torch.randint(0, 3, (k, B))
    dp = DPSGD(0.1, 0.0)
    sums, norms, _ = dp.batched_clipped_sums(model, F.cross_entropy, params, xb, yb)
    for r in range(k):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n][r])
        loop, loop_norms, _ = dp.clipped_sum(model, F.cross_entropy, xb[r], yb[r])
        for (n, _), got in zip(model.named_parameters(), loop, strict=True):
            torch.testing.assert_close(sums[n][r], got, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(norms[r], loop_norms, rtol=1e-10, atol=1e-12)


class _RNNVariants(nn.Module):
    """An LSTM or GRU fed a given state, its final state used, time-major or batch-first, with or without biases."""

    def __init__(self, cell: type, batch_first: bool, bias: bool, layers: int) -> None:
        super().__init__()
        self.rnn = cell(3, 4, layers, batch_first=batch_first, bias=bias)
        self.states = 2 if cell is nn.LSTM else 1
        self.state = nn.Linear(3, self.states * layers * 4)
        self.out = nn.Linear(4 + self.states * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, layers = x.shape[0], self.rnn.num_layers
        given = torch.tanh(self.state(x[:, 0])).reshape(B, self.states, layers, 4).permute(1, 2, 0, 3).contiguous()
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        y, final = self.rnn(seq, tuple(given) if self.states == 2 else given[0])
        last = y[:, -1] if self.rnn.batch_first else y[-1]
        finals = [final[0][-1], final[1][0]] if self.states == 2 else [final[-1]]
        return self.out(torch.cat([last, *finals], 1))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first,bias,layers", [(True, True, 1), (False, False, 2), (False, True, 3)])
def test_rnn_variants_equal_per_sample_loop(cell, batch_first, bias, layers):
    """Given initial states, the final states' gradients, time-major input, no biases, a frozen weight: the
    book-kept LSTM / GRU equals one backward per sample."""
    torch.manual_seed(7)
    model = _RNNVariants(cell, batch_first, bias, layers).double()
    model.rnn.weight_hh_l0.requires_grad_(False)
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    sums, _, total = DPSGD(0.2, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    for got, want in zip(sums, _clip_reference(_loop_per_sample(model, x, y), 0.2), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(total, F.cross_entropy(model(x), y, reduction="sum"))
    assert "forward" not in vars(model.rnn)  # the class's own forward again


def test_gru_layer_gradients_equal_autograd_of_its_cells():
    """_GRULayer's backward: ∂L/∂(x, h0, weights) equal torch's GRU's, and ∂L/∂(probes) equal the gradients of the
    input and hidden projections A_t, C_t of the same layer written cell by cell."""
    from pyfedkern.dpsgd import _GRULayer

    torch.manual_seed(10)
    B, T, I, H = 3, 5, 4, 6
    gru = nn.GRU(I, H, batch_first=True).double()
    weights = [gru.weight_ih_l0, gru.weight_hh_l0, gru.bias_ih_l0, gru.bias_hh_l0]
    x = torch.randn(B, T, I, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    probes = [torch.zeros(B, T, 3 * H, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    wy, wh = torch.randn(B, T, H, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64)
    y, h = _GRULayer.apply(x, h0, *probes, *weights)
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), [x, h0, *weights, *probes])
    y2, h2 = gru(x, h0[None])
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad((y2 * wy).sum() + (h2[0] * wh).sum(), [x, h0, *weights])
    for a, b in zip(got[:-2], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    w_ih, w_hh, b_ih, b_hh = (w.detach() for w in weights)
    a_all = (x.detach() @ w_ih.T + b_ih).requires_grad_()
    hh, outs = h0.detach(), []
    probe_c = torch.zeros(B, T, 3 * H, dtype=torch.float64, requires_grad=True)
    for t in range(T):
        ar, az, an = a_all[:, t].chunk(3, 1)
        cr, cz, cn = (hh @ w_hh.T + b_hh + probe_c[:, t]).chunk(3, 1)
        r, z = torch.sigmoid(ar + cr), torch.sigmoid(az + cz)
        n = torch.tanh(an + r * cn)
        hh = (1 - z) * n + z * hh
        outs.append(hh)
    da, dc = torch.autograd.grad((torch.stack(outs, 1) * wy).sum() + (hh * wh).sum(), [a_all, probe_c])
    torch.testing.assert_close(got[-2], da, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[-1], dc, rtol=1e-10, atol=1e-12)


def test_lstm_layer_gradients_equal_autograd_of_its_cells():
    """_LSTMLayer's backward: ∂L/∂(x, h0, c0, weights) equal torch's LSTM's, and ∂L/∂probe equals the gradient of
    the gate pre-activations Z_t of the same layer written cell by cell."""
    from pyfedkern.dpsgd import _LSTMLayer

    torch.manual_seed(8)
    B, T, I, H = 3, 5, 4, 6
    lstm = nn.LSTM(I, H, batch_first=True).double()
    weights = [lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0]
    x = torch.randn(B, T, I, dtype=torch.float64, requires_grad=True)
    h0, c0 = (torch.randn(B, H, dtype=torch.float64, requires_grad=True) for _ in range(2))
    probe = torch.zeros(B, T, 4 * H, dtype=torch.float64, requires_grad=True)
    wy, wh, wc = (torch.randn(*shape, dtype=torch.float64) for shape in ((B, T, H), (B, H), (B, H)))
    y, h, c = _LSTMLayer.apply(x, h0, c0, probe, *weights)
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum() + (c * wc).sum(), [x, h0, c0, *weights, probe])
    y2, (h2, c2) = lstm(x, (h0[None], c0[None]))
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad((y2 * wy).sum() + (h2[0] * wh).sum() + (c2[0] * wc).sum(), [x, h0, c0, *weights])
    for a, b in zip(got[:-1], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    w_ih, w_hh, b_ih, b_hh = (w.detach() for w in weights)
    z = (x.detach() @ w_ih.T + b_ih + b_hh).requires_grad_()
    hh, cc, outs = h0.detach(), c0.detach(), []
    for t in range(T):
        i, f, g, o = (z[:, t] + hh @ w_hh.T).chunk(4, 1)
        cc = torch.sigmoid(f) * cc + torch.sigmoid(i) * torch.tanh(g)
        hh = torch.sigmoid(o) * torch.tanh(cc)
        outs.append(hh)
    dz = torch.autograd.grad((torch.stack(outs, 1) * wy).sum() + (hh * wh).sum() + (cc * wc).sum(), z)[0]
    torch.testing.assert_close(got[-1], dz, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name,shape,kwargs",
    [
        ("simple_cnn", (3, 10, 10), {"dropout": False}),
        ("mlp", (12,), {}),
        ("lstm", (6,), {"hidden": 8}),
        ("resnet18", (3, 8, 8), {}),
        ("transformer", (6,), {"dim": 8, "heads": 2, "ff": 16}),
    ],
)
def test_builtin_models_equal_per_sample_loop(name, shape, kwargs):
    torch.manual_seed(2)
    model = build_model(name, shape, 4, **kwargs).double()
    B = 3
    x = _tokens(B, shape[0], 4, 3) if name in ("lstm", "transformer") else torch.randn(B, *shape, dtype=torch.float64)
    y = torch.randint(0, 4, (B,))
    sums, _, total = DPSGD(0.3, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    for got, want in zip(sums, _clip_reference(_loop_per_sample(model, x, y), 0.3), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(total, F.cross_entropy(model(x), y, reduction="sum"))


def test_gradient_writes_mean_plus_noise_into_the_flat_buffer():
    """gradient_: (clipped sum + σC·ξ)/b in .grad; the noise has standard deviation σC/b, is reproducible per key,
    differs between keys, does not depend on the thread count, and a Poisson step divides by the expected size."""
    torch.manual_seed(3)
    model = nn.Linear(300, 100).double()
    x, y = torch.randn(4, 300, dtype=torch.float64), torch.randint(0, 100, (4,))
    dp = DPSGD(0.5, 2.0, seed=7)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    clean, _, _ = DPSGD(0.5, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    clean_flat = torch.cat([c.reshape(-1) for c in clean]) / 4
    dp.gradient_(model, F.cross_entropy, x, y, (1, 2, 3), flat)
    noise = (flat - clean_flat) * 4 / (2.0 * 0.5)  # ξ ~ N(0, I)
    assert abs(float(noise.std()) - 1.0) < 0.03 and abs(float(noise.mean())) < 0.03
    first = flat.clone()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        dp.gradient_(model, F.cross_entropy, x, y, (1, 2, 3), flat)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(flat, first, rtol=1e-12, atol=1e-12)
    dp.gradient_(model, F.cross_entropy, x, y, (1, 2, 4), flat)
    assert not torch.allclose(flat, first)
    poisson = DPSGD(0.5, 2.0, seed=7, expected_batch=8.0)
    poisson.gradient_(model, F.cross_entropy, x, y, (1, 2, 3), flat)
    torch.testing.assert_close(flat, first * 4 / 8, rtol=1e-12, atol=1e-12)


def test_noise_standard_deviation_over_many_keys():
    dp = DPSGD(1.5, 0.8, seed=0)
    draws = torch.stack([dp.add_noise_(torch.zeros(50), (0, 0, s), 0.5) for s in range(400)])
    assert abs(float(draws.std()) / (0.8 * 1.5 * 0.5) - 1.0) < 0.02


def test_penalty_is_added_unclipped():
    torch.manual_seed(4)
    model = nn.Linear(5, 3).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    dp = DPSGD(0.01, 0.0)
    dp.gradient_(model, F.cross_entropy, x, y, (0,))
    plain = [p.grad.clone() for p in model.parameters()]
    dp.gradient_(model, F.cross_entropy, x, y, (0,), penalty=lambda m: 0.5 * m.weight.square().sum())
    torch.testing.assert_close(model.weight.grad, plain[0] + model.weight.detach())
    torch.testing.assert_close(model.bias.grad, plain[1])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"clip": 0.0, "noise_multiplier": 1.0}, "clip"),
        ({"clip": float("inf"), "noise_multiplier": 1.0}, "clip"),
        ({"clip": float("nan"), "noise_multiplier": 1.0}, "clip"),
        ({"clip": 1.0, "noise_multiplier": -1.0}, "noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "seed": -1}, "seed"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "expected_batch": 0}, "expected_batch"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSGD(**kwargs)


def test_batchnorm_in_training_mode_is_refused_by_name():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 2))
    with pytest.raises(ValueError, match=r"1 is a BatchNorm2d in training mode"):
        units(model)
    model.eval()
    assert [u.name for u in units(model)] == ["0", "1", "3"]


def test_shared_parameters_and_unhandled_layers_are_refused():
    lin = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="called more than once"):
        DPSGD(1.0, 0.0).clipped_sum(nn.Sequential(lin, lin), F.cross_entropy, torch.randn(2, 3), torch.tensor([0, 1]))

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w * float(x.sum())  # .item()-like: torch.func cannot run it

    with pytest.raises(TypeError, match="Odd"):
        DPSGD(1.0, 0.0).clipped_sum(Odd(), F.cross_entropy, torch.randn(2, 3), torch.tensor([0, 1]))


@pytest.mark.parametrize(
    "model,clients",
    [
        (lambda: build_model("cnn", (3, 6, 6), 4, channels=3, hidden=8), "iid"),
        (lambda: build_model("svm", (3, 6, 6), 4), "dirichlet:0.5"),  # a penalty; unequal batches (padding)
        (lambda: build_model("mlp", (3, 6, 6), 4, hidden=8), "dirichlet:0.5"),
    ],
)
def test_batched_dpsgd_equals_the_loop(model, clients):
    """k clients' DP-SGD steps as one batched step equal local_sgd client by client, noise included (float64),
    with momentum and weight decay; padded rows of unequal batches add nothing."""
    import numpy as np

    from pyfedkern import Experiment
    from pyfedkern.algorithms import local_sgd
    from pyfedkern.algorithms.looped import local_sgd_rows_

    torch.manual_seed(0)
    x, y = torch.randn(130, 3, 6, 6), torch.randint(0, 4, (130,))
    sims = []
    for batched in (False, True):
        experiment = Experiment(
            model,
            (x[:100], y[:100]),
            (x[100:], y[100:]),
            clients=clients,
            num_clients=5,
            rounds=1,
            batch_size=7,
            lr=0.1,
            momentum=0.5,
            weight_decay=0.01,
            dtype="float64",
            batched=batched,
            eval_initial=False,
        )
        sim = experiment.simulation
        sim.dpsgd = DPSGD(0.5, 1.0, seed=3)
        sims.append(sim)
    chosen = np.array([0, 2, 3])
    x0 = sims[0].initial_vector
    rows = x0.expand(len(chosen), -1).clone()
    losses = local_sgd_rows_(sims[1], 1, rows, chosen)
    for r, cid in enumerate(chosen):
        loop = local_sgd(sims[0], int(cid), 1, x0)
        assert (loop.x - x0).abs().max() > 1e-3
        torch.testing.assert_close(rows[r], loop.x, rtol=0, atol=1e-12)
        assert abs(float(losses[r]) - loop.loss) < 1e-12
