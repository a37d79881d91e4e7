"""CephaloKTOTrainer vs STOCK TRL KTOTrainer (issue 48 item 2): the same settings give the same
numbers.

One run_ranks call per world size trains the sub-cases through CephaloKTOTrainer: every one on 2
gloo ranks with the uneven plan b = [1, 3], m = [1, 2], the reference-model and LoRA ones also on
3 ranks with b = [1, 3, 0], m = [1, 1, 0] (different l_i and an idle rank; THREE_RANK_CASES, to
bound the test time), where the 2-rank run's step-2 checkpoint is also resumed. The test process trains the same sub-cases with stock
``KTOTrainer`` in ONE process with the whole global batch (per_device_train_batch_size = 4,
sequential order: the same global batches and the same KL pairing) and compares, per step, the
logged loss, grad_norm, learning_rate and KTO's metrics (kl, rewards/*, logps/*, logits/*,
entropy, num_tokens), then the final weights. fp32, SGD, rtol 1e-5 / atol 1e-6 (the rewards, differences of two fp32 sums of ~100: at 4
fp32 spacings of the largest sum times beta, as tests/test_trl_dpo.py).

The rows' labels make unbalanced steps: in the first global batch rank 0 (b_0 = 1) sees only
an undesirable row, in the second rank 1 sees only undesirable rows, and the third has no
desirable row at all (stock logs no rewards/chosen, logps/chosen, rewards/margins for it). Sub-cases (KTO_CASES):
a reference model (weights 0.9x the policy's) with desirable / undesirable weights != 1, LoRA
with the adapter off as the reference, and apo_zero_unpaired (no KL term).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.dist_utils import portable, run_ranks, test_timeout
from tests.trl_fixtures import (B, SEED, assert_same_state, eval_logs, load_tokenizer,
                                offline_env, plan, save_tokenizer, state_copy, step_logs,
                                tiny_llama)

trl = pytest.importorskip("trl")
pytest.importorskip("peft")

RTOL, ATOL = 1e-5, 1e-6
LR, STEPS = 0.5, 3
METRICS = ("loss", "grad_norm", "learning_rate", "kl", "rewards/chosen", "rewards/rejected",
           "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen",
           "logits/rejected", "entropy", "num_tokens")
KTO_CASES = {
    # name: (reference, KTOConfig overrides)
    "ref_model": ("ref_model", dict(beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)),
    "lora": ("lora", dict(beta=0.5, desirable_weight=0.8, undesirable_weight=1.25)),
    "apo_zero_unpaired": ("ref_model", dict(beta=0.3, loss_type="apo_zero_unpaired")),
}
LABELS = [False, True, True, False,    # rank 0 (b_0 = 1): only an undesirable row
          True, False, False, False,   # rank 1 (b_1 = 3): only undesirable rows
          False, False, False, False]  # no desirable row in the whole global batch
NUM_ROWS = len(LABELS)  # three global batches


def _kto_kwargs(case: str, out_dir: str) -> dict:
    _, extra = KTO_CASES[case]
    return dict(output_dir=os.path.join(out_dir, case), report_to="none", optim="sgd",
                learning_rate=LR, max_steps=STEPS, logging_steps=1, save_strategy="no",
                seed=SEED, train_sampling_strategy="sequential", bf16=False,
                gradient_checkpointing=False, disable_tqdm=True, use_cpu=True, max_length=64,
                **extra)


def kto_dataset():
    """Unpaired rows (prompt, completion, label): a question with its own answer (desirable)
    or another topic's (undesirable), in the order of ``LABELS``."""
    import datasets

    from hf_cephalo.demo_data import pydoc_preference_dataset

    pairs = pydoc_preference_dataset(NUM_ROWS, max_answer_chars=60)
    return datasets.Dataset.from_dict({
        "prompt": pairs["prompt"],
        "completion": [c if good else r for c, r, good in
                       zip(pairs["chosen"], pairs["rejected"], LABELS)],
        "label": LABELS})


EVAL_LABELS = [True, False, False, True, False, True, True]  # 7 rows: a partial last step
EVAL_CASES = ("ref_model", "lora")  # evaluated at steps 2 and 3 and by evaluate() after


