"""A stock Accelerate custom loop on CephaloAccelerator equals single-device full-batch training.

One process group per world size (2 and 3 gloo ranks) runs every sub-case through
``CephaloAccelerator.prepare`` + ``model(**batch)`` + ``accelerator.backward`` (docs/accelerate.md
"Your own training loop"); the test process runs the same job as a plain PyTorch loop on ONE
process with the whole global batch (the same global batches: ``runtime.sampler.global_batches``
with the loader's seed). Compared per step (the global item-mean loss) and at the end (every
parameter), fp32 at rtol 1e-5 / atol 1e-6:

* plans with uneven b_i, m_i and r_i, an idle rank (b_i = 0) on 3 ranks, a zero-state rank;
* (a) the model's own loss; (b) a user loss from ``outputs.logits`` (label-smoothed cross entropy,
  a mean over this rank's scored tokens: ``loss_reduction="mean"``) and a class-weighted sum over
  ``outputs.num_items_in_batch`` (``"sum"``); (c) AdamW with a no-decay group and a per-group
  learning rate, built BEFORE prepare; (d) a LambdaLR scheduler (stepped as stock Accelerate
  steps it: world-size times per optimizer step, the world size the run started on, kept
  across a resume on another); clipping by the global norm;
* ``gradient_accumulation_steps=2`` (each prepared batch is one global batch of b x W x 2);
* a live b_i / m_i switch mid-run (``session.switch_plan``) changes nothing;
* ``save_state`` on 2 ranks, ``load_state`` on 3 (another plan and world, same B) continues the
  uninterrupted 2-rank trajectory, LR schedule included; ``skip_first_batches`` resumes
  mid-epoch;
* a streamed training set (a torch ``IterableDataset`` without a length): B consecutive rows per
  step, as one process reads them; saved mid-epoch on 2 ranks and resumed on 3 (the skipped
  global batches read again, as stock's ``skip_first_batches``);
* the same job through ``CephaloTrainer`` gives the loop's losses;
* bf16 autocast: the loop equals the Trainer door on the same plan (same engine), fp32 master
  weights within bf16 tolerance of the fp32 reference;
* evaluation: ``gather_for_metrics`` returns every eval row exactly once, in dataset order, and
  so do per-row ids the collator passes through as a list (each rank holds its rows' own);
  the loop pops those ids from every batch (an idle rank's too);
* after training, the prepared model's ``generate`` and ``CephaloTrainer.generate`` give each
  row (interleaved over the ranks, an idle rank included) what one process decodes with the
  final weights (keyed sampling, docs/generation.md);
* T5 (an encoder-decoder) with the model's own loss, both world sizes;
* refusals before any collective: a second model, ``no_sync``, backward twice, a loss that does
  not depend on the outputs (every rank raises, none hangs).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout
from tests.models_fixtures import build

RTOL, ATOL = 1e-5, 1e-6
SEED, N_TRAIN, N_EVAL, EPOCHS = 11, 12, 7, 1
LR, MAX_NORM = 0.01, 0.8
# adam eps 1e-4: an element whose true gradient is ~0 gets rounding noise that differs with the
# order of the fp32 sums (ranks, microbatches); with a tiny eps AdamW turns that noise into
# +-lr steps, so two exact runs would differ by ~lr, not by rounding (tests/test_checkpoint_trainer.py)
EPS = 1e-4
PLANS = {  # world -> (b_i, m_i, r_i) per plan; B = 6
    2: [([2, 4], [1, 2], [0.3, 0.7]), ([5, 1], [5, 1], [1.0, 0.0])],
    3: [([3, 0, 3], [1, 0, 3], [0.2, 0.5, 0.3]), ([1, 2, 3], [1, 1, 3], [0.4, 0.0, 0.6])],
}
B = 6
JOB2_S, JOB3_S = 60.0, 70.0  # quiet 2-core seconds of each group (measured)
pytestmark = test_timeout(JOB2_S, JOB3_S, margin_s=120)


def _samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (10,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 5, (), generator=g))] = -100  # uneven item counts
        rows.append({"input_ids": ids, "attention_mask": torch.ones(10, dtype=torch.long),
                     "labels": labels})
    return rows


class _Stream(torch.utils.data.IterableDataset):
    """The samples as a stream: no length, no indexing."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _with_idx(rows):
    return [dict(r, idx=i) for i, r in enumerate(rows)]


