"""The Trainer support matrix (hf_cephalo/integrations/trainer/support.py) is complete, documented and
enforced: every TrainingArguments field of the installed transformers is classified, every
"works as stock" entry names an existing test, docs/trainer_support.md is the rendered table,
and refused values / hooks raise ValueError at construction before any process group exists.
Single process, no collectives.
"""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest
import torch
import transformers

from hf_cephalo.integrations.trainer.support import (FIELD_SUPPORT, HOOK_SUPPORT, Status,
                                             check_training_args, render_markdown,
                                             unclassified_fields)
from tests.models_fixtures import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_training_arguments_field_is_classified():
    """A field a future transformers adds fails here until it is classified in support.py."""
    names = [f.name for f in dataclasses.fields(transformers.TrainingArguments)]
    assert unclassified_fields(names) == []
    assert set(FIELD_SUPPORT) - set(names) == set(), "entries for fields that no longer exist"


def _test_names(path: str) -> set[str]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def assert_entries_explained(table: dict, label: str = "") -> None:
    """Every entry of a support table has a note, and every "works as stock" one names a test
    that exists."""
    for name, support in table.items():
        where = f"{label} {name}".strip()
        assert support.note, where
        if support.status is Status.STOCK:
            assert support.test, f"{where}: a 'works as stock' entry needs a test"
            path, _, func = support.test.partition("::")
            assert func in _test_names(path), f"{where}: {support.test} does not exist"


def test_stock_entries_name_existing_tests_and_notes():
    assert_entries_explained({**FIELD_SUPPORT, **HOOK_SUPPORT})


def test_docs_page_is_the_rendered_matrix():
    with open(os.path.join(ROOT, "docs", "trainer_support.md")) as f:
        page = f.read()
    assert render_markdown() in page, "regenerate docs/trainer_support.md (see its header)"


def _args(tmp_path, **kw):
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    return CephaloTrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)


