"""torch.compile per unit (engine/compile.py): compiled vs eager engine, dropout replay under
compile, and compile failures raised on every rank before the first all-gather (in the first
step and while profiling at start) with one message per failure, identical on every failing
rank (printed once under a launcher), that carries the backend's root cause: a test backend
fails as torch's tvm backend does without apache-tvm (``register_failing_backend``).

Tolerances: the compiled and the eager engine run the same math, but inductor fuses kernels
and reorders fp32 reductions (layer norm, softmax, matmul epilogues, gradient sums), so results
agree to fp32 rounding accumulated over 3 AdamW steps, not bit for bit: rtol 1e-4, atol 1e-5
(the eager engine itself is held to 1e-5 / 1e-6 against the single-process reference).

Compiling is slow on 2 cores: ONE 3-rank process group runs every multi-rank sub-case on tiny
models (the 2-rank cases in a subgroup), and every case reuses the same graphs (same block
shapes), which the in-process dynamo cache and inductor's on-disk cache serve after the first.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

from hf_cephalo.engine import CephaloEngine, CompileOptions
from hf_cephalo.engine import schedule
from hf_cephalo.engine.compile import CompileFailure, compile_line, compiled_earlier
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from tests.dist_utils import budget_s, run_ranks, test_timeout

RTOL, ATOL = 1e-4, 1e-5
LR, WD = 1e-2, 0.1
CFG = dict(vocab_size=24, hidden_size=16, num_heads=2, num_layers=2, mlp_ratio=2, max_seq_len=8)
INDUCTOR = CompileOptions(backend="inductor")
TVM_MISSING = "Please install apache-tvm"  # what torch's tvm backend raises without apache-tvm


def register_failing_backend(name: str = "fails_like_tvm", ranks=None) -> str:
    """A dynamo backend ``name`` that fails like torch's tvm backend without apache-tvm (an
    ImportError at compile time, wrapped by dynamo in BackendCompilerFailed) on ``ranks``
    (None: every process) and compiles eagerly elsewhere; returns ``name``. The ImportError is
    raised from a ModuleNotFoundError, as torch's: the message keeps the ImportError's line."""
    def backend(gm, example_inputs):
        rank = dist.get_rank() if dist.is_initialized() else 0
        if ranks is None or rank in ranks:
            try:
                import no_such_module_tvm  # noqa: F401
            except ImportError as exc:  # as torch's tvm backend: the message to act on
                raise ImportError(TVM_MISSING) from exc
        return gm.forward
    torch._dynamo.reset()  # graphs cached under another registration of the same name
    torch._dynamo.register_backend(backend, name=name)
    return name


def tiny_llama():
    import transformers

    from hf_cephalo.models.registry import stage_model
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return stage_model(transformers.LlamaForCausalLM(cfg))


def batches(world: int, step: int, sizes_b, seq: int = 6):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG["vocab_size"], (sum(sizes_b), seq), generator=gen)
    return ids


def my_microbatches(ids, sizes_b, sizes_m, rank):
    """Rank ``rank``'s microbatches of size sizes_m[rank] (the last one smaller if it does not
    divide: a microbatch of another size every step)."""
    start = sum(sizes_b[:rank])
    mine = ids[start:start + sizes_b[rank]]
    return [{"input_ids": mine[k:k + sizes_m[rank]]}
            for k in range(0, sizes_b[rank], sizes_m[rank])]


def train(rank, group, cfg, ratios, sizes_b, sizes_m, compile, steps=3, seed=0, **kw):
    """Losses, the full state dict (rank 0) and the engine after ``steps`` AdamW steps."""
    torch.manual_seed(seed)
    engine = CephaloEngine(ToyStaged(ToyLM(cfg)), ratios, process_group=group, compile=compile,
                           **kw)
    opt = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=WD)
    losses, reports = [], []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # dropout masks: same stream in both runs
        ids = batches(len(ratios), step, sizes_b)
        losses.append(engine.train_step(my_microbatches(ids, sizes_b, sizes_m, rank)).loss)
        opt.step()
        engine.zero_grad()
        reports.append(engine.compile_report())
        # [Note: compiled units]: compiled only while the engine runs; the model is eager
        # between steps, as stock Trainer leaves the user's model
        assert compiled_modules(engine.staged.model) == [], compiled_modules(engine.staged.model)
    return losses, engine.full_state_dict(), reports


def compiled_modules(model) -> list[str]:
    """Names of the modules of ``model`` that run compiled when called."""
    return [name or "<model>" for name, module in model.named_modules()
            if module._compiled_call_impl is not None]


def assert_same_run(got, expected, what, rank, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(got[0], expected[0], rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: losses: {m}")
    if rank == 0:
        for key, value in expected[1].items():
            torch.testing.assert_close(got[1][key], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what}: {key} after 3 steps: {m}")


# ---- sub-cases (each runs on every rank of the 3-rank group) -----------------------------------

def case_compiled_equals_eager(rank, world, pair):
    """Dropout 0, uneven state split, uneven microbatches (a last one of another size, a rank
    with none): compiled == eager after 3 AdamW steps; no recompile after the first step.
    Microbatches of 3 and 2 on whichever rank has two (rank 0, then rank 1): every rank
    compiles the same two shapes (3 static, then the batch dimension dynamic), so a cold
    inductor cache compiles 6 graphs' kernels once for both ranks, not a set of shapes each."""
    plans = [(pair, [0.7, 0.3], [5, 3], [3, 3]),
             (None, [0.5, 0.1, 0.4], [3, 5, 0], [3, 3, 1])]
    for group, ratios, sizes_b, sizes_m in plans:
        if group is pair and rank == 2:
            continue
        cfg = ToyConfig(**CFG)
        eager = train(rank, group, cfg, ratios, sizes_b, sizes_m, None)
        compiled = train(rank, group, cfg, ratios, sizes_b, sizes_m, INDUCTOR)
        assert_same_run(compiled, eager, f"compiled vs eager, {len(ratios)} ranks", rank)
        reports = compiled[2]
        assert reports[0].recompiles == reports[-1].recompiles, \
            f"recompiled after the first step: {reports}"
        assert reports[-1].graphs <= 4, reports  # see [Note: compiled units]


