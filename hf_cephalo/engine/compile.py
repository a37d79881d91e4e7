"""torch.compile per unit: options, the up-front probe, graph counts (docs/engine.md "Compile").

``CompiledUnits`` compiles the layer units and installs the compiled calls while the engine
runs; ``probe_compile`` compiles every graph a call needs before its first collective.
"""

# [Note: compiled units]
# Only the layer units are compiled, each with ``nn.Module.compile(fullgraph=True)``: the module
# tree, its names and the engine's parameter leaves are unchanged, and a graph break is an
# error, never a silent partial fallback to eager (the recompile limit too, while the engine
# runs: ``fail_on_recompile_limit_hit``). Identical layers share one graph per grad mode (at most
# 4 graphs in training mode, whatever the number of layers). The compiled call is installed only
# while the engine runs the modules (``CompiledUnits.active``: the probe, ``train_step``,
# ``evaluate``, the profiler's timing) and the modules get back what they had when it returns,
# so the user's model object is eager whenever the user can reach it, as stock Trainer leaves
# it. Dropout under compile replays the forward's masks in the recompute (``RngState`` in
# ``schedule.py``). Graph counts, why only the layers, how the call is installed and removed:
# docs/engine.md, "Compiled units".

# [Note: compile failures before the first collective]
# Compilation is lazy and a unit's first call comes after its all-gather, so a compile failure
# there would leave the other ranks waiting in a collective. The first ``train_step`` and the
# first ``evaluate`` in each of train and eval mode therefore first run ``probe_compile`` on
# every rank with a microbatch: the embedding and each unit run locally on zero-filled
# parameters of the real shapes, with the ``requires_grad`` the real call has (dynamo guards
# on it), compiling every graph the call uses without any collective. A failure is folded into
# the step's first collective, the item-count all-reduce, and every rank raises before any
# all-gather, with a message that does not hold the raising rank's number (printed once by
# ``hf_cephalo.rank_errors``). The profiler does the same before its first lockstep barrier
# (``profiler/compute.py``, [Note: compiling before timing]). The messages: docs/engine.md,
# "Compile", Failures.

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import torch
from torch import nn

from .flat_param import ParamLeaves, install_param_views

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OFF_HINT = ("turn compile off (--torch_compile False, or CephaloEngine(compile=None)) or pick "
            "another backend (--torch_compile_backend)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How ``CephaloEngine(compile=...)`` compiles each layer unit (``torch.compile``).

    backend: a ``torch._dynamo.list_backends()`` name ("inductor": C++/OpenMP kernels on the
        CPU, Triton on CUDA; "aot_eager" and "eager" are debugging backends).
    mode: None / "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
        (inductor only; see ``torch.compile``).
    Raises ValueError for an unknown backend or mode (at construction, before any collective).
    """

    backend: str = "inductor"
    mode: str | None = None

    def __post_init__(self):
        known = sorted(set(torch._dynamo.list_backends()) | {"eager", "aot_eager"})
        if self.backend not in known:
            raise ValueError(f"torch.compile backend {self.backend!r} is not registered in this "
                             f"torch {torch.__version__} (registered: {known}; some need their "
                             f"own package installed, e.g. tvm needs apache-tvm): {OFF_HINT}")
        if self.mode not in _MODES:
            raise ValueError(f"torch.compile mode {self.mode!r} (--torch_compile_mode) is not "
                             f"one of {list(_MODES)}: pick one of them or leave the mode unset")
        if self.mode not in (None, "default") and self.backend != "inductor":
            raise ValueError(f"torch.compile mode {self.mode!r} (--torch_compile_mode) is an "
                             f"inductor setting, the backend is {self.backend!r}: drop the "
                             f"mode or use inductor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileStats:
    """What compiling the units cost and produced on this rank.

    graphs: graphs dynamo compiled in this process since the units were compiled (shared by
        every unit: see [Note: compiled units]; other compiled code in the process counts too);
        probe_graphs: those compiled by the probe (first step);
        recompiles: ``graphs - probe_graphs`` (later shapes / grad modes).
    compile_s: wall seconds of the probe (compilation of every graph of the first step).
    """

    graphs: int = 0
    probe_graphs: int = 0
    compile_s: float = 0.0

    @property
    def recompiles(self) -> int:
        return self.graphs - self.probe_graphs


def graph_count() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


class CompiledUnits:
    """The layer units' compiled calls, installed only inside ``active()`` (see
    [Note: compiled units]).

    units: the layer unit modules; each is compiled with ``nn.Module.compile(backend, mode,
        fullgraph=True)`` now (lazily: dynamo compiles at the first call) and left as it was
        before (eager unless the caller had compiled it itself) until ``active()``.
    graphs_at_compile: ``graph_count()`` at construction (the base of ``CompileStats.graphs``).
    """

    def __init__(self, units: Sequence[nn.Module], options: CompileOptions):
        self.options = options
        self._modules = list(units)
        self._before = [m.__dict__.get("_compiled_call_impl") for m in self._modules]
        self._calls = []
        for module in self._modules:
            module.compile(backend=options.backend, mode=options.mode, fullgraph=True)
            self._calls.append(module._compiled_call_impl)
        self._depth = 0  # nested active() contexts (the probe inside a step's first collective)
        self._uninstall()
        self.graphs_at_compile = graph_count()

    def _uninstall(self) -> None:
        for module, before in zip(self._modules, self._before):
            if before is None:
                module.__dict__.pop("_compiled_call_impl", None)  # the class default: eager
            else:
                module._compiled_call_impl = before

    @contextlib.contextmanager
    def active(self, *, strict: bool = True):
        """The units run compiled inside; on exit (also on an exception) they are as before.
        strict: passing dynamo's recompile limit raises instead of falling back to eager."""
        if self._depth == 0:
            for module, call in zip(self._modules, self._calls):
                module._compiled_call_impl = call
        self._depth += 1
        try:
            with (torch._dynamo.config.patch(fail_on_recompile_limit_hit=True) if strict
                  else contextlib.nullcontext()):
                yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._uninstall()