REFUSED_VALUES = [
    dict(auto_find_batch_size=True), dict(use_liger_kernel=True),
    dict(train_sampling_strategy="batch_rebalance"), dict(label_names=[]),
    dict(average_tokens_across_devices=False), dict(eval_do_concat_batches=False),
    dict(save_on_each_node=True), dict(neftune_noise_alpha=5.0), dict(debug="underflow_overflow"),
    dict(torch_empty_cache_steps=3), dict(gradient_checkpointing_kwargs={"use_reentrant": True}),
    dict(activation_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": 2}),
    dict(gradient_checkpointing_kwargs={"offload": True}),
    dict(gradient_checkpointing_kwargs={"preserve_rng_state": False}),
    dict(optim="adalomo"), dict(batch_eval_metrics=True),
    dict(accelerator_config={"split_batches": True}),
]


@pytest.mark.parametrize("kw", REFUSED_VALUES, ids=lambda kw: next(iter(kw)))
def test_refused_at_construction(tmp_path, kw, monkeypatch):
    """Refused before the process group, the plan or the engine exist; the message names the
    field and says what to do."""
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    (field,) = kw
    with pytest.raises(ValueError, match=f"--{field} = .* not supported by Cephalo: "):
        CephaloTrainer(model=build("llama"), args=_args(tmp_path, **kw))
    assert not torch.distributed.is_initialized()


def test_torch_compile_becomes_the_engines_per_unit_compile(tmp_path):
    """TrainingArguments fills in torch_compile_backend when torch_compile is set and sets
    torch_compile when a backend or mode is given: each maps to the engine's CompileOptions;
    an unknown backend is a ValueError at construction (before any collective)."""
    from hf_cephalo.engine import CompileOptions
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer, _compile_options

    assert _compile_options(_args(tmp_path)) is None
    for kw, expected in ((dict(torch_compile=True), CompileOptions()),
                         (dict(torch_compile_backend="aot_eager"),
                          CompileOptions(backend="aot_eager")),
                         (dict(torch_compile_mode="max-autotune"),
                          CompileOptions(mode="max-autotune"))):
        args = _args(tmp_path, **kw)
        check_training_args(args)
        assert _compile_options(args) == expected, kw
    with pytest.raises(ValueError, match="backend 'nope' is not registered.*--torch_compile False"):
        CephaloTrainer(model=build("llama"), args=_args(tmp_path, torch_compile_backend="nope"))
    assert not torch.distributed.is_initialized()


def test_defaults_pass(tmp_path):
    check_training_args(_args(tmp_path))
    check_training_args(_args(tmp_path, train_sampling_strategy="group_by_length",
                              gradient_checkpointing=True, weight_decay=0.1,
                              label_smoothing_factor=0.1, label_names=["labels"]))
    # issue 23: the fields fine-tuning scripts set routinely
    for kw in (dict(include_num_input_tokens_seen=True),
               dict(include_num_input_tokens_seen="non_padding"),
               dict(label_names=["labels", "sample_id"]),
               dict(include_for_metrics=["inputs", "loss"]), dict(enable_jit_checkpoint=True),
               dict(gradient_checkpointing=True,
                    gradient_checkpointing_kwargs={"use_reentrant": False}),
               dict(activation_checkpointing=True, activation_checkpointing_kwargs={
                   "use_reentrant": False, "every_n_layers": 1, "offload": False})):
        check_training_args(_args(tmp_path, **kw))


def test_reentrant_checkpointing_refusal_says_why(tmp_path):
    with pytest.raises(ValueError, match="use_reentrant=True is refused: reentrant "
                                         "checkpointing gives no gradient"):
        check_training_args(_args(tmp_path, gradient_checkpointing=True,
                                  gradient_checkpointing_kwargs={"use_reentrant": True}))


class _CustomForward(transformers.LlamaForCausalLM):
    def forward(self, *args, **kwargs):  # e.g. a custom loss: the engine would bypass it
        return super().forward(*args, **kwargs)


def test_hooks_refused_at_construction(tmp_path):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer

    model = build("llama")

    class OwnSampler(CephaloTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return None

    with pytest.raises(ValueError, match="_get_train_sampler"):
        OwnSampler(model=model, args=_args(tmp_path))
    custom = _CustomForward(build("llama").config)
    with pytest.raises(ValueError, match="forward.*compute_loss_func"):
        CephaloTrainer(model=custom, args=_args(tmp_path))
    assert not torch.distributed.is_initialized()


def test_engine_refusal_after_oom_does_not_look_like_oom():
    """After a step failed with an out-of-memory error, the engine's refusal of further steps
    must not read as an OOM to Accelerate (auto_find_batch_size would keep "shrinking")."""
    from accelerate.utils.memory import should_reduce_batch_size

    from hf_cephalo.engine import CephaloEngine

    class Fake:
        rank, _abandoned, _failure = 0, [], None

        def all_units(self):
            return []

    fake = Fake()
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert should_reduce_batch_size(oom)
    CephaloEngine.abandon_step(fake, None, oom, "train_step")
    with pytest.raises(RuntimeError, match=r"train_step raised mid-schedule \(RuntimeError\)") as info:
        CephaloEngine.check_usable(fake, "train_step")
    assert not should_reduce_batch_size(info.value)
    assert info.value.__cause__ is oom


def test_every_refusal_of_a_script_in_one_message(tmp_path, monkeypatch):
    """A stock script differing in several places gets ONE error listing all of them
    ([Note: one refusal message]): TrainingArguments fields (one worded by
    CephaloTrainingArguments, two by the table), a Trainer argument, a dataset and the model —
    before any process group exists."""
    from torch.utils.data import IterableDataset

    from hf_cephalo.integrations.trainer.support import RefusedSettings
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer

    class Stream(IterableDataset):
        def __iter__(self):
            yield from ()

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    model = torch.nn.Linear(4, 4)  # no adapter
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1)
    args = _args(tmp_path, gradient_accumulation_steps=2, fp16_full_eval=True,
                 auto_find_batch_size=True, use_liger_kernel=True)
    with pytest.raises(RefusedSettings) as info:
        CephaloTrainer(model=model, args=args, optimizers=(opt, None), train_dataset=Stream())
    message = str(info.value)
    expected = ["--fp16_full_eval is not supported", "--use_liger_kernel = True is not supported",
                "--auto_find_batch_size = True is not supported",
                "optimizers: LBFGS is not an element-wise optimizer",
                "train_dataset: Stream is a stream without a length", "model: "]
    assert message.startswith(f"CephaloTrainer refuses {len(expected)} settings of this script; "
                              "change all of them (docs/trainer_support.md):\n"), message
    lines = message.splitlines()[1:]
    assert len(lines) == len(expected), message
    for i, (line, start) in enumerate(zip(lines, sorted(expected, key=message.index)), 1):
        assert line.startswith(f"  {i}. {start}"), (i, line)
    assert "Linear" in lines[-1]
    assert isinstance(info.value, ValueError)
    assert len(info.value.problems) == len(expected)
    assert not torch.distributed.is_initialized()


def test_gradient_checkpointing_with_checkpointing_off_is_refused(tmp_path, monkeypatch):
    """--gradient_checkpointing asks for activation checkpointing: beside
    --cephalo_activation_checkpointing false, or a plan file made without it, it is refused
    before any process group exists; with 'auto' it means checkpointing on."""
    from hf_cephalo.integrations.trainer.preflight import \
        engine_checkpointing_replaces_model_checkpointing as _engine_checkpointing_replaces_model_checkpointing
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.planner import Plan

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    monkeypatch.delenv("HF_CEPHALO_ACTIVATION_CHECKPOINTING", raising=False)
    with pytest.raises(ValueError, match="asks for activation checkpointing but "
                                         "--cephalo_activation_checkpointing is 'false'"):
        CephaloTrainer(model=build("llama"), args=_args(
            tmp_path, gradient_checkpointing=True, cephalo_activation_checkpointing="false"))
    plan_file = tmp_path / "plan.json"
    Plan.from_ratios([2, 2], [2, 2], [0.5, 0.5], activation_checkpointing=False).save(plan_file)
    with pytest.raises(ValueError, match="plan file .* was made without it"):
        CephaloTrainer(model=build("llama"), args=_args(
            tmp_path, activation_checkpointing=True, cephalo_plan_file=str(plan_file)))
    assert not torch.distributed.is_initialized()
    args = _args(tmp_path, gradient_checkpointing=True, cephalo_activation_checkpointing="auto")
    _engine_checkpointing_replaces_model_checkpointing(args)
    assert args.cephalo_activation_checkpointing == "true" and not args.gradient_checkpointing
    with pytest.raises(ValueError, match="cephalo_activation_checkpointing.*must be one of"):
        _args(tmp_path, cephalo_activation_checkpointing="maybe")


def test_activation_checkpointing_flag_any_case_and_against_a_plan_file(tmp_path, monkeypatch,
                                                                       caplog):
    """--cephalo_activation_checkpointing True / FALSE (HF style, as --torch_compile True)
    parse from the command line as from Python and env; an explicit choice that contradicts a
    plan file is refused both ways, naming both (the default and 'auto' take the plan's); with
    --gradient_checkpointing and auto both warnings are said once per job (rank 0 only)."""
    import logging

    from transformers import HfArgumentParser

    from hf_cephalo.integrations.trainer.training_args import job_from_training_args
    from hf_cephalo.runtime.planning import check_plan_file_checkpointing
    from hf_cephalo.integrations.trainer.preflight import \
        engine_checkpointing_replaces_model_checkpointing as _engine_checkpointing_replaces_model_checkpointing
    from hf_cephalo.integrations.trainer.trainer import format_plan_table
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    monkeypatch.delenv("HF_CEPHALO_ACTIVATION_CHECKPOINTING", raising=False)
    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    parser = HfArgumentParser(CephaloTrainingArguments)
    for word, want in (("True", "true"), ("FALSE", "false"), ("Auto", "auto")):
        (args,) = parser.parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--report_to", "none",
             "--cephalo_activation_checkpointing", word])
        assert args.cephalo_activation_checkpointing == want
    assert _args(tmp_path, cephalo_activation_checkpointing=" TRUE ") \
        .cephalo_activation_checkpointing == "true"
    kept, recompute = tmp_path / "kept.json", tmp_path / "recompute.json"
    Plan.from_ratios([2, 2], [2, 2], [0.5, 0.5], activation_checkpointing=False).save(kept)
    Plan.from_ratios([2, 2], [2, 2], [0.5, 0.5]).save(recompute)
    for word, path in (("true", kept), ("false", recompute)):
        args = _args(tmp_path, cephalo_plan_file=str(path),
                     cephalo_activation_checkpointing=word.capitalize())
        with pytest.raises(ValueError, match=f"--cephalo_activation_checkpointing {word} but the "
                                             f"plan file .* was made with(out)? activation "
                                             f"checkpointing .*re-plan with `hf-cephalo plan "
                                             f"--activation-checkpointing {word}`"):
            check_plan_file_checkpointing(Plan.load(path), job_from_training_args(args, 2))
    monkeypatch.setenv("HF_CEPHALO_ACTIVATION_CHECKPOINTING", "True")  # env: explicit too
    with pytest.raises(ValueError, match="made without activation checkpointing"):
        check_plan_file_checkpointing(Plan.load(kept), job_from_training_args(_args(tmp_path), 2))
    monkeypatch.delenv("HF_CEPHALO_ACTIVATION_CHECKPOINTING")
    for args in (_args(tmp_path), _args(tmp_path, cephalo_activation_checkpointing="auto")):
        for path in (kept, recompute):  # the default and auto: the plan file decides
            check_plan_file_checkpointing(Plan.load(path), job_from_training_args(args, 2))
    for rank, said in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_cephalo"):
            _engine_checkpointing_replaces_model_checkpointing(_args(
                tmp_path, gradient_checkpointing=True, cephalo_activation_checkpointing="auto"))
        texts = [r.getMessage() for r in caplog.records if r.name.startswith("hf_cephalo")]
        assert sum("planning with activation checkpointing on" in t for t in texts) == said
        assert sum("already recomputes every layer" in t for t in texts) == said, texts
    from hf_cephalo.runtime.planning import _infeasible_remedy

    for word, suggested in (("false", True), ("auto", False), ("true", False)):
        job = job_from_training_args(_args(tmp_path, cephalo_activation_checkpointing=word), 2)
        remedy = _infeasible_remedy(job, 64, "batch")
        assert remedy.startswith("; to fit: ")
        assert ("--cephalo_activation_checkpointing true or auto" in remedy) == suggested
        assert "a smaller --cephalo_global_batch_size (now 64)" in remedy
    plan = Plan.load(recompute)
    assert "activation checkpointing on (recompute in backward) [auto: off does not fit: x]," \
        in format_plan_table(plan, "off does not fit: x")
    assert "[auto:" not in format_plan_table(plan)


