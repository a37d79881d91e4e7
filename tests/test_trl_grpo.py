"""CephaloGRPOTrainer / CephaloRLOOTrainer vs STOCK TRL GRPOTrainer / RLOOTrainer (issue 46): the
same settings give the same numbers.

Completions come from a deterministic ``rollout_func`` (a fixed function of the prompt text,
the step and the completion's number in its group: ``_rollout``, which also asserts it is
called with whole groups in order) and the rewards from two deterministic reward functions, so
both sides train on the same completions. One run_ranks call per world size trains the
sub-cases: 2 gloo ranks with the uneven plan b = [1, 3], m = [1, 2] (the first group spans the
ranks; every sub-case), and 3 ranks with b = [1, 3, 0], m = [1, 1, 0] (different l_i and an
idle rank; ``THREE_RANKS``). The test process trains the same sub-cases with stock TRL in ONE
process with the whole generation batch (per_device_train_batch_size = B = 4, G = 2: two
prompts per step) and compares every key of every per-step log row (loss, grad_norm,
learning_rate, epoch, rewards, reward_std, zero-std fraction, entropy, clip ratios, kl,
completion lengths, tokens; step_time aside), then the final weights. Qwen3 (tiny, from its
config), fp32, SGD, rtol 1e-5 / atol 1e-6.

Sub-cases (GRPO_CASES): every built loss type (dapo: TRL's default, grpo, bnpo, dr_grpo) with
scale_rewards group / batch / none, reward weights, mask_truncated_completions, the top-entropy
token mask, beta 0.04 with TRL's reference model (a second engine) and num_iterations 2 (old
log-probabilities), a LoRA policy with beta (the reference: the adapter off), and Qwen3-MoE.
RLOO_CASES: CephaloRLOOTrainer with RLOOConfig's defaults against stock RLOOTrainer whose
generation is the same function (``_rollout_rloo_class``: stock RLOOTrainer takes no
rollout_func).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout
from tests.trl_fixtures import (B, SEED, assert_same_state, load_tokenizer, offline_env, plan,
                                save_tokenizer, state_copy)
from tests.zoo_fixtures import ZOO

trl = pytest.importorskip("trl")

RTOL, ATOL = 1e-5, 1e-6
LR, STEPS, G = 0.5, 3, 2
GRPO_CASES = {
    # name: GRPOConfig overrides
    "dapo": dict(),
    # conversational prompts (chat template, assistant-message completions)
    "grpo_conversational": dict(loss_type="grpo", scale_rewards="batch",
                                reward_weights=[1.0, 0.5]),
    # truncated completions masked; the mask of the top 50 % entropy tokens (a quantile over
    # the global batch's tokens)
    "bnpo_masked_entropy": dict(loss_type="bnpo", mask_truncated_completions=True,
                                top_entropy_quantile=0.5),
    "dr_grpo_no_scale": dict(loss_type="dr_grpo", scale_rewards="none",
                             max_completion_length=16),
    "beta_ref_two_iterations": dict(beta=0.04, num_iterations=2),
    # a LoRA policy: the reference is the policy with its adapter off
    "lora_beta": dict(beta=0.04, loss_type="bnpo"),
    # a mixture of experts, with a reference engine
    # (router loss off: TRL adds it per microbatch, refused otherwise)
    "moe_beta": dict(beta=0.04, loss_type="grpo", router_aux_loss_coef=0.0),
    # built-in generation on the engine (no rollout_func): keyed sampling; stock runs
    # hf_cephalo.reproducible_rollout(seed) on one process
    "generated": dict(temperature=0.9, top_k=20, top_p=0.95),
    "generated_sharded_plan": dict(temperature=1.2, min_p=0.02, beta=0.04, num_iterations=2),
}
GENERATED = {  # case: the Cephalo settings of its built-in generation
    "generated": dict(cephalo_decode_mode="gather_once"),
    "generated_sharded_plan": dict(cephalo_decode_mode="sharded",
                                   cephalo_generation_split="plan"),
    "rloo_generated": dict(cephalo_decode_mode="sharded"),
}
LORA_CASES = ("lora_beta",)
CONVERSATIONAL_CASES = ("grpo_conversational",)  # chat prompts, assistant-message completions
MOE_CASES = ("moe_beta",)  # Qwen3-MoE (4 experts, top 2; no router loss)
RLOO_CASES = {
    # RLOOConfig's defaults: beta 0.05 (KL in the reward, TRL's reference model)
    "rloo_default": dict(),
    # no reference; each batch trained twice (old log-probabilities); advantages normalized
    # over the batch; rewards clipped
    "rloo_two_iterations": dict(beta=0.0, num_iterations=2, normalize_advantages=True,
                                reward_clip_range=(0.0, 6.0)),
    # built-in generation (stock: its generation replaced by the same keyed decode)
    "rloo_generated": dict(temperature=0.8, top_k=30),
}
SCORING_PASSES = {
    # case: forward-only passes per optimizer step the door prices its start plan with
    # (Job.scoring_passes): per generation round the old policy's (GRPO: num_iterations > 1;
    # RLOO: always) and the reference's (beta != 0), over the num_iterations steps a round
    # feeds, plus GRPO's entropy-threshold pass every step (top_entropy_quantile < 1)
    "dapo": 0.0, "grpo_conversational": 0.0, "bnpo_masked_entropy": 1.0,
    "dr_grpo_no_scale": 0.0, "beta_ref_two_iterations": (1 + 1) / 2, "lora_beta": 1.0,
    "moe_beta": 1.0, "generated": 0.0, "generated_sharded_plan": (1 + 1) / 2,
    "rloo_default": 1.0 + 1.0, "rloo_two_iterations": 1 / 2, "rloo_generated": 1.0 + 1.0,
}
THREE_RANKS = ("dapo", "beta_ref_two_iterations", "lora_beta", "moe_beta", "rloo_default",
               "generated_sharded_plan")
"""The sub-cases also run on 3 ranks (an idle rank); the loss types' normalizers differ from
dapo's only in the item count, which the 2-rank run (a group spanning ranks) checks."""
METRICS = ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "frac_reward_zero_std",
           "rewards/length_reward/mean", "rewards/length_reward/std",
           "rewards/vowel_reward/mean", "entropy", "clip_ratio/region_mean",
           "completions/mean_length", "completions/min_length", "completions/max_length",
           "completions/clipped_ratio", "completions/mean_terminated_length", "num_tokens", "kl")