def kto_eval_dataset():
    """Rows the training set does not hold (other questions, another shift), EVAL_LABELS."""
    import datasets

    from hf_cephalo.demo_data import pydoc_preference_dataset

    n = len(EVAL_LABELS)
    pairs = pydoc_preference_dataset(NUM_ROWS + n, max_answer_chars=60, shift=5)
    pairs = pairs.select(range(NUM_ROWS, NUM_ROWS + n))
    return datasets.Dataset.from_dict({
        "prompt": pairs["prompt"],
        "completion": [c if good else r for c, r, good in
                       zip(pairs["chosen"], pairs["rejected"], EVAL_LABELS)],
        "label": EVAL_LABELS})


def _models(case: str, vocab: int):
    """(policy, ref_model or None, peft_config or None) — the same weights on both sides."""
    reference, _ = KTO_CASES[case]
    model = tiny_llama(vocab)
    if reference == "ref_model":
        ref = copy.deepcopy(model)
        with torch.no_grad():  # a reference unlike the policy: the log-ratios start non-zero
            for p in ref.parameters():
                p.mul_(0.9)
        return model, ref, None
    from peft import LoraConfig

    return model, None, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                   target_modules=["q_proj", "v_proj"], init_lora_weights=False)


# ---- the Cephalo side --------------------------------------------------------------------------

SAVED_CASE = "ref_model"  # saved at step 2 on 2 ranks, resumed on 3
# on 3 ranks (an idle rank, different l_i): the case that exercises the most (test time)
THREE_RANK_CASES = ("ref_model", "lora")


def _worker(rank, world_size, out_dir, tokenizer_path, resume_from=None):
    offline_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    results = {case: _cephalo_kto(case, world_size, out_dir, tokenizer_path)
               for case in KTO_CASES if world_size == 2 or case in THREE_RANK_CASES}
    if resume_from is not None:
        results["resume"] = _cephalo_kto(SAVED_CASE, world_size, os.path.join(out_dir, "resume"),
                                   tokenizer_path, resume_from=resume_from)
    return portable(results, True)


def _checkpoint(out_dir_w2: str) -> str:
    """Where the 2-rank run saved SAVED_CASE's step-2 checkpoint."""
    return os.path.join(out_dir_w2, "w2", SAVED_CASE, "checkpoint-2")


def _cephalo_kto(case, world_size, out_dir, tokenizer_path, resume_from=None):
    from hf_cephalo import CephaloKTOConfig, CephaloKTOTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    model, ref, peft_config = _models(case, len(tokenizer))
    kwargs = _kto_kwargs(case, os.path.join(out_dir, f"w{world_size}"))
    if case == SAVED_CASE and world_size == 2 and resume_from is None:
        kwargs.update(save_strategy="steps", save_steps=2)
    evaluating = case in EVAL_CASES and resume_from is None
    if evaluating:  # microbatches of 2 inside the eval loader's steps of b_i rows
        kwargs.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    args = CephaloKTOConfig(**kwargs)
    trainer = CephaloKTOTrainer(model=model, ref_model=ref, args=args,
                                train_dataset=kto_dataset(), processing_class=tokenizer,
                                peft_config=peft_config, plan=plan(world_size),
                                eval_dataset=kto_eval_dataset() if evaluating else None)
    trainer.train(resume_from_checkpoint=resume_from)
    result = {"logs": step_logs(trainer.state.log_history, METRICS)}
    if evaluating:
        trainer.evaluate()
        result["eval"] = eval_logs(trainer.state.log_history)
    result["state"] = state_copy(trainer.unshard_model())
    return result


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
        out_dir = str(tmp_path_factory.mktemp(f"cephalo_kto_w{world_size}"))
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


def _stock_kto(case, tmp_path_factory, tokenizer_path):
    if case not in _STOCK:
        from trl import KTOConfig, KTOTrainer

        offline_env()
        tokenizer = load_tokenizer(tokenizer_path)
        model, ref, peft_config = _models(case, len(tokenizer))
        out_dir = str(tmp_path_factory.mktemp("stock_kto"))
        evaluating = case in EVAL_CASES  # the whole eval set in one batch
        eval_kwargs = dict(eval_strategy="steps", eval_steps=2,
                           per_device_eval_batch_size=len(EVAL_LABELS)) if evaluating else {}
        args = KTOConfig(**_kto_kwargs(case, out_dir), **eval_kwargs,
                         per_device_train_batch_size=B)
        trainer = KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=kto_dataset(),
                             processing_class=tokenizer, peft_config=peft_config,
                             eval_dataset=kto_eval_dataset() if evaluating else None)
        trainer.train()
        _STOCK[case] = {"logs": step_logs(trainer.state.log_history, METRICS), "rows": len(trainer.train_dataset)}
        if evaluating:
            trainer.evaluate()
            _STOCK[case]["eval"] = eval_logs(trainer.state.log_history)
        _STOCK[case]["state"] = state_copy(trainer.model)
    return _STOCK[case]


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
ULPS = 4