def test_default_auto_checkpointing_and_a_checkpointing_model(tmp_path, monkeypatch):
    """The plan made at start defaults to auto (the faster plan that fits: no recompute where
    the kept graphs fit, as stock without --gradient_checkpointing); a model whose Hugging
    Face gradient checkpointing is on asks for checkpointing (planned on, as the stock flag),
    an explicit true is kept, and an explicit false beside it is refused."""
    from hf_cephalo.integrations.trainer.training_args import job_from_training_args
    from hf_cephalo.runtime.planning import planned_checkpointing
    from hf_cephalo.runtime.settings import CephaloSettings

    monkeypatch.delenv("HF_CEPHALO_ACTIVATION_CHECKPOINTING", raising=False)
    assert CephaloSettings.default_of("activation_checkpointing") == "auto"
    model = build("llama")
    default = job_from_training_args(_args(tmp_path), 2)
    assert default.settings.activation_checkpointing == "auto"
    assert planned_checkpointing(default) is None
    assert planned_checkpointing(default, model) is None
    enable = getattr(model, "activation_checkpointing_enable", None)  # newer transformers
    (enable or model.gradient_checkpointing_enable)()
    assert planned_checkpointing(default, model) is True
    job = job_from_training_args(_args(tmp_path, cephalo_activation_checkpointing="true"), 2)
    assert planned_checkpointing(job, model) is True
    job = job_from_training_args(_args(tmp_path, cephalo_activation_checkpointing="false"), 2)
    assert planned_checkpointing(job, build("llama")) is False
    with pytest.raises(ValueError, match="gradient checkpointing is on .* is 'false' .* opposite"):
        planned_checkpointing(job, model)  # as 'false' beside --gradient_checkpointing


