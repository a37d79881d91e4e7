"""A Trainer's ``compute_loss`` inside the engine's head: no collective there, one per step.

[Note: collectives inside the engine's head]
The engine calls the user's loss once per microbatch in its head phase (``user_loss.py``), and
ranks run different numbers of microbatches (l_i; an idle rank none), so a collective issued
there (TRL's ``gather_for_metrics``) would pair the wrong calls or wait forever. So nothing in
the head communicates: gathers and ``reduce(sum)`` return and record this microbatch's value,
and once per step every rank joins ONE ``all_gather_object`` of the records
(``HeadCalls.finish``), then replays ``compute_loss`` on zero-row inputs whose gathers return
every microbatch's value in global-batch order: the metrics of one process holding the global
batch ([Note: global item count for user losses] in models/base.py). Any other collective,
and any exception, gives that microbatch a zero loss and every rank the same
``HeadCallError`` at the exchange. docs/trl.md, "Metrics and collectives in a loss".
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["HeadCallError", "HeadCalls", "current_head_call"]

_CURRENT: contextvars.ContextVar["_HeadCall | None"] = contextvars.ContextVar(
    "hf_cephalo_head_call", default=None)

# torch.distributed entry points a user loss might call; replaced while a user call runs
# (restored after it) so that one never leaves the ranks' collective sequences out of step
_GUARDED_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather",
    "gather_object", "scatter", "scatter_object_list", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")

_PLAIN_BUDGET = 100_000
"""Most leaves the trainer's plain-data state may hold for the step's snapshot (a larger one
is left alone: its changes inside the head are kept, as without the replay)."""


class HeadCallError(RuntimeError):
    """The user's ``compute_loss`` failed (raised, or called a collective the head refuses)
    on some rank; raised on EVERY rank at the step's exchange, before the optimizer step."""


class _Refused(Exception):
    """Raised inside the user's call by a refused collective (caught by ``HeadCalls``)."""


def current_head_call() -> "_HeadCall | None":
    """The user call running inside the engine's head (or its replay), else None; the
    ``CephaloAccelerator`` collectives consult it."""
    return _CURRENT.get()


class _Phase(enum.Enum):
    HEAD = "head"      # in the engine's head: record, answer locally
    REPLAY = "replay"  # once per step: answer from every microbatch's records


@dataclass
class _HeadCall:
    """One user call: the head phase records what it gathers; the replay answers from
    ``answers`` (the k-th gather gets ``answers[k]``)."""

    phase: _Phase
    records: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    answers: list[torch.Tensor] = field(default_factory=list)
    refused: str | None = None

    def gather(self, value: Any, what: str) -> Any:
        """``accelerator.gather`` / ``gather_for_metrics`` (``what`` "gather") or
        ``reduce(sum)`` ("reduce") of ``value``: in the head this microbatch's value, in the
        replay every microbatch's combined (``_combine``)."""
        if not isinstance(value, torch.Tensor):
            self.refuse(f"accelerator.{what} of a {type(value).__name__} (only tensors can be "
                        "deferred to the step's exchange)")
        if self.phase is _Phase.HEAD:
            self.records.append((what, value.detach().to("cpu", copy=True)))
            return value
        k = len(self.records)
        self.records.append((what, value))
        if k >= len(self.answers):
            raise HeadCallError(
                f"compute_loss made {k + 1} accelerator.{what} calls in its replay but at most "
                f"{len(self.answers)} per microbatch in the head: the gathers of a step must not "
                "depend on the data (docs/trl.md, 'Metrics and collectives in a loss')")
        return self.answers[k].to(value.device)

    def refuse(self, what: str) -> None:
        self.refused = self.refused or what
        raise _Refused(what)


@dataclass
class _MicrobatchRecord:
    """What one microbatch's call left for the exchange: its gathered values (CPU), or the
    failure (rank-independent text) that every rank raises."""

    gathered: list[tuple[str, torch.Tensor]]
    failure: str | None = None


def _schema(microbatch) -> dict[str, Any]:
    """Keys, trailing shapes and dtypes of a collated microbatch (what an idle rank needs to
    build the replay's zero-row inputs); non-tensor values kept as they are."""
    out = {}
    for key, value in dict(microbatch).items():
        if isinstance(value, torch.Tensor):
            out[key] = ("tensor", tuple(value.shape[1:]) if value.dim() else None, value.dtype)
        else:
            out[key] = ("value", value)
    return out


