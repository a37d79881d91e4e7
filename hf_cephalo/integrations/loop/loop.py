"""What ``CephaloAccelerator.prepare`` hands a custom training loop: the model, loaders and
optimizer over the runtime session (docs/accelerate.md "Your own training loop").

[Note: a custom loop on the layered engine]
A stock Accelerate loop (``loss = model(**batch).loss; accelerator.backward(loss);
optimizer.step(); optimizer.zero_grad()``) runs unchanged on the layered engine: the loader
yields this rank's b_i rows of each global batch (every rank the same number of batches; an idle
rank 0 rows), ``model(**batch)`` runs the engine's layered forward and head over microbatches of
m_i and returns this rank's loss mean and item counts, ``accelerator.backward`` weights the loss
by the normalization rule and runs the layered backward (one reduce-scatter per unit; the loss
must come from this step's outputs), and ``optimizer.step()`` steps the shards and ends the
session's step. So the gradient is that of the loss on the single-device full global batch
whenever the loss is a mean over this rank's items, or, with "sum", this rank's part of a global
sum. Each call in detail: docs/accelerate.md, "A custom loop on the layered engine".
"""

from __future__ import annotations

import itertools

import logging
from typing import Any, Iterator

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import send_to_device
from torch import nn

from hf_cephalo.runtime import empty_logits, split_rows

__all__ = ["CephaloModel", "CephaloDataLoader", "CephaloOptimizer", "CephaloScheduler"]

logger = logging.getLogger(__name__)


