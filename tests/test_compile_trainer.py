"""``--torch_compile`` through CephaloTrainer on 2 gloo ranks (tests/test_compile.py tests the
engine alone): the compiled run (training, then evaluation) equals the eager run of the same
script, and the user's model is left as stock Trainer leaves it (eager).

One 2-rank process group runs a tiny Llama (dropout 0) twice with the same uneven plan (rank 1
has a last microbatch of another size): eager, then ``torch_compile_backend="aot_eager"``
(dynamo + AOTAutograd: the trainer's whole compile path). Tolerances are those of
tests/test_compile.py, rtol 1e-4 / atol 1e-5 on losses and parameters after 3 steps. The
optimizer is SGD (with clipping), as in tests/test_trainer.py: Adam's first update is lr *
sign(g) for every element, so an element whose gradient is rounding noise moves by +-lr either
way, which would test the optimizer, not the compile.

Why not inductor here: what this file tests (the flags reaching the engine, the probe of the
training and of the evaluation graphs, the units compiled only while the engine runs, a second
``train()`` reusing the graphs, ``save_model``) is the trainer's and the engine's handling of
dynamo, the same for every backend: a backend only receives the FX graphs dynamo traced. What
inductor adds is its own kernels (fused, fp32 reductions reordered) and its own RNG for dropout,
which tests/test_compile.py checks on the engine (compiled == eager on 2 and 3 ranks, the
dropout replay). A cold inductor cache compiled this file's Llama graphs in ~70 s of the 2-core
suite's time, for no assertion aot_eager does not make.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout
from tests.models_fixtures import build

RTOL, ATOL = 1e-4, 1e-5  # those of tests/test_compile.py (see the module docstring)
# seconds of the 2-rank job, measured when it also ran inductor on a cold cache (90 s on 2 cores
# under load 8), kept as the budget: [Note: test time budgets]
JOB_S = 90.0
pytestmark = test_timeout(JOB_S, 20.0)
BACKENDS = (None, "aot_eager")  # None: eager, the reference of the compiled run
SIZES, MICRO, RATIOS = [1, 3], [1, 2], [0.6, 0.4]
NUM_SAMPLES = 12  # 3 steps of the global batch 4
NUM_EVAL = 8


def _samples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (12,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 6, (), generator=g))] = -100  # uneven item counts
        rows.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long),
                     "labels": labels})
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` that run compiled when called."""
    return [name or "<model>" for name, module in model.named_modules()
            if module._compiled_call_impl is not None]


def _args(out_dir: str, backend: str | None, cls=None):
    if cls is None:
        from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments as cls
    return cls(output_dir=out_dir, report_to="none", optim="sgd", learning_rate=0.5,
               max_grad_norm=0.5, num_train_epochs=1, logging_steps=1, save_strategy="no",
               seed=3, disable_tqdm=True, per_device_eval_batch_size=1, use_cpu=True,
               torch_compile=backend is not None, torch_compile_backend=backend)


def _compile_lines(printed: io.StringIO, what: str) -> int:
    """How many engine compile lines were printed; each must say it is for ``what``."""
    lines = [line for line in printed.getvalue().splitlines()
             if line.startswith("[hf_cephalo] torch.compile (backend ")]
    assert all(f" for {what}: " in line for line in lines), lines
    return len(lines)


def _spy_units(trainer, seen: list[bool]) -> None:
    """Record, at every unit call of the engine, whether the unit runs compiled."""
    staged = trainer.engine.staged
    run_unit = staged.run_unit

    def spy(index, hidden, ctx):
        seen.append(staged.units()[index]._compiled_call_impl is not None)
        return run_unit(index, hidden, ctx)

    staged.run_unit = spy


