"""Plots: every run's curve stays visible, and the legend says which runs coincide."""

import matplotlib.figure
import pytest

from pyfedkern.sim.plots import coinciding_runs, plot_curves


def _records(acc, loss):
    return [{"round": t, "test_acc": a, "test_loss": l} for t, (a, l) in enumerate(zip(acc, loss, strict=True))]


ACC = [0.1, 0.4, 0.6, 0.7, 0.8, 0.85]
LOSS = [2.3, 1.5, 1.0, 0.7, 0.5, 0.4]


def test_coinciding_runs_exact_near_and_apart():
    runs = {
        "fedavg": _records(ACC, LOSS),
        "fedprox": _records([a + 0.002 for a in ACC], [v * 1.001 for v in LOSS]),  # within 1% of each panel
        "copy": _records(ACC, LOSS),
        "scaffold": _records([a - 0.05 for a in ACC], LOSS),  # same loss, accuracy 7% of the panel lower
        "short": _records(ACC[:-1], LOSS[:-1]),  # other rounds
    }
    same = coinciding_runs(runs, ("test_acc", "test_loss"))
    assert same == {
        "fedavg": (None, False),
        "fedprox": ("fedavg", False),
        "copy": ("fedavg", True),
        "scaffold": (None, False),
        "short": (None, False),
    }
    # on the loss panel alone scaffold lies on fedavg; a loss gap small in absolute terms but not in log10 is apart
    assert coinciding_runs(runs, ("test_loss",))["scaffold"] == ("fedavg", True)
    low = {"a": _records(ACC, [1e-4] * 6), "b": _records(ACC, [2e-4] * 6), "c": _records(ACC, [1.0] * 6)}
    assert coinciding_runs(low, ("test_loss",))["b"] == (None, False)
    assert coinciding_runs(low, ("test_loss",), log_loss=False)["b"] == ("a", False)


@pytest.fixture
def saved_figures(monkeypatch):
    figures = []
    original = matplotlib.figure.Figure.savefig

    def record(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return figures


def test_every_curve_has_its_own_style_and_the_legend_names_coinciding_runs(tmp_path, saved_figures):
    runs = {f"run{i}": _records([a + 0.1 * i for a in ACC], LOSS) for i in range(10)}
    runs["fedprox"] = runs["run0"]
    path = plot_curves(runs, tmp_path / "sub" / "compare.png", title="t")
    assert path.read_bytes().startswith(b"\x89PNG")
    (fig,) = saved_figures
    for ax in fig.axes:
        lines = ax.get_lines()
        assert len(lines) == 11
        assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 11
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert legend == [*(f"run{i}" for i in range(10)), "fedprox (= run0)"]
