"""CephaloTrainer checkpoints through the stock Trainer flow (save_steps, resume_from_checkpoint).

Four process groups:
1. (2 gloo ranks) the uninterrupted run (AdamW, linear warmup/decay, 2 epochs, a checkpoint
   every 2 steps);
2. the same run SIGKILLed on rank 0 in the middle of saving checkpoint-4 (its shards are written,
   the marker is not) — a real kill, the surviving rank is killed by the test;
3. ``train(resume_from_checkpoint=True)`` on the killed run's directory (picks checkpoint-2,
   resumes mid-epoch): identical losses, learning rates and final parameters;
4. (3 gloo ranks) a resume from the uninterrupted run's checkpoint-4 onto another world size
   and plan (other batch split, a rank without state): same losses and parameters up to
   rounding. (3 ranks -> 2 with exact optimizer state is in test_checkpoint.py.)
"""

from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest
import torch

from hf_cephalo.engine import checkpoint as ckpt
from tests.dist_utils import budget_s, run_ranks, start_ranks, test_timeout
from tests.models_fixtures import build

RTOL, ATOL = 1e-5, 1e-6
# Seconds per process group, measured (4 jobs in 100 s on 2 cores under load 7); each job gets
# budget_s(JOB_S) and the module fixture (run by the first test) the sum: [Note: test time budgets].
JOB_S = 35.0
pytestmark = test_timeout(JOB_S, JOB_S, JOB_S, JOB_S)
NUM_SAMPLES, MAX_STEPS, SAVE_STEPS, KILL_AT = 12, 6, 2, 4  # B = 4: 3 steps per epoch, 2 epochs
PLANS = {"first": ([3, 1], [2, 1], [0.7, 0.3]),
         "other": ([1, 2, 1], [1, 1, 1], [0.25, 0.0, 0.75]),  # 3 ranks, rank 1 holds no state
         "one": ([4], [2], [1.0])}