def _reward_atol(ref_logs, beta):
    """The rewards are beta * (logp - ref_logp) per row: differences of two fp32 sums of
    magnitude |logp| (~100 here), so they carry the absolute error of those sums (one fp32
    spacing at 100 is 7.6e-6), not an error relative to the small difference; compared at
    ``ULPS`` spacings of the largest summed log-probability, times beta, as
    tests/test_trl_dpo.py does. The log-probabilities themselves, the KL estimate and every
    other metric are compared at rtol 1e-5 / atol 1e-6."""
    largest = max(abs(v) for m in ("logps/chosen", "logps/rejected") for v in ref_logs[m])
    x = torch.tensor(largest, dtype=torch.float32)
    spacing = float(torch.nextafter(x, torch.tensor(float("inf"))) - x)
    return beta * ULPS * spacing


def _assert_same_run(got, ref, beta, metrics=METRICS):
    for metric in metrics:
        assert len(got["logs"][metric]) == len(ref["logs"][metric]), metric
        rtol, atol = (0, _reward_atol(ref["logs"], beta)) if metric in REWARDS else (RTOL, ATOL)
        torch.testing.assert_close(torch.tensor(got["logs"][metric], dtype=torch.float64),
                                   torch.tensor(ref["logs"][metric], dtype=torch.float64),
                                   rtol=rtol, atol=atol, msg=lambda m: f"{metric}: {m}")
    assert_same_state(got["state"], ref["state"], RTOL, ATOL)


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("case, world_size", [*((c, 2) for c in KTO_CASES),
                                             *((c, 3) for c in THREE_RANK_CASES)])
def test_kto_matches_stock(case, world_size, tmp_path_factory, tokenizer_path):
    """Every KTO sub-case, 2 and 3 ranks (uneven plan; different l_i and an idle rank; steps
    where a rank sees only undesirable rows): per-step loss, grad_norm, learning_rate and
    KTO's metrics, and the final weights, equal stock KTOTrainer's on one process with the
    whole global batch."""
    ref = _stock_kto(case, tmp_path_factory, tokenizer_path)
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path):
        _assert_same_run(rank_result[case], ref, KTO_CASES[case][1]["beta"])
    assert ref["rows"] == NUM_ROWS, ref["rows"]  # no row dropped: B rows a step, as LABELS says
    logs = ref["logs"]  # the run trained and the metrics are informative
    assert logs["loss"][0] != logs["loss"][-1]
    assert len(logs["rewards/margins"]) == STEPS - 1 and len(logs["rewards/rejected"]) == STEPS
    if KTO_CASES[case][1].get("loss_type", "kto") == "kto":
        assert any(v > 1e-4 for v in logs["kl"]), logs["kl"]  # the KL term is not clamped away


def test_kto_cases_differ(tmp_path_factory, tokenizer_path):
    """The sub-cases are different runs."""
    losses = {case: _stock_kto(case, tmp_path_factory, tokenizer_path)["logs"]["loss"][0]
              for case in KTO_CASES}
    assert len({round(v, 6) for v in losses.values()}) == len(losses), losses


