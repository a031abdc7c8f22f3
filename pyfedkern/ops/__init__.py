"""pyfedkern's accelerated ops: validation, CPU/CUDA dispatch and output allocation over numpy, torch and cupy.

Every op has a plain reference with the same signature in :mod:`pyfedkern.reference`.
"""

from pyfedkern.ops.aggregate import accumulate_, weighted_sum
from pyfedkern.ops.herding import GrabBalancer, centred_gram, grab_select, herding_order, herding_select
from pyfedkern.ops.pbc import mifa_update_, pbc_agg_bcast_, weighted_delta_

__all__ = ["accumulate_", "weighted_sum"]

from pyfedkern.ops.fedspeed import fedspeed_round_end_, fedspeed_update_, sam_perturb
from pyfedkern.ops.norms import FeatureNorms, class_feature_norms, per_sample_grad_norms, row_norms

__all__ += ["FeatureNorms", "class_feature_norms", "per_sample_grad_norms", "row_norms"]

__all__ += ["mifa_update_", "pbc_agg_bcast_", "weighted_delta_"]
<<<<<<< HEAD
__all__ += ["fedspeed_round_end_", "fedspeed_update_", "sam_perturb"]
=======

__all__ += ["GrabBalancer", "centred_gram", "grab_select", "herding_order", "herding_select"]
>>>>>>> herding