def _collate_idx(rows):
    """Per-row metadata as collators pass it through: a list of ints beside the tensors."""
    return {**_collate([{k: v for k, v in r.items() if k != "idx"} for r in rows]),
            "idx": [r["idx"] for r in rows]}


# the model's matrices (decayed); the norms are not. By NAME: the prepared model's parameters
# are 1-D shards (docs/accelerate.md), so a grouping by p.dim() must be made before prepare
DECAY = {n for n, p in build("llama").named_parameters() if p.dim() >= 2}


def _groups(named):
    """A no-decay group (norms) at half the learning rate, built by name."""
    decay = [p for n, p in named if n in DECAY]
    rest = [p for n, p in named if n not in DECAY]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                                                      "lr": LR / 2}]


def _lambda(step):
    return 1.0 / (1.0 + 0.1 * step)


def _smoothed(logits, labels):
    """A user loss: label-smoothed cross entropy over the scored tokens, mean over them."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), ignore_index=-100,
                                             label_smoothing=0.1)


def _weighted_sum(logits, labels, num_items):
    """A class-weighted cross entropy summed over the scored tokens, divided by the GLOBAL
    item count (the "sum" convention)."""
    weight = torch.linspace(0.5, 1.5, logits.shape[-1])
    per = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                            labels[:, 1:].reshape(-1), ignore_index=-100,
                                            weight=weight, reduction="sum")
    return per / num_items


CASES = {  # name -> (loss kind, scheduler, gradient accumulation steps, precision)
    "own": ("own", False, 1, "no"),
    "smoothed_sched": ("smoothed", True, 1, "no"),
    "weighted_sum": ("weighted", False, 1, "no"),
    "grad_accum": ("own", True, 2, "no"),
}


# ---- the distributed side -------------------------------------------------------------------
def _accelerator(plan_file, precision="no", ga=1, handlers=None, project=True, **plugin):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    from hf_cephalo.integrations.loop.accelerator import CephaloAccelerator, CephaloPlugin

    AcceleratorState._reset_state(reset_partial_state=False)  # another mixed precision per case
    GradientState._reset_state()
    project = os.path.dirname(plan_file)
    # data_seed seeds the training order, as stock's seedable sampler (the model's build
    # leaves torch's initial seed at 0)
    return CephaloAccelerator(
        cephalo_plugin=CephaloPlugin(plan_file=plan_file, adaptive="off", **plugin),
        mixed_precision=precision, gradient_accumulation_steps=ga, kwargs_handlers=handlers,
        project_config=ProjectConfiguration(project_dir=project) if project else None,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=SEED))


def _loop(rank, world, root, name, plan, *, kind="own", sched=False, ga=1, precision="no",
          switch=None, save_at=None, resume=None, steps=None, stream=False,
          checkpoint="loop-ckpt", project=True):
    """One run of the stock-shaped loop; returns per-step global losses and (rank 0) the final
    state dict."""
    from hf_cephalo.planner import Plan
    from torch.utils.data import DataLoader

    out = os.path.join(root, f"{world}-{name}")
    os.makedirs(out, exist_ok=True)
    plan_file = os.path.join(out, "plan.json")
    Plan.from_ratios(*plan).save(plan_file)
    accelerator = _accelerator(plan_file, precision, ga, project=project,
                               loss_reduction="sum" if kind == "weighted" else "mean")
    model = build("llama", seed=0).train()
    optimizer = torch.optim.AdamW(_groups(list(model.named_parameters())), lr=LR, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lambda) if sched else None
    # the permutation is data_seed + epoch's (the loader's generator draws workers' seeds)
    if stream:  # in order (a DataLoader over an IterableDataset takes no shuffle)
        loader = DataLoader(_Stream(_samples(N_TRAIN, 0)), batch_size=B // world,
                            collate_fn=_collate)
    else:
        loader = DataLoader(_with_idx(_samples(N_TRAIN, 0)),
                            batch_size=max(B // (world * ga), 1), shuffle=True,
                            collate_fn=_collate_idx, generator=torch.Generator().manual_seed(SEED))
    objects = [model, optimizer, loader] + ([scheduler] if sched else [])
    model, optimizer, loader, *rest = accelerator.prepare(*objects)
    scheduler = rest[0] if rest else None
    start_epoch, skip = 0, 0
    if resume is not None:
        accelerator.load_state(resume)
        start_epoch = loader.epoch
        done = 0 if stream else start_epoch * len(loader)  # a stream has no length: epoch 0
        skip = accelerator.cephalo_session.global_step - done
    losses, step = [], accelerator.cephalo_session.global_step
    for epoch in range(start_epoch, EPOCHS + 1):
        active = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in active:
            # the loop edits its batch (issue 37: an idle rank's batch was one cached object,
            # so the second pop raised KeyError); the ids are this rank's rows' own
            idx = batch.pop("idx", None)
            if not stream:
                assert len(idx) == batch["input_ids"].shape[0], idx
            with accelerator.accumulate(model):
                outputs = model(**batch)
                if kind == "own":
                    loss = outputs.loss
                elif kind == "smoothed":
                    loss = _smoothed(outputs.logits, batch["labels"])
                else:
                    loss = _weighted_sum(outputs.logits, batch["labels"],
                                         outputs.num_items_in_batch)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
            # a rank without items has a NaN mean loss (never backpropagated): it adds 0
            local = loss.detach() if kind == "weighted" else \
                loss.detach() * outputs.num_items if outputs.num_items else torch.zeros(())
            total = accelerator.reduce(local, "sum")
            losses.append(float(total) / (outputs.num_items_in_batch if kind != "weighted"
                                          else 1.0))
            step += 1
            if switch is not None and step == switch[0]:  # b_i / m_i only: the r_i stay
                session = accelerator.cephalo_session
                sizes, micro, _ = switch[1]
                session.switch_plan(Plan.from_ratios(sizes, micro, session.plan.state_ratios),
                                    step)
            if save_at is not None and step == save_at:
                accelerator.save_state(os.path.join(root, checkpoint))
            if steps is not None and step >= steps:
                break
        if steps is not None and step >= steps:
            break
    state = accelerator.get_state_dict(model)
    generated = _generate(rank, world, model.generate) if name == "own" else None
    # the rows decoded elsewhere than where they are held (the planner's g_i apart from b_i)
    split = _generate(rank, world, model.generate, GEN_SPLITS[world]) if name == "own" else None
    return dict(losses=losses, state=state if rank == 0 else None, generated=generated,
                generated_split=split)


GEN_PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14], [3, 3]]
COMPLETION_PROMPTS = ["abc", "hello"]
CALLBACK_KW = dict(max_new_tokens=5, do_sample=True, top_k=10, eos_token_id=1, seed=4)


def _char_tokenizer():
    """A character-level tokenizer of fewer ids than the test model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz "
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


