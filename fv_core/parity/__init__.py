"""Parity harness: compare helpers, the interleave gate, batched parity, ParityAligner."""

from fv_core.parity.aligner import Divergence, ParityAligner
from fv_core.parity.compare import leaves, max_abs, max_rel, psnr
from fv_core.parity.gate import ParityReport, assert_interleave_parity, check_batched_parity, compare_results

__all__ = [
    "Divergence",
    "ParityAligner",
    "ParityReport",
    "assert_interleave_parity",
    "check_batched_parity",
    "compare_results",
    "leaves",
    "max_abs",
    "max_rel",
    "psnr",
]