def case_dropout_replay(rank, world, pair, break_replay=False):
    """Dropout 0.3, compiled: the recompute (activation checkpointing) gives the gradient of
    the logged loss, i.e. the same run as keeping every forward graph (no recompute), only if
    the recompute replays the forward's masks. Microbatches of 2 on both ranks: one graph per
    grad mode (the batch dimension dynamic, as case_compiled_equals_eager left the block's
    code), the same on both ranks."""
    if rank == 2:
        return None
    cfg = ToyConfig(**CFG, dropout=0.3)
    args = (rank, pair, cfg, [0.6, 0.4], [4, 2], [2, 2], INDUCTOR)
    kept = train(*args, activation_checkpointing=False)
    saved = schedule.RngState.replay
    if break_replay:  # the recompute draws fresh masks
        schedule.RngState.replay = lambda self: contextlib.nullcontext()
    try:
        recomputed = train(*args, activation_checkpointing=True)
    finally:
        schedule.RngState.replay = saved
    assert_same_run(recomputed, kept, "dropout: recompute vs kept graphs", rank)
    return True


def case_unit_failure(rank, world):
    """A unit that cannot compile (a data-dependent branch is a graph break, an error under
    fullgraph) fails on every rank, the rank without a microbatch included, before any
    all-gather, with a message naming the unit, the backend and how to turn compile off."""
    cfg = ToyConfig(**CFG, rare_token_id=3)
    torch.manual_seed(0)
    engine = CephaloEngine(ToyStaged(ToyLM(cfg)), [0.4, 0.4, 0.2], compile=INDUCTOR)
    before = engine.stats.all_gather_count
    ids = batches(3, 0, [2, 2, 0])
    with pytest.raises(RuntimeError) as err:
        engine.train_step(my_microbatches(ids, [2, 2, 0], [2, 1, 1], rank))
    message = str(err.value)
    assert "'inductor'" in message and "--torch_compile False" in message, message
    assert "unit 0" in message, message
    assert engine.stats.all_gather_count == before, "an all-gather ran before the error"
    return message