def _cat(tensors: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """Rows of every microbatch in order (``empty``: the 0-row logits of a rank without rows)."""
    if tensors:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return empty


class CephaloModel(nn.Module):
    """The prepared model of a custom loop (see [Note: a custom loop on the layered engine]).

    ``parameters()`` / ``named_parameters()`` are this rank's per-parameter shards (an
    optimizer built over them after ``prepare`` steps the shards); every other attribute
    (``config``, ``generate``...) is the wrapped model's, which is hollow while sharded
    (``accelerator.unwrap_model`` returns it; ``accelerator.get_state_dict`` /
    ``save_model`` give its weights).
    """

    def __init__(self, session, hooks) -> None:
        super().__init__()
        self.__dict__["_session"] = session
        self.__dict__["_hooks"] = hooks  # the accelerator's step state (open step, backward)
        self.__dict__["_module"] = session.model
        self.training = session.model.training

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_module"], name)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for name, shard in self._session.named_shards():
            yield prefix + name, shard

    def train(self, mode: bool = True) -> "CephaloModel":
        self.training = mode
        self._module.train(mode)
        return self

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        """Collective (every rank, same number of calls): ``generate`` on the sharded weights,
        with keyed sampling (docs/generation.md): (B, P + T) prompts then completions, as
        ``model.generate`` returns them. Keywords: ``max_new_tokens``, ``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``eos_token_id``, ``pad_token_id``
        (default: the model's ``generation_config``), and ``rows`` (the prompts' global row
        indices: completions then do not depend on the plan), ``round_``, ``seed``, ``mode``
        (``runtime.generation.generate_tensor``). Raises TypeError for other keywords."""
        from hf_cephalo.runtime import generate_tensor

        self._hooks.end_open_step("generate")
        return generate_tensor(self._session, input_ids, attention_mask, **kwargs)

    def state_dict(self, *args, **kwargs):
        raise RuntimeError("the prepared model is sharded across ranks: use "
                           "accelerator.get_state_dict(model) (every rank calls it; rank 0 gets "
                           "the full state dict) or accelerator.save_model(model, dir)")

    def forward(self, *args, **batch):
        if args:
            raise TypeError("call the prepared model with keyword arguments, model(**batch): "
                            "the batch's rows are cut into the plan's microbatches by name")
        session, hooks = self._session, self._hooks
        microbatches = split_rows(batch, hooks.microbatch_size())
        if self.training and torch.is_grad_enabled():
            open_step = hooks.begin_forward(microbatches)
            logits, loss_sums = open_step.logits, open_step.loss_sums
            local, total = open_step.local_items, open_step.global_items
            loss = torch.stack(loss_sums).sum() / local if local else \
                torch.zeros((), device=session.job.device)
        else:
            hooks.end_open_step("an evaluation forward")
            out = session.evaluate(microbatches, return_logits=True)
            logits, total = out.logits, out.num_items
            counts = [session.staged.count_items(mb) for mb in microbatches]
            local = sum(counts)
            sums = [m * n for m, n in zip(out.microbatch_losses, counts) if n]
            loss = torch.tensor(sum(sums) / local if local else 0.0, device=session.job.device)
        empty = None if logits else empty_logits(session.staged, batch, session.job.device)
        output = hooks.output_class(loss=loss, logits=_cat(list(logits), empty))
        # not ModelOutput fields: attributes, so the output's tuple / dict views stay stock's
        object.__setattr__(output, "num_items", int(local))
        object.__setattr__(output, "num_items_in_batch", int(total))
        return output


class CephaloDataLoader:
    """The prepared loader of a custom loop: per iteration (an epoch: ``seed + epoch``
    permutation, advanced at each new iteration as Accelerate's prepared loaders do) this
    rank's rows of each global batch as one collated batch on the device.

    Args:
        inner: the runtime's loader (``Session.train_loader`` / ``eval_loader``) yielding
            one-element microbatch lists.
        hooks: the accelerator's step state; training: the training loader (drives steps).
        empty_batch: makes the 0-row batch of an idle rank (the keys a real batch has).
        microbatch_size: the microbatch the model cuts an evaluation batch into (training:
            the plan's m_i in force).
    """

    def __init__(self, inner, hooks, *, training: bool, empty_batch, microbatch_size: int,
                 batch_size: int, device, dataset) -> None:
        self.inner, self.hooks, self.training = inner, hooks, training
        self._empty_batch, self._microbatch_size = empty_batch, microbatch_size
        self.batch_size, self.device = batch_size, device
        self.dataset = dataset  # the user's (the runtime's loader reads it through its own)
        self.epoch = 0  # the epoch the next iteration draws
        self.position = 0  # batches handed out in the current epoch
        self._skip_next = 0  # batches the next iteration skips (skip_first_batches / a resume)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skipping(self, num_batches: int) -> "_SkippingLoader":
        return _SkippingLoader(self, num_batches)

    def __iter__(self):
        return self._iterate(self._skip_next)

    def _iterate(self, skip: int):
        self._skip_next = 0
        epoch = self.epoch
        steps = self._stream_steps()
        if steps is None:
            self.inner.batch_sampler.set_epoch(epoch)
            self.inner.batch_sampler.skip_batches = skip
            batches = iter(self.inner)
        else:  # a stream cannot seek: the skipped global batches are read (as stock's skip)
            steps.set_epoch(epoch)
            steps.steps_drawn = max(self.hooks.session.global_step - skip, 0) \
                if self.training else 0
            batches = itertools.islice(iter(self.inner), skip, None)
        self.position = skip
        for microbatches in batches:
            batch = microbatches[0] if microbatches else self._empty_batch()
            assert len(microbatches) <= 1, "the loop's loaders yield one batch per step"
            batch = send_to_device(batch, self.device)
            self.hooks.batch_drawn(self, batch)
            self.position += 1
            yield batch
        if steps is None:
            self.inner.batch_sampler.skip_batches = 0
        self.epoch = epoch + 1
        self.position = 0

    def _stream_steps(self):
        """The runtime's ``StreamSteps`` when this loader reads a stream, else None."""
        from hf_cephalo.runtime import StreamSteps

        return self.inner.dataset if isinstance(self.inner.dataset, StreamSteps) else None

    def state(self) -> dict[str, int]:
        """Where the loader stands: the epoch in progress and the batches it handed out
        (at the end of an epoch: the next epoch, 0)."""
        try:
            done = self.position >= len(self)
        except TypeError:  # a stream without a length: its end is seen when it ends
            done = False
        if done:
            return {"epoch": self.epoch + (1 if self.position else 0), "position": 0}
        return {"epoch": self.epoch, "position": self.position}

    def microbatch_size(self) -> int:
        return self._microbatch_size


class _SkippingLoader:
    """``accelerator.skip_first_batches(loader, n)``: one iteration of ``loader`` from batch n
    of the epoch in progress (the loaders share the epoch counter)."""

    def __init__(self, loader: CephaloDataLoader, num_batches: int) -> None:
        self.loader, self.num_batches = loader, num_batches

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __iter__(self):
        return self.loader._iterate(self.num_batches)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class CephaloScheduler(AcceleratedScheduler):
    """A prepared LR scheduler of a custom loop: Accelerate's, stepped
    ``steps_per_optimizer_step`` times per optimizer step instead of the CURRENT number of
    processes.

    [Note: the LR schedule across world sizes]
    Stock ``AcceleratedScheduler`` steps the scheduler ``num_processes`` times per optimizer step
    (once with ``split_batches``): a script sizes its schedule for the unprepared loader, and one
    optimizer step consumes that many of its batches. Here the global batch B is fixed by the
    run (a plan, ``global_batch_size``), not by the world size, so the count is the number of
    unprepared-loader batches B replaces, B / (batch_size x gradient_accumulation_steps)
    (``prepare.scheduler_steps``): stock's count at stock's B, and one process's at a B of one
    loader batch; a B that is not a whole number of batches is refused with a scheduler. The
    count is saved with the checkpoint (``state.SCHEDULERS_NAME``) and a resume continues it.
    """

    def __init__(self, scheduler, optimizers, *, steps_per_optimizer_step: int,
                 step_with_optimizer: bool = True, split_batches: bool = False) -> None:
        super().__init__(scheduler, optimizers, step_with_optimizer=step_with_optimizer,
                         split_batches=split_batches)
        self.steps_per_optimizer_step = int(steps_per_optimizer_step)

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer or not self.gradient_state.sync_gradients:
            return super().step(*args, **kwargs)  # stock's bookkeeping, no count involved
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.steps_per_optimizer_step):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)