def _run(rank: int, out_dir: str, backend: str | None) -> dict:
    """One short training run; what the tests compare (state and save only on rank 0)."""
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.planner import Plan

    out_dir = os.path.join(out_dir, str(backend))
    printed = io.StringIO()
    seen_first: list[bool] = []
    with contextlib.redirect_stdout(printed):
        trainer = CephaloTrainer(model=build("llama"), args=_args(out_dir, backend),
                                 plan=Plan.from_ratios(SIZES, MICRO, RATIOS),
                                 data_collator=_collate, train_dataset=_samples(NUM_SAMPLES),
                                 eval_dataset=_samples(NUM_EVAL, seed=1))
        _spy_units(trainer, seen_first)
        trainer.train()
    report = trainer.engine.compile_report()
    logs = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    after_train = compiled_modules(trainer.model)
    model = trainer.unshard_model()
    after_unshard = compiled_modules(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    save_dir = os.path.join(out_dir, "final")
    trainer.save_model(save_dir)
    # training again after the model was handed back: the units run compiled again, reusing
    # the graphs of the first run (no recompile), and the model is eager afterwards
    seen_again: list[bool] = []
    _spy_units(trainer, seen_again)
    trainer.args.max_steps = 1
    trainer.train()
    after_second_run = compiled_modules(trainer.model)
    graphs_after_second_run = trainer.engine.compile_report().graphs
    # evaluation (eval mode, no autograd): its probe compiles the graph evaluate runs, nothing
    # is compiled after it (microbatches of one size: per_device_eval_batch_size 1)
    before_eval, seen_eval, printed_eval = trainer.engine.compile_report(), [], io.StringIO()
    _spy_units(trainer, seen_eval)
    with contextlib.redirect_stdout(printed_eval):
        eval_loss = trainer.evaluate()["eval_loss"]
    after_eval = trainer.engine.compile_report()
    out = dict(losses=logs, compile_lines=_compile_lines(printed, "training"),
               graphs=report.graphs, probe_graphs=report.probe_graphs,
               graphs_after_second_run=graphs_after_second_run,
               seen_first=seen_first, seen_again=seen_again, after_train=after_train,
               after_unshard=after_unshard, after_second_run=after_second_run,
               eval_loss=eval_loss, seen_eval=seen_eval,
               eval_lines=_compile_lines(printed_eval, "evaluation"),
               eval_probe_graphs=after_eval.probe_graphs - before_eval.probe_graphs,
               eval_recompiles=after_eval.recompiles - before_eval.recompiles,
               after_eval=compiled_modules(trainer.model))
    if rank == 0:
        out.update(state=state, save_dir=save_dir)
    return out


def _worker(rank, world_size, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    results = {}
    for backend in BACKENDS:
        # each run as in its own process: the runs' graphs of the same decoder-layer code
        # would otherwise add up to dynamo's recompile limit (8 per code object)
        torch._dynamo.reset()
        results[str(backend)] = _run(rank, out_dir, backend)
    return portable(results, True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("compile_trainer"))
    return portable(run_ranks(_worker, 2, out_dir, timeout_s=budget_s(JOB_S)), False)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_trainer_equals_eager(runs, backend):
    """Same losses and final parameters as the eager run within rtol 1e-4 / atol 1e-5; the
    engine compiled graphs (the flag was not ignored) and every unit call ran compiled; the
    compile line is printed once, by rank 0."""
    for rank, result in enumerate(runs):
        eager, compiled = result["None"], result[backend]
        assert len(compiled["losses"]) == 3, compiled["losses"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=RTOL, atol=ATOL)
        assert compiled["probe_graphs"] > 0 and compiled["graphs"] >= compiled["probe_graphs"]
        assert compiled["seen_first"] and all(compiled["seen_first"])
        assert eager["graphs"] == 0 and not any(eager["seen_first"])
        assert compiled["compile_lines"] == (1 if rank == 0 else 0), compiled["compile_lines"]
        assert eager["compile_lines"] == 0
    for key, value in runs[0]["None"]["state"].items():
        torch.testing.assert_close(runs[0][backend]["state"][key], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{backend} vs eager: {key} after 3 steps: {m}")


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_model_is_eager_after_training_and_training_again_compiles(runs, backend):
    """[Note: compiled units]: the user's model is eager after training and after
    ``unshard_model`` (stock Trainer compiles a wrapper and leaves the model eager: see
    test_stock_trainer_leaves_the_model_eager); a second ``train()`` runs the units compiled
    again without compiling a new graph, and leaves the model eager too."""
    for result in runs:
        compiled = result[backend]
        assert compiled["after_train"] == [] and compiled["after_unshard"] == [], compiled
        assert compiled["seen_again"] and all(compiled["seen_again"])
        assert compiled["graphs_after_second_run"] == compiled["graphs"]
        assert compiled["after_second_run"] == []


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_evaluation_compiles_once_what_it_runs(runs, backend):
    """``trainer.evaluate()`` after compiled training: the eval loss equals eager's; its probe
    (eval mode, no autograd, parameters without grad, as evaluate runs them) compiles the
    graph evaluate runs, so nothing is compiled after it (a probe with grad-requiring
    parameters left evaluate to recompile: dynamo guards on requires_grad); its compile line
    is printed once, by rank 0; the model is eager afterwards."""
    for rank, result in enumerate(runs):
        eager, compiled = result["None"], result[backend]
        torch.testing.assert_close(compiled["eval_loss"], eager["eval_loss"], rtol=RTOL,
                                   atol=ATOL)
        assert compiled["eval_probe_graphs"] >= 1, compiled
        assert compiled["eval_recompiles"] == 0, compiled
        assert compiled["seen_eval"] and all(compiled["seen_eval"])
        assert compiled["eval_lines"] == (1 if rank == 0 else 0), compiled["eval_lines"]
        assert compiled["after_eval"] == []


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_saved_compiled_model_reloads_with_the_trained_parameters(runs, backend):
    """``save_model`` after a compiled run writes the model's own keys (no ``_orig_mod.``
    prefix of a compiled wrapper); ``from_pretrained`` gives back the trained parameters."""
    import transformers

    result = runs[0][backend]
    reloaded = transformers.LlamaForCausalLM.from_pretrained(result["save_dir"]).state_dict()
    assert set(reloaded) == set(result["state"]), set(reloaded) ^ set(result["state"])
    for key, value in result["state"].items():
        assert torch.equal(reloaded[key], value), key


def test_stock_trainer_leaves_the_model_eager(tmp_path):
    """The reference for the test above: stock Trainer with ``torch_compile`` (one process,
    aot_eager, one step) trains through a compiled wrapper and leaves ``trainer.model``
    eager."""
    import transformers

    model = build("llama")
    args = _args(str(tmp_path), "aot_eager", transformers.TrainingArguments)
    args.max_steps, args.per_device_train_batch_size = 1, sum(SIZES)
    trainer = transformers.Trainer(model=model, args=args, data_collator=_collate,
                                   train_dataset=_samples(NUM_SAMPLES))
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert trainer.model is model and compiled_modules(model) == []