def case_backend_root_cause(rank, world):
    """A backend that raises at compile time (torch's tvm backend without apache-tvm: dynamo
    wraps the ImportError in BackendCompilerFailed, whose own first line is only "backend=...
    raised:"): the one-line message carries the root cause's type and first line."""
    options = CompileOptions(backend=register_failing_backend())
    torch.manual_seed(0)
    engine = CephaloEngine(ToyStaged(ToyLM(ToyConfig(**CFG))), [0.4, 0.4, 0.2], compile=options)
    ids = batches(3, 0, [2, 2, 0])
    with pytest.raises(RuntimeError) as err:
        engine.train_step(my_microbatches(ids, [2, 2, 0], [2, 1, 1], rank))
    assert engine.stats.all_gather_count == 0, "an all-gather ran before the error"
    return str(err.value)


def case_profiler_failure(rank, world, failing_ranks):
    """A backend failing on ``failing_ranks`` while profiling at start: every rank raises before
    the profiler's first lockstep barrier, the failing ones a CompileFailure with the engine's
    wording, identical on each of them (printed once under a launcher)."""
    from hf_cephalo.profiler import measure

    name = register_failing_backend(f"fails_on_{'_'.join(map(str, failing_ranks))}",
                                    failing_ranks)
    config = measure.MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1,
                                   progress=False, compile_backend=name)
    with pytest.raises(RuntimeError) as err:
        measure.profile_cluster(tiny_llama(), config, cache=False)
    assert isinstance(err.value, CompileFailure) == (rank in failing_ranks), repr(err.value)
    return str(err.value)


def compile_worker(rank, world):
    out = {}
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    case_compiled_equals_eager(rank, world, pair)
    out["failure"] = case_unit_failure(rank, world)
    out["root_cause"] = case_backend_root_cause(rank, world)
    out["profile_all"] = case_profiler_failure(rank, world, (0, 1, 2))
    out["profile_one"] = case_profiler_failure(rank, world, (1,))
    case_dropout_replay(rank, world, pair)
    try:
        case_dropout_replay(rank, world, pair, break_replay=True)
        out["broken_replay_detected"] = False
    except AssertionError:
        out["broken_replay_detected"] = True
    return out


@test_timeout(150)
def test_compiled_engine_three_ranks():
    results = run_ranks(compile_worker, 3, timeout_s=budget_s(150))
    # ranks 0 and 1 fail on unit 0: one message naming both, identical on both ranks, so that
    # hf_cephalo.rank_errors prints it once (its election compares the whole message)
    assert "failed on ranks 0, 1:" in results[0]["failure"], results[0]["failure"]
    assert results[1]["failure"] == results[0]["failure"]
    assert "rank 0 on unit 0" in results[2]["failure"]  # the rank without a microbatch
    root_cause = results[0]["root_cause"]
    assert root_cause.splitlines() == [root_cause], root_cause  # one line
    for text in (f"ImportError: {TVM_MISSING} (through BackendCompilerFailed)", "unit 0 (",
                 "'fails_like_tvm'", "failed on ranks 0, 1:", "--torch_compile False"):
        assert text in root_cause, root_cause
    assert results[1]["root_cause"] == root_cause
    # profiling at start: the engine's wording, the root cause, once for all ranks
    profile_all = results[0]["profile_all"]
    for text in ("unit 0 (LlamaDecoderLayer)", "'fails_on_0_1_2'", "failed on ranks 0, 1, 2",
                 f"ImportError: {TVM_MISSING}", "--torch_compile False",
                 "while profiling the compiled units for the plan"):
        assert text in profile_all, profile_all
    assert results[1]["profile_all"] == results[2]["profile_all"] == profile_all
    assert "failed on rank 1:" in results[1]["profile_one"], results[1]["profile_one"]
    assert "rank 1 on unit 0" in results[0]["profile_one"], results[0]["profile_one"]
    assert results[0]["profile_one"] == results[2]["profile_one"]  # printed once too
    assert results[0]["broken_replay_detected"] and results[1]["broken_replay_detected"]


