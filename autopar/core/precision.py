"""Mixed precision as FSDP2's policy: parameters and optimizer state in their own dtype
(float32 masters), the forward and backward computing with copies cast to ``param_dtype``."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``autopar.compile(..., mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))``.

    The captured graph casts each floating-point parameter, and each floating-point input, to
    ``param_dtype`` where the forward reads it, so matmuls run and are priced at that dtype's
    rate and bytes; a split parameter may be cast before it is gathered, where the plan finds
    that cheaper. The casts' backward brings gradients back to the parameters' dtype, in which
    they are stepped. A gradient's reduction runs on either side of that cast, whichever the plan
    prices cheaper: in ``param_dtype`` before it (as FSDP2 reduces by default) or in the
    parameters' dtype after it; a policy that forces the latter is not offered yet.
    """

    param_dtype: torch.dtype | None = None
    """Dtype the forward and backward compute in (``None``: the parameters' own)."""

    def __post_init__(self) -> None:
        dtype = self.param_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"MixedPrecision(param_dtype={dtype!r}): give a floating-point torch.dtype, e.g. torch.bfloat16"
            )