NUM_PROMPTS = 8
CASE_WORLDS = [(c, 2) for c in [*GRPO_CASES, *RLOO_CASES]] + [(c, 3) for c in THREE_RANKS]


# ---- the deterministic rollout and rewards -----------------------------------------------------

def _rollout(prompts, trainer):
    """A fixed function of (prompt text, step, the completion's number in its group): prompt
    ids from the tokenizer; 2-9 completion tokens, most ending in EOS (one in three runs to
    its end: truncated)."""
    G = trainer.num_generations  # called with whole groups, in order, as on one process
    assert len(prompts) % G == 0 and all(p == prompts[i - i % G] for i, p in enumerate(prompts))
    tokenizer = trainer.processing_class
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    step = trainer.state.global_step
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        k = i % G
        h = sum(_text(prompt).encode()) % 997
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:12]
        else:  # conversational: the chat template's prompt
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[-20:]
        n = 2 + (h + 3 * k + step) % 8
        done = [((h * 7 + k * 13 + step * 5 + j * 11) % (vocab - 20)) + 10 for j in range(n)]
        if (h + k + step) % 3:
            done[-1] = eos
        prompt_ids.append(ids)
        completion_ids.append(done)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _text(message) -> str:
    """A prompt or completion's text (a string, or the last message of a conversation)."""
    return message if isinstance(message, str) else message[-1]["content"]


def length_reward(prompts, completions, **kwargs):
    return [float(len(_text(c))) / 10.0 for c in completions]


def vowel_reward(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in _text(c))) for c in completions]