def running(compiled: CompiledUnits | None):
    """``compiled.active()``, or a no-op context with compile off."""
    return contextlib.nullcontext() if compiled is None else compiled.active()


def plural(n: int, word: str) -> str:
    """``"1 graph"``, ``"2 graphs"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def root_cause(exc: BaseException) -> BaseException:
    """The error behind dynamo's wrappers: ``BackendCompilerFailed`` (and dynamo's other
    exceptions that wrap one) keeps the backend's own error as ``inner_exception`` /
    ``__cause__``, whose first line is what a user acts on (``ImportError: Please install
    apache-tvm ...``); its own first line is only ``backend='tvm' raised:``. Unwraps exceptions
    of ``torch._dynamo`` only (up to 8), so that the backend's error is kept, not what it was
    raised from (``ModuleNotFoundError: No module named 'tvm'``)."""
    for _ in range(8):
        if not type(exc).__module__.startswith("torch._dynamo"):
            break
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    return exc


def _summary(exc: BaseException) -> str:
    """``"<Type>: <first line>"`` of the root cause of ``exc`` (``root_cause``), followed by
    ``" (through <Type>)"`` naming ``exc``'s type where that is another exception (dynamo's
    ``BackendCompilerFailed``); the line cut at 300 characters."""
    def line(e: BaseException) -> str:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return f"{type(e).__name__}: {first}" if first else type(e).__name__
    root = root_cause(exc)
    return line(exc) if root is exc else f"{line(root)} (through {type(exc).__name__})"


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


class CompileFailure(RuntimeError):
    """A unit failed to compile (raised by ``probe_compile`` and the profiler).

    The message names the unit, the backend and mode, the failing ranks (``ranks``: every rank
    that failed on this unit, once the ranks have exchanged their results; before that, this
    rank), the error and its root cause (``root_cause``), and how to turn compile off. It holds
    nothing else that differs between ranks, so that the identical failure on several ranks
    is one message, printed once (``hf_cephalo.rank_errors``).
    stops: what every rank does next, for the message.
    """

    def __init__(self, unit_index: int, unit_name: str, options: CompileOptions,
                 ranks: Sequence[int], exc: BaseException,
                 stops: str = "Every rank stops before the first all-gather"):
        super().__init__(f"torch.compile of {unit_name} with backend {options.backend!r} "
                         f"(mode {options.mode}) failed on {_ranks_text(ranks)}: "
                         f"{_summary(exc)}. {stops}; {OFF_HINT}")
        self.unit_index, self.unit_name, self.options = unit_index, unit_name, options
        self.ranks, self.exc, self.stops = list(ranks), exc, stops

    def on_ranks(self, codes: Sequence[int]) -> "CompileFailure":
        """This failure naming every rank that failed on the same unit (``codes`` as in
        ``remote_failure``), raised from the compiler's error."""
        ranks = [r for r, c in enumerate(codes) if int(c) == self.unit_index + 1]
        failure = CompileFailure(self.unit_index, self.unit_name, self.options, ranks, self.exc,
                                 self.stops)
        failure.__cause__ = self.exc
        return failure


def remote_failure(codes: Sequence[int], options: CompileOptions, rank: int,
                   unit_names: Sequence[str],
                   stops: str = "before the first all-gather") -> RuntimeError | None:
    """The error a rank raises for the other ranks' probe failures (``codes[r]``: 0 = rank r
    compiled fine, k > 0: rank r failed on unit k - 1); None if none failed. The message is
    the same on every rank that raises it (printed once: ``hf_cephalo.rank_errors``)."""
    failed = [(r, int(c) - 1) for r, c in enumerate(codes) if int(c) > 0]
    if not failed:
        return None
    where = ", ".join(f"rank {r} on {unit_names[k]}" for r, k in failed)
    ok = [r for r, c in enumerate(codes) if int(c) == 0]
    return RuntimeError(f"torch.compile with backend {options.backend!r} (mode {options.mode}) "
                        f"failed ({where}; see that rank's error); {_ranks_text(ok)} "
                        f"{'stops' if len(ok) == 1 else 'stop'} {stops} too: {OFF_HINT}")