def _dataset():
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(NUM_SAMPLES):
        ids = torch.randint(1, 97, (12,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 6, (), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _kill_mid_save_class():
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer

    class KilledMidSave(CephaloTrainer):
        """Rank 0 dies by SIGKILL after writing its shards of checkpoint-KILL_AT, before the
        completeness marker and the rename."""

        def _save_optimizer_and_scheduler(self, output_dir):
            super()._save_optimizer_and_scheduler(output_dir)
            if self.state.global_step == KILL_AT and self.args.process_index == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    return KilledMidSave


def _trainer(rank, world_size, out_dir, plan_name, cls=None, save_full_model=False):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    # adam_epsilon 1e-4: attention's key bias has a zero true gradient; with a tiny eps Adam turns
    # its rounding noise into full-lr steps, so runs that reduce in another order (other plan)
    # would differ by ~lr instead of by rounding. Bitwise comparisons do not depend on it.
    args = CephaloTrainingArguments(
        output_dir=out_dir, report_to="none", learning_rate=3e-3, adam_epsilon=1e-4,
        weight_decay=0.01, warmup_steps=2, max_steps=MAX_STEPS, logging_steps=1,
        save_strategy="steps", save_steps=SAVE_STEPS, seed=5, max_grad_norm=1.0,
        disable_tqdm=True, cephalo_save_full_model=save_full_model, cephalo_max_shard_size="100KB")
    cls = cls or CephaloTrainer
    return cls(model=build("llama").train(), args=args, plan=Plan.from_ratios(*PLANS[plan_name]),
               train_dataset=_dataset(), data_collator=_collate)


def _summary(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    params = trainer.engine.full_state_dict()
    return dict(steps=[h["step"] for h in logs], losses=[h["loss"] for h in logs],
                lrs=[h["learning_rate"] for h in logs],
                params=None if params is None else {k: v.numpy() for k, v in params.items()})


def _uninterrupted(rank, world_size, out_dir):
    trainer = _trainer(rank, world_size, out_dir, "first", save_full_model=True)
    trainer.train()
    return _summary(trainer)


def _killed(rank, world_size, out_dir):
    trainer = _trainer(rank, world_size, out_dir, "first", cls=_kill_mid_save_class())
    trainer.train()
    return "finished"  # never reached on rank 0


def _resumed(rank, world_size, killed_dir):
    trainer = _trainer(rank, world_size, killed_dir, "first")
    trainer.train(resume_from_checkpoint=True)
    return _summary(trainer)


def _resumed_other_plan(rank, world_size, full_dir, other_dir):
    trainer = _trainer(rank, world_size, other_dir, "other")
    trainer.train(resume_from_checkpoint=os.path.join(full_dir, f"checkpoint-{KILL_AT}"))
    return _summary(trainer)


def _resume_true_error(rank, world_size, run_dir):
    """``train(resume_from_checkpoint=True)`` in ``run_dir``: the error it raises, as text."""
    trainer = _trainer(rank, world_size, run_dir, "one")
    try:
        trainer.train(resume_from_checkpoint=True)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _run_until_killed(fn, world_size, *args, timeout_s=budget_s(JOB_S)):
    """Start ``fn`` on gloo ranks like ``run_ranks``; wait for rank 0 to die by SIGKILL, then
    kill the other ranks (blocked in a collective with the dead rank). Hard timeout."""
    procs, _ = start_ranks(fn, world_size, *args)
    try:
        procs[0].join(timeout_s)
        exitcode = procs[0].exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    if exitcode is None:
        raise TimeoutError(f"rank 0 was not killed within {timeout_s} s")
    return exitcode


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_ckpt")
    full_dir, killed_dir, other_dir = (str(root / n) for n in ("full", "killed", "other"))
    full = run_ranks(_uninterrupted, 2, full_dir, timeout_s=budget_s(JOB_S))[0]
    exitcode = _run_until_killed(_killed, 2, killed_dir)
    after_kill = dict(exitcode=exitcode, listing=sorted(os.listdir(killed_dir)))
    from transformers.trainer_utils import get_last_checkpoint

    after_kill["last"] = get_last_checkpoint(killed_dir)
    staging = os.path.join(killed_dir, ".tmp-checkpoint-4")  # the resume below replaces it
    after_kill["staging_files"] = sorted(os.listdir(staging)) if os.path.isdir(staging) else None
    after_kill["staging_complete"] = ckpt.is_complete(staging)
    try:
        ckpt.read_full_state_dict(staging)
        after_kill["staging_error"] = None
    except ckpt.CheckpointError as e:
        after_kill["staging_error"] = str(e)
    resumed = dict(same=run_ranks(_resumed, 2, killed_dir, timeout_s=budget_s(JOB_S))[0],
                   other=run_ranks(_resumed_other_plan, 3, full_dir, other_dir,
                                   timeout_s=budget_s(JOB_S))[0])
    return dict(full=full, after_kill=after_kill, resumed=resumed, killed_dir=killed_dir,
                full_dir=full_dir)


def test_kill_mid_save_leaves_no_complete_checkpoint(runs):
    info = runs["after_kill"]
    assert info["exitcode"] == -signal.SIGKILL
    # checkpoint-2 is published; checkpoint-4 only exists as the staging directory
    assert "checkpoint-2" in info["listing"] and "checkpoint-4" not in info["listing"]
    assert ".tmp-checkpoint-4" in info["listing"]
    assert info["last"] == os.path.join(runs["killed_dir"], "checkpoint-2")
    assert ckpt.FILES.shard(0) in info["staging_files"]  # the kill really was mid-save
    assert ckpt.FILES.COMPLETE not in info["staging_files"] and not info["staging_complete"]
    assert "incomplete checkpoint" in info["staging_error"]
    # the resumed run saved checkpoint-4 again over the stale staging directory
    assert ckpt.is_complete(os.path.join(runs["killed_dir"], "checkpoint-4"))
    assert not os.path.exists(os.path.join(runs["killed_dir"], ".tmp-checkpoint-4"))


def test_checkpoint_contents(runs):
    files = set(os.listdir(os.path.join(runs["full_dir"], "checkpoint-4")))
    sharded = {"scheduler.pt", "trainer_state.json", "training_args.bin", "rng_state_0.pth",
               "rng_state_1.pth", ckpt.FILES.LAYOUT, ckpt.FILES.BUFFERS, ckpt.FILES.shard(0),
               ckpt.FILES.shard(1), ckpt.FILES.COMPLETE}
    # cephalo_save_full_model: the full model as save_model writes it (sharded: 100KB files)
    assert sharded | {"model.safetensors.index.json", "config.json"} <= files
    assert sum(n.startswith("model-") for n in files) > 2
    assert not any(name.startswith(".tmp-") for name in os.listdir(runs["full_dir"]))
    # default: no full model in the checkpoint (the killed run's, resumed)
    files = set(os.listdir(os.path.join(runs["killed_dir"], "checkpoint-2")))
    assert sharded <= files and not any(n.startswith(("model", "config")) for n in files)


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(runs):
    full, same = runs["full"], runs["resumed"]["same"]
    assert full["steps"] == list(range(1, MAX_STEPS + 1))
    # log_history = checkpoint-2's (the kill destroyed checkpoint-4's save) + the resumed steps
    assert same["steps"] == full["steps"]
    assert same["losses"] == full["losses"]  # bitwise, steps 3..6 computed after the resume
    assert same["lrs"] == full["lrs"]        # scheduler position restored
    for key, value in full["params"].items():
        assert np.array_equal(same["params"][key], value), key


def test_resume_onto_another_plan(runs):
    full, other = runs["full"], runs["resumed"]["other"]
    assert other["steps"] == full["steps"]  # steps 1..4 from checkpoint-4's log history
    assert other["lrs"] == full["lrs"]
    assert other["losses"][:KILL_AT] == full["losses"][:KILL_AT]
    torch.testing.assert_close(torch.tensor(other["losses"][KILL_AT:], dtype=torch.float64),
                               torch.tensor(full["losses"][KILL_AT:], dtype=torch.float64),
                               rtol=RTOL, atol=ATOL)
    for key, value in full["params"].items():
        torch.testing.assert_close(torch.from_numpy(other["params"][key]),
                                   torch.from_numpy(value), rtol=RTOL, atol=ATOL, msg=key)


def test_export_of_a_trainer_checkpoint_equals_its_model_file(runs, tmp_path):
    from safetensors.torch import load_file

    directory = os.path.join(runs["full_dir"], "checkpoint-4")
    merged = ckpt.read_full_state_dict(directory)
    saved = {k: v for n in os.listdir(directory) if n.startswith("model-")
             for k, v in load_file(os.path.join(directory, n)).items()}
    assert set(saved) == set(merged)  # untied Llama: every key
    for key, value in saved.items():
        assert torch.equal(merged[key], value), key
    out = ckpt.export_hf(directory, str(tmp_path / "hf"), max_shard_size="100KB")
    exported = {n: load_file(os.path.join(out, n)) for n in os.listdir(out)
                if n.endswith(".safetensors")}
    assert exported.keys() == {n for n in os.listdir(directory) if n.startswith("model-")}
    for name, tensors in exported.items():
        want = load_file(os.path.join(directory, name))
        assert list(tensors) == list(want) and all(torch.equal(tensors[k], want[k]) for k in want)


@test_timeout(JOB_S, JOB_S, JOB_S, JOB_S, JOB_S)  # the module fixture's 4 jobs, then 1 rank
def test_resume_true_over_a_corrupt_newest_checkpoint_names_the_complete_one_before_it(
        runs, tmp_path):
    """The newest checkpoint carries its marker but a shard was corrupted after the save:
    ``resume_from_checkpoint=True`` picks it and refuses it (its CRC-32), and the refusal names
    checkpoint-2, the complete one before it, with the flag to pass (issue 33)."""
    run_dir = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(os.path.join(runs["full_dir"], f"checkpoint-{step}"),
                        run_dir / f"checkpoint-{step}")
    shard = run_dir / "checkpoint-4" / ckpt.FILES.shard(0)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    [error] = run_ranks(_resume_true_error, 1, str(run_dir), timeout_s=budget_s(JOB_S))
    earlier = str(run_dir / "checkpoint-2")
    assert error is not None and error.startswith(
        f"CheckpointError: {shard}: corrupt — CRC-32 does not match the one recorded at save; "
        "the checkpoint is damaged: copy the directory again, or resume from the newest complete "
        f"checkpoint before it, {earlier}: --resume_from_checkpoint {earlier} "), error


def test_trainer_refuses_a_custom_loop_checkpoint(tmp_path):
    """A checkpoint written by a custom loop's save_state holds no trainer_state.json:
    CephaloTrainer names that and what to do, before reading any state (issue 37: a raw
    FileNotFoundError), on every rank alike (the contents file is what every rank reads)."""
    from types import SimpleNamespace

    from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
    from hf_cephalo.runtime.checkpoint_contents import CheckpointContents

    loop_ckpt = tmp_path / "loop-ckpt"
    loop_ckpt.mkdir()
    CheckpointContents(save_only_model=False, save_full_model=False, peft=False, scaler=False,
                       scheduler=True, world_size=2, front_end="accelerate").write(str(loop_ckpt))
    stub = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), session=None)
    with pytest.raises(ValueError, match=r"custom Accelerate loop.*accelerator\.load_state.*"
                                         r"hf-cephalo export"):
        CephaloTrainerMixin._prepare_resume(stub, str(loop_ckpt))
