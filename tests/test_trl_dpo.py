"""CephaloDPOTrainer vs STOCK TRL DPOTrainer (issue 31 item 3): the same settings give the same
numbers.

One run_ranks call per world size trains every sub-case through CephaloDPOTrainer: 2 gloo ranks
with the uneven plan b = [1, 3], m = [1, 2], and 3 ranks with b = [1, 3, 0], m = [1, 1, 0]
(different l_i and an idle rank). The test process trains the same sub-cases with stock
``DPOTrainer`` in ONE process with the whole global batch of pairs (per_device_train_batch_size
= 4, sequential order: the same global batches) and compares, per step, the logged loss,
grad_norm and DPO's metrics (rewards/*, logps/*, logits/*, entropy, mean_token_accuracy,
num_tokens), then the final weights. fp32, SGD, rtol 1e-5 / atol 1e-6.

Sub-cases (DPO_CASES): the reference as an explicit ``ref_model`` (a second, frozen engine
sharded by the plan), as ``precompute_ref_log_probs``, and as a LoRA policy with its adapter
off; the loss types hinge and ipo (per-pair means of other shapes), conversational pairs; on
2 ranks also the policy given by name.
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
LR, STEPS = 0.2, 3
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "rewards/accuracies", "logps/chosen", "logps/rejected", "logits/chosen",
           "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens")
DPO_CASES = {
    # name: (conversational, reference, DPOConfig overrides)
    "ref_model": (False, "ref_model", dict(beta=0.5)),
    "precompute": (False, "precompute", dict(precompute_ref_log_probs=True, beta=0.5)),
    "lora": (False, "lora", dict(beta=0.5)),
    "hinge_conversational": (True, "ref_model", dict(loss_type=["hinge"], beta=0.3)),
    "ipo_precompute": (False, "precompute", dict(loss_type=["ipo"], beta=0.5,
                                                 precompute_ref_log_probs=True)),
}
NUM_PAIRS = 3 * B  # three global batches


def _dpo_kwargs(case: str, out_dir: str) -> dict:
    _, _, extra = DPO_CASES[case]
    return dict(output_dir=os.path.join(out_dir, case), report_to="none", optim="sgd",
                learning_rate=LR, max_steps=STEPS, logging_steps=1, save_strategy="no",
                seed=SEED, train_sampling_strategy="sequential", bf16=False,
                gradient_checkpointing=False, disable_tqdm=True, use_cpu=True, max_length=64,
                **extra)


def _save_datasets(root: str) -> str:
    """Every case's pairs saved under ``root``: TRL's precompute writes its reference column as
    a cache file beside the dataset's files, which every rank must find (an in-memory dataset
    caches in a per-process temporary directory, so stock TRL on several processes fails the
    same way)."""
    from hf_cephalo.demo_data import pydoc_preference_dataset

    for conversational in (False, True):
        pydoc_preference_dataset(NUM_PAIRS, max_answer_chars=60, conversational=conversational
                                 ).save_to_disk(os.path.join(root, f"conversational={conversational}"))
    return root


def _dataset(case: str, root: str):
    import datasets

    conversational, _, _ = DPO_CASES[case]
    return datasets.load_from_disk(os.path.join(root, f"conversational={conversational}"))


EVAL_PAIRS = 7  # not a multiple of B: the eval loader's last step is partial
EVAL_CASE = "ref_model"  # evaluated at steps 2 and 3 (eval_strategy "steps") and after


def _eval_dataset():
    """EVAL_PAIRS pairs the training set does not hold (other questions, another shift)."""
    import datasets

    from hf_cephalo.demo_data import pydoc_preference_dataset

    ds = pydoc_preference_dataset(NUM_PAIRS + EVAL_PAIRS, max_answer_chars=60, shift=5)
    return datasets.Dataset.from_dict(ds.select(range(NUM_PAIRS, NUM_PAIRS + EVAL_PAIRS)).to_dict())


def _models(case: str, vocab: int):
    """(policy, ref_model or None, peft_config or None) — the same weights on both sides."""
    _, reference, _ = DPO_CASES[case]
    model = tiny_llama(vocab)
    if reference == "ref_model":
        ref = copy.deepcopy(model)
        with torch.no_grad():  # a reference unlike the policy: the log-ratios start non-zero
            for p in ref.parameters():
                p.mul_(0.9)
        return model, ref, None
    if reference == "lora":
        from peft import LoraConfig

        return model, None, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                       target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return model, None, None


# ---- the Cephalo side --------------------------------------------------------------------------

def _worker(rank, world_size, out_dir, tokenizer_path, data_root):
    offline_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    results = {case: _cephalo_dpo(case, world_size, out_dir, tokenizer_path, data_root)
               for case in DPO_CASES}
    if world_size == 2:
        results["in_memory_precompute"] = _in_memory_precompute(out_dir, tokenizer_path,
                                                                data_root)
        results["by_name"] = _cephalo_dpo("lora", world_size, out_dir, tokenizer_path,
                                          data_root, by_name=_by_name_dir(out_dir))
    return portable(results, True)


def _by_name_dir(out_dir: str) -> str:
    """The "lora" case's base model saved as a ``save_pretrained`` folder, for the door's
    model-by-name path (TRL's dpo.py passes ``model=model_args.model_name_or_path``, no
    reference model and, with --use_peft, a peft_config)."""
    return os.path.join(out_dir, "policy")


def _save_by_name(out_dir: str, tokenizer_path: str) -> None:
    model, _, _ = _models("lora", len(load_tokenizer(tokenizer_path)))
    model.save_pretrained(_by_name_dir(out_dir), max_shard_size="200KB")


def _in_memory_precompute(out_dir, tokenizer_path, data_root):
    """precompute_ref_log_probs with an in-memory dataset on 2 ranks: refused on every rank
    before any collective (TRL's cache file would be in a per-process temporary directory)."""
    import datasets

    from hf_cephalo.integrations import CephaloDPOConfig, CephaloDPOTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    in_memory = datasets.Dataset.from_dict(_dataset("precompute", data_root).to_dict())
    args = CephaloDPOConfig(**_dpo_kwargs("precompute", os.path.join(out_dir, "in_memory")))
    try:
        CephaloDPOTrainer(model=tiny_llama(len(tokenizer)), args=args, train_dataset=in_memory,
                          processing_class=tokenizer, plan=plan(2))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _cephalo_dpo(case, world_size, out_dir, tokenizer_path, data_root, by_name=None):
    from hf_cephalo.integrations import CephaloDPOConfig, CephaloDPOTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    model, ref, peft_config = _models(case, len(tokenizer))
    if by_name:
        model = by_name  # the same weights, read by the door from the folder
    where = f"w{world_size}" + ("-by-name" if by_name else "")
    evaluating = case == EVAL_CASE and not by_name
    eval_kwargs = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2) \
        if evaluating else {}  # microbatches of 2 inside the eval loader's steps
    args = CephaloDPOConfig(**_dpo_kwargs(case, os.path.join(out_dir, where)), **eval_kwargs)
    trainer = CephaloDPOTrainer(model=model, ref_model=ref, args=args,
                                train_dataset=_dataset(case, data_root),
                                processing_class=tokenizer, peft_config=peft_config,
                                plan=plan(world_size),
                                eval_dataset=_eval_dataset() if evaluating else None)
    trainer.train()
    result = {"logs": step_logs(trainer.state.log_history, METRICS)}
    if evaluating:
        trainer.evaluate()
        result["eval"] = eval_logs(trainer.state.log_history)
    result["state"] = state_copy(trainer.unshard_model())
    return result