def zero_row_inputs(schema: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The replay's inputs: every tensor of the schema with 0 rows (a 0-dim one as 0), other
    values as they were."""
    out = {}
    for key, entry in schema.items():
        if entry[0] == "value":
            out[key] = entry[1]
        elif entry[1] is None:
            out[key] = torch.zeros((), dtype=entry[2], device=device)
        else:
            out[key] = torch.zeros((0, *entry[1]), dtype=entry[2], device=device)
    return out


def _combine(entries: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Every microbatch's k-th gathered value as one process with the global batch sees it:
    a reduce (and a 0-dim gather: a sum over the batch's items) summed elementwise, else
    concatenated along dim 0 (rows)."""
    kinds = sorted({kind for kind, _ in entries})
    values = [v for _, v in entries]
    if len(kinds) > 1:
        raise HeadCallError(f"the same call of compute_loss was {kinds} in different "
                            "microbatches: the calls must not depend on the data")
    if kinds[0] == "reduce" or all(v.dim() == 0 for v in values):
        try:
            return torch.stack(values).sum(0).to(values[0].dtype)
        except RuntimeError as exc:
            raise HeadCallError(f"compute_loss reduced tensors of shapes "
                                f"{sorted({tuple(v.shape) for v in values})} in the same call "
                                "across microbatches: they must have one shape") from exc
    try:
        return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values])
    except RuntimeError as exc:
        shapes = sorted({tuple(v.shape) for v in values})
        raise HeadCallError(f"compute_loss gathered tensors of shapes {shapes} in the same call "
                            "across microbatches; they cannot be concatenated along dim 0 (pad "
                            "them to a fixed width first)") from exc


# ---- the trainer's plain-data state (the replay's side effects replace the head's) -----------

def _copy_plain(value: Any, budget: list[int]) -> tuple[bool, Any]:
    """(True, a copy) for plain data (numbers, strings, None, enums, small tensors, and
    lists / tuples / dicts / sets / deques of them), else (False, None)."""
    budget[0] -= 1
    if budget[0] < 0:
        return False, None
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum)):
        return True, value
    if isinstance(value, torch.Tensor):
        return (True, value.detach().clone()) if value.numel() <= 1024 else (False, None)
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        items = []
        for item in value:
            ok, copied = _copy_plain(item, budget)
            if not ok:
                return False, None
            items.append(copied)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return True, type(value)(*items)
        return True, type(value)(items)
    if isinstance(value, dict):
        out = type(value)(value.default_factory) if isinstance(value, collections.defaultdict) \
            else type(value)()
        for key, item in value.items():
            ok, copied = _copy_plain(item, budget)
            if not ok:
                return False, None
            out[key] = copied
        return True, out
    return False, None


def snapshot_plain_state(obj: Any) -> dict[str, Any]:
    """Copies of ``obj``'s plain-data attributes (``_copy_plain``)."""
    budget = [_PLAIN_BUDGET]
    out = {}
    for key, value in vars(obj).items():
        ok, copied = _copy_plain(value, budget)
        if ok:
            out[key] = copied
    return out


def restore_plain_state(obj: Any, snapshot: dict[str, Any]) -> None:
    """Put ``obj``'s plain-data attributes back as ``snapshot`` holds them; plain attributes
    created since are removed; other attributes are left alone."""
    state = vars(obj)
    for key in list(state):
        if key in snapshot:
            continue
        ok, _ = _copy_plain(state[key], [_PLAIN_BUDGET])
        if ok:
            del state[key]
    state.update(snapshot)


