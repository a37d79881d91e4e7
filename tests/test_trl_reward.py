"""CephaloRewardTrainer vs STOCK TRL RewardTrainer (issue 48 item 1): the same settings give the
same numbers.

One run_ranks call per world size trains the sub-cases through CephaloRewardTrainer: every one on
2 gloo ranks with the uneven plan b = [1, 3], m = [1, 2], the one with margin and centering also
on 3 ranks with b = [1, 3, 0], m = [1, 1, 0] (different l_i and an idle rank; THREE_RANK_CASES,
to bound the test time), where the 2-rank run's step-2 checkpoint is also resumed. The test process trains the same sub-cases with stock
``RewardTrainer`` in ONE process with the whole global batch of pairs
(per_device_train_batch_size = 4, sequential order: the same global batches) and compares, per
step, the logged loss, grad_norm, learning_rate and the reward metrics (accuracy, margin,
min / mean / max reward, num_tokens), then the final weights. fp32, SGD with clipping, a linear
LR schedule, rtol 1e-5 / atol 1e-6.

Sub-cases (REWARD_CASES): a tiny Qwen3 and a tiny Llama classifier; with a ``margin`` column
and ``center_rewards_coefficient``; conversational pairs; LoRA with the ``score`` head trained
in full (``modules_to_save``, as TRL recommends for a reward model).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import portable, run_ranks, test_timeout
from tests.trl_fixtures import (B, SEED, assert_same_state, eval_logs, load_tokenizer,
                                offline_env, plan, save_tokenizer, state_copy, step_logs)

trl = pytest.importorskip("trl")

RTOL, ATOL = 1e-5, 1e-6
LR, STEPS = 0.5, 3
METRICS = ("loss", "grad_norm", "learning_rate", "accuracy", "margin", "min_reward",
           "mean_reward", "max_reward", "num_tokens")
REWARD_CASES = {
    # name: (architecture, dataset, RewardConfig overrides)
    "qwen3": ("qwen3", "plain", {}),
    "qwen3_margin_center": ("qwen3", "margin", dict(center_rewards_coefficient=0.1)),
    "llama_center_conversational": ("llama", "conversational",
                                    dict(center_rewards_coefficient=0.05)),
    # LoRA on the attention projections, the score head trained in full (modules_to_save)
    "qwen3_lora": ("qwen3", "plain", {}),
}
NUM_PAIRS = 3 * B  # three global batches
MAX_LENGTH = 96  # RewardTrainer DROPS longer pairs: every pair here is 50-81 tokens long


def _reward_kwargs(case: str, out_dir: str) -> dict:
    _, _, extra = REWARD_CASES[case]
    return dict(output_dir=os.path.join(out_dir, case), report_to="none", optim="sgd",
                learning_rate=LR, max_steps=STEPS, logging_steps=1, save_strategy="no",
                seed=SEED, train_sampling_strategy="sequential", bf16=False,
                gradient_checkpointing=False, disable_tqdm=True, use_cpu=True,
                max_length=MAX_LENGTH, max_grad_norm=1.0, **extra)


def _dataset(kind: str):
    import datasets

    from hf_cephalo.demo_data import pydoc_preference_dataset

    ds = pydoc_preference_dataset(NUM_PAIRS, max_answer_chars=60,
                                  conversational=kind == "conversational")
    if kind == "margin":
        rows = ds.to_dict()
        rows["margin"] = [0.25 * (i % 4) for i in range(len(ds))]
        ds = datasets.Dataset.from_dict(rows)
    return ds


EVAL_PAIRS = 7  # not a multiple of B: the eval loader's last step is partial
EVAL_CASE = "qwen3_margin_center"  # evaluated during training (eval_steps) and after it


def _eval_dataset(kind: str):
    """EVAL_PAIRS pairs the training set does not hold (other questions, another shift)."""
    import datasets

    from hf_cephalo.demo_data import pydoc_preference_dataset

    ds = pydoc_preference_dataset(NUM_PAIRS + EVAL_PAIRS, max_answer_chars=60, shift=5,
                                  conversational=kind == "conversational")
    rows = ds.select(range(NUM_PAIRS, NUM_PAIRS + EVAL_PAIRS)).to_dict()
    if kind == "margin":
        rows["margin"] = [0.5 - 0.25 * (i % 3) for i in range(EVAL_PAIRS)]
    return datasets.Dataset.from_dict(rows)


def _eval_kwargs(case: str) -> dict:
    """Evaluation during training: at steps 2 and 3 (eval_strategy "steps": every 2 steps and
    the last), then trainer.evaluate() and predict() after it."""
    if case != EVAL_CASE:
        return {}
    return dict(eval_strategy="steps", eval_steps=2)


def reward_metrics(prediction) -> dict:
    """A compute_metrics of the rewards (stock hands it label_ids=(): no label names)."""
    rewards = prediction.predictions
    assert prediction.label_ids == (), prediction.label_ids
    half = rewards.shape[0] // 2
    return {"chosen_first": float(rewards[0, 0]), "top_rejected": float(rewards[half:].max())}


def double_rewards(logits, labels):
    """A preprocess_logits_for_metrics (stock calls it with the batch's rewards and ())."""
    assert labels == (), labels
    return logits * 2


def _evaluate_and_predict(trainer) -> dict:
    """trainer.evaluate() after training, then predict() of the eval set (its rewards)."""
    trainer.evaluate()
    out = trainer.predict(trainer.eval_dataset)
    return {"eval": eval_logs(trainer.state.log_history), "predictions": out.predictions,
            "label_ids": out.label_ids, "test_loss": out.metrics["test_loss"],
            "test_chosen_first": out.metrics["test_chosen_first"]}


def tiny_classifier(arch: str, vocab_size: int, pad_token_id: int):
    """A tiny random ``*ForSequenceClassification`` with one label (a reward model)."""
    import transformers

    torch.manual_seed(SEED)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, num_labels=1, pad_token_id=pad_token_id)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=8, **common)
        return transformers.Qwen3ForSequenceClassification(cfg)
    cfg = transformers.LlamaConfig(**common)
    return transformers.LlamaForSequenceClassification(cfg)


