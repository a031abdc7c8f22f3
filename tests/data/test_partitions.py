"""Partitions: determinism, disjointness, coverage, the skew each scheme promises, BHerd cases, groups, reports."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pyfedkern.data.partitions import PARTITIONS, Partition, make_partition, parse_partition

# 2,000 samples, 10 classes of 200, in a shuffled order.
LABELS = np.random.default_rng(7).permutation(np.arange(2000) % 10)

RANDOM_SCHEMES = [
    "iid",
    "dirichlet:0.3",
    "shards:2",
    "quantity:0.5",
    "noise:0.5",
    "groups:0.2,0.3",
    "dirichlet-equal:0.3",
]
ALL_SCHEMES = [*RANDOM_SCHEMES, "bherd1", "bherd2", "bherd3"]


def _check_valid(part: Partition, n: int, num_clients: int, *, full: bool = True) -> None:
    assert part.num_clients == num_clients
    joined = np.concatenate(part.client_indices)
    for idx in part.client_indices:
        assert idx.dtype == np.int64
        assert np.all(np.diff(idx) > 0)  # sorted, no repeats
    assert np.unique(joined).size == joined.size  # disjoint
    assert joined.min() >= 0 and joined.max() < n
    if full:
        assert joined.size == n


def test_names():
    assert set(PARTITIONS) == {
        "iid", "dirichlet", "shards", "quantity", "noise", "bherd1", "bherd2", "bherd3", "groups",
        "dirichlet-equal", "natural",
    }  # fmt: skip


@pytest.mark.parametrize("spec", ALL_SCHEMES)
def test_valid_and_deterministic(spec):
    a = make_partition(spec, LABELS, 10, seed=3)
    b = make_partition(spec, LABELS, 10, seed=3)
    _check_valid(a, LABELS.size, 10, full=not spec.startswith("groups"))
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices, strict=True))
    assert all(idx.size > 0 for idx in a.client_indices)


@pytest.mark.parametrize("spec", RANDOM_SCHEMES)
def test_seed_changes_random_schemes(spec):
    a = make_partition(spec, LABELS, 10, seed=0)
    b = make_partition(spec, LABELS, 10, seed=1)
    assert any(not np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices, strict=True))


def test_iid_sizes_and_mix():
    part = make_partition("iid", LABELS, 7, seed=0)
    sizes = [idx.size for idx in part.client_indices]
    assert max(sizes) - min(sizes) <= 1
    counts = part.counts(LABELS, 10)
    assert counts.min() > 0  # every client sees every class


def _mean_tv_from_global(part: Partition) -> float:
    counts = part.counts(LABELS, 10).astype(float)
    mix = counts / counts.sum(axis=1, keepdims=True)
    return float(0.5 * np.abs(mix - 0.1).sum(axis=1).mean())


def test_dirichlet_skew_depends_on_alpha():
    skewed = make_partition("dirichlet:0.05", LABELS, 10, seed=0)
    flat = make_partition("dirichlet:1000", LABELS, 10, seed=0)
    _check_valid(skewed, LABELS.size, 10)
    assert _mean_tv_from_global(skewed) > 0.5
    assert _mean_tv_from_global(flat) < 0.08
    assert min(idx.size for idx in skewed.client_indices) >= 2


def test_dirichlet_gives_up_on_impossible_requests():
    with pytest.raises(ValueError, match="larger α or fewer clients"):
        make_partition("dirichlet:0.001", np.zeros(40, dtype=np.int64), 20, seed=0)


def test_shards_limit_classes_per_client():
    for k in (1, 2, 3):
        part = make_partition(f"shards:{k}", LABELS, 10, seed=k)
        _check_valid(part, LABELS.size, 10)
        classes_held = (part.counts(LABELS, 10) > 0).sum(axis=1)
        assert classes_held.max() <= k
    assert (make_partition("shards:1", LABELS, 10).counts(LABELS, 10) > 0).sum(axis=1).tolist() == [1] * 10
    with pytest.raises(ValueError, match="fewer than the 10 classes"):
        make_partition("shards:1", LABELS, 5)


def test_quantity_skews_sizes_not_labels():
    part = make_partition("quantity:0.3", LABELS, 10, seed=2)
    sizes = np.array([idx.size for idx in part.client_indices])
    assert sizes.min() >= 1 and sizes.max() > 3 * np.median(sizes)
    big = int(np.argmax(sizes))
    mix = part.counts(LABELS, 10)[big] / sizes[big]
    assert np.abs(mix - 0.1).max() < 0.05  # the largest client's labels look like the whole set's


def test_noise_levels():
    part = make_partition("noise:0.5", LABELS, 5, seed=0)
    np.testing.assert_allclose(part.noise_std, [0.0, 0.125, 0.25, 0.375, 0.5])
    assert part.noise_std.dtype == np.float64
    assert make_partition("iid", LABELS, 5).noise_std is None
    np.testing.assert_array_equal(make_partition("noise:0.5", LABELS, 1).noise_std, [0.0])


# BHerd cases on N = 5, labels 0..9 ----------------------------------------------------------------------------


def test_bherd_case1_round_robin():
    part = make_partition("bherd1", LABELS, 5)
    for c, idx in enumerate(part.client_indices):
        np.testing.assert_array_equal(idx, np.arange(c, 2000, 5))


def test_bherd_case2_label_mod_n():
    part = make_partition("bherd2", LABELS, 5)
    for c, idx in enumerate(part.client_indices):
        assert set(LABELS[idx].tolist()) == {c, c + 5}
        np.testing.assert_array_equal(idx, np.flatnonzero(LABELS % 5 == c))


def test_bherd_case3():
    part = make_partition("bherd3", LABELS, 5)
    index = np.arange(LABELS.size)
    lower = LABELS < 5
    for c in range(3):  # labels 0-4 go to client i mod 3
        np.testing.assert_array_equal(part.client_indices[c], index[lower & (index % 3 == c)])
    assert set(LABELS[part.client_indices[3]].tolist()) == {6, 8}
    assert set(LABELS[part.client_indices[4]].tolist()) == {5, 7, 9}
    np.testing.assert_array_equal(part.client_indices[4], index[np.isin(LABELS, [5, 7, 9])])


def test_bherd_more_clients_than_labels():
    # N = 20 > 10 labels: slot t's samples are shared round-robin by clients t and t + 10 (least-filled rule).
    part = make_partition("bherd2", LABELS, 20)
    _check_valid(part, LABELS.size, 20)
    for c, idx in enumerate(part.client_indices):
        assert set(LABELS[idx].tolist()) == {c % 10}
        own = np.flatnonzero(LABELS == c % 10)
        np.testing.assert_array_equal(idx, own[c // 10 :: 2])
    case3 = make_partition("bherd3", LABELS, 20)
    _check_valid(case3, LABELS.size, 20)
    index = np.arange(LABELS.size)
    for c, idx in enumerate(case3.client_indices):
        slot = c % 10
        if slot < 5:  # lower labels: slot i mod 5, then alternating between clients slot and slot + 10
            own = index[(LABELS < 5) & (index % 5 == slot)]
        else:  # upper labels: slot 5 + label mod 5, i.e. label == slot
            own = index[LABELS == slot]
        np.testing.assert_array_equal(idx, own[c // 10 :: 2])


def test_bherd_single_client():
    for case in (1, 2, 3):
        part = make_partition(f"bherd{case}", LABELS, 1)
        np.testing.assert_array_equal(part.client_indices[0], np.arange(LABELS.size))


# groups / dirichlet-equal / natural --------------------------------------------------------------------------


def test_groups_label_sets_cifar_like():
    part = make_partition("groups:0.2,0.3", LABELS, 10, seed=0, num_classes=10)
    assert part.group_labels[0].tolist() == [0, 1, 2, 3, 4]
    assert part.group_labels[1].tolist() == [4, 5, 6, 7, 8]
    np.testing.assert_array_equal(part.groups, [0] * 5 + [1] * 5)
    counts = part.counts(LABELS, 10)
    assert counts[:5, 5:].sum() == 0 and counts[5:, :4].sum() == 0 and counts[:, 9].sum() == 0
    # Label 4 is shared: its samples are split between the groups, everything else in a set is used.
    assert counts[:5, 4].sum() == 100 and counts[5:, 4].sum() == 100
    np.testing.assert_array_equal(counts.sum(axis=0), [200] * 9 + [0])
    sizes = counts.sum(axis=1)
    assert sizes[:5].max() - sizes[:5].min() <= 1 and sizes[5:].max() - sizes[5:].min() <= 1


def test_groups_halves_and_skew():
    part = make_partition("groups", LABELS, 4, seed=0)
    assert part.scheme == "groups:0,0.3"
    assert part.group_labels[0].tolist() == [0, 1, 2, 3, 4] and part.group_labels[1].tolist() == [5, 6, 7, 8, 9]
    _check_valid(part, LABELS.size, 4)  # o = 0 with 10 labels uses every label
    skewed = make_partition("groups:0,0.05", LABELS, 20, seed=0).counts(LABELS, 10)
    even = make_partition("groups:0,100", LABELS, 20, seed=0).counts(LABELS, 10)
    top_share = lambda c: (c.max(axis=1) / c.sum(axis=1)).mean()  # noqa: E731
    assert top_share(skewed) > 0.6 and top_share(even) < 0.35
    with pytest.raises(ValueError, match="even number"):
        make_partition("groups", LABELS, 5)
    with pytest.raises(ValueError, match="overlap"):
        make_partition("groups:1.5", LABELS, 4)


def test_dirichlet_equal_sizes_and_skew():
    part = make_partition("dirichlet-equal:0.05", LABELS, 10, seed=4)
    sizes = np.array([idx.size for idx in part.client_indices])
    assert sizes.tolist() == [200] * 10
    assert _mean_tv_from_global(part) > 0.4
    flat = make_partition("dirichlet-equal:1000", LABELS, 10, seed=4)
    # The last clients take what is left, so allow more slack than for dirichlet.
    assert _mean_tv_from_global(flat) < 0.15


def test_natural():
    ids = np.repeat([3, 1, 8], [5, 7, 2])
    labels = np.zeros(14, dtype=np.int64)
    part = make_partition("natural", labels, 3, client_ids=ids)
    assert [idx.tolist() for idx in part.client_indices] == [
        list(range(5, 12)),
        list(range(0, 5)),
        list(range(12, 14)),
    ]
    assert make_partition("natural", labels, 2, client_ids=ids).num_clients == 2
    with pytest.raises(ValueError, match="3 natural clients"):
        make_partition("natural", labels, 4, client_ids=ids)
    with pytest.raises(ValueError, match="client_ids"):
        make_partition("natural", labels, 2)


# validation and reports ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "clients", "message"),
    [
        ("iid", 0, "num_clients"),
        ("iid", 2001, "num_clients"),
        ("dirichlet:0", 5, "dirichlet:α must be > 0"),
        ("dirichlet:-1", 5, "α"),
        ("quantity:0", 5, "quantity:α must be > 0"),
        ("shards:0", 5, "shards:k"),
        ("shards:1.5", 5, "shards:k"),
        ("noise:-0.1", 5, "σ"),
        ("iid:3", 5, "at most 0"),
        ("dirichlet:1,2", 5, "at most 1"),
        ("random", 5, "unknown partition"),
        ("dirichlet:x", 5, "not a number"),
    ],
)
def test_bad_specs(spec, clients, message):
    with pytest.raises(ValueError, match=message):
        make_partition(spec, LABELS, clients)
    if clients <= LABELS.size:  # everything but the sample count is checked without data
        with pytest.raises(ValueError, match=message):
            parse_partition(spec, clients)


def test_parse_partition_fills_defaults():
    assert parse_partition("dirichlet", 5) == ("dirichlet", [0.5])
    assert parse_partition("groups:0.2", 4) == ("groups", [0.2, 0.3])
    with pytest.raises(ValueError, match="even number"):
        parse_partition("groups", 5)
    with pytest.raises(ValueError, match="groups:o,α α must be > 0"):
        parse_partition("groups:0.5,0", 4)


def test_bad_labels():
    with pytest.raises(ValueError, match="integer"):
        make_partition("iid", np.array([0.5, 1.0]), 1)
    with pytest.raises(ValueError, match="num_classes"):
        make_partition("iid", LABELS, 2, num_classes=5)
    with pytest.raises(TypeError, match="num_clients"):
        make_partition("iid", LABELS, 2.0)


def test_summary_table():
    part = make_partition("dirichlet:0.5", LABELS, 4, seed=0)
    counts = part.counts(LABELS, 10)
    table = part.summary_table(LABELS, 10)
    lines = table.splitlines()
    rows = [line.split() for line in lines[2:]]
    for c in range(4):
        assert rows[c][0] == str(c) and [int(v) for v in rows[c][1:]] == [*counts[c], counts[c].sum()]
    assert rows[-1] == ["total", *(str(v) for v in counts.sum(axis=0)), "2000"]
    noisy = make_partition("noise:0.3", LABELS, 60).summary_table(LABELS, 10)
    assert "… 10 more clients" in noisy and "noise" in noisy.splitlines()[1]
    assert len(noisy.splitlines()) == 2 + 50 + 2
    wide_labels = np.arange(300) % 30
    wide = make_partition("iid", wide_labels, 3).summary_table(wide_labels, 30)
    header = wide.splitlines()[1].split()
    assert header[-2:] == ["…", "total"] and len(header) == 1 + 20 + 2
    assert wide.splitlines()[-1].split()[-2:] == ["100", "300"]


def test_plot_writes_png(tmp_path):
    part = make_partition("shards:2", LABELS, 8, seed=0)
    out = part.plot(LABELS, 10, tmp_path / "split.png")
    assert out == tmp_path / "split.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    many = np.arange(600) % 40
    heat = make_partition("iid", many, 6).plot(many, 40, tmp_path / "heat.png")
    assert heat.stat().st_size > 1000


def test_plot_names_the_file_it_writes(tmp_path):
    part = make_partition("shards:2", LABELS, 8, seed=0)
    folder = tmp_path / "plots"
    folder.mkdir()
    cases = [
        (tmp_path / "bare", tmp_path / "bare.png"),  # no suffix: .png added
        (folder, folder / "partition.png"),  # an existing directory
        (f"{folder}{os.sep}", folder / "partition.png"),  # a trailing separator means a directory
        (tmp_path / "split.pdf", tmp_path / "split.pdf"),  # the suffix names the format
    ]
    magic = {".png": b"\x89PNG", ".pdf": b"%PDF"}
    for given, written in cases:
        assert part.plot(LABELS, 10, given) == written
        assert written.read_bytes().startswith(magic[written.suffix])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.png", "plots", "split.pdf"]
    made = tmp_path / "new" / "partition.png"  # missing folders are made, as compare makes its own
    assert part.plot(LABELS, 10, f"{tmp_path / 'new'}{os.sep}") == made and made.exists()
    assert part.plot(LABELS, 10, tmp_path / "deep" / "er" / "split.png").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot write the plot"):  # a folder where a file is
        part.plot(LABELS, 10, tmp_path / "file" / "split.png")