@contextlib.contextmanager
def _zero_params(unit, requires_grad: bool) -> Any:
    """``unit`` (a sharded ``FlatParamUnit``) with zero-filled full parameters installed as the
    engine installs gathered ones (per-parameter leaves over a flat (Nt,) buffer, whose
    gradients accumulate into a flat (Nt,) gradient: the same graphs); yields the function that
    installs them again; placeholders afterwards. No collective."""
    trainable = torch.zeros(unit.trainable_numel, dtype=unit.gather_dtype(unit.parts[0]),
                            device=unit.device)
    frozen = torch.zeros(unit.numel - unit.trainable_numel,
                         dtype=unit.gather_dtype(unit.parts[1]), device=unit.device)
    leaves = ParamLeaves(unit.infos, trainable, requires_grad=requires_grad)
    if leaves.requires_grad:
        leaves.accumulate_into(torch.zeros(unit.trainable_numel, dtype=unit.dtype,
                                           device=unit.device))

    def install() -> None:  # before each call, as ``use_params``
        install_param_views(unit.infos, unit.uses, leaves.leaves, frozen)
    try:
        install()
        yield install
    finally:
        unit.set_placeholders()


def probe_compile(staged, units, embed_unit, microbatch, device: torch.device,
                  options: CompileOptions, rank: int, *, for_training: bool = True) -> None:
    """Run the embedding and every unit once on ``microbatch`` with zero parameters, so that
    every graph of the step is compiled now ([Note: compile failures before the first
    collective]). for_training (``train_step``): without autograd (the forward) and with it
    (recompute + backward), parameters requiring grad as in the step; else (``evaluate``):
    the no-grad forward only, on parameters that do not require grad, as ``evaluate`` runs
    it. The global RNG is left as it was. Raises ``CompileFailure`` naming the first unit that
    failed."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        with _zero_params(embed_unit, for_training), torch.no_grad():
            hidden, ctx = staged.embed(microbatch)
        hidden = hidden.detach()
        for i, unit in enumerate(units):
            try:
                with _zero_params(unit, for_training) as install:
                    with torch.no_grad():
                        staged.run_unit(i, hidden, ctx)
                    if not for_training:
                        continue
                    install()
                    with torch.enable_grad():  # also when called under no_grad
                        x = hidden.clone().requires_grad_(True)
                        y = staged.run_unit(i, x, ctx)
                        torch.autograd.backward(y, torch.ones_like(y))
            except Exception as exc:  # any compiler error: reported, never swallowed
                raise CompileFailure(i, f"{unit.name} ({type(staged.units()[i]).__name__})",
                                     options, [rank], exc) from exc


_EARLIER: dict[tuple[str, str | None], str] = {}


def record_compile(options: CompileOptions, where: str, graphs: int, seconds: float) -> None:
    """Remember, for this process, that ``where`` (e.g. "while profiling") compiled
    ``graphs`` graphs of the units in ``seconds`` wall seconds with ``options``: the engine's
    compile line names it when its own probe finds every graph compiled already."""
    _EARLIER[(options.backend, options.mode)] = \
        f"compiled {where}: {plural(graphs, 'graph')} in {seconds:.1f} s"


def compiled_earlier(options: CompileOptions) -> str | None:
    """What ``record_compile`` recorded for ``options`` in this process, or None."""
    return _EARLIER.get((options.backend, options.mode))


def compile_line(options: CompileOptions, what: str, num_units: int, graphs: int,
                 seconds: float) -> str:
    """Rank 0's line after the probe for ``what`` ("training", "evaluation") compiled
    ``graphs`` graphs of ``num_units`` units in ``seconds`` wall seconds. With no new graph
    it says where they were compiled (``compiled_earlier``: the profiler at start), whose
    time the probe's does not include."""
    if graphs == 0:
        earlier = compiled_earlier(options) or "reused graphs compiled earlier in this process"
        done = f"0 new graphs ({earlier}; probe {seconds:.1f} s)"
    else:
        done = f"{plural(graphs, 'graph')} compiled in {seconds:.1f} s"
    return (f"[hf_cephalo] torch.compile (backend {options.backend}, mode {options.mode}) for "
            f"{what}: {plural(num_units, 'unit')}, {done} (inductor cache: "
            f"{inductor_cache_dir()})")


def timed_probe(probe) -> tuple[float, int]:
    """(seconds, graphs compiled) of ``probe()``."""
    before, t0 = graph_count(), time.perf_counter()
    probe()
    return time.perf_counter() - t0, graph_count() - before


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache folder (``TORCHINDUCTOR_CACHE_DIR``, default
    ``/tmp/torchinductor_<user>``): compiled kernels and FX graphs are reused across runs."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except Exception:  # an older layout: report the variable instead
        import os
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
