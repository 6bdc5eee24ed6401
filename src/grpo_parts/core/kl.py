"""KL(pi || pi_ref) estimated per token from samples of pi (Schulman's k1 / k2 / k3)."""

from __future__ import annotations

import torch

from ..errors import GRPOPartsError, check_same_shape
from .config import KLClamp, KLEstimator

#: the value clamp verl applies to k3 and OpenRLHF to every estimator
KL_VALUE_CLAMP = 10.0
#: verl clamps k3's log-ratio d to this before exp (beyond it k3 is clamped anyway)
K3_LOG_RATIO_CLAMP = 20.0


def kl_estimate(
    logps: torch.Tensor, ref_logps: torch.Tensor, estimator: KLEstimator = "k3", clamp: KLClamp = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref): ``[N, T] x [N, T] -> [N, T]``. k1 = log pi - log pi_ref;
    k2 = 0.5 (log pi - log pi_ref)^2; k3 = exp(d) - d - 1 with d = log pi_ref - log pi. ``clamp``:
    :data:`~.config.KLClamp` (OpenRLHF's extra k3 bound at -10 before exp gives the same values and
    gradients as verl's: k3 is beyond the final clamp there)."""
    check_same_shape(["logps", "ref_logps"], [logps, ref_logps])
    if estimator == "k1":
        value = logps - ref_logps
    elif estimator == "k2":
        value = 0.5 * (logps - ref_logps).square()
    elif estimator == "k3":
        d = ref_logps - logps
        if clamp != "none":
            d = torch.clamp(d, min=-K3_LOG_RATIO_CLAMP, max=K3_LOG_RATIO_CLAMP)
        value = torch.exp(d) - d - 1.0
    else:
        raise GRPOPartsError(f"kl_estimator: expected one of 'k1', 'k2', 'k3', got {estimator!r}")
    if clamp == "all" or (clamp == "k3" and estimator == "k3"):
        value = torch.clamp(value, min=-KL_VALUE_CLAMP, max=KL_VALUE_CLAMP)
    elif clamp not in ("k3", "all", "none"):
        raise GRPOPartsError(f"kl_clamp: expected one of 'k3', 'all', 'none', got {clamp!r}")
    return value