# one run_ranks per world size, every sub-case inside
QUIET_S = {2: 45.0, 3: 60.0}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    offline_env()
    return save_tokenizer(str(tmp_path_factory.mktemp("chat_tokenizer")))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    offline_env()
    return _save_datasets(str(tmp_path_factory.mktemp("preference_pairs")))


_RUNS: dict = {}
_RUN_DIRS: dict = {}


def _cephalo(world_size, tmp_path_factory, tokenizer_path, data_root):
    from tests.dist_utils import budget_s

    if world_size not in _RUNS:
        out_dir = str(tmp_path_factory.mktemp(f"cephalo_dpo_w{world_size}"))
        _RUN_DIRS[world_size] = out_dir
        if world_size == 2:
            _save_by_name(out_dir, tokenizer_path)
        _RUNS[world_size] = run_ranks(_worker, world_size, out_dir, tokenizer_path, data_root,
                                      timeout_s=budget_s(QUIET_S[world_size]))
    return _RUNS[world_size]


# ---- the stock side -------------------------------------------------------------------------

_STOCK: dict = {}


def _stock_dpo(case, tmp_path_factory, tokenizer_path, data_root, by_name=None):
    key = case if by_name is None else (case, "by name")
    if key not in _STOCK:
        from trl import DPOConfig, DPOTrainer

        offline_env()
        tokenizer = load_tokenizer(tokenizer_path)
        model, ref, peft_config = _models(case, len(tokenizer))
        if by_name is not None:
            model = by_name  # stock TRL loads it (create_model_from_path)
        out_dir = str(tmp_path_factory.mktemp("stock_dpo"))
        evaluating = case == EVAL_CASE and by_name is None  # the whole eval set in one batch
        eval_kwargs = dict(eval_strategy="steps", eval_steps=2,
                           per_device_eval_batch_size=EVAL_PAIRS) if evaluating else {}
        args = DPOConfig(**_dpo_kwargs(case, out_dir), **eval_kwargs,
                         per_device_train_batch_size=B)
        trainer = DPOTrainer(model=model, ref_model=ref, args=args,
                             train_dataset=_dataset(case, data_root),
                             processing_class=tokenizer, peft_config=peft_config,
                             eval_dataset=_eval_dataset() if evaluating else None)
        trainer.train()
        _STOCK[key] = {"logs": step_logs(trainer.state.log_history, METRICS)}
        if evaluating:
            trainer.evaluate()
            _STOCK[key]["eval"] = eval_logs(trainer.state.log_history)
        _STOCK[key]["state"] = state_copy(trainer.model)
    return _STOCK[key]