def test_kto_refusals_before_any_collective(tmp_path, tokenizer_path):
    """A dataset without KTO's columns, per_device_train_batch_size 1 (a global batch of one
    row: the KL rows would pair a prompt with its own completion), precompute_ref_log_probs,
    sync_ref_model, a full fine-tune without a reference to load, a train and an eval dataset
    without KTO's columns (each named) and compute_metrics (stock's predictions are full logits
    the engine does not reproduce): refused in ONE message at construction (one process, no
    process group made)."""
    import datasets
    import torch.distributed as dist

    from hf_cephalo import CephaloKTOConfig, CephaloKTOTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    args = CephaloKTOConfig(**{**_kto_kwargs("ref_model", str(tmp_path)),
                               "per_device_train_batch_size": 1,
                               "precompute_ref_log_probs": True, "sync_ref_model": True})
    wrong = datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError) as info:
        CephaloKTOTrainer(model=tiny_llama(len(tokenizer)), args=args, train_dataset=wrong,
                          eval_dataset={"held_out": wrong}, processing_class=tokenizer,
                          compute_metrics=lambda prediction: {})
    text = str(info.value)
    for expected in ("a global batch of 1 row", "per_device_train_batch_size = 1",
                     "--precompute_ref_log_probs", "--sync_ref_model",
                     "train_dataset has the columns ['answer', 'prompt']",
                     "eval_dataset['held_out'] has the columns ['answer', 'prompt']",
                     "'prompt', 'completion', 'label'", "ref_model=copy.deepcopy(model)",
                     "does not predict"):
        assert expected in text, (expected, text)
    assert not dist.is_initialized()


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_kto_save_on_2_resume_on_3(tmp_path_factory, tokenizer_path):
    """ref_model: the step-2 checkpoint of the 2-rank run (b = [1, 3]), resumed on 3 ranks
    (b = [1, 3, 0], another state layout) by a fresh trainer, gives step 3's loss, metrics and
    the final weights of the uninterrupted run (stock's on one process); steps 1-2 come from
    the checkpoint's trainer_state.json. TRL keeps its token counter outside the checkpoint
    (stock restarts num_tokens at 0 on resume too): the resumed step counts its own tokens."""
    ref = _stock_kto(SAVED_CASE, tmp_path_factory, tokenizer_path)
    for rank_result in _cephalo(3, tmp_path_factory, tokenizer_path):
        resumed = rank_result["resume"]
        _assert_same_run(resumed, ref, KTO_CASES[SAVED_CASE][1]["beta"],
                         [m for m in METRICS if m != "num_tokens"])
        tokens = ref["logs"]["num_tokens"]
        assert resumed["logs"]["num_tokens"] == [*tokens[:2], tokens[2] - tokens[1]]


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("case, world_size", [(c, w) for c in EVAL_CASES for w in (2, 3)])
def test_kto_evaluation_matches_stock(case, world_size, tmp_path_factory, tokenizer_path):
    """EVAL_CASES evaluated at steps 2 and 3 (eval_strategy "steps") and by evaluate() after
    training, on 2 ranks (b = [1, 3]) and 3 (an idle rank), microbatches of 2 rows: eval_loss,
    the KL estimate (the whole eval set's) and KTO's metrics equal stock KTOTrainer's with the
    whole eval set in ONE batch on one process."""
    ref = _stock_kto(case, tmp_path_factory, tokenizer_path)
    beta = KTO_CASES[case][1]["beta"]
    assert len(ref["eval"]) == 3  # steps 2 and 3 (eval_steps; the last step), evaluate()
    keys = {"eval_loss", "eval_kl", "eval_entropy", "eval_num_tokens", "eval_logits/chosen",
            "eval_logits/rejected", "eval_rewards/chosen", "eval_rewards/rejected",
            "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"}
    logps = {m: [h[f"eval_{m}"] for h in ref["eval"]] for m in ("logps/chosen", "logps/rejected")}
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path):
        got = rank_result[case]["eval"]
        assert len(got) == len(ref["eval"])
        for mine, theirs in zip(got, ref["eval"]):
            assert set(mine) == set(theirs) == keys, (sorted(mine), sorted(theirs))
            for key in keys:
                rewards = key.removeprefix("eval_") in REWARDS
                rtol, atol = (0, _reward_atol(logps, beta)) if rewards else (RTOL, ATOL)
                torch.testing.assert_close(torch.tensor(mine[key], dtype=torch.float64),
                                           torch.tensor(theirs[key], dtype=torch.float64),
                                           rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    # informative: the KL term is not clamped away (the reference-model case: LoRA's eval KL
    # estimate is negative, clamped to 0 on both sides); the rewards are not 0; the evaluations
    # differ
    if case == "ref_model":
        assert any(h["eval_kl"] > 1e-4 for h in ref["eval"]), ref["eval"]
    assert all(abs(h["eval_rewards/margins"]) > 1e-4 for h in ref["eval"]), ref["eval"]
    assert ref["eval"][0]["eval_loss"] != ref["eval"][-1]["eval_loss"]