# ---- shared pieces -----------------------------------------------------------------------------

def _dataset(case: str | None = None):
    import datasets

    from hf_cephalo.demo_data import pydoc_texts

    text = " ".join(pydoc_texts(8000))
    prompts = [text[i * 97:i * 97 + 20 + 7 * (i % 4)] for i in range(NUM_PROMPTS)]
    if case in CONVERSATIONAL_CASES:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return datasets.Dataset.from_dict({"prompt": prompts})


def _model_dir(root: str, tokenizer_path: str) -> str:
    """Tiny Qwen3 and Qwen3-MoE (``tests/zoo_fixtures.py``) saved under ``root`` (TRL builds the
    reference copy from the model's name)."""
    import transformers

    for name in ("qwen3", "qwen3_moe_no_router_loss"):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            class_name, config = ZOO[name]
            torch.manual_seed(SEED)
            cfg = config()
            tokenizer = load_tokenizer(tokenizer_path)
            cfg.vocab_size, cfg.pad_token_id = len(tokenizer), tokenizer.pad_token_id
            cfg.eos_token_id = tokenizer.eos_token_id
            getattr(transformers, class_name)(cfg).save_pretrained(path)
    return root


def _model(root: str, case: str):
    import transformers

    name = "qwen3_moe_no_router_loss" if case in MOE_CASES else "qwen3"
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, name),
                                                             dtype=torch.float32)


def _peft_config(case: str):
    if case not in LORA_CASES:
        return None
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      init_lora_weights=False)


def _grpo_kwargs(case: str, out_dir: str) -> dict:
    if case in RLOO_CASES:
        return {**_base_kwargs(case, out_dir), **RLOO_CASES[case]}
    return {**_base_kwargs(case, out_dir), **GRPO_CASES[case]}


def _base_kwargs(case: str, out_dir: str) -> dict:
    return {**dict(output_dir=os.path.join(out_dir, case), report_to="none", optim="sgd",
                   learning_rate=LR, max_steps=STEPS, logging_steps=1, save_strategy="no",
                   seed=SEED, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
                   use_cpu=True, num_generations=G, max_completion_length=8)}


def _logs(history):
    """Every value of the per-step log rows (all that stock logs, step_time aside: a wall
    clock)."""
    rows = [h for h in history if "loss" in h and "train_loss" not in h]
    keys = sorted({k for h in rows for k in h} - {"step_time"})
    return {m: [h[m] for h in rows if m in h] for m in keys}


# ---- the Cephalo side --------------------------------------------------------------------------

def _worker(rank, world_size, out_dir, tokenizer_path, model_dir):
    offline_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), TRL_EXPERIMENTAL_SILENCE="1")
    cases = [c for c, w in CASE_WORLDS if w == world_size]
    results = {case: _cephalo_grpo(case, world_size, out_dir, tokenizer_path, model_dir)
               for case in cases if case in GRPO_CASES}
    results.update({case: _cephalo_rloo(case, world_size, out_dir, tokenizer_path, model_dir)
                    for case in cases if case in RLOO_CASES})
    if world_size == 2:
        results["reward_raises"] = _reward_raises(out_dir, tokenizer_path, model_dir)
    return portable(results, True)


def _cephalo_rloo(case, world_size, out_dir, tokenizer_path, model_dir):
    from hf_cephalo import CephaloRLOOConfig, CephaloRLOOTrainer

    args = CephaloRLOOConfig(**_grpo_kwargs(case, os.path.join(out_dir, f"w{world_size}")),
                             per_device_train_batch_size=2, cephalo_adaptive="off",
                             **GENERATED.get(case, {}))
    trainer = CephaloRLOOTrainer(model=_model(model_dir, case), args=args,
                                 reward_funcs=[length_reward, vowel_reward],
                                 train_dataset=_dataset(),
                                 processing_class=load_tokenizer(tokenizer_path),
                                 rollout_func=None if case in GENERATED else _rollout,
                                 plan=plan(world_size))
    trainer.train()
    return {"logs": _logs(trainer.state.log_history), "state": state_copy(trainer.unshard_model()),
            "scoring_passes": trainer.session.job.scoring_passes}