def _close(got, ref, what):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(ref, dtype=torch.float64), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
ULPS = 4


def _reward_atol(ref_logs, beta):
    """The rewards are beta * (logp - ref_logp): differences of two fp32 sums of magnitude
    |logp| (~100 here), so they carry the absolute error of those sums (one fp32 spacing at
    100 is 7.6e-6), not an error relative to the small difference. They are compared at
    ``ULPS`` spacings of the largest summed log-probability, times beta (1.5e-5 at beta 0.5);
    the log-probabilities themselves are compared at rtol 1e-5 / atol 1e-6."""
    largest = max(abs(v) for m in ("logps/chosen", "logps/rejected") for v in ref_logs[m])
    x = torch.tensor(largest, dtype=torch.float32)
    spacing = float(torch.nextafter(x, torch.tensor(float("inf"))) - x)
    return beta * ULPS * spacing


def _assert_same_run(got, ref, beta):
    for metric in METRICS:
        assert len(got["logs"][metric]) == len(ref["logs"][metric]) == STEPS, metric
        if metric in REWARDS:
            torch.testing.assert_close(torch.tensor(got["logs"][metric], dtype=torch.float64),
                                       torch.tensor(ref["logs"][metric], dtype=torch.float64),
                                       rtol=0, atol=_reward_atol(ref["logs"], beta),
                                       msg=lambda m: f"{metric}: {m}")
        else:
            _close(got["logs"][metric], ref["logs"][metric], metric)
    assert_same_state(got["state"], ref["state"], RTOL, ATOL)


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_matches_stock(case, world_size, tmp_path_factory, tokenizer_path, data_root):
    """Every DPO reference kind and loss, 2 and 3 ranks (uneven plan; different l_i and an idle
    rank): per-step loss, grad_norm and DPO's metrics, and the final weights, equal stock
    DPOTrainer's on one process with the whole global batch of pairs."""
    ref = _stock_dpo(case, tmp_path_factory, tokenizer_path, data_root)
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path, data_root):
        _assert_same_run(rank_result[case], ref, DPO_CASES[case][2]["beta"])
    # the run trained and the metrics are informative (a test that cannot fail is a defect)
    logs = ref["logs"]
    assert logs["loss"][0] != logs["loss"][-1]
    assert any(abs(v) > 1e-3 for v in logs["rewards/margins"]), logs["rewards/margins"]


