"""Plain NumPy/PyTorch versions of every pyfedkern op, with the same signatures: the executable specification
used by the tests and benchmarks. They favour clarity (and float64 arithmetic) over speed."""

from pyfedkern.reference.aggregate import accumulate_, weighted_sum
from pyfedkern.reference.dp import clip_accumulate, gaussian_noise_
from pyfedkern.reference.fedspeed import fedspeed_round_end_, fedspeed_update_, sam_perturb
from pyfedkern.reference.herding import centred_gram, grab_select, herding_order, herding_select
from pyfedkern.reference.norms import class_feature_norms, grad_norms, per_sample_grad_norms, row_norms
from pyfedkern.reference.pbc import mifa_update_, pbc_agg_bcast_, weighted_delta_
from pyfedkern.reference.robust import (
    bulyan,
    centred_clip,
    coordinate_median,
    geometric_median,
    krum_scores,
    krum_select,
    trimmed_mean,
)
from pyfedkern.reference.sampling import seeded_permutations
from pyfedkern.reference.similarity import similarity_combine, similarity_weights

__all__ = [
    "accumulate_",
    "bulyan",
    "centred_clip",
    "centred_gram",
    "class_feature_norms",
    "clip_accumulate",
    "coordinate_median",
    "fedspeed_round_end_",
    "fedspeed_update_",
    "gaussian_noise_",
    "geometric_median",
    "grab_select",
    "grad_norms",
    "herding_order",
    "herding_select",
    "krum_scores",
    "krum_select",
    "mifa_update_",
    "pbc_agg_bcast_",
    "per_sample_grad_norms",
    "row_norms",
    "sam_perturb",
    "seeded_permutations",
    "similarity_combine",
    "similarity_weights",
    "trimmed_mean",
    "weighted_delta_",
    "weighted_sum",
]
