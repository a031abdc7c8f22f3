"""Plain NumPy/PyTorch versions of every pyfedkern op, with the same signatures: the executable specification
used by the tests and benchmarks. They favour clarity (and float64 arithmetic) over speed."""

from pyfedkern.reference.aggregate import accumulate_, weighted_sum

__all__ = ["accumulate_", "weighted_sum"]

from pyfedkern.reference.similarity import similarity_combine, similarity_weights

__all__ += ["similarity_combine", "similarity_weights"]