GEN_SPLITS = {2: [5, 0], 3: [0, 2, 3]}  # g_i: rows each rank decodes
GEN_KW = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=20,
              eos_token_id=[4, 17], pad_token_id=0, seed=3, round_=2)


def _generate(rank, world, generate, split=None):
    """This rank's rows of GEN_PROMPTS (interleaved: rank r gets rows r, r + W, ...), left
    padded, through a door's ``generate`` with their global row indices."""
    rows = list(range(rank, len(GEN_PROMPTS), world))
    width = max(len(GEN_PROMPTS[r]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, r in enumerate(rows):
        ids[j, width - len(GEN_PROMPTS[r]):] = torch.tensor(GEN_PROMPTS[r])
        mask[j, width - len(GEN_PROMPTS[r]):] = 1
    out = generate(ids, mask, rows=rows, generation_split=split, **GEN_KW)
    return dict(rows=rows, width=width, out=out.tolist())


def _eval_case(rank, world, root, plan):
    """gather_for_metrics over an uneven split: every eval row once, in dataset order."""
    from hf_cephalo.planner import Plan
    from torch.utils.data import DataLoader

    out = os.path.join(root, f"{world}-eval")
    os.makedirs(out, exist_ok=True)
    plan_file = os.path.join(out, "plan.json")
    Plan.from_ratios(*plan).save(plan_file)
    accelerator = _accelerator(plan_file)
    model = build("llama", seed=0)
    train = DataLoader(_samples(N_TRAIN, 0), batch_size=B // world, collate_fn=_collate)
    evals = DataLoader(_with_idx(_samples(N_EVAL, 5)), batch_size=2, collate_fn=_collate_idx)
    model, train, evals = accelerator.prepare(model, train, evals)
    model.eval()
    ids, logits, idx = [], [], []
    for batch in evals:
        rows = batch.pop("idx")
        with torch.no_grad():
            outputs = model(**batch)
        got = accelerator.gather_for_metrics((batch["input_ids"], outputs.logits))
        ids.append(got[0])
        logits.append(got[1])
        idx.extend(accelerator.gather_for_metrics(rows))  # metadata: gather_object
    return dict(ids=torch.cat(ids), logits=torch.cat(logits), idx=idx)


def _refusals(rank, world, root, plan):
    """Errors a loop meets, raised on every rank (no hang)."""
    from hf_cephalo.planner import Plan
    from torch.utils.data import DataLoader

    out = os.path.join(root, f"{world}-refusals")
    os.makedirs(out, exist_ok=True)
    plan_file = os.path.join(out, "plan.json")
    Plan.from_ratios(*plan).save(plan_file)
    accelerator = _accelerator(plan_file)
    errors = {}
    model = build("llama", seed=0).train()
    loader = DataLoader(_samples(N_TRAIN, 0), batch_size=B // world, collate_fn=_collate)
    # a loader before the model is prepared as stock (nothing to split it by yet); the model
    # prepared after it is refused, naming it, instead of training on that loader unchecked
    early = _accelerator(plan_file)
    early.prepare(DataLoader(_samples(N_TRAIN, 0), batch_size=B // world, collate_fn=_collate))
    try:
        early.prepare(build("llama", seed=0).train())
    except ValueError as e:
        errors["loader_first"] = str(e)
    accelerator = _accelerator(plan_file)
    try:
        accelerator.prepare(model, build("llama", seed=1), loader)
    except ValueError as e:
        errors["second_model"] = str(e)
    data = _samples(N_TRAIN, 0)
    samplers = {  # issue 37: each was replaced by the engine's order without a word
        "reverse_sampler": DataLoader(data, batch_size=B // world, collate_fn=_collate,
                                      sampler=list(range(N_TRAIN))[::-1]),
        "weighted_sampler": DataLoader(data, batch_size=B // world, collate_fn=_collate,
                                       sampler=torch.utils.data.WeightedRandomSampler(
                                           [1.0] * N_TRAIN, N_TRAIN)),
        "replacement": DataLoader(data, batch_size=B // world, collate_fn=_collate,
                                  sampler=torch.utils.data.RandomSampler(data, True)),
        "batch_sampler": DataLoader(data, collate_fn=_collate, batch_sampler=[[0, 1], [2, 3]]),
    }
    for name, bad in samplers.items():
        try:
            accelerator.prepare(model, bad)
        except ValueError as e:
            errors[name] = str(e)
    model, loader = accelerator.prepare(model, loader)
    try:
        accelerator.prepare(DataLoader(_Stream(_samples(N_EVAL, 5)), batch_size=2,
                                       collate_fn=_collate))
    except ValueError as e:
        errors["stream_eval"] = str(e)
    try:
        accelerator.prepare(build("llama", seed=1))
    except ValueError as e:
        errors["second_model_later"] = str(e)
    try:
        with accelerator.no_sync(model):
            pass
    except RuntimeError as e:
        errors["no_sync"] = str(e)
    batch = next(iter(loader))
    outputs = model(**batch)
    try:
        accelerator.backward(torch.ones((), requires_grad=True) * 2)
    except RuntimeError as e:
        errors["not_from_outputs"] = str(e)
    outputs = model(**batch)
    accelerator.backward(outputs.loss)
    try:
        accelerator.backward(outputs.loss)
    except RuntimeError as e:
        errors["backward_twice"] = str(e)
    # generate: a keyword refused on rank 0 only, a token outside the vocabulary on the last
    # rank only, one row index with two prompts: every rank raises, none hangs, and the model
    # generates afterwards
    ids = torch.tensor([[5, 6, 7]])
    for name, kw in (("generate_beams", dict(num_beams=2) if rank == 0 else {}),
                     ("generate_vocab", {}),
                     ("generate_rows", dict(generation_split=[1] + [0] * (world - 1)))):
        bad = torch.tensor([[5, 6, 10_000]]) if name == "generate_vocab" and \
            rank == world - 1 else ids + rank if name == "generate_rows" else ids
        try:
            model.generate(bad, rows=[0], max_new_tokens=2, **kw)
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    errors["generate_after"] = model.generate(ids, rows=[rank], max_new_tokens=2).shape[1]
    # GradScalerKwargs reach the engine's sharded loss scaler (issue 37: they were dropped)
    from accelerate.utils import GradScalerKwargs

    fp16 = _accelerator(plan_file, "fp16", handlers=[GradScalerKwargs(init_scale=1024.0,
                                                                        growth_interval=7)])
    fp16.prepare(build("llama", seed=0).train(),
                 DataLoader(_samples(N_TRAIN, 0), batch_size=B // world, collate_fn=_collate))
    errors["scaler"] = (float(fp16.scaler.get_scale()), fp16.scaler.get_growth_interval())
    return errors


def _worker(rank, world, root):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    first, second = PLANS[world]
    results = {}
    for name, (kind, sched, ga, precision) in CASES.items():
        results[name] = _loop(rank, world, root, name, first, kind=kind, sched=sched, ga=ga,
                              precision=precision)
    results["switch"] = _loop(rank, world, root, "switch", first, switch=(3, second))
    # no project_dir: the loop writes nothing into the working directory (as stock)
    cwd, empty = os.getcwd(), os.path.join(root, f"cwd-{world}-{rank}")
    os.makedirs(empty)
    os.chdir(empty)
    try:
        results["no_project"] = _loop(rank, world, root, "no_project", first, project=False)
    finally:
        os.chdir(cwd)
    results["no_project"]["cwd_files"] = sorted(os.listdir(empty))
    results["stream"] = _loop(rank, world, root, "stream", second, stream=True, sched=True)
    if world == 2:
        results["saved"] = _loop(rank, world, root, "saved", first, sched=True, save_at=3,
                                 steps=3)
        results["stream_saved"] = _loop(rank, world, root, "stream_saved", first, stream=True,
                                        save_at=1, steps=1, checkpoint="stream-ckpt")
        for precision in ("bf16", "fp16"):
            results[precision] = _loop(rank, world, root, precision, first, precision=precision)
            results[f"trainer_{precision}"] = _trainer(rank, world, root, first, precision)
        results["trainer"] = _trainer(rank, world, root, first)
    else:
        results["resumed"] = _loop(rank, world, root, "resumed", second, sched=True,
                                   resume=os.path.join(root, "loop-ckpt"))
        results["stream_resumed"] = _loop(rank, world, root, "stream_resumed", second,
                                          stream=True, resume=os.path.join(root, "stream-ckpt"))
    results["eval"] = _eval_case(rank, world, root, first)
    results["t5"] = _seq2seq_loop(rank, world, root, first)
    results["refusals"] = _refusals(rank, world, root, first)
    return portable(results, to_numpy=True)


def _trainer(rank, world, root, plan, precision="no"):
    """The same job (model, data order, AdamW groups, clipping, constant LR) through
    CephaloTrainer."""
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    args = CephaloTrainingArguments(
        output_dir=os.path.join(root, f"{world}-trainer-{precision}"), report_to="none",
        learning_rate=LR, max_grad_norm=MAX_NORM, num_train_epochs=EPOCHS + 1,
        logging_steps=1, save_strategy="no", seed=SEED, disable_tqdm=True,
        lr_scheduler_type="constant", bf16=precision == "bf16", fp16=precision == "fp16",
        cephalo_adaptive="off", weight_decay=0.1)
    model = build("llama", seed=0).train()
    trainer = CephaloTrainer(model=model, args=args, plan=Plan.from_ratios(*plan),
                             train_dataset=_samples(N_TRAIN, 0), data_collator=_collate)
    trainer.optimizer = torch.optim.AdamW(
        _groups(list(trainer.engine.param_shards.named_parameters())), lr=LR, eps=EPS)
    if precision == "no":  # completions of fixed prompts every 2 steps and at the end
        from hf_cephalo import CompletionsCallback

        trainer.processing_class = _char_tokenizer()
        trainer.add_callback(CompletionsCallback(trainer, COMPLETION_PROMPTS, every_n_steps=2,
                                                 **CALLBACK_KW))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    generated = _generate(rank, world, trainer.generate) if precision == "no" else None
    return dict(losses=[h["loss"] for h in logs], state=trainer.engine.full_state_dict(),
                generated=generated)


# ---- the single-process reference ------------------------------------------------------------
def _seq2seq_samples() -> list[dict[str, torch.Tensor]]:
    """``DataCollatorForSeq2Seq``-style rows of one width: 9 input tokens right-padded with 0
    (3..9 kept), 6 labels padded with -100 (2..6 kept)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(N_TRAIN):
        ids, mask = torch.randint(3, 97, (9,), generator=g), torch.ones(9, dtype=torch.long)
        keep = int(torch.randint(3, 10, (), generator=g))
        ids[keep:], mask[keep:] = 0, 0
        labels = torch.randint(3, 97, (6,), generator=g)
        labels[int(torch.randint(2, 7, (), generator=g)):] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def _seq2seq_loop(rank, world, root, plan):
    """T5 (``T5ForConditionalGeneration``: an encoder-decoder, the decoder's input the model's
    own shift of the labels) through the loop with the model's own loss: per-step global
    losses and (rank 0) the final state dict."""
    from hf_cephalo.planner import Plan
    from torch.utils.data import DataLoader
    from tests.zoo_fixtures import build_zoo

    plan_file = os.path.join(root, f"{world}-t5", "plan.json")
    os.makedirs(os.path.dirname(plan_file), exist_ok=True)
    Plan.from_ratios(*plan).save(plan_file)
    accelerator = _accelerator(plan_file)
    model = build_zoo("t5", seed=3).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * 5)
    loader = DataLoader(_seq2seq_samples(), batch_size=B // world, shuffle=True,
                        collate_fn=_collate, generator=torch.Generator().manual_seed(SEED))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        local = outputs.loss.detach() * outputs.num_items if outputs.num_items else \
            torch.zeros(())
        losses.append(float(accelerator.reduce(local, "sum")) / outputs.num_items_in_batch)
    state = accelerator.get_state_dict(model)
    return dict(losses=losses, state=state if rank == 0 else None)


def _seq2seq_reference():
    """``_seq2seq_loop``'s job as a plain loop on one process with the whole global batch."""
    from hf_cephalo.runtime.sampler import global_batches
    from tests.zoo_fixtures import build_zoo

    model = build_zoo("t5", seed=3).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * 5)
    data, losses = _seq2seq_samples(), []
    for indices in global_batches(N_TRAIN, B, epoch=0, seed=SEED):
        loss = model(**_collate([data[i] for i in indices])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


def _reference(world, *, kind="own", sched=False, ga=1, precision="no", steps=None,
               stream=False):
    from hf_cephalo.runtime.sampler import global_batches

    model = build("llama", seed=0).train()
    optimizer = torch.optim.AdamW(_groups(list(model.named_parameters())), lr=LR, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lambda) if sched else None
    data = _samples(N_TRAIN, 0)
    losses = []
    for epoch in range(EPOCHS + 1):
        order = [range(i, min(i + B, N_TRAIN)) for i in range(0, N_TRAIN, B)] if stream else \
            global_batches(N_TRAIN, B, epoch=epoch, seed=SEED)
        for indices in order:
            batch = _collate([data[i] for i in indices])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                out = model(**batch)
                if kind == "own":
                    loss = out.loss
                elif kind == "smoothed":
                    loss = _smoothed(out.logits.float(), batch["labels"])
                else:
                    n = int((batch["labels"][:, 1:] != -100).sum())
                    loss = _weighted_sum(out.logits.float(), batch["labels"], n)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                # once per unprepared-loader batch the global batch replaces (stock's
                # num_processes at stock's B): B / (batch_size x ga), the loader of _loop
                for _ in range(B // (max(B // (world * ga), 1) * ga)):
                    scheduler.step()
            losses.append(float(loss.detach()))
            if steps is not None and len(losses) >= steps:
                return losses, model.state_dict()
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("loop"))
    out = {2: run_ranks(_worker, 2, root, timeout_s=budget_s(JOB2_S)),
           3: run_ranks(_worker, 3, root, timeout_s=budget_s(JOB3_S))}
    return {"root": root, **{w: [portable(r, to_numpy=False) for r in res]
                             for w, res in out.items()}}


def _close(got, want, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                               torch.as_tensor(want, dtype=torch.float64), rtol=rtol, atol=atol)


def _params_close(got, want, rtol=RTOL, atol=ATOL):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol, msg=key)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_loop_equals_full_batch_reference(runs, world, case):
    kind, sched, ga, precision = CASES[case]
    ref_losses, ref_state = _reference(world, kind=kind, sched=sched, ga=ga)
    for result in runs[world]:  # the global loss is the same on every rank
        _close(result[case]["losses"], ref_losses)
    _params_close(runs[world][0][case]["state"], ref_state)


@pytest.mark.parametrize("world", [2, 3])
def test_encoder_decoder_loop_equals_full_batch_reference(runs, world):
    """T5 through the loop door (the model's own loss; [Note: encoder-decoders at the doors])
    equals one process with the whole global batch, an idle rank included on 3 ranks."""
    ref_losses, ref_state = _seq2seq_reference()
    for result in runs[world]:
        _close(result["t5"]["losses"], ref_losses)
    _params_close(runs[world][0]["t5"]["state"], ref_state)


@pytest.mark.parametrize("world", [2, 3])
def test_without_project_dir_nothing_is_written(runs, world):
    """A loop without ``project_dir`` writes no progress, plan or report file into the working
    directory (a cephalo_progress.json once landed in the repository root that way), and
    trains the same run."""
    for rank in range(world):
        assert runs[world][rank]["no_project"]["cwd_files"] == []
        _close(runs[world][rank]["no_project"]["losses"], runs[world][rank]["own"]["losses"])


@pytest.mark.parametrize("world", [2, 3])
def test_live_switch_changes_nothing(runs, world):
    ref_losses, ref_state = _reference(world)
    _close(runs[world][0]["switch"]["losses"], ref_losses)
    _params_close(runs[world][0]["switch"]["state"], ref_state)


def test_save_on_two_ranks_resume_on_three(runs):
    """Saved at step 3 on 2 ranks, resumed on 3 (another plan): the uninterrupted 2-rank run,
    LR schedule included (issue 37: the scheduler stepped 3x per step after the resume, as
    stock steps it on 3 processes, so the schedule changed with the world size; the count
    the run started with is now kept: [Note: the LR schedule across world sizes])."""
    ref_losses, ref_state = _reference(2, sched=True)
    _close(runs[2][0]["saved"]["losses"], ref_losses[:3])
    resumed = runs[3][0]["resumed"]
    assert len(resumed["losses"]) == len(ref_losses) - 3
    _close(resumed["losses"], ref_losses[3:])
    _params_close(resumed["state"], ref_state)


def test_trainer_and_loop_give_the_same_losses(runs):
    """The same job through CephaloTrainer and through the loop: the same losses and weights,
    in fp32 and with bf16 / fp16 autocast (the same engine casts in both doors: the low
    precision gathered parameters, fp32 master weights; fp16 with the sharded loss scaler), and
    the bf16 loop's losses within bf16 resolution of the fp32-master full-batch reference
    under autocast (which keeps fp32 weights outside the matmuls, so only the losses are
    comparable at bf16 resolution)."""
    for rank in range(2):
        _close(runs[2][rank]["trainer"]["losses"], runs[2][rank]["own"]["losses"])
        for precision in ("bf16", "fp16"):
            _close(runs[2][rank][f"trainer_{precision}"]["losses"],
                   runs[2][rank][precision]["losses"])
    _params_close(runs[2][0]["trainer"]["state"], runs[2][0]["own"]["state"])
    for precision in ("bf16", "fp16"):
        _params_close(runs[2][0][f"trainer_{precision}"]["state"], runs[2][0][precision]["state"])
    ref_losses, _ = _reference(2, precision="bf16")
    _close(runs[2][0]["bf16"]["losses"], ref_losses, rtol=2 ** -7, atol=0)


def _completions(generated: list[dict], eos=(4, 17)) -> dict[int, list[int]]:
    """Row -> completion (up to its first EOS) from every rank's ``_generate`` result."""
    out = {}
    for g in generated:
        for row, tokens in zip(g["rows"], g["out"]):
            assert tokens[:g["width"]][-len(GEN_PROMPTS[row]):] == GEN_PROMPTS[row]
            tail = tokens[g["width"]:]
            end = next((k for k, t in enumerate(tail) if t in eos), None)
            out[row] = tail[:end + 1] if end is not None else tail
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_generate_after_training_in_both_doors(runs, world):
    """After training, the loop's prepared ``model.generate`` (2 and 3 ranks, an idle rank
    included: rows interleaved over the ranks) and ``CephaloTrainer.generate`` (2 ranks) give
    every row the completion one process decodes with the final weights (docs/generation.md):
    (B, P + T) as ``generate`` returns it, keyed sampling by the global row; also when the
    rows are decoded by other ranks than hold them (``generation_split`` g = [5, 0] on 2
    ranks, [0, 2, 3] on 3)."""
    from hf_cephalo.runtime.generation import SamplingParams, generate_rows

    model = build("llama", seed=0)
    model.load_state_dict(runs[world][0]["own"]["state"])
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=20, eos_token_ids=(4, 17),
                            pad_token_id=0, seed=3)
    want = generate_rows(model.eval(), GEN_PROMPTS, list(range(len(GEN_PROMPTS))), params,
                         2).completions
    doors = [[r["own"]["generated"] for r in runs[world]],
             [r["own"]["generated_split"] for r in runs[world]]]
    if world == 2:
        doors.append([r["trainer"]["generated"] for r in runs[world]])
    for generated in doors:
        got = _completions(generated)
        assert [got[row] for row in range(len(GEN_PROMPTS))] == want


def test_completions_callback_samples_the_final_weights(runs):
    """CompletionsCallback on the 2-rank Trainer run: rank 0 wrote each prompt at steps 2, 4,
    ... and at the end; the last step's completions are what one process decodes from the
    final weights with the same keys (prompt index, step)."""
    import json

    from hf_cephalo.runtime.generation import SamplingParams, generate_rows

    path = os.path.join(runs["root"], "2-trainer-no", "completions.jsonl")
    lines = [json.loads(line) for line in open(path)]
    steps = sorted({line["step"] for line in lines})
    assert steps[:2] == [2, 4] and all(s % 2 == 0 for s in steps[:-1])
    last = [line for line in lines if line["step"] == steps[-1]]
    assert [line["prompt"] for line in last] == COMPLETION_PROMPTS
    tok = _char_tokenizer()
    model = build("llama", seed=0)
    model.load_state_dict(runs[2][0]["trainer"]["state"])
    ids = [tok(p)["input_ids"] for p in COMPLETION_PROMPTS]
    params = SamplingParams(max_new_tokens=5, top_k=10, eos_token_ids=(1,), pad_token_id=0,
                            seed=4)
    want = generate_rows(model.eval(), ids, [0, 1], params, steps[-1]).completions
    assert [line["completion"] for line in last] == \
        [tok.decode(w, skip_special_tokens=True) for w in want]


@pytest.mark.parametrize("world", [2, 3])
def test_streamed_training_set(runs, world):
    """B consecutive rows of the stream per step (both epochs read the stream from its start),
    the scheduler stepped world-size times per step, as one process reading the stream."""
    ref_losses, ref_state = _reference(world, sched=True, stream=True)
    assert len(ref_losses) == 2 * (EPOCHS + 1)
    for result in runs[world]:
        _close(result["stream"]["losses"], ref_losses)
    _params_close(runs[world][0]["stream"]["state"], ref_state)


def test_stream_saved_on_two_ranks_resumed_on_three(runs):
    """save_state after step 1 of a stream's epoch on 2 ranks; load_state on 3 ranks reads the
    stream again from its start, skips the step done and continues the uninterrupted run."""
    ref_losses, ref_state = _reference(2, stream=True)
    _close(runs[2][0]["stream_saved"]["losses"], ref_losses[:1])
    for result in runs[3]:
        _close(result["stream_resumed"]["losses"], ref_losses[1:])
    _params_close(runs[3][0]["stream_resumed"]["state"], ref_state)


@pytest.mark.parametrize("world", [2, 3])
def test_gather_for_metrics_every_row_once_in_order(runs, world):
    data = _samples(N_EVAL, 5)
    model = build("llama", seed=0)
    with torch.no_grad():
        want = model(**_collate(data)).logits
    for result in runs[world]:
        got = result["eval"]
        assert torch.equal(got["ids"], torch.stack([r["input_ids"] for r in data]))
        assert got["idx"] == list(range(N_EVAL))  # each row's metadata once, in order
        torch.testing.assert_close(got["logits"], want, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_refusals_on_every_rank(runs, world):
    for result in runs[world]:
        errors = result["refusals"]
        assert "got the model after DataLoaderShard" in errors["loader_first"], errors
        assert "prepare the model first" in errors["loader_first"]
        assert "trains ONE model" in errors["second_model"]
        assert "trains ONE model" in errors["second_model_later"]
        assert "no_sync" in errors["no_sync"]
        assert "evaluation DataLoader over a stream" in errors["stream_eval"]
        assert "sampler=list(...)" in errors["reverse_sampler"], errors
        assert "WeightedRandomSampler" in errors["weighted_sampler"]
        for name in ("reverse_sampler", "weighted_sampler", "replacement"):
            assert "reorder or repeat the dataset" in errors[name], errors[name]
        assert "replacement=True" in errors["replacement"]
        assert "batch_sampler=list" in errors["batch_sampler"]
        assert "Pass batch_size= and shuffle=" in errors["batch_sampler"]
        assert "does not depend on this step's model outputs" in errors["not_from_outputs"]
        assert "called twice" in errors["backward_twice"]
        assert "num_beams" in errors["generate_beams"] or \
            "another rank's call was refused" in errors["generate_beams"], errors
        assert "outside the model's vocabulary" in errors["generate_vocab"] or \
            "were refused" in errors["generate_vocab"], errors
        assert "given with different prompts" in errors["generate_rows"], errors
        assert errors["generate_after"] == 5
        assert list(errors["scaler"]) == [1024.0, 7]  # tuples come back as lists