def _model(case: str, tokenizer):
    arch, _, _ = REWARD_CASES[case]
    return tiny_classifier(arch, len(tokenizer), tokenizer.pad_token_id)


def _peft_config(case: str):
    if not case.endswith("_lora"):
        return None
    from peft import LoraConfig

    return LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj"], modules_to_save=["score"],
                      init_lora_weights=False)


# ---- the Cephalo side --------------------------------------------------------------------------

SAVED_CASE = "qwen3_margin_center"  # saved at step 2 on 2 ranks, resumed on 3
# on 3 ranks (an idle rank, different l_i): the case that exercises the most (test time)
THREE_RANK_CASES = ("qwen3_margin_center",)


def _worker(rank, world_size, out_dir, tokenizer_path, resume_from=None):
    offline_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    results = {case: _cephalo_reward(case, world_size, out_dir, tokenizer_path)
               for case in REWARD_CASES if world_size == 2 or case in THREE_RANK_CASES}
    if resume_from is not None:
        results["resume"] = _cephalo_reward(SAVED_CASE, world_size, os.path.join(out_dir, "resume"),
                                   tokenizer_path, resume_from=resume_from)
    return portable(results, True)


def _checkpoint(out_dir_w2: str) -> str:
    """Where the 2-rank run saved SAVED_CASE's step-2 checkpoint."""
    return os.path.join(out_dir_w2, "w2", SAVED_CASE, "checkpoint-2")


def _cephalo_reward(case, world_size, out_dir, tokenizer_path, resume_from=None):
    from hf_cephalo import CephaloRewardConfig, CephaloRewardTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    kwargs = _reward_kwargs(case, os.path.join(out_dir, f"w{world_size}"))
    if case == SAVED_CASE and world_size == 2 and resume_from is None:
        kwargs.update(save_strategy="steps", save_steps=2)
    evaluating = resume_from is None and bool(_eval_kwargs(case))
    eval_kwargs = {}
    if evaluating:  # microbatches of 2 inside the eval loader's steps of b_i pairs
        kwargs.update(_eval_kwargs(case), per_device_eval_batch_size=2)
        eval_kwargs = dict(eval_dataset=_eval_dataset(REWARD_CASES[case][1]),
                           compute_metrics=reward_metrics,
                           preprocess_logits_for_metrics=double_rewards)
    args = CephaloRewardConfig(**kwargs)
    trainer = CephaloRewardTrainer(model=_model(case, tokenizer), args=args,
                                   train_dataset=_dataset(REWARD_CASES[case][1]),
                                   processing_class=tokenizer, plan=plan(world_size),
                                   peft_config=_peft_config(case), **eval_kwargs)
    trainer.train(resume_from_checkpoint=resume_from)
    result = {"logs": step_logs(trainer.state.log_history, METRICS)}
    if evaluating:
        result.update(_evaluate_and_predict(trainer))
    if case == SAVED_CASE and world_size == 2 and resume_from is None:
        trainer.save_model(_saved_model(out_dir))  # collective: the GRPO reward model test's
    result["state"] = state_copy(trainer.unshard_model())
    return result


