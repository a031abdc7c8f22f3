"""Splitting a training set among simulated clients.

Every scheme returns sorted, disjoint int64 index arrays into the label array, one per client; the same seed gives
the same split. Specs are ``name`` or ``name:arg,arg``:

- ``iid``: a seeded permutation cut into near-equal parts.
- ``dirichlet:α`` (α = 0.5): label skew as in NIID-Bench; per class, p ~ Dir(α·1_N) over clients (clients already
  holding ≥ n/N samples get p = 0) and the class's shuffled samples are cut at the cumulative proportions; redrawn
  until every client has at least 2 samples.
- ``shards:k`` (k = 2): each class is cut into shards (N·k in all, shared out by class size) and every client is
  dealt k random shards, so it holds at most k classes.
- ``quantity:α`` (α = 0.5): client sizes 1 + Dir(α) share of the rest; labels IID.
- ``noise:σ`` (σ = 0.1): IID, plus FNR-FL feature skew: client i gets Gaussian input noise of std σ·i/(N−1).
- ``bherd1`` / ``bherd2`` / ``bherd3``: Cases 1–3 of BHerd (the code cases 1, 2 and 4 of Wang et al., JSAC'19).
- ``groups:o,α`` (o = 0, α = 0.3): two client groups with overlapping label sets (dynamic initial models).
- ``dirichlet-equal:α`` (α = 0.5): equal sizes, each client's label mix ~ Dir(α) (FedPBC's data split).
- ``natural``: one client per distinct ``client_ids`` value (synthetic, synthetic-iid, quadratic).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyfedkern.data.spec import parse_spec

# name -> default arguments (and so the number it takes)
_DEFAULTS: dict[str, tuple[float, ...]] = {
    "iid": (),
    "dirichlet": (0.5,),
    "shards": (2.0,),
    "quantity": (0.5,),
    "noise": (0.1,),
    "bherd1": (),
    "bherd2": (),
    "bherd3": (),
    "groups": (0.0, 0.3),
    "dirichlet-equal": (0.5,),
    "natural": (),
}
PARTITIONS = tuple(_DEFAULTS)

_MIN_DIRICHLET_SIZE = 2
_MAX_DIRICHLET_TRIES = 1000


@dataclass
class Partition:
    """Client index lists (sorted int64 arrays into the label array) and per-client extras.

    noise_std: float64 [N] Gaussian feature-noise std of each client (``noise`` scheme). groups: int64 [N] group id
    0/1 and group_labels: the two groups' label arrays (``groups`` scheme).
    """

    scheme: str
    client_indices: list[np.ndarray]
    noise_std: np.ndarray | None = None
    groups: np.ndarray | None = None
    group_labels: list[np.ndarray] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def counts(self, labels: np.ndarray, num_classes: int) -> np.ndarray:
        """Samples per client per class, int64 [N, num_classes]."""
        labels = np.asarray(labels)
        out = np.zeros((self.num_clients, num_classes), dtype=np.int64)
        for i, idx in enumerate(self.client_indices):
            out[i] = np.bincount(labels[idx], minlength=num_classes)[:num_classes]
        return out

    def summary_table(self, labels: np.ndarray, num_classes: int, *, max_rows: int = 50, max_classes: int = 20) -> str:
        """Plain-text table: one row per client (samples per class and total), then a total row.

        Shows at most ``max_rows`` clients and ``max_classes`` class columns (the rest summed in a "…" column).
        """
        counts = self.counts(labels, num_classes)
        shown = min(num_classes, max_classes)
        header = ["client", *(str(c) for c in range(shown))]
        if num_classes > shown:
            header.append("…")
        header.append("total")
        extras = []
        if self.groups is not None:
            header.append("group")
            extras.append(lambda i: "AB"[int(self.groups[i])])
        if self.noise_std is not None:
            header.append("noise")
            extras.append(lambda i: f"{self.noise_std[i]:.3g}")

        def cells(name: str, row: np.ndarray) -> list[str]:
            out = [name, *(str(v) for v in row[:shown])]
            if num_classes > shown:
                out.append(str(row[shown:].sum()))
            return [*out, str(row.sum())]

        rows = [[*cells(str(i), counts[i]), *(f(i) for f in extras)] for i in range(min(self.num_clients, max_rows))]
        total = [*cells("total", counts.sum(axis=0)), *([""] * len(extras))]
        widths = [max(len(cell) for cell in column) for column in zip(header, total, *rows, strict=True)]

        def line(row: list[str]) -> str:
            return "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip()

        sizes = counts.sum(axis=1)
        lines = [
            f"partition {self.scheme}: {self.num_clients} clients, {int(sizes.sum())} samples, "
            f"client size min/median/max {int(sizes.min())}/{float(np.median(sizes)):g}/{int(sizes.max())}",
            line(header),
            *(line(r) for r in rows),
        ]
        if self.num_clients > max_rows:
            lines.append(f"… {self.num_clients - max_rows} more clients")
        lines.append(line(total))
        return "\n".join(lines)

    def plot(self, labels: np.ndarray, num_classes: int, path: str | Path) -> Path:
        """Save a plot of samples per client per class (stacked bars, or a heat map beyond 20 classes); return the
        file written: ``path`` itself, ``path/partition.png`` when it is a directory (existing, or given with a
        trailing separator), ``path`` + ``.png`` when it has no suffix; missing folders are made. A suffix names the
        format (``.pdf``, ``.svg``: any that matplotlib writes)."""
        import matplotlib
        from matplotlib.figure import Figure

        counts = self.counts(labels, num_classes)
        n = self.num_clients
        fig = Figure(figsize=(min(max(6.0, 0.18 * n + 2.5), 30.0), 4.0))
        ax = fig.add_subplot()
        clients = np.arange(n)
        if num_classes <= 20:
            palette = matplotlib.colormaps["tab10" if num_classes <= 10 else "tab20"]
            bottom = np.zeros(n)
            for c in range(num_classes):
                ax.bar(clients, counts[:, c], bottom=bottom, width=0.85, label=str(c), color=palette(c))
                bottom += counts[:, c]
            ax.legend(title="class", fontsize="small", bbox_to_anchor=(1.01, 1.0), loc="upper left")
            ax.set_ylabel("samples")
        else:
            image = ax.imshow(counts.T, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis")
            fig.colorbar(image, ax=ax, label="samples")
            ax.set_ylabel("class")
        ax.set_xlabel("client")
        ax.set_title(f"{self.scheme}: {n} clients")
        fig.tight_layout()
        text = os.fspath(path)
        if text.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)) or Path(text).is_dir():
            path = Path(text) / "partition.png"
        else:
            path = Path(text) if Path(text).suffix else Path(text + ".png")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # as compare makes its output folders
        except OSError as err:
            raise ValueError(f"cannot write the plot {path}: {err.strerror}") from None
        fig.savefig(path, dpi=100)
        return path


def make_partition(
    spec: str,
    labels: np.ndarray,
    num_clients: int,
    *,
    seed: int = 0,
    num_classes: int | None = None,
    client_ids: np.ndarray | None = None,
) -> Partition:
    """Split the samples with ``labels`` (int [n]) among ``num_clients`` clients as ``spec`` says.

    ``num_classes`` defaults to max(labels) + 1; ``client_ids`` (int [n]) is needed by ``natural``.
    """
    name, args = parse_partition(spec, num_clients)
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a non-empty 1-D integer array, got {labels.dtype} {labels.shape}")
    if labels.min() < 0:
        raise ValueError("labels must be >= 0")
    n = labels.size
    if not 1 <= num_clients <= n:
        raise ValueError(f"num_clients must be in [1, {n}] (the number of samples), got {num_clients}")
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    elif num_classes <= labels.max():
        raise ValueError(f"num_classes={num_classes} but labels go up to {int(labels.max())}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    rng = np.random.default_rng(seed)
    n_clients = int(num_clients)
    scheme = name + (":" + ",".join(f"{a:g}" for a in args) if args else "")

    if name == "iid":
        return Partition(scheme, _iid(n, n_clients, rng))
    if name == "dirichlet":
        return Partition(scheme, _dirichlet(labels, n_clients, args[0], num_classes, rng))
    if name == "shards":
        return Partition(scheme, _shards(labels, n_clients, int(args[0]), num_classes, rng))
    if name == "quantity":
        return Partition(scheme, _quantity(n, n_clients, args[0], rng))
    if name == "noise":
        noise = args[0] * np.arange(n_clients, dtype=np.float64) / max(n_clients - 1, 1)
        return Partition(scheme, _iid(n, n_clients, rng), noise_std=noise)
    if name.startswith("bherd"):
        case = int(name[-1])
        return Partition(scheme, _bherd(labels, n_clients, num_classes, case))
    if name == "groups":
        return _groups(scheme, labels, n_clients, args[0], args[1], num_classes, rng)
    if name == "dirichlet-equal":
        pools = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        return Partition(scheme, _inverse_cdf_split(pools, _equal_sizes(n, n_clients), args[0], rng))
    return Partition(scheme, _natural(labels, n_clients, client_ids))


def parse_partition(spec: str, num_clients: int) -> tuple[str, list[float]]:
    """Check a partition spec and its arguments without any data; return (name, arguments with defaults filled).

    Raises ValueError for an unknown name, too many arguments, α ≤ 0, a non-integer shard count, σ < 0, a groups
    overlap outside [0, 1) or an odd number of clients for groups; TypeError if num_clients is not an integer.
    What depends on the data (enough samples for the clients) is checked by :func:`make_partition`.
    """
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise TypeError(f"num_clients must be an integer, got {type(num_clients).__name__}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    name, args = parse_spec(spec, what="partition", choices=PARTITIONS)
    defaults = _DEFAULTS[name]
    if len(args) > len(defaults):
        raise ValueError(f"partition {name!r} takes at most {len(defaults)} argument(s), got {spec!r}")
    args = [*args, *defaults[len(args) :]]
    if name in ("dirichlet", "quantity", "dirichlet-equal"):
        _positive(args[0], f"{name}:α")
    elif name == "shards":
        _count(args[0], "shards:k")
    elif name == "noise" and not (math.isfinite(args[0]) and args[0] >= 0):
        raise ValueError(f"partition noise:σ needs σ >= 0, got {args[0]:g}")
    elif name == "groups":
        if not (math.isfinite(args[0]) and 0 <= args[0] < 1):
            raise ValueError(f"partition groups:o,α needs overlap o in [0, 1), got {args[0]:g}")
        _positive(args[1], "groups:o,α α")
        if num_clients < 2 or num_clients % 2:
            raise ValueError(f"partition groups needs an even number of clients >= 2, got {num_clients}")
    return name, args


# helpers ----------------------------------------------------------------------------------------------------------


def _positive(value: float, what: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"partition argument {what} must be > 0, got {value:g}")


def _count(value: float, what: str) -> None:
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise ValueError(f"partition argument {what} must be an integer >= 1, got {value:g}")


def _finish(parts: list) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64).reshape(-1)) for p in parts]


def _equal_sizes(total: int, parts: int) -> np.ndarray:
    """Near-equal sizes summing to ``total`` (the first ``total % parts`` get one more)."""
    sizes = np.full(parts, total // parts, dtype=np.int64)
    sizes[: total % parts] += 1
    return sizes


def _iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return _finish(np.array_split(rng.permutation(n), num_clients))


def _dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    n = labels.size
    min_size = min(_MIN_DIRICHLET_SIZE, n // num_clients)
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    for _ in range(_MAX_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            if idx.size == 0:
                continue
            p = rng.dirichlet(np.full(num_clients, alpha))
            open_ = sizes < n / num_clients  # NIID-Bench: full clients take no more
            p = np.where(open_, p, 0.0)
            p = p / p.sum() if p.sum() > 0 else open_ / open_.sum()
            cuts = (np.cumsum(p)[:-1] * idx.size).astype(np.int64)
            for j, piece in enumerate(np.split(rng.permutation(idx), cuts)):
                parts[j].append(piece)
                sizes[j] += piece.size
        if sizes.min() >= min_size:
            return _finish([np.concatenate(p) for p in parts])
    raise ValueError(
        f"dirichlet: no split with >= {min_size} samples per client in {_MAX_DIRICHLET_TRIES} draws "
        f"(α={alpha:g}, {num_clients} clients, {n} samples); use a larger α or fewer clients"
    )


def _shards(
    labels: np.ndarray, num_clients: int, k: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    class_sizes = np.bincount(labels, minlength=num_classes)
    present = np.flatnonzero(class_sizes)
    total = num_clients * k
    if total < present.size:
        raise ValueError(
            f"shards:{k} with {num_clients} clients makes {total} shards, fewer than the {present.size} classes"
        )
    if total > labels.size:
        raise ValueError(
            f"shards:{k} with {num_clients} clients needs {total} shards but there are {labels.size} samples"
        )
    # Shards per class: proportional to class size, at least 1 and at most the class size.
    share = class_sizes[present] * total / labels.size
    per_class = np.clip(np.round(share).astype(np.int64), 1, class_sizes[present])
    while per_class.sum() < total:
        room = np.flatnonzero(per_class < class_sizes[present])
        per_class[room[np.argmax((share - per_class)[room])]] += 1
    while per_class.sum() > total:
        room = np.flatnonzero(per_class > 1)
        per_class[room[np.argmin((share - per_class)[room])]] -= 1
    shards = []
    for c, count in zip(present, per_class, strict=True):
        shards.extend(np.array_split(rng.permutation(np.flatnonzero(labels == c)), count))
    order = rng.permutation(total)
    return _finish([np.concatenate([shards[s] for s in order[i * k : (i + 1) * k]]) for i in range(num_clients)])


def _quantity(n: int, num_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    q = rng.dirichlet(np.full(num_clients, alpha))
    spare = n - num_clients
    cuts = np.floor(np.cumsum(q) * spare).astype(np.int64)
    cuts[-1] = spare
    sizes = 1 + np.diff(cuts, prepend=0)
    return _finish(np.split(rng.permutation(n), np.cumsum(sizes)[:-1]))


def _bherd(labels: np.ndarray, num_clients: int, num_classes: int, case: int) -> list[np.ndarray]:
    """BHerd's splits, following Wang et al.'s code (docs/bherd.md §6, §7.6); deterministic, no seed.

    Case 1: sample i → client i mod N. Case 2: label mod N. Case 3: labels below (C−1)/2 → client i mod h with
    h = ⌈min(N, C)/2⌉; the rest → h + label mod (min(N, C) − h). With N > C the target t names a slot and the
    sample goes to the least-filled client n with n mod C = t (lowest n on ties), i.e. round-robin over them.
    """
    n = labels.size
    index = np.arange(n)
    if case == 1:
        return _finish([index[index % num_clients == j] for j in range(num_clients)])
    if case == 2:
        slot = labels % num_clients
    elif num_clients == 1:
        slot = np.zeros(n, dtype=np.int64)
    else:
        width = min(num_clients, num_classes)
        lower = -(-width // 2)
        slot = np.where(2 * labels < num_classes - 1, index % lower, lower + labels % (width - lower))
    if num_clients <= num_classes:
        return _finish([index[slot == j] for j in range(num_clients)])
    owner = np.empty(n, dtype=np.int64)
    for t in range(num_classes):
        members = np.flatnonzero(slot == t)
        holders = np.arange(t, num_clients, num_classes)
        owner[members] = holders[np.arange(members.size) % holders.size]
    return _finish([index[owner == j] for j in range(num_clients)])


def _inverse_cdf_split(
    pools: list[np.ndarray], sizes: np.ndarray, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Clients in order draw ``sizes[i]`` samples from label ``pools`` (shuffled index arrays, consumed).

    Client i draws p ~ Dir(α·1_L) over the L pools and picks each sample's label by inverse CDF of p; when a label
    runs out, the draw moves on to the next label (cyclically) that has samples left. Needs sum(sizes) ≤ pool total.
    """
    num_labels = len(pools)
    left = np.array([p.size for p in pools], dtype=np.int64)
    used = np.zeros(num_labels, dtype=np.int64)
    parts = []
    for size in sizes:
        cdf = np.cumsum(rng.dirichlet(np.full(num_labels, alpha)))
        picks = np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), num_labels - 1)
        wanted = np.bincount(picks, minlength=num_labels)
        take = np.zeros(num_labels, dtype=np.int64)
        carry = 0
        for step in range(2 * num_labels):
            j = step % num_labels
            want = carry + (wanted[j] if step < num_labels else 0)
            got = min(want, left[j] - take[j])
            take[j] += got
            carry = want - got
            if step >= num_labels - 1 and carry == 0:
                break
        parts.append(np.concatenate([pools[j][used[j] : used[j] + take[j]] for j in range(num_labels)]))
        used += take
        left -= take
    return _finish(parts)