class CephaloOptimizer(AcceleratedOptimizer):
    """The prepared optimizer of a custom loop: Accelerate's wrapper (loss scaler, skipped
    steps) around the user's optimizer re-pointed at the shards; ``step`` also ends the
    session's step and ``zero_grad`` drops the engine's gradients."""

    def __init__(self, optimizer, hooks, *, scaler=None) -> None:
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        self._cephalo_hooks = hooks

    def step(self, closure=None):
        self._cephalo_hooks.check_backward_done()
        super().step(closure)
        self._cephalo_hooks.optimizer_stepped()

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none)
        self._cephalo_hooks.session.zero_grad()


class LoopState:
    """The per-step bookkeeping of a prepared custom loop, shared by the accelerator, the
    model, the loaders and the optimizer: which batch was drawn last, the open step between
    ``model(**batch)`` and ``accelerator.backward``, and the step hooks of the session.

    Args:
        session: the runtime ``Session``; output_class: the model's output type
            (``CausalLMOutputWithPast``, ``SequenceClassifierOutput``, ...).
    """

    def __init__(self, session, output_class) -> None:
        self.session, self.output_class = session, output_class
        self.open = None  # the engine's OpenStep awaiting backward
        self.backward_done = False
        self._loader: CephaloDataLoader | None = None  # the loader that drew the last batch
        self._rows = 0
        self._step_open = False  # the session's step was begun by a training batch
        self._training = False  # a training batch was drawn since the last ``finish``

    # ---- the loaders ------------------------------------------------------------------------
    def batch_drawn(self, loader: CephaloDataLoader, batch: dict[str, Any]) -> None:
        self._loader = loader
        self._rows = next((int(v.shape[0]) for v in batch.values()
                           if torch.is_tensor(v) and v.dim() > 0), 0)
        if loader.training:
            self.end_open_step("the next training batch")
            if not self._training:  # the session's train begin: the report counts from here
                self.session.train_begin()
                self._training = True
            self.session.step_begin(self.session.global_step)
            self._step_open = True
            self.backward_done = False

    def microbatch_size(self) -> int:
        """m_i of the batch drawn last: the plan's in force for a training batch, the
        evaluation loader's batch size for an evaluation batch."""
        if self._loader is None or self._loader.training:
            return max(self.session.plan.ranks[self.session.job.rank].microbatch_size, 1)
        return self._loader.microbatch_size()

    # ---- forward / backward -----------------------------------------------------------------
    def begin_forward(self, microbatches):
        if self.open is not None:
            raise RuntimeError("model(**batch) was called again before accelerator.backward(loss) "
                               "of the previous forward: the layered engine runs one forward and "
                               "one backward per step (compute every loss term from one forward's "
                               "outputs)")
        if self.backward_done:
            raise RuntimeError("a second training forward in one step (after "
                               "accelerator.backward): draw the next batch from the prepared "
                               "training loader first, or evaluate under torch.no_grad() / "
                               "model.eval(); several loss terms come from one forward's "
                               "outputs")
        self.open = self.session.forward_step(microbatches)
        return self.open

    def finish(self) -> None:
        """The session's train end, as the Trainer door's ``on_train_end``: the accuracy table
        (rank 0) and the measured step times written back to the profile cache. Collective
        (every rank, at ``accelerator.end_training()``); nothing when no step trained."""
        if self._training:
            self._training = False
            self.session.train_end()

    def end_open_step(self, why: str) -> None:
        """A forward whose backward will not come (every rank at the same point): dropped
        with a warning (rank 0)."""
        if self.open is None:
            return
        self.session.discard_step(self.open, why)
        self.open = None
        if self.session.job.is_main:
            logger.warning("model(**batch) ran in training mode but %s came before "
                           "accelerator.backward(loss): that forward's step was dropped", why)

    def backward(self, loss: torch.Tensor, *, reduction: str, scaler) -> None:
        """``accelerator.backward(loss)`` on the open step (see the module note).

        Raises RuntimeError (on every rank alike, before the backward's collectives where the
        ranks could disagree): no open step (no training forward, or backward twice), or a
        loss that does not depend on this step's outputs on some rank."""
        open_step, self.open = self.open, None
        if open_step is None:
            raise RuntimeError("accelerator.backward(loss) without a model(**batch) forward in "
                               "training mode since the last backward (called twice, or the "
                               "model was in eval mode / under torch.no_grad())")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            self.session.discard_step(open_step, "a bad loss")
            raise TypeError(f"accelerator.backward needs a 1-element loss tensor, got "
                            f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        weighted = None
        if open_step.local_items:  # a rank without items contributes no gradient
            weight = open_step.local_items / open_step.global_items if reduction == "mean" else 1.0
            weighted = loss.reshape(()) * weight
            if scaler is not None:
                weighted = scaler.scale(weighted)
        elif scaler is not None:
            scaler.scale(torch.zeros((), device=self.session.job.device))  # lazily made scale
        self._check_loss_connected(open_step, weighted)
        self.session.backward_step(open_step, weighted)
        self.backward_done = True

    def _check_loss_connected(self, open_step, loss) -> None:
        """Every rank learns whether some rank's loss does not reach its outputs (one int
        all-reduce), so all raise together instead of one rank hanging in the backward."""
        bad = False
        if open_step.local_items and open_step.logits:
            outputs = [*open_step.logits, *open_step.loss_sums]
            bad = loss is None or not loss.requires_grad or not _reaches(loss, outputs)
        if self.session.any_rank(bad):
            self.session.discard_step(open_step, "a loss not from the outputs")
            raise RuntimeError("accelerator.backward(loss): on some rank the loss does not "
                               "depend on this step's model outputs (outputs.loss / "
                               "outputs.logits of the last model(**batch)); the layered "
                               "backward starts from them: compute the loss from those outputs")

    # ---- the optimizer ---------------------------------------------------------------------
    def check_backward_done(self) -> None:
        if self._step_open and not self.backward_done:
            raise RuntimeError("optimizer.step() before accelerator.backward(loss) in this step: "
                               "the gradients are not there yet")

    def optimizer_stepped(self) -> None:
        """End the session's step (timer, report, adaptive switch, progress)."""
        if not self._step_open:
            return
        self._step_open = False
        # a loop has no known last step: the controller may exchange after any step
        self.session.step_end(self.session.global_step + 1, self._rows)


def _reaches(loss: torch.Tensor, outputs: list[torch.Tensor]) -> bool:
    """Whether ``loss``'s autograd graph contains one of ``outputs`` (a walk of grad_fn's)."""
    targets = {t.grad_fn for t in outputs if t.grad_fn is not None}
    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        if fn in targets:
            return True
        seen.add(fn)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return False
