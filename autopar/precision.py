"""Mixed precision as FSDP2's policy: parameters and optimizer state in their own dtype
(float32 masters), the forward and backward computing with copies cast to ``param_dtype``,
gradients reduced in the parameters' dtype."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``autopar.compile(..., mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))``.

    The captured graph casts each floating-point parameter to ``param_dtype`` where the forward
    reads it, so matmuls run and are priced at that dtype's rate and bytes; a split parameter
    may be cast before it is gathered, when the plan finds that cheaper. The casts' backward
    brings gradients back to the parameters' dtype, in which they are reduced and stepped.
    """

    param_dtype: torch.dtype | None = None
    """Dtype the forward and backward compute in (``None``: the parameters' own)."""
    reduce_dtype: torch.dtype | None = torch.float32
    """Dtype gradients are reduced in: float32 (the master parameters' dtype) is what autopar
    does; another is refused."""

    def __post_init__(self) -> None:
        if self.param_dtype is not None and not (
            isinstance(self.param_dtype, torch.dtype) and self.param_dtype.is_floating_point
        ):
            raise ValueError(
                f"MixedPrecision(param_dtype={self.param_dtype!r}): give a floating-point torch.dtype, "
                "e.g. torch.bfloat16"
            )
        if self.reduce_dtype not in (None, torch.float32):
            raise ValueError(
                f"MixedPrecision(reduce_dtype={self.reduce_dtype!r}): autopar reduces gradients in the "
                "float32 master parameters' dtype. Fix: leave reduce_dtype as torch.float32"
            )
