"""pyfedkern's accelerated ops: validation, CPU/CUDA dispatch and output allocation over numpy, torch and cupy.

Every op has a plain reference with the same signature in :mod:`pyfedkern.reference`.
"""

from pyfedkern.ops.aggregate import accumulate_, weighted_sum

__all__ = ["accumulate_", "weighted_sum"]

from pyfedkern.ops.similarity import similarity_combine, similarity_weights

__all__ += ["similarity_combine", "similarity_weights"]