def _groups(
    scheme: str,
    labels: np.ndarray,
    num_clients: int,
    overlap: float,
    alpha: float,
    num_classes: int,
    rng: np.random.Generator,
) -> Partition:
    """Dynamic-init label split: clients [0, N/2) are group A with labels [0, G), the rest group B with labels
    [U, U+G), where G = ⌊L/(2−o)⌋, O = ⌊G·o⌋, U = G − O. Labels in both sets have their shuffled samples halved
    between the groups; within a group the samples are shared out in near-equal quotas by inverse-CDF Dirichlet
    draws (see :func:`_inverse_cdf_split`). Labels ≥ U+G are unused. Arguments are checked by parse_partition."""
    width = math.floor(num_classes / (2 - overlap) + 1e-9)
    shared = math.floor(width * overlap + 1e-9)
    start_b = width - shared
    if width < 1:
        raise ValueError(f"partition groups needs at least 2 classes, got num_classes={num_classes}")
    label_sets = [np.arange(width, dtype=np.int64), np.arange(start_b, start_b + width, dtype=np.int64)]
    pools: list[list[np.ndarray]] = [[], []]
    for c in range(start_b + width):
        idx = rng.permutation(np.flatnonzero(labels == c))
        owners = [g for g in (0, 1) if c in label_sets[g]]
        if len(owners) == 2:
            half = idx.size // 2
            pools[0].append(idx[:half])
            pools[1].append(idx[half:])
        else:
            pools[owners[0]].append(idx)
    half_n = num_clients // 2
    parts = []
    for g in (0, 1):
        total = sum(p.size for p in pools[g])
        if total < half_n:
            raise ValueError(f"partition groups: group {'AB'[g]} has {total} samples for {half_n} clients")
        parts.extend(_inverse_cdf_split(pools[g], _equal_sizes(total, half_n), alpha, rng))
    groups = np.repeat(np.array([0, 1], dtype=np.int64), half_n)
    return Partition(scheme, parts, groups=groups, group_labels=label_sets)


def _natural(labels: np.ndarray, num_clients: int, client_ids: np.ndarray | None) -> list[np.ndarray]:
    if client_ids is None:
        raise ValueError("partition natural needs client_ids (a dataset with natural clients, e.g. synthetic)")
    ids = np.asarray(client_ids)
    if ids.shape != labels.shape:
        raise ValueError(f"client_ids has shape {ids.shape}, labels {labels.shape}")
    distinct, counts = np.unique(ids, return_counts=True)
    if num_clients > distinct.size:
        raise ValueError(f"partition natural: the data has {distinct.size} natural clients, asked for {num_clients}")
    order = np.argsort(ids, kind="stable")  # each natural client's samples, ascending
    return np.split(order, np.cumsum(counts))[:num_clients]