def rank_one_reward(prompts, completions, **kwargs):
    if os.environ["RANK"] == "1":
        raise RuntimeError("no reward for these rows")
    return [0.0] * len(prompts)


def _reward_raises(out_dir, tokenizer_path, model_dir):
    """A reward function that raises on rank 1 only: the same error on both ranks at the
    first step, before the step's engine collectives (no hang)."""
    from hf_cephalo import CephaloGRPOConfig, CephaloGRPOTrainer

    args = CephaloGRPOConfig(**_grpo_kwargs("dapo", os.path.join(out_dir, "raises")),
                             per_device_train_batch_size=2)
    trainer = CephaloGRPOTrainer(model=_model(model_dir, "dapo"), args=args,
                                 reward_funcs=[rank_one_reward], train_dataset=_dataset(),
                                 processing_class=load_tokenizer(tokenizer_path),
                                 rollout_func=_rollout, plan=plan(2))
    try:
        trainer.train()
    except ValueError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def _cephalo_grpo(case, world_size, out_dir, tokenizer_path, model_dir):
    from hf_cephalo import CephaloGRPOConfig, CephaloGRPOTrainer

    args = CephaloGRPOConfig(**_grpo_kwargs(case, os.path.join(out_dir, f"w{world_size}")),
                             per_device_train_batch_size=2, cephalo_adaptive="off",
                             **GENERATED.get(case, {}))
    trainer = CephaloGRPOTrainer(model=_model(model_dir, case), args=args,
                                 reward_funcs=[length_reward, vowel_reward],
                                 train_dataset=_dataset(case),
                                 processing_class=load_tokenizer(tokenizer_path),
                                 rollout_func=None if case in GENERATED else _rollout,
                                 plan=plan(world_size), peft_config=_peft_config(case))
    trainer.train()
    report = trainer._builtin.report if case in GENERATED else None
    return {"logs": _logs(trainer.state.log_history), "state": state_copy(trainer.unshard_model()),
            "generation": report, "scoring_passes": trainer.session.job.scoring_passes}


QUIET_S = {2: 60.0, 3: 75.0}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    offline_env()
    return save_tokenizer(str(tmp_path_factory.mktemp("chat_tokenizer")))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_path):
    return _model_dir(str(tmp_path_factory.mktemp("grpo_model")), tokenizer_path)


_RUNS: dict = {}


def _cephalo(world_size, tmp_path_factory, tokenizer_path, model_dir):
    if world_size not in _RUNS:
        out_dir = str(tmp_path_factory.mktemp(f"cephalo_grpo_w{world_size}"))
        _RUNS[world_size] = run_ranks(_worker, world_size, out_dir, tokenizer_path, model_dir,
                                      timeout_s=budget_s(QUIET_S[world_size]))
    return _RUNS[world_size]


# ---- the stock side ----------------------------------------------------------------------------

_STOCK: dict = {}


def _stock_grpo(case, tmp_path_factory, tokenizer_path, model_dir):
    if case not in _STOCK:
        from trl import GRPOConfig, GRPOTrainer

        offline_env()
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        out_dir = str(tmp_path_factory.mktemp("stock_grpo"))
        args = GRPOConfig(**_grpo_kwargs(case, out_dir), per_device_train_batch_size=B)
        import hf_cephalo

        rollout = hf_cephalo.reproducible_rollout(SEED) if case in GENERATED else _rollout
        trainer = GRPOTrainer(model=_model(model_dir, case), args=args,
                              reward_funcs=[length_reward, vowel_reward],
                              train_dataset=_dataset(case),
                              processing_class=load_tokenizer(tokenizer_path),
                              rollout_func=rollout, peft_config=_peft_config(case))
        trainer.train()
        _STOCK[case] = {"logs": _logs(trainer.state.log_history), "state": state_copy(trainer.model)}
    return _STOCK[case]


