"""The MoE router's load-balancing loss of a generic causal LM, over the GLOBAL batch.

Transformers' MoE causal LMs add ``coef x load_balancing_loss_func(router_logits)`` to the
loss. ``RouterLoss`` accumulates its sums over every microbatch and rank (all-reduced once), so
the loss and each row's gradient are the global batch's ([Note: global router loss]);
``AttachRouterGrad`` adds that gradient to a recomputed layer's router logits. Used by
``GenericCausalLM`` in ``models/generic.py``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ROUTER_COEFS = ("router_aux_loss_coef", "aux_loss_coef")
"""The names transformers' MoE causal LMs give the router loss's coefficient (on the model or
its config): ``router_aux_loss_coef`` (Mixtral, Qwen3-MoE, ...), ``aux_loss_coef`` (JetMoE)."""


def router_coef_name(source: Any) -> str | None:
    """The first name of ``ROUTER_COEFS`` that ``source`` holds as a number, or None."""
    return next((a for a in ROUTER_COEFS if isinstance(getattr(source, a, None), (int, float))
                 and not isinstance(getattr(source, a, None), bool)), None)


class RouterLoss:
    """The load-balancing loss ``coef * load_balancing_loss_func(router logits of the whole
    global batch)`` (Switch Transformer eqs. 4-6, as transformers' MoE causal LMs add it with
    ``output_router_logits=True``), over every microbatch of every rank, not per rank.

    [Note: global router loss]
    ``aux = E * sum_e (T_e / R) * (P_e / R)``: T_e the top-k assignments to expert e, P_e the
    sum of softmax router probabilities, R the (unmasked) rows, each summed over every layer and
    every token of the global batch. T is not differentiable, so given the global T and R the
    gradient of one row's logits z is ``coef * E / R^2 * m * p * (T - p . T)`` (p = softmax(z),
    m its attention-mask entry): a sum over rows, exact under any split. The engine's forward
    phase accumulates T, P, R per rank (``global_loss_sums``), all-reduces them once, and every
    recomputed layer adds that gradient to its router logits (``AttachRouterGrad``).
    """

    def __init__(self, model: Any, router_cls: type, index: int):
        """``model``: the model, or its text config, holding ``num_experts``,
        ``num_experts_per_tok`` and a coefficient named in ``ROUTER_COEFS``."""
        self.E = int(model.num_experts)
        self.top_k = int(model.num_experts_per_tok)
        self.coef_name = router_coef_name(model) or ROUTER_COEFS[0]
        self.coef = float(getattr(model, self.coef_name))
        self.router_cls, self.index = router_cls, index
        self.collecting = False
        self.sums = torch.zeros(2 * self.E + 1, dtype=torch.float64)
        self.total: torch.Tensor | None = None
        self.aux = 0.0  # the step's aux (before ``coef``), set by ``finish``
        self.grad_scale = 1.0
        self.seen: set = set()

    def begin_step(self) -> None:
        self.collecting, self.total, self.seen = True, None, set()
        self.sums = torch.zeros(2 * self.E + 1, dtype=torch.float64)
        self.rows: dict[int, float] = {}  # id(microbatch context) -> its part of R

    def logits_of(self, out: Any) -> torch.Tensor:
        return out[self.index] if isinstance(out, (tuple, list)) else out

    def add(self, logits: torch.Tensor, mask: torch.Tensor | None, key: int = 0) -> None:
        """Accumulate one layer's router logits (rows, E) of one microbatch (``key``: its
        context's id, for ``share``)."""
        with torch.no_grad():
            probs = torch.softmax(logits.detach().float(), dim=-1)
            _, chosen = torch.topk(probs, self.top_k, dim=-1)
            w = torch.ones(probs.shape[0], device=probs.device) if mask is None \
                else mask.to(probs.device, torch.float32)
            counts = torch.zeros(self.E, device=probs.device).scatter_add_(
                0, chosen.reshape(-1), w.repeat_interleave(self.top_k))
            part = torch.cat([counts, (probs * w[:, None]).sum(0), w.sum().view(1)])
            self.sums += part.to("cpu", torch.float64)
            self.rows[key] = self.rows.get(key, 0.0) + float(part[-1])  # over layers, as R

    def finish(self, total: torch.Tensor, grad_scale: float) -> float:
        """Set the global sums (all-reduced ``sums``); return coef * aux of the global batch."""
        self.total, self.grad_scale, self.collecting = total.to(torch.float64), grad_scale, False
        T, P, R = self.total[:self.E], self.total[self.E:2 * self.E], float(self.total[-1])
        self.aux = 0.0 if R == 0 else self.E * float((T / R * P / R).sum())
        return self.coef * self.aux

    def share(self, key: int) -> float:
        """The aux (before ``coef``, after ``finish``) times the fraction of the global rows R
        that the microbatch of context id ``key`` holds: the microbatches' shares add up to the
        aux of the global batch."""
        R = float(self.total[-1])
        return 0.0 if R == 0 else self.aux * self.rows.get(key, 0.0) / R

    def row_grad(self, logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """d(coef * aux)/d logits for one layer's rows of one microbatch (``finish`` first)."""
        assert self.total is not None, "router loss gradient before the global sums"
        T = self.total[:self.E].to(logits.device, torch.float32)
        R = float(self.total[-1])
        p = torch.softmax(logits.float(), dim=-1)
        g = p * (T - (p * T).sum(-1, keepdim=True))
        if mask is not None:
            g = g * mask.to(g.device, g.dtype)[:, None]
        return (g * (self.grad_scale * self.coef * self.E / (R * R))).to(logits.dtype)


class AttachRouterGrad(torch.autograd.Function):
    """Identity on a layer's output that, in backward, gives the layer's router logits the
    global router loss's gradient (``RouterLoss.row_grad``)."""

    @staticmethod
    def forward(ctx, hidden, router_loss, mask, *logits):
        ctx.router_loss, ctx.mask = router_loss, mask
        ctx.save_for_backward(*logits)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        logits = ctx.saved_tensors
        return (grad, None, None, *(ctx.router_loss.row_grad(z.detach(), ctx.mask)
                                    for z in logits))


def router_spec(model: nn.Module) -> tuple[type, int] | None:
    """The router module class and output index the model declares for ``router_logits``
    (``_can_record_outputs``, transformers' own output-recording table), or None."""
    spec = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return None
    if isinstance(spec, type):
        return spec, 0
    cls = getattr(spec, "target_class", None)
    return (cls, int(getattr(spec, "index", 0) or 0)) if isinstance(cls, type) else None