def _saved_model(out_dir: str) -> str:
    """Where the 2-rank run saves SAVED_CASE's final reward model (from_pretrained folder)."""
    return os.path.join(out_dir, "w2", SAVED_CASE, "final_model")


QUIET_S = {2: 45.0, 3: 60.0}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    offline_env()
    return save_tokenizer(str(tmp_path_factory.mktemp("chat_tokenizer")))


_RUNS: dict = {}
_RUN_DIRS: dict = {}


def _cephalo(world_size, tmp_path_factory, tokenizer_path):
    from tests.dist_utils import budget_s

    if world_size not in _RUNS:
        out_dir = str(tmp_path_factory.mktemp(f"cephalo_reward_w{world_size}"))
        resume_from = None
        if world_size == 3:  # resumes the 2-rank run's checkpoint
            _cephalo(2, tmp_path_factory, tokenizer_path)
            resume_from = _checkpoint(_RUN_DIRS[2])
        _RUN_DIRS[world_size] = out_dir
        _RUNS[world_size] = run_ranks(_worker, world_size, out_dir, tokenizer_path, resume_from,
                                      timeout_s=budget_s(QUIET_S[world_size]))
    return _RUNS[world_size]


# ---- the stock side -------------------------------------------------------------------------

_STOCK: dict = {}


def _stock_reward(case, tmp_path_factory, tokenizer_path):
    if case not in _STOCK:
        from trl import RewardConfig, RewardTrainer

        offline_env()
        tokenizer = load_tokenizer(tokenizer_path)
        out_dir = str(tmp_path_factory.mktemp("stock_reward"))
        eval_kwargs = {}
        if _eval_kwargs(case):  # the whole eval set in one batch
            eval_kwargs = dict(eval_dataset=_eval_dataset(REWARD_CASES[case][1]),
                               compute_metrics=reward_metrics,
                               preprocess_logits_for_metrics=double_rewards)
        args = RewardConfig(**_reward_kwargs(case, out_dir), **_eval_kwargs(case),
                            per_device_train_batch_size=B, per_device_eval_batch_size=EVAL_PAIRS)
        trainer = RewardTrainer(model=_model(case, tokenizer), args=args,
                                train_dataset=_dataset(REWARD_CASES[case][1]),
                                processing_class=tokenizer, peft_config=_peft_config(case),
                                **eval_kwargs)
        trainer.train()
        _STOCK[case] = {"logs": step_logs(trainer.state.log_history, METRICS), "pairs": len(trainer.train_dataset)}
        if eval_kwargs:
            _STOCK[case].update(_evaluate_and_predict(trainer))
        _STOCK[case]["state"] = state_copy(trainer.model)
    return _STOCK[case]


