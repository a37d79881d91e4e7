"""The generic path through the Accelerate loop and TRL SFT doors (issue 36): Qwen3 and Gemma 3
(sliding and full attention layers, logit and attention softcapping) on 2 gloo ranks with an
uneven plan and on 3 with an idle rank that holds state equal one process with the whole global
batch.

* Accelerate loop: ``CephaloAccelerator(cpu=False)`` (as Accelerate's examples pass it on a
  machine without CUDA), ``prepare`` + ``model(**batch)`` + ``accelerator.backward`` with AdamW
  built before prepare, clipping by the global norm, sequential order, 3 steps; the
  reference is a plain PyTorch loop over the same global batches in this process.
* TRL SFT: ``CephaloSFTTrainer`` with prompt-completion data (prompt masked out) vs stock
  ``SFTTrainer`` on one process (per_device_train_batch_size = the global batch), SGD, 3 steps:
  logged loss, grad norm, entropy, token accuracy, token count, then the final weights; and
  Qwen3 given BY NAME (a saved folder), as TRL's reference scripts pass it. Qwen3-MoE with the
  router load-balancing loss (issue 49), 2 ranks, as an object and by name (a save_pretrained
  folder storing one tensor per expert): the same, plus TRL's logged ``aux_loss``.

fp32, rtol 1e-5 / atol 1e-6. One run_ranks call per world size.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout
from tests.zoo_fixtures import ZOO

trl = pytest.importorskip("trl")

RTOL, ATOL = 1e-5, 1e-6
NAMES = ("qwen3", "gemma3")
PLANS = {2: ([1, 3], [1, 2], [0.35, 0.65]),  # b_i, m_i, r_i; global batch 4
         3: ([2, 0, 2], [1, 1, 2], [0.0, 0.6, 0.4])}  # an idle rank that holds state
B, STEPS, SEQ, LR, MAX_NORM, EPS = 4, 3, 10, 0.01, 0.8, 1e-4
SFT_METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
MOE = "qwen3_moe"  # SFT on 2 ranks: the router loss (coefficient 0.3) and its aux_loss metric
JOB_S = 60.0
pytestmark = test_timeout(JOB_S, JOB_S, margin_s=180)


def _model(name: str, vocab: int | None = None) -> torch.nn.Module:
    """The zoo model (``tests/zoo_fixtures.py``), with the tokenizer's vocabulary for SFT."""
    import transformers

    class_name, config = ZOO[name]
    torch.manual_seed(3)
    cfg = config()
    if vocab is not None:
        cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = vocab, 0, 1, 2
    cfg._attn_implementation = "eager"
    return getattr(transformers, class_name)(cfg)


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 97, (SEQ,), generator=g)
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[:SEQ - (i % 3) * 2] = 1
        labels = ids.masked_fill(mask == 0, -100)
        labels[: i % 4] = -100
        rows.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                     "labels": labels})
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)


# ---- Accelerate loop ---------------------------------------------------------------------------