def _rollout_rloo_class():
    """Stock ``RLOOTrainer`` whose generation is ``_rollout`` (it takes no rollout_func): its
    prompt tokenization returns the rollout's prompt ids and its generation the rollout's
    completions; everything after (metrics, rewards, advantages, loss) is stock's."""
    from trl import RLOOTrainer

    class RolloutRLOOTrainer(RLOOTrainer):
        def _tokenize_prompts(self, prompts):
            self._rollout_output = _rollout(prompts, self)
            return self._rollout_output["prompt_ids"], None, {}

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            return self._rollout_output["completion_ids"]

    return RolloutRLOOTrainer


def _keyed_rloo_class():
    """Stock ``RLOOTrainer`` whose generation is the keyed decode of
    ``hf_cephalo.reproducible_rollout`` over the whole batch (row j keyed by its index; the
    round by the optimizer step): what CephaloRLOOTrainer's built-in generation gives."""
    from trl import RLOOTrainer

    from hf_cephalo.integrations.trl.reproducible import generation_round, sampling_params
    from hf_cephalo.runtime.generation import generate_rows

    class KeyedRLOOTrainer(RLOOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            model = self.accelerator.unwrap_model(self.model)
            rows = [list(map(int, p)) for p in prompt_ids]
            return generate_rows(model, rows, list(range(len(rows))),
                                 sampling_params(self.args, self, SEED), generation_round(self),
                                 pad_to_multiple_of=self.pad_to_multiple_of).completions

    return KeyedRLOOTrainer


def _stock_rloo(case, tmp_path_factory, tokenizer_path, model_dir):
    if case not in _STOCK:
        from trl import RLOOConfig

        offline_env()
        out_dir = str(tmp_path_factory.mktemp("stock_rloo"))
        args = RLOOConfig(**_grpo_kwargs(case, out_dir), per_device_train_batch_size=B)
        cls = _keyed_rloo_class() if case in GENERATED else _rollout_rloo_class()
        trainer = cls(model=_model(model_dir, case), args=args,
                      reward_funcs=[length_reward, vowel_reward], train_dataset=_dataset(),
                      processing_class=load_tokenizer(tokenizer_path))
        trainer.train()
        _STOCK[case] = {"logs": _logs(trainer.state.log_history), "state": state_copy(trainer.model)}
    return _STOCK[case]


def _assert_same_run(got, ref):
    assert set(got["logs"]) == set(ref["logs"]), set(got["logs"]) ^ set(ref["logs"])
    assert set(METRICS) <= set(ref["logs"]) | {"kl"}
    for metric in ref["logs"]:
        assert len(got["logs"][metric]) == len(ref["logs"][metric]), metric
        torch.testing.assert_close(torch.tensor(got["logs"][metric], dtype=torch.float64),
                                   torch.tensor(ref["logs"][metric], dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{metric}: {m}")
    assert_same_state(got["state"], ref["state"], RTOL, ATOL)


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("case, world_size", [cw for cw in CASE_WORLDS if cw[0] in GRPO_CASES])
def test_grpo_matches_stock(case, world_size, tmp_path_factory, tokenizer_path, model_dir):
    """Every built loss type, reward scaling, truncation masking, beta > 0 with TRL's
    reference model and num_iterations 2, on 2 and 3 ranks (uneven plan, a group spanning
    ranks; different l_i and an idle rank): per-step loss, grad_norm, learning rate and GRPO's
    metrics, and the final weights, equal stock GRPOTrainer's on one process with the whole
    generation batch."""
    ref = _stock_grpo(case, tmp_path_factory, tokenizer_path, model_dir)
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path, model_dir):
        _assert_same_run(rank_result[case], ref)
        assert rank_result[case]["scoring_passes"] == SCORING_PASSES[case]
    # the run trained and its metrics are informative (a test that cannot fail is a defect)
    logs = ref["logs"]
    assert len(logs["loss"]) == STEPS
    assert all(v > 1e-3 for v in logs["grad_norm"]), logs["grad_norm"]
    assert logs["reward"][0] != logs["reward"][-1]
    if GRPO_CASES[case].get("beta"):
        assert len(logs["kl"]) == STEPS and any(v > 0 for v in logs["kl"]), logs["kl"]


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("case, world_size", [cw for cw in CASE_WORLDS if cw[0] in RLOO_CASES])
def test_rloo_matches_stock(case, world_size, tmp_path_factory, tokenizer_path, model_dir):
    """CephaloRLOOTrainer with its default loss (beta 0.05: KL in the reward, TRL's reference
    model as a second engine; 2 and 3 ranks) and with num_iterations 2, normalized advantages
    and clipped rewards (2 ranks) equals stock RLOOTrainer on one process whose generation is
    the same deterministic function (``_rollout_rloo_class``)."""
    ref = _stock_rloo(case, tmp_path_factory, tokenizer_path, model_dir)
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path, model_dir):
        _assert_same_run(rank_result[case], ref)
        assert rank_result[case]["scoring_passes"] == SCORING_PASSES[case]
    logs = ref["logs"]
    assert sum(v > 1e-3 for v in logs["grad_norm"]) >= 2, logs["grad_norm"]
    if RLOO_CASES[case].get("num_iterations", 1) > 1:  # the 2nd pass: ratios off 1, clipped
        assert logs["clip_ratio/region_mean"][1] > 0, logs["clip_ratio/region_mean"]
    if RLOO_CASES[case].get("beta", 0.05):
        assert len(logs["kl"]) == STEPS and any(v != 0 for v in logs["kl"]), logs["kl"]


@test_timeout(QUIET_S[2], margin_s=240)
def test_reward_function_raising_on_one_rank(tmp_path_factory, tokenizer_path, model_dir):
    """A reward function raising on rank 1 only: both ranks raise the same ValueError naming
    the rank and the error (one status exchange), instead of rank 0 waiting in the next
    collective."""
    errors = [r["reward_raises"]["error"]
              for r in _cephalo(2, tmp_path_factory, tokenizer_path, model_dir)]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "a reward function failed on rank 1" in errors[0], errors[0]
    assert "no reward for these rows" in errors[0], errors[0]


def test_grpo_refusals_before_any_collective(tmp_path, tokenizer_path, model_dir):
    """Every setting the door does not build, in ONE message at construction (one process, no
    process group made): no rollout_func, num_generations not dividing the global batch,
    steps_per_generation, gradient accumulation, an unvalidated loss type, the entropy bonus,
    vLLM, tools, num_iterations with live re-balancing, and what built-in generation (no
    rollout_func) does not reproduce: repetition_penalty, generation_kwargs, a cache
    implementation; then evaluation."""
    import torch.distributed as dist

    from hf_cephalo import CephaloGRPOConfig, CephaloGRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    tokenizer = load_tokenizer(tokenizer_path)
    kwargs = {**_grpo_kwargs("dapo", str(tmp_path)), "num_generations": 3,
              "loss_type": "sapo", "entropy_coef": 0.1, "use_vllm": True,
              "gradient_accumulation_steps": 2, "num_iterations": 2,
              "cephalo_adaptive": "batch", "repetition_penalty": 1.1,
              "generation_kwargs": {"num_beams": 2}, "cache_implementation": "static"}
    args = CephaloGRPOConfig(**kwargs, per_device_train_batch_size=3)
    with pytest.raises(ValueError) as info:
        CephaloGRPOTrainer(model=_model(model_dir, "dapo"), args=args,
                           reward_funcs=[length_reward], train_dataset=_dataset(),
                           processing_class=tokenizer, tools=[len], plan=plan(2))
    text = str(info.value)
    for expected in ("num_generations = 3 does not divide the generation "
                     "batch B = 4", "--steps_per_generation = 2", "--gradient_accumulation_steps "
                     "= 2", "--loss_type 'sapo'", "--entropy_coef = 0.1",
                     "--cephalo_adaptive batch with num_iterations = 2",
                     "--use_vllm = True", "tools: multi-turn", "repetition_penalty = 1.1",
                     "generation_kwargs = {'num_beams': 2}", "cache_implementation = 'static'"):
        assert expected in text, (expected, text)
    assert not dist.is_initialized()
    args = CephaloGRPOConfig(**_grpo_kwargs("dapo", str(tmp_path)), per_device_train_batch_size=2)
    with pytest.raises(ValueError, match="does not evaluate yet"):
        CephaloGRPOTrainer(model=_model(model_dir, "dapo"), args=args,
                           reward_funcs=[length_reward], train_dataset=_dataset(),
                           eval_dataset=_dataset(),
                           processing_class=tokenizer, rollout_func=_rollout, plan=plan(2))
    assert not dist.is_initialized()


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_builtin_generation_reports_its_mode_and_split(tmp_path_factory, tokenizer_path,
                                                       model_dir):
    """Built-in generation ran in the configured decode mode every round; with the 'plan'
    split the generation planner gave every rank its rows (summing to the generation batch)
    and a predicted time, on 2 ranks and on 3 (an idle rank decodes too)."""
    for world_size in (2, 3):
        for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path, model_dir):
            report = rank_result["generated_sharded_plan"]["generation"]
            assert len(report) == STEPS // 2 + STEPS % 2  # num_iterations 2: rounds 0 and 2
            assert {r["mode"] for r in report} == {"sharded"}
            assert all(sum(r["split"]) == B and len(r["split"]) == world_size for r in report)
            assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in report)
    for rank_result in _cephalo(2, tmp_path_factory, tokenizer_path, model_dir):
        report = rank_result["generated"]["generation"]
        assert len(report) == STEPS and {r["mode"] for r in report} == {"gather_once"}
        assert all(r["split"] is None for r in report)


