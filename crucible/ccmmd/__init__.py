"""CC-MMD: contamination-corrected MMD between a clean reference and an audited pool.

Method: docs/methods.md, curate. ``cc_mmd`` is the estimator; ``kernel_matvec`` the exact blockwise kernel
sums it runs on (torch, or Triton on CUDA); ``rff_matvec`` their random-feature approximation;
``fit_min_ccmmd`` minimum-CC-MMD estimation of a parametric model.
"""

from .estimator import CCMMDResult, cc_mmd, mmd_terms
from .fit import FitResult, contaminated_regression, fit_min_ccmmd, linear_gaussian_sampler
from .kernels import (
    GaussianKernel,
    gaussian_kernel_matrix,
    kernel_matvec,
    median_bandwidth,
    weighted_kernel_sum,
    within_kernel_sum,
)
from .rff import rff_features, rff_matvec

__all__ = [
    "CCMMDResult",
    "cc_mmd",
    "mmd_terms",
    "FitResult",
    "fit_min_ccmmd",
    "contaminated_regression",
    "linear_gaussian_sampler",
    "GaussianKernel",
    "gaussian_kernel_matrix",
    "kernel_matvec",
    "median_bandwidth",
    "weighted_kernel_sum",
    "within_kernel_sum",
    "rff_features",
    "rff_matvec",
]