@test_timeout(QUIET_S[2], margin_s=240)
def test_dpo_by_name_matches_stock(tmp_path_factory, tokenizer_path, data_root):
    """The model given by name (a ``save_pretrained`` folder of the "lora" case's base model)
    with a LoRA peft_config and no reference model, as TRL's dpo.py passes them with
    --use_peft, loaded by the door on the meta device, each rank reading its shards: the same
    run as stock DPOTrainer on the model object (TRL loads a name with ``from_pretrained``: the
    same weights), 2 ranks. (With ``precompute_ref_log_probs`` a model by name is refused with
    what to do: TRL would run the whole model before the engine shards it.)"""
    runs = _cephalo(2, tmp_path_factory, tokenizer_path, data_root)
    ref = _stock_dpo("lora", tmp_path_factory, tokenizer_path, data_root,
                     by_name=_by_name_dir(_RUN_DIRS[2]))
    for rank_result in runs:
        _assert_same_run(rank_result["by_name"], ref, DPO_CASES["lora"][2]["beta"])


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_dpo_cases_differ(tmp_path_factory, tokenizer_path, data_root):
    """The sub-cases are different runs (the reference kind and the loss change the numbers)."""
    losses = {case: _stock_dpo(case, tmp_path_factory, tokenizer_path, data_root)["logs"]["loss"][-1]
              for case in DPO_CASES}
    assert len({round(v, 6) for v in losses.values()}) == len(losses), losses