# ---- the guard ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _collectives_refused(call: _HeadCall) -> Iterator[None]:
    """``torch.distributed``'s collectives raise while the user's call runs (scoped: restored
    after it). Only the public module attributes are replaced; code that imported a
    collective by name before the call is not caught."""
    import torch.distributed as dist

    saved = {}
    for name in _GUARDED_COLLECTIVES:
        if hasattr(dist, name):
            saved[name] = getattr(dist, name)
            setattr(dist, name, _refusing(call, name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _refusing(call: _HeadCall, name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        call.refuse(f"torch.distributed.{name}")
    return refused


@contextlib.contextmanager
def _user_call(call: _HeadCall) -> Iterator[_HeadCall]:
    token = _CURRENT.set(call)
    try:
        with _collectives_refused(call):
            yield call
    finally:
        _CURRENT.reset(token)


def _failure_text(call: _HeadCall, exc: BaseException) -> str:
    if call.refused is not None:
        return (f"compute_loss called {call.refused} inside the engine's head, where ranks run "
                "different numbers of microbatches (an idle rank none), so a collective there "
                "would pair the wrong calls or hang; use accelerator.gather_for_metrics / "
                "gather / reduce(..., 'sum') (deferred to one exchange per step) or compute the "
                "value outside compute_loss (docs/trl.md, 'Metrics and collectives in a loss')")
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"compute_loss raised {type(exc).__name__}: {exc}\n{''.join(lines[-6:])}"


# ---- the step --------------------------------------------------------------------------------

@dataclass
class _Step:
    """This rank's part of one engine call: the schema of its first microbatch, one record per
    user call, the trainer's plain state before it, the first exception raised."""

    schema: dict[str, Any] | None
    snapshot: dict[str, Any]
    records: list[_MicrobatchRecord] = field(default_factory=list)
    exception: BaseException | None = None
    open: bool = True


class HeadCalls:
    """The two-phase user calls of one trainer (see [Note: collectives inside the engine's
    head]).

    Args:
        trainer: whose plain-data state is snapshot / restored around the head.
        replay: ``replay(inputs, num_items)`` runs the trainer's ``compute_loss`` once on the
            zero-row ``inputs`` with the global item count (the front end builds the
            stand-in model's empty outputs).
        group: the process group of the exchange (the engine's).
        device: where the replay's inputs live.
    """

    def __init__(self, trainer: Any, replay: Callable[[dict[str, Any], int], Any], group,
                 device: torch.device) -> None:
        self.trainer, self._replay, self.group, self.device = trainer, replay, group, device
        self._step: _Step | None = None

    @contextlib.contextmanager
    def step(self, microbatches) -> Iterator[None]:
        """Around one engine call (``train_step`` / ``evaluate``) over this rank's
        ``microbatches``: the user calls in its head record instead of communicating. Call
        ``finish`` after it, on every rank (also when the engine call raised: then the ranks'
        collectives are out of step anyway and the engine refuses further calls)."""
        self._step = _Step(_schema(microbatches[0]) if microbatches else None,
                           snapshot_plain_state(self.trainer))
        try:
            yield
        finally:
            self._step.open = False

    def call(self, fn: Callable[[], torch.Tensor], fallback: Callable[[], torch.Tensor]
             ) -> torch.Tensor:
        """Run one microbatch's user loss ``fn`` in the head. Outside a ``step`` (a direct
        engine call) ``fn`` runs as is. A failure is recorded and ``fallback()`` (a zero loss
        connected to the head's input) returned, so the schedule's collectives go on."""
        step = self._step
        if step is None or not step.open:
            return fn()
        call = _HeadCall(_Phase.HEAD)
        try:
            with _user_call(call):
                loss = fn()
            if call.refused is not None:  # the user's code caught the refusal and went on
                raise _Refused(call.refused)
        except Exception as exc:  # every rank raises it at the exchange (module note)
            step.records.append(_MicrobatchRecord([], _failure_text(call, exc)))
            step.exception = step.exception or exc
            return fallback()
        step.records.append(_MicrobatchRecord(call.records))
        return loss

    def finish(self, num_items: int) -> None:
        """Collective (every rank, after each ``step``): exchange the records, raise a
        failure on every rank, restore the trainer's plain state, replay ``compute_loss`` once
        with every microbatch's gathered values."""
        import torch.distributed as dist

        step, self._step = self._step, None
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (step.schema, step.records), group=self.group)
        restore_plain_state(self.trainer, step.snapshot)
        records = [(rank, j, rec) for rank, (_, recs) in enumerate(everyone)
                   for j, rec in enumerate(recs)]
        _raise_failures(records, step.exception)
        schema = next((s for s, _ in everyone if s is not None), None)
        if schema is None:
            return  # no rank had a microbatch (an evaluation step past the data)
        answers = _answers([rec for _, _, rec in records])
        call = _HeadCall(_Phase.REPLAY, answers=answers)
        try:
            with _user_call(call):
                self._replay(zero_row_inputs(schema, self.device), num_items)
        except _Refused:
            raise HeadCallError(_failure_text(call, None)) from None
        if call.refused is not None:
            raise HeadCallError(_failure_text(call, None))
        if len(call.records) != len(answers):
            raise HeadCallError(
                f"compute_loss made {len(call.records)} gathers in its replay but "
                f"{len(answers)} per microbatch in the head: the gathers of a step must not "
                "depend on the data (docs/trl.md, 'Metrics and collectives in a loss')")


def _raise_failures(records, exception: BaseException | None) -> None:
    """HeadCallError on every rank when some rank's user call failed (chained to this rank's
    own exception, if it had one)."""
    failed = [(rank, j, rec.failure) for rank, j, rec in records if rec.failure is not None]
    if not failed:
        return
    rank, j, text = failed[0]
    ranks = sorted({r for r, _, _ in failed})
    raise HeadCallError(f"the user loss failed inside the engine's head on rank(s) {ranks} "
                        f"(first: rank {rank}, microbatch {j}); the step's update is not "
                        f"applied on any rank:\n{text}") from exception


def _answers(records: list[_MicrobatchRecord]) -> list[torch.Tensor]:
    """The replay's answers: the k-th gather of every microbatch combined (``_combine``)."""
    counts = sorted({len(rec.gathered) for rec in records})
    if len(counts) > 1:
        raise HeadCallError(
            f"compute_loss made {counts} gathers in different microbatches of one step: the "
            "k-th gather of every microbatch is combined into the replay's k-th answer, so "
            "their number must not depend on the data (docs/trl.md, 'Metrics and collectives "
            "in a loss')")
    n = counts[0] if counts else 0
    return [_combine([rec.gathered[k] for rec in records]) for k in range(n)]