def _loop(name: str, root: str, world: int) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration
    from torch.utils.data import DataLoader

    from hf_cephalo.integrations.loop.accelerator import CephaloAccelerator, CephaloPlugin
    from hf_cephalo.planner import Plan

    out = os.path.join(root, f"loop-{name}-{world}")
    os.makedirs(out, exist_ok=True)
    plan_file = os.path.join(out, "plan.json")
    Plan.from_ratios(*PLANS[world]).save(plan_file)
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = CephaloAccelerator(  # cpu=False as Accelerate's examples pass it (issue 37)
        cpu=False, cephalo_plugin=CephaloPlugin(plan_file=plan_file, adaptive="off"),
        project_config=ProjectConfiguration(project_dir=out))
    model = _model(name).train()
    optimizer = _optimizer(model)
    # the plan fixes the global batch B; the loader's batch_size is what stock DDP on 2 ranks
    # would take for it
    loader = DataLoader(_rows(STEPS * B), batch_size=B // 2, collate_fn=_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        local = outputs.loss.detach() * outputs.num_items if outputs.num_items \
            else torch.zeros(())
        losses.append(float(accelerator.reduce(local, "sum")) / outputs.num_items_in_batch)
    state = accelerator.get_state_dict(model)
    return dict(losses=losses, state=state if accelerator.is_main_process else None)


def _loop_reference(name: str) -> dict:
    model = _model(name).train()
    optimizer = _optimizer(model)
    rows, losses = _rows(STEPS * B), []
    for step in range(STEPS):
        loss = model(**_collate(rows[step * B:(step + 1) * B])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return dict(losses=losses, state=model.state_dict())


# ---- TRL SFT -----------------------------------------------------------------------------------

def _sft_args(out_dir: str) -> dict:
    return dict(output_dir=out_dir, report_to="none", optim="sgd", learning_rate=0.5,
                max_steps=STEPS, logging_steps=1, save_strategy="no", seed=7,
                train_sampling_strategy="sequential", bf16=False, gradient_checkpointing=False,
                disable_tqdm=True, use_cpu=True, completion_only_loss=True, max_length=48)


def _sft_logs(history) -> dict:
    rows = [h for h in history if "loss" in h and "train_loss" not in h]
    return {m: [h[m] for h in rows if m in h] for m in (*SFT_METRICS, "aux_loss")}


def _sft(name: str, root: str, tokenizer_path: str, world: int,
         by_name: str | None = None, planned: bool = False) -> dict:
    from hf_cephalo.integrations import CephaloSFTConfig, CephaloSFTTrainer
    from hf_cephalo.planner import Plan
    from tests.trl_fixtures import chat_dataset, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    extra = {} if by_name is None else {"model_init_kwargs": {"dtype": "float32"}}
    trainer = CephaloSFTTrainer(
        model=_model(name, len(tokenizer)) if by_name is None else by_name,
        args=CephaloSFTConfig(**_sft_args(os.path.join(
            root, f"sft-{name}-{by_name is None}-{world}-{planned}")), **extra,
            **({"per_device_train_batch_size": B // world} if planned else {})),
        train_dataset=chat_dataset("prompt_completion"), processing_class=tokenizer,
        plan=None if planned else Plan.from_ratios(*PLANS[world]))
    if by_name is not None:  # used by the door, hidden from SFTTrainer's warning, restored
        assert trainer.args.model_init_kwargs == {"dtype": "float32"}
    trainer.train()
    return dict(logs=_sft_logs(trainer.state.log_history),
                state={k: v.detach().clone()
                       for k, v in trainer.unshard_model().state_dict().items()})


def _sft_reference(name: str, root: str, tokenizer_path: str) -> dict:
    from trl import SFTConfig, SFTTrainer

    from tests.trl_fixtures import chat_dataset, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    model = _model(name, len(tokenizer))
    trainer = SFTTrainer(model=model, args=SFTConfig(**_sft_args(os.path.join(root, name)),
                                                     per_device_train_batch_size=B),
                         train_dataset=chat_dataset("prompt_completion"),
                         processing_class=tokenizer)
    trainer.train()
    return dict(logs=_sft_logs(trainer.state.log_history),
                state={k: v.detach().clone() for k, v in model.state_dict().items()})


def _worker(rank: int, world: int, root: str, tokenizer_path: str) -> dict:
    from tests.trl_fixtures import offline_env

    offline_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world),
                      HF_CEPHALO_PROFILE_CACHE=os.path.join(root, "profile-cache"))
    torch.set_num_threads(1)
    out = {}
    for name in NAMES:
        out[f"loop-{name}"] = _loop(name, root, world)
        out[f"sft-{name}"] = _sft(name, root, tokenizer_path, world)
    if world == 2:  # by name, as TRL's scripts pass model_args.model_name_or_path (issue 37)
        out["sft-by-name"] = _sft("qwen3", root, tokenizer_path, world, by_name=_saved(root))
        # ... and with no plan: profiled at start through a copy (the model is on the meta
        # device), planned, then trained
        out["sft-by-name-planned"] = _sft("qwen3", root, tokenizer_path, world,
                                          by_name=_saved(root), planned=True)
        out[f"sft-{MOE}"] = _sft(MOE, root, tokenizer_path, world)
        out[f"sft-{MOE}-by-name"] = _sft(MOE, root, tokenizer_path, world,
                                         by_name=_saved(root, MOE))
    return portable(out, True)


def _saved(root: str, name: str = "qwen3") -> str:
    return os.path.join(root, f"{name}-saved")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.trl_fixtures import offline_env, save_tokenizer

    offline_env()
    root = str(tmp_path_factory.mktemp("generic_doors"))
    tokenizer_path = save_tokenizer(os.path.join(root, "tokenizer"))
    from tests.trl_fixtures import load_tokenizer

    for name in ("qwen3", MOE):
        _model(name, len(load_tokenizer(tokenizer_path))).save_pretrained(
            _saved(root, name), max_shard_size="200KB")
    got = {world: run_ranks(_worker, world, root, tokenizer_path, timeout_s=budget_s(JOB_S))
           for world in PLANS}
    refs = {}
    for name in NAMES:
        refs[f"loop-{name}"] = _loop_reference(name)
        refs[f"sft-{name}"] = _sft_reference(name, os.path.join(root, "stock"), tokenizer_path)
    refs[f"sft-{MOE}"] = _sft_reference(MOE, os.path.join(root, "stock"), tokenizer_path)
    return got, refs


def _close(got, ref, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                               torch.as_tensor(ref, dtype=torch.float64), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


def _same_state(got: dict, ref: dict, where: str) -> None:
    assert set(got) == set(ref), where
    for key, value in ref.items():
        torch.testing.assert_close(torch.as_tensor(got[key]), value.detach(), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"{where} {key}: {m}")


@pytest.mark.parametrize("world", list(PLANS))
@pytest.mark.parametrize("name", NAMES)
def test_accelerate_loop_equals_one_process(runs, name, world):
    got, refs = runs
    ref = refs[f"loop-{name}"]
    assert ref["losses"][0] != ref["losses"][-1]  # it trained
    for rank, result in enumerate(got[world]):
        _close(result[f"loop-{name}"]["losses"], ref["losses"], f"{name} rank {rank} losses")
    _same_state(got[world][0][f"loop-{name}"]["state"], ref["state"], f"{name} loop")


@pytest.mark.parametrize("world, name, key", [(w, n, f"sft-{n}") for w in PLANS for n in NAMES]
                         + [(2, "qwen3", "sft-by-name"), (2, "qwen3", "sft-by-name-planned"),
                            (2, MOE, f"sft-{MOE}"), (2, MOE, f"sft-{MOE}-by-name")])
def test_trl_sft_equals_stock_one_process(runs, world, name, key):
    """``key`` "sft-by-name": the model given by name (a sharded ``save_pretrained`` folder of
    the same Qwen3 model), loaded by the door on the meta device, each rank reading its shards
    ("-planned": with no plan, so profiled at start through a copy and planned);
    stock SFTTrainer trains the model object (TRL loads a name with ``from_pretrained``: the
    same weights). Qwen3-MoE: stock adds the router loss (TRL switches the config's
    output_router_logits on) and logs ``aux_loss``; by name, its experts are stored one tensor
    per expert and merged range by range."""
    got, refs = runs
    ref = refs[f"sft-{name}"]
    assert ref["logs"]["loss"][0] != ref["logs"]["loss"][-1]
    metrics = SFT_METRICS + (("aux_loss",) if name == MOE else ())
    if name == MOE:  # the router loss is in stock's run (a test that cannot fail is a defect)
        assert len(ref["logs"]["aux_loss"]) == STEPS and min(ref["logs"]["aux_loss"]) > 0
    for rank, result in enumerate(got[world]):
        for metric in metrics:
            assert len(result[key]["logs"][metric]) == STEPS, (key, metric)
            _close(result[key]["logs"][metric], ref["logs"][metric],
                   f"{key} rank {rank} {metric}")
        _same_state(result[key]["state"], ref["state"], f"{key} rank {rank}")


def test_user_loss_and_the_router_loss():
    """A user ``compute_loss`` cannot add the global router loss as stock would (once, over the
    whole batch, with its gradient): refused at construction with the fix; a door whose loss
    leaves the term to the engine (the SFT door, ``global_loss_apart``) is not refused."""
    from hf_cephalo.models import stage_model
    from hf_cephalo.runtime.user_loss import UserLossStagedModel

    staged = stage_model(_model(MOE))
    assert staged.global_loss_name() is not None and staged.global_loss_output() is None
    with pytest.raises(ValueError, match="output_router_logits = False"):
        UserLossStagedModel(staged, lambda *a, **k: None)
    UserLossStagedModel(staged, lambda *a, **k: None, global_loss_apart=True)