def test_the_start_plan_prices_the_doors_scoring_passes(tmp_path, monkeypatch, model_dir):
    """resolve_plan hands the door's Job.scoring_passes to the optimizer (one process, no
    process group; the profile is a fixed 2-rank one whose rank 0 has a slow forward against
    its backward: ``planner_fixtures.forward_heavy_pair``): B = 12 starts on b = [5, 7]
    without scoring passes and on [4, 8] with one per step (beta with num_iterations 2:
    reference + old policy every 2 steps), and the line printed under the plan gives the
    training step, one pass and their sum as the optimizer priced them."""
    from hf_cephalo import CephaloGRPOConfig
    from hf_cephalo.integrations.trainer.training_args import job_from_training_args
    from hf_cephalo.models import stage_model
    from hf_cephalo.runtime import planning
    from hf_cephalo.runtime.report import format_scoring_line
    from tests.planner_fixtures import forward_heavy_pair

    for name in ("PLAN_FILE", "PROFILE_FILE", "GLOBAL_BATCH_SIZE", "EMULATE_SLOWDOWN",
                 "EMULATE_MEMORY_CAP_BYTES"):
        monkeypatch.delenv("HF_CEPHALO_" + name, raising=False)
    monkeypatch.setattr(planning, "profile_cluster", lambda *a, **k: forward_heavy_pair())
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    args = CephaloGRPOConfig(**_grpo_kwargs("beta_ref_two_iterations", str(tmp_path)),
                             per_device_train_batch_size=6, cephalo_adaptive="off")
    staged = stage_model(_model(model_dir, "dapo"))
    splits = {}
    for k in (0.0, SCORING_PASSES["beta_ref_two_iterations"]):
        resolved = planning.resolve_plan(job_from_training_args(args, 2, scoring_passes=k),
                                         staged)
        splits[k] = resolved.plan.batch_sizes
    assert splits == {0.0: [5, 7], 1.0: [4, 8]}
    line = format_scoring_line(resolved.plan, resolved.cluster, 1.0)
    assert "training 1.344 s + 1 forward-only scoring pass(es) per step" in line, line
    assert "x 0.480 s = 1.824 s predicted" in line, line
    assert not torch.distributed.is_initialized()
