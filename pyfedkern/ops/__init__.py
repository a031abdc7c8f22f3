"""pyfedkern's accelerated ops: validation, CPU/CUDA dispatch and output allocation over numpy, torch and cupy.

Every op has a plain reference with the same signature in :mod:`pyfedkern.reference`. Every op is also a PyTorch
operator, ``torch.ops.pyfedkern.<name>`` (registered on import), which compiled code and autograd use.
"""

from pyfedkern.ops import _declare
from pyfedkern.ops.aggregate import accumulate_, weighted_sum
from pyfedkern.ops.dp import clip_accumulate, gaussian_noise_
from pyfedkern.ops.fedspeed import fedspeed_round_end_, fedspeed_update_, sam_perturb
from pyfedkern.ops.herding import GrabBalancer, centred_gram, grab_select, herding_order, herding_select
from pyfedkern.ops.norms import FeatureNorms, class_feature_norms, per_sample_grad_norms, row_norms
from pyfedkern.ops.pbc import mifa_update_, pbc_agg_bcast_, weighted_delta_
from pyfedkern.ops.robust import (
    bulyan,
    centred_clip,
    coordinate_median,
    geometric_median,
    krum_scores,
    krum_select,
    trimmed_mean,
)
from pyfedkern.ops.sampling import seeded_permutations
from pyfedkern.ops.similarity import similarity_combine, similarity_weights

__all__ = [
    # norms
    "FeatureNorms",
    # herding
    "GrabBalancer",
    # aggregate
    "accumulate_",
    "bulyan",
    "centred_clip",
    "centred_gram",
    "class_feature_norms",
    "clip_accumulate",
    "coordinate_median",
    # fedspeed
    "fedspeed_round_end_",
    "fedspeed_update_",
    "gaussian_noise_",
    "geometric_median",
    "grab_select",
    "herding_order",
    "herding_select",
    "krum_scores",
    "krum_select",
    # pbc
    "mifa_update_",
    "pbc_agg_bcast_",
    "per_sample_grad_norms",
    "row_norms",
    "sam_perturb",
    # sampling
    "seeded_permutations",
    # similarity
    "similarity_combine",
    "similarity_weights",
    "trimmed_mean",
    "weighted_delta_",
    "weighted_sum",
]

_declare.register()
