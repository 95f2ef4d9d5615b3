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
    parameters' dtype after it; ``reduce_dtype=torch.float32`` (float32 parameters) keeps every
    gradient whole-precision until it is reduced, as FSDP2's ``reduce_dtype`` does. Batch
    norm's weight and bias stay in their dtype, as its running statistics do.
    """

    param_dtype: torch.dtype | None = None
    """Dtype the forward and backward compute in (``None``: the parameters' own)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced across ranks in: ``None``, whichever the plan prices cheaper;
    otherwise the parameters' own dtype (the one the gradients are stepped in)."""

    def __post_init__(self) -> None:
        dtype = self.param_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"MixedPrecision(param_dtype={dtype!r}): give a floating-point torch.dtype, e.g. torch.bfloat16"
            )
        reduce = self.reduce_dtype
        if reduce is not None and not (isinstance(reduce, torch.dtype) and reduce.is_floating_point):
            raise ValueError(
                f"MixedPrecision(reduce_dtype={reduce!r}): give the parameters' floating-point dtype, e.g. "
                "torch.float32, or None to let the plan choose"
            )