def _assert_same_run(got, ref, metrics=METRICS):
    for metric in metrics:
        assert len(got["logs"][metric]) == len(ref["logs"][metric]) == STEPS, metric
        torch.testing.assert_close(torch.tensor(got["logs"][metric], dtype=torch.float64),
                                   torch.tensor(ref["logs"][metric], dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{metric}: {m}")
    assert_same_state(got["state"], ref["state"], RTOL, ATOL)


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("case, world_size", [*((c, 2) for c in REWARD_CASES),
                                             *((c, 3) for c in THREE_RANK_CASES)])
def test_reward_matches_stock(case, world_size, tmp_path_factory, tokenizer_path):
    """Every reward sub-case, 2 and 3 ranks (uneven plan; different l_i and an idle rank):
    per-step loss, grad_norm, learning_rate and the reward metrics, and the final weights,
    equal stock RewardTrainer's on one process with the whole global batch of pairs."""
    ref = _stock_reward(case, tmp_path_factory, tokenizer_path)
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path):
        _assert_same_run(rank_result[case], ref)
    # the run trained and the metrics are informative (a test that cannot fail is a defect):
    # every pair kept (B pairs a step, on both ranks), the metrics not all 0 / 1
    assert ref["pairs"] == NUM_PAIRS, ref["pairs"]
    logs = ref["logs"]
    assert logs["loss"][0] != logs["loss"][-1]
    assert any(0 < v < 1 for v in logs["accuracy"]), logs["accuracy"]
    assert any(abs(v) > 1e-3 for v in logs["margin"]), logs["margin"]


def test_reward_cases_differ(tmp_path_factory, tokenizer_path):
    """The sub-cases are different runs (margin and center_rewards_coefficient change the
    numbers)."""
    losses = {case: _stock_reward(case, tmp_path_factory, tokenizer_path)["logs"]["loss"][0]
              for case in REWARD_CASES}
    assert len({round(v, 6) for v in losses.values()}) == len(losses), losses


def test_reward_refusals_before_any_collective(tmp_path, tokenizer_path):
    """A train and an eval dataset without the preference columns (each named),
    activation_offloading and include_for_metrics: refused in ONE message at construction (one
    process, no process group made)."""
    import datasets
    import torch.distributed as dist

    from hf_cephalo import CephaloRewardConfig, CephaloRewardTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    args = CephaloRewardConfig(**{**_reward_kwargs("qwen3", str(tmp_path)),
                                  "activation_offloading": True,
                                  "include_for_metrics": ["inputs"], "eval_strategy": "steps"})
    wrong = datasets.Dataset.from_dict({"text": ["a"], "score": [1.0]})
    unpaired = datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})
    with pytest.raises(ValueError) as info:
        CephaloRewardTrainer(model=_model("qwen3", tokenizer), args=args, train_dataset=wrong,
                             eval_dataset={"held_out": unpaired}, processing_class=tokenizer,
                             plan=plan(2))
    text = str(info.value)
    for expected in ("--activation_offloading", "train_dataset has the columns ['score', 'text']",
                     "eval_dataset['held_out'] has the columns ['completion', 'prompt']",
                     "'chosen' and 'rejected'", "include_for_metrics=['inputs']"):
        assert expected in text, (expected, text)
    assert not dist.is_initialized()


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_reward_save_on_2_resume_on_3(tmp_path_factory, tokenizer_path):
    """qwen3_margin_center: the step-2 checkpoint of the 2-rank run (b = [1, 3]), resumed on 3 ranks
    (b = [1, 3, 0], another state layout) by a fresh trainer, gives step 3's loss, metrics and
    the final weights of the uninterrupted run (stock's on one process); steps 1-2 come from
    the checkpoint's trainer_state.json. TRL keeps its token counter outside the checkpoint
    (stock restarts num_tokens at 0 on resume too): the resumed step counts its own tokens."""
    ref = _stock_reward(SAVED_CASE, tmp_path_factory, tokenizer_path)
    for rank_result in _cephalo(3, tmp_path_factory, tokenizer_path):
        resumed = rank_result["resume"]
        _assert_same_run(resumed, ref, [m for m in METRICS if m != "num_tokens"])
        tokens = ref["logs"]["num_tokens"]
        assert resumed["logs"]["num_tokens"] == [*tokens[:2], tokens[2] - tokens[1]]


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reward_evaluation_matches_stock(world_size, tmp_path_factory, tokenizer_path):
    """EVAL_CASE evaluated at steps 2 and 3 (eval_strategy "steps"), by trainer.evaluate() after
    training and by predict(), on 2 ranks (b = [1, 3]) and 3 (an idle rank), microbatches of 2
    pairs: eval_loss, the reward metrics, compute_metrics' and the predictions (2N rewards,
    after preprocess_logits_for_metrics) equal stock RewardTrainer's with the whole eval set in
    ONE batch on one process."""
    ref = _stock_reward(EVAL_CASE, tmp_path_factory, tokenizer_path)
    assert len(ref["eval"]) == 3  # steps 2 and 3 (eval_steps; the last step), evaluate()
    keys = {"eval_loss", "eval_accuracy", "eval_margin", "eval_min_reward", "eval_mean_reward",
            "eval_max_reward", "eval_num_tokens", "eval_chosen_first", "eval_top_rejected"}
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path):
        got = rank_result[EVAL_CASE]
        assert len(got["eval"]) == len(ref["eval"])
        for mine, theirs in zip(got["eval"], ref["eval"]):
            assert set(mine) == set(theirs) == keys, (sorted(mine), sorted(theirs))
            for key in keys:
                torch.testing.assert_close(torch.tensor(mine[key], dtype=torch.float64),
                                           torch.tensor(theirs[key], dtype=torch.float64),
                                           rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
        assert tuple(got["label_ids"]) == ref["label_ids"] == ()  # a list once portable
        assert got["predictions"].shape == ref["predictions"].shape == (2 * EVAL_PAIRS, 1)
        torch.testing.assert_close(torch.as_tensor(got["predictions"]),
                                   torch.as_tensor(ref["predictions"]), rtol=RTOL, atol=ATOL)
        for key in ("test_loss", "test_chosen_first"):
            torch.testing.assert_close(got[key], ref[key], rtol=RTOL, atol=ATOL)
    # informative: the two evaluations differ (a step of training between), the rewards differ
    first, last = ref["eval"][0], ref["eval"][-1]
    assert first["eval_loss"] != last["eval_loss"]
    assert len({round(float(v), 6) for v in ref["predictions"].ravel()}) == 2 * EVAL_PAIRS


def test_saved_reward_model_scores_grpo_completions(tmp_path_factory, tokenizer_path, tmp_path):
    """The reward model CephaloRewardTrainer saved (2 ranks, save_model) loads with
    AutoModelForSequenceClassification.from_pretrained and is a GRPO reward model
    (reward_funcs=[its folder]): stock GRPOTrainer on one process, one step with
    hf_cephalo.reproducible_rollout; the logged reward is the mean of the scores the loaded
    model gives the prompt + completion texts directly (TRL's scoring: right padding, no
    special tokens, logits[:, 0])."""
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    import hf_cephalo

    run = _cephalo(2, tmp_path_factory, tokenizer_path)
    folder = _saved_model(_RUN_DIRS[2])
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    saved = {k: torch.as_tensor(v) for k, v in run[0][SAVED_CASE]["state"].items()}
    assert_same_state(state_copy(loaded), saved, RTOL, ATOL)
    tokenizer = load_tokenizer(tokenizer_path)
    torch.manual_seed(SEED)
    policy = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    seen = []

    def record(prompts, completions, **kwargs):
        seen.extend(p + c for p, c in zip(prompts, completions))
        return [0.0] * len(completions)

    prompts = _eval_dataset("plain")["prompt"][:2]
    import datasets
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1, logging_steps=1,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                      learning_rate=0.0, save_strategy="no", seed=SEED, use_cpu=True,
                      bf16=False, disable_tqdm=True)
    trainer = GRPOTrainer(model=policy, args=args, reward_funcs=[folder, record],
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer,
                          rollout_func=hf_cephalo.reproducible_rollout(SEED))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h][0]
    assert len(seen) == 4
    inputs = load_tokenizer(folder)(text=seen, return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        scores = loaded(**inputs).logits[:, 0]
    name = os.path.basename(folder)
    torch.testing.assert_close(logged[f"rewards/{name}/mean"], scores.mean().item(),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(logged["reward"], scores.mean().item(), rtol=RTOL, atol=ATOL)
    assert scores.std().item() > 1e-4  # the completions get different scores


def test_a_pair_is_planned_as_two_rows_of_its_longer_width():
    """The pair doors plan a sample as 2 rows (Job.rows_per_sample; KTO's KL rows run in
    microbatches of their own: 1), profiled at each pair's longer sequence, at most
    max_length (PairWidths; the planner side: tests/test_planner_rows.py)."""
    import datasets

    from hf_cephalo import CephaloDPOTrainer, CephaloKTOTrainer, CephaloRewardTrainer
    from hf_cephalo.integrations.trl.pairs import PairWidths
    from hf_cephalo.profiler.inputs import sequence_length_of

    assert [cls._rows_per_sample(None) for cls in (CephaloDPOTrainer, CephaloRewardTrainer,
                                                   CephaloKTOTrainer)] == [2, 2, 1]
    reward = datasets.Dataset.from_dict({"chosen_ids": [[1] * 5, [1] * 9],
                                         "rejected_ids": [[2] * 7, [2] * 3]})
    dpo = datasets.Dataset.from_dict({"prompt_ids": [[3] * 4, [3] * 6],
                                      "chosen_ids": [[1] * 5, [1] * 2],
                                      "rejected_ids": [[2] * 1, [2] * 8]})
    assert sequence_length_of(PairWidths.of(reward, None), 128) == 9
    assert sequence_length_of(PairWidths.of(dpo, None), 128) == 14  # 6 + 8
    assert sequence_length_of(PairWidths.of(dpo, 12), 128) == 12  # the collator truncates
    unpaired = datasets.Dataset.from_dict({"text": ["a"]})
    assert PairWidths.of(unpaired, 12) is unpaired