def test_bad_backend_or_mode_refused_without_process_group():
    with pytest.raises(ValueError, match="backend 'no_such_backend' is not registered.*"
                                         "--torch_compile False"):
        CompileOptions(backend="no_such_backend")
    with pytest.raises(ValueError, match=r"mode 'fastest' \(--torch_compile_mode\) is not one of"):
        CompileOptions(mode="fastest")
    with pytest.raises(ValueError, match=r"\(--torch_compile_mode\) is an inductor setting"):
        CompileOptions(backend="aot_eager", mode="max-autotune")
    with pytest.raises(TypeError, match="CompileOptions"):
        CephaloEngine(ToyStaged(ToyLM(ToyConfig(**CFG))), compile="inductor")


def test_profiler_times_the_compiled_units_under_their_own_cache_key(tmp_path, monkeypatch):
    """With compile_backend set, profile_cluster compiles the units before timing them (every
    unit call sees the compiled module, and no graph is compiled in the timed rounds; on the CPU the memory pass alone is forced eager: see
    ``compute._peak_bytes``), and the profile is cached apart from
    the eager one (an eager profile never prices a compiled run). aot_eager: dynamo and
    AOTAutograd without inductor's kernel compilation, to keep the test cheap."""
    import transformers

    from hf_cephalo.models.registry import stage_model
    from hf_cephalo.profiler import compute, measure
    from hf_cephalo.profiles.cache import ProfileCache

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    staged = stage_model(transformers.LlamaForCausalLM(cfg))
    seen = []
    real_run_unit = type(staged).run_unit

    def spy(self, index, hidden, ctx):
        seen.append(self.units()[index]._compiled_call_impl is not None)
        return real_run_unit(self, index, hidden, ctx)

    monkeypatch.setattr(type(staged), "run_unit", spy)
    cache = ProfileCache(tmp_path)
    base = dict(max_microbatch_size=2, sequence_length=8, repeats=1, progress=False)
    measure.profile_cluster(staged, measure.MeasureConfig(**base), cache=cache)
    assert seen and not any(seen)
    seen.clear()
    # [Note: compiling before timing]: every graph is compiled before the timed rounds, whose
    # times and progress estimate thus leave compiling out
    from hf_cephalo.engine.compile import graph_count
    real_rounds, compiled_in_rounds = compute._time_rounds, []

    def rounds_spy(*args, **kwargs):
        before = graph_count()
        real_rounds(*args, **kwargs)
        compiled_in_rounds.append(graph_count() - before)

    monkeypatch.setattr(compute, "_time_rounds", rounds_spy)
    measure.profile_cluster(staged, measure.MeasureConfig(**base, compile_backend="aot_eager"),
                            cache=cache)
    assert seen and all(seen)
    assert compiled_in_rounds and not any(compiled_in_rounds), compiled_in_rounds
    assert len(list(tmp_path.glob("device-*.json"))) == 2  # not a hit of the eager entry
    assert compiled_modules(staged.model) == []  # eager again once measured, as it came
    # the engine's compile line, whose probe then compiles no new graph, says where they were
    # compiled and how long it took (not "0 graphs compiled in 0.0 s")
    options = CompileOptions(backend="aot_eager")
    earlier = compiled_earlier(options)
    assert re.fullmatch(r"compiled while profiling: ([1-9]\d*) graphs? in \d+\.\d s",
                        earlier or ""), earlier
    line = compile_line(options, "training", 2, 0, 0.04)
    assert f"for training: 2 units, 0 new graphs ({earlier}; probe 0.0 s)" in line, line
    assert "1 unit, 1 graph compiled in 1.5 s" in compile_line(options, "training", 1, 1, 1.5)


def test_profiler_compile_failure_has_the_engine_wording():
    """Profiling at start with a backend that cannot compile: a CompileFailure naming the unit,
    the backend, the root cause and --torch_compile False, not dynamo's raw error."""
    from hf_cephalo.profiler import measure

    config = measure.MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1,
                                   progress=False, compile_backend=register_failing_backend())
    with pytest.raises(CompileFailure) as err:
        measure.profile_cluster(tiny_llama(), config, cache=False)
    message = str(err.value)
    for text in ("unit 0 (LlamaDecoderLayer)", "'fails_like_tvm'", "failed on rank 0:",
                 f"ImportError: {TVM_MISSING}", "--torch_compile False", "while profiling"):
        assert text in message, message