def test_dpo_refusals_before_any_collective(tmp_path, tokenizer_path, data_root):
    """Batch-level losses, sync_ref_model, ld_alpha with a per-step reference, a full
    fine-tune without a reference to load are refused in ONE message at construction (one
    process, no process group made); so are evaluation with precompute_ref_log_probs and
    compute_metrics."""
    import torch.distributed as dist

    from hf_cephalo.integrations import CephaloDPOConfig, CephaloDPOTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    args = CephaloDPOConfig(**{**_dpo_kwargs("ref_model", str(tmp_path)),
                               "loss_type": ["sigmoid", "aot"], "sync_ref_model": True,
                               "ld_alpha": 0.5})
    with pytest.raises(ValueError) as info:
        CephaloDPOTrainer(model=tiny_llama(len(tokenizer)), args=args,
                          train_dataset=_dataset("ref_model", data_root), processing_class=tokenizer,
                          plan=plan(2))
    text = str(info.value)
    for expected in ("--loss_type ['sigmoid', 'aot'] (aot)", "--sync_ref_model", "--ld_alpha = 0.5",
                     "ref_model=copy.deepcopy(model)"):  # no name to load a reference copy by
        assert expected in text, text
    assert not dist.is_initialized()
    # a mixture of experts: DPOTrainer adds its router loss per call (issue 49: refused after
    # DPOTrainer.__init__ decided it, before planning; router_aux_loss_coef=0.0 is the fix)
    import transformers

    from tests.zoo_fixtures import ZOO

    moe_config = ZOO["qwen3_moe_no_router_loss"][1]()
    moe_config.vocab_size = len(tokenizer)
    moe = transformers.Qwen3MoeForCausalLM(moe_config)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.0 in the DPOConfig"):
        CephaloDPOTrainer(model=moe, ref_model=copy.deepcopy(moe),
                          args=CephaloDPOConfig(**_dpo_kwargs("ref_model", str(tmp_path))),
                          train_dataset=_dataset("ref_model", data_root),
                          processing_class=tokenizer, plan=plan(2))
    assert not dist.is_initialized()
    # evaluation with precomputed reference columns, compute_metrics (stock's predictions are
    # full-vocabulary logits the engine does not reproduce): refused, each with its reason
    args = CephaloDPOConfig(**{**_dpo_kwargs("precompute", str(tmp_path)),
                               "eval_strategy": "steps", "eval_steps": 1})
    with pytest.raises(ValueError) as info:
        CephaloDPOTrainer(model=tiny_llama(len(tokenizer)), args=args,
                          train_dataset=_dataset("ref_model", data_root),
                          eval_dataset=_dataset("ref_model", data_root),
                          compute_metrics=lambda prediction: {},
                          processing_class=tokenizer, plan=plan(2))
    text = str(info.value)
    for expected in ("precompute_ref_log_probs=True with evaluation", "does not predict"):
        assert expected in text, text
    assert not dist.is_initialized()


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_in_memory_precompute_refused_on_every_rank(tmp_path_factory, tokenizer_path, data_root):
    """An in-memory dataset with precompute_ref_log_probs on 2 ranks: the same refusal on
    both ranks at construction, naming save_to_disk, instead of stock TRL's missing cache file
    inside its precompute (the refusal is in the mixin's first check, before DPOTrainer's
    __init__ and any collective)."""
    results = [r["in_memory_precompute"]
               for r in _cephalo(2, tmp_path_factory, tokenizer_path, data_root)]
    assert results[0]["error"] is not None and "save_to_disk" in results[0]["error"], results
    assert results[0]["error"] == results[1]["error"]


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_dpo_evaluation_matches_stock(world_size, tmp_path_factory, tokenizer_path, data_root):
    """EVAL_CASE evaluated at steps 2 and 3 (eval_strategy "steps") and by evaluate() after
    training, on 2 ranks (b = [1, 3]) and 3 (an idle rank), microbatches of 2 pairs: eval_loss
    and DPO's metrics equal stock DPOTrainer's with the whole eval set in ONE batch on one
    process."""
    ref = _stock_dpo(EVAL_CASE, tmp_path_factory, tokenizer_path, data_root)
    beta = DPO_CASES[EVAL_CASE][2]["beta"]
    assert len(ref["eval"]) == 3  # steps 2 and 3 (eval_steps; the last step), evaluate()
    keys = {f"eval_{m}" for m in METRICS if m != "grad_norm"}
    logps = {m: [h[f"eval_{m}"] for h in ref["eval"]] for m in ("logps/chosen", "logps/rejected")}
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path, data_root):
        got = rank_result[EVAL_CASE]["eval"]
        assert len(got) == len(ref["eval"])
        for mine, theirs in zip(got, ref["eval"]):
            assert set(mine) == set(theirs) and keys <= set(theirs), (sorted(mine), sorted(theirs))
            for key in theirs:
                rewards = key.removeprefix("eval_") in REWARDS
                rtol, atol = (0, _reward_atol(logps, beta)) if rewards else (RTOL, ATOL)
                torch.testing.assert_close(torch.tensor(mine[key], dtype=torch.float64),
                                           torch.tensor(theirs[key], dtype=torch.float64),
                                           rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    # informative: the evaluations differ, the margins are not 0, accuracy strictly inside (0, 1)
    assert ref["eval"][0]["eval_loss"] != ref["eval"][-1]["eval_loss"]
    assert all(abs(h["eval_rewards/margins"]) > 1e-4 for h in ref["eval"]), ref["eval"]