def test_label_smoother_shifts_by_stocks_rule():
    """Stock Trainer's label smoother shifts the labels when the model's class is in
    transformers' causal-LM mapping, whatever the model's own loss does: BartForCausalLM (its
    own loss takes labels as given) shifts, Qwen3_5ForConditionalGeneration (a causal LM by
    what it computes, not in the mapping) does not, a classifier does not."""
    from hf_cephalo.runtime.user_loss import EngineOutputs

    class Staged:  # what EngineOutputs reads of a staged model here: its model's class name
        def __init__(self, class_name: str):
            self.model = type(class_name, (), {})()

    for name, shift in (("BartForCausalLM", True), ("Qwen3ForCausalLM", True),
                        ("Qwen3_5ForConditionalGeneration", False),
                        ("Gemma3ForConditionalGeneration", True),
                        ("Qwen3ForSequenceClassification", False)):
        assert EngineOutputs(Staged(name), None, 1, {}).cephalo_smoother_shift is shift, name


def test_seq2seq_fields_are_classified_and_documented():
    """CephaloSeq2SeqTrainingArguments: every field Seq2SeqTrainingArguments adds to
    TrainingArguments is classified (SEQ2SEQ_FIELD_SUPPORT), explained, and rendered in
    docs/trainer_support.md; both classes are importable from hf_cephalo."""
    import hf_cephalo
    from hf_cephalo.integrations.trainer.seq2seq import (SEQ2SEQ_FIELD_SUPPORT,
                                                         render_seq2seq_markdown)

    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    added = {f.name for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments)} - base
    assert added == set(SEQ2SEQ_FIELD_SUPPORT)
    assert_entries_explained(SEQ2SEQ_FIELD_SUPPORT, "Seq2SeqTrainingArguments")
    with open(os.path.join(ROOT, "docs", "trainer_support.md")) as f:
        assert render_seq2seq_markdown() in f.read(), "regenerate docs/trainer_support.md"
    assert issubclass(hf_cephalo.CephaloSeq2SeqTrainer, transformers.Seq2SeqTrainer)
    assert issubclass(hf_cephalo.CephaloSeq2SeqTrainingArguments,
                      transformers.Seq2SeqTrainingArguments)


