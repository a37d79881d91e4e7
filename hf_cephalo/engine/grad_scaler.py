"""The engine's fp16 loss scaler: PyTorch's ``ShardedGradScaler`` made safe for fused optimizers.

[Note: found-inf shape for fused optimizers] ``ShardedGradScaler.unscale_`` records the
found-inf flag with shape (1,) (plain ``GradScaler`` uses shape ()), and ``GradScaler.step``
hands it to an optimizer with ``_step_supports_amp_scaling`` (``AdamW(fused=True)``,
transformers' default ``adamw_torch_fused``), whose in-place ``_foreach_sub_`` on its 0-dim
step counters cannot broadcast to (1,): "output with shape [] doesn't match the broadcast
shape [1]". And the all-reduce SUMS the flag: it counts the ranks that found an inf (with
uneven shards a reduce-scattered inf usually reaches every rank), while the fused kernels
skip the update only for a flag of exactly 1 and subtract the flag from their step counters,
so a flag of 2 would apply the inf gradients. ``unscale_`` therefore makes the flag 0-dim and
0 / 1 after its all-reduce (``update`` and ``step`` only sum it, test ``>= 1`` or pass it on,
so neither the shape nor the clamp changes the scale sequence).
For such an optimizer ``step`` without a prior ``unscale_`` would only check this rank's
gradients (``GradScaler._check_inf_per_device`` has no all-reduce), so one rank could step
while another skips: ``step`` runs ``unscale_`` first, as for any other optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class CephaloGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` whose found-inf flag is 0-dim, 0 or 1, and agreed over the group
    for every optimizer, fused ones included ([Note: found-inf shape for fused optimizers])."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)  # unscales and SUM-all-reduces the (1,)-shaped flag
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {device: found_inf.reshape(()).clamp(max=1.0)
                                         for device, found_inf in
                                         state["found_inf_per_device"].items()}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if (self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False)
                and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY):
            self.unscale_(optimizer)  # the fused path would check only this rank's gradients
        return super().step(optimizer, *args, **kwargs)
