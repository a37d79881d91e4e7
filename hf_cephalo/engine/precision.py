"""The engine's precision policy: compute (autocast), gathered-parameter and reduce dtypes.

One object (``EnginePrecision``) because the three only make sense together (FSDP2
``MixedPrecisionPolicy`` semantics, [Note: low-precision gathered parameters] in
``flat_param.py``); it is validated once, when built. ``CephaloEngine(precision=...)`` takes it;
the runtime's ``JobPrecision.engine()`` and ``rank_precision`` build it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EnginePrecision"]

# the dtypes the engine autocasts, gathers and reduces in below fp32
_LOW_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class EnginePrecision:
    """``CephaloEngine``'s mixed-precision policy (None everywhere: fp32, no autocast).

    compute: None (compute in the parameters' dtype), ``torch.bfloat16`` or ``torch.float16``:
        every forward call (and recompute) runs under ``torch.autocast(device.type, compute)``
        while master parameters, gradients and optimizer state stay fp32. float16 needs a loss
        scaler (``CephaloEngine.make_grad_scaler``).
    param: None (gather the fp32 master shards) or ``compute``: each shard is cast to it before
        the all-gather (half the all-gathered bytes; FSDP2's ``MixedPrecisionPolicy.param_dtype``).
    reduce: None (reduce-scatter gradients in fp32) or ``param`` (half the reduce-scatter bytes;
        the reduced shard is upcast to fp32).
    ``torch.float32`` for ``param`` / ``reduce`` is stored as None (no cast), so equal policies
    compare equal.

    Raises ValueError (naming the value and the fix): ``compute`` other than None / bf16 / fp16;
    a ``param`` other than None / bf16 / fp16, without ``compute`` or other than it; a
    ``reduce`` other than None or ``param``. The engine checks the rest (fp32 master
    parameters under autocast), since that needs the model.
    """

    compute: torch.dtype | None = None
    param: torch.dtype | None = None
    reduce: torch.dtype | None = None

    def __post_init__(self):
        compute, param, reduce = self.compute, self.param, self.reduce
        if compute is not None and compute not in _LOW_DTYPES:
            raise ValueError(f"autocast_dtype={compute}: only torch.bfloat16, torch.float16 (with "
                             "a loss scaler: engine.make_grad_scaler()) or None are supported")
        if param == torch.float32:
            param = None
        if reduce == torch.float32:
            reduce = None
        if param is not None:
            if param not in _LOW_DTYPES:
                raise ValueError(f"param_dtype={param}: use torch.bfloat16, torch.float16 or "
                                 "None (gather the fp32 master weights)")
            if compute is None:
                raise ValueError(f"param_dtype={param} needs mixed-precision compute: the "
                                 "forward runs in fp32 without autocast_dtype; pass "
                                 f"autocast_dtype={param} (--bf16 / --fp16) or drop param_dtype")
            if param != compute:
                raise ValueError(f"param_dtype={param} differs from autocast_dtype={compute}: "
                                 f"gather the parameters in the compute dtype "
                                 f"(param_dtype={compute}) or in fp32 (None)")
        if reduce is not None and reduce != param:
            raise ValueError(f"reduce_dtype={reduce} is lower than (or differs from) "
                             f"param_dtype={param or torch.float32}: reduce in fp32 (None) or "
                             "in the param dtype")
        object.__setattr__(self, "param", param)  # frozen: the fp32 -> None normalization
        object.__setattr__(self, "reduce", reduce)