def test_seq2seq_refusals_in_one_message(tmp_path, monkeypatch):
    """predict_with_generate=True is refused (with the reason) for a decoder-only model, with
    generation_num_beams > 1, for a generation_config with num_beams > 1 and for Whisper (its
    encoder reads features), together with every other refused setting of the script, before
    any process group exists; the generation fields are accepted without
    predict_with_generate, as stock reads them nowhere then."""
    from hf_cephalo import CephaloSeq2SeqTrainer, CephaloSeq2SeqTrainingArguments
    from tests.zoo_fixtures import build_zoo

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    args = CephaloSeq2SeqTrainingArguments(output_dir=str(tmp_path), report_to="none",
                                           predict_with_generate=True, auto_find_batch_size=True,
                                           generation_num_beams=2)
    with pytest.raises(ValueError, match=r"(?s)refuses 3 settings.*--auto_find_batch_size.*"
                                         r"--generation_num_beams = 2 with "
                                         r"--predict_with_generate is not supported by Cephalo: "
                                         r"beam search is not built.*--predict_with_generate = "
                                         r"True is not supported for LlamaForCausalLM"):
        CephaloSeq2SeqTrainer(model=build("llama"), args=args)
    t5 = build_zoo("t5")
    t5.generation_config.num_beams = 4
    generating = CephaloSeq2SeqTrainingArguments(output_dir=str(tmp_path), report_to="none",
                                                 predict_with_generate=True)
    with pytest.raises(ValueError, match=r"predict_with_generate = True is not supported for "
                                         r"T5ForConditionalGeneration with these settings: .*"
                                         r"'beam_search' \(num_beams=4\)"):
        CephaloSeq2SeqTrainer(model=t5, args=generating)
    with pytest.raises(ValueError, match=r"WhisperForConditionalGeneration's encoder reads "
                                         r"'input_features', not token ids"):
        CephaloSeq2SeqTrainer(model=build_zoo("whisper"), args=generating)
    assert not torch.distributed.is_initialized()
    check_training_args(CephaloSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), report_to="none", generation_max_length=8,
        generation_num_beams=2, sortish_sampler=True))


def test_seq2seq_in_a_door_without_encoder_decoders_is_refused_before_any_process_group():
    """CephaloTrainer takes T5 / BART with the model's own loss, label smoothing or a
    compute_loss_func (tests/test_generic_trainer_parity.py); a door that does not take
    encoder-decoders (the accelerate loop, TRL's reference models: ``stage_model`` without
    ``seq2seq``) refuses them ([Note: encoder-decoders at the doors])."""
    from hf_cephalo.runtime import stage_model
    from tests.zoo_fixtures import build_zoo

    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder: .*"
                                         "this door does not take encoder-decoders yet"):
        stage_model(build_zoo("t5"))
    assert type(stage_model(build_zoo("t5"), seq2seq=True)).__name__ == "T5StagedModel"


def test_seq2seq_user_loss_without_decoder_ids_is_refused_when_counting_items():
    """Label smoothing and compute_loss_func call the model without its labels (stock pops
    them), so an encoder-decoder batch without decoder_input_ids would make stock's BART build
    its decoder input from input_ids (T5: an error) while the engine runs the labels' shift:
    refused when the engine counts a microbatch's items, before the step's first collective;
    with decoder_input_ids the count is the model's own. Another model gets no such rule."""
    from hf_cephalo.runtime import seq2seq_user_loss_items, stage_model
    from tests.zoo_fixtures import build_zoo, seq2seq_batch

    count = seq2seq_user_loss_items(stage_model(build_zoo("bart"), seq2seq=True))
    batch = seq2seq_batch(3, seed=0)
    with pytest.raises(ValueError, match="without labels and without decoder_input_ids"):
        count(batch)
    ids = torch.zeros_like(batch["labels"]).clamp(min=0)
    assert count({**batch, "decoder_input_ids": ids}) == int((batch["labels"] != -100).sum())
    assert seq2seq_user_loss_items(stage_model(build_zoo("qwen3"))) is None
