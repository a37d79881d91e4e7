"""The generic path (models/generic.py) in the engine equals one process with the whole batch
(issue 36): the 2026 model zoo of ``tests/zoo_fixtures.py`` on 2 and 3 gloo ranks with uneven
plans (uneven b_i including a rank with no samples, uneven m_i, uneven state ratios r_i
including a zero share).

Per variant, every rank runs 3 SGD steps (fp32; the parameter difference is lr x the gradient
difference, so the gradients themselves are checked) of ``CephaloEngine`` on its own slice of
each global batch; the reference is ``model(**batch).loss.backward()`` on the whole batch in one
process, with the same optimizer. Compared: each step's global loss (the MoE models' include
the router load-balancing loss of the WHOLE global batch, as the model's own loss over that
batch does), every parameter after the last step, and an evaluation's loss. The same process
groups also run the models with side inputs (``SIDE_INPUTS``: Gemma 3n text and Gemma 4 E with
per-layer inputs, each layer reading its own; MPNet's position bias, which every layer reads;
their gradient reaches the embedding side's weights: docs/engine.md, "Side inputs"; Gemma 3n
and Gemma 4 E with KV sharing, whose store layers make the keys / values the later layers
reuse, their gradient carried back through the store units: models/kv_sharing.py) and the
hierarchical image backbones (``IMAGES``: a ConvNeXt classifier on random images, each of its 4
stages one unit, the hidden state's shape changing at every unit boundary; a Swin V2
classifier, whose stages return the output dimensions its encoder reads, from a fake-tensor run
on the stages' whole shapes while the engine holds them sharded; a SigLIP 2 classifier on
patch sequences of different grids, its position embeddings resized per image from a parameter
of the embedding unit) and the
encoder-decoders (``SEQ2SEQ``: T5 and BART ``...ForConditionalGeneration`` on
``DataCollatorForSeq2Seq``-style batches; the encoder's output is a side input the first decoder
unit makes and every decoder layer reads, T5's position biases side inputs each stack's layer 0
makes: engine/schedule.py [Note: side inputs], models/seq2seq.py; Whisper on random log-mel
features, models/whisper.py; LED and PEGASUS-X, whose encoder boundary is padded to a window or
block and joined with global tokens, models/seq2seq_kin.py; T5Gemma's Gemma stacks, their masks
by layer type (sliding windows) and rotary positions made before the layers,
models/seq2seq_gemma.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_cephalo.engine import CephaloEngine
from hf_cephalo.models import stage_model
from tests.dist_utils import budget_s, run_ranks, test_timeout
from tests.models_fixtures import make_batch
from tests.zoo_fixtures import (IMAGES, SEQ2SEQ, SIDE_INPUTS, ZOO, build_zoo, image_zoo_batch,
                                seq2seq_batch, zoo_batch_arch)

RTOL, ATOL = 1e-5, 1e-6
LR = {"gemma4_e": 0.01, "gemma4_e_kv": 0.01}
"""SGD learning rates other than 0.1. Gemma 4 E's tiny copy is ill-conditioned at 0.1: stock
itself, the same batches accumulated over this file's microbatches instead of one full batch,
ends 3 steps 1.6e-6 (2 ranks' split) / 9.6e-7 (3 ranks') apart at embed_tokens (the engine:
1.4e-6); at 0.01 stock's own drift is 1.2e-7, and the engine's first-step gradient equals
stock's to 6e-8 at lr 1. Gemma 4 E with KV sharing is the same model with its last 2 layers
reusing keys / values, at the same rate."""
PLANS = {2: ([4, 1], [3, 1], [0.7, 0.3]),
         3: ([2, 0, 3], [1, 1, 2], [0.0, 0.6, 0.4])}


def _slice(batch, sizes_b, sizes_m, rank):
    start = sum(sizes_b[:rank])
    mine = {k: v[start:start + sizes_b[rank]] for k, v in batch.items()}
    m = sizes_m[rank]
    return [{k: v[j:j + m] for k, v in mine.items()} for j in range(0, sizes_b[rank], m)]


def _batch(name: str, size: int, seed: int):
    if name in IMAGES:
        return image_zoo_batch(size, seed, name)
    if name in SEQ2SEQ:
        return seq2seq_batch(size, seed, name)
    padding = "left" if name.endswith("_cls") else True
    batch = make_batch(zoo_batch_arch(name), size, seed=seed, padding=padding)
    if name.endswith("_tokens"):  # one of 3 classes per token, none on the padding
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, 3, batch["input_ids"].shape, generator=g)
        batch["labels"] = labels.masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _run(rank: int, world: int, name: str) -> float:
    """Trains and compares ``name``; the largest difference of a loss or weight from stock's
    (rank 0's, which compares the weights)."""
    sizes_b, sizes_m, ratios = PLANS[world]
    model = build_zoo(name, seed=11)
    staged = stage_model(model)
    staged.prepare_for_training()
    ref = copy.deepcopy(model)
    engine = CephaloEngine(staged, ratios)
    opt = torch.optim.SGD(engine.parameters(), lr=LR.get(name, 0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR.get(name, 0.1))
    worst = 0.0
    for step in range(3):
        batch = _batch(name, sum(sizes_b), seed=100 + step)
        out = engine.train_step(_slice(batch, sizes_b, sizes_m, rank))
        opt.step()
        engine.zero_grad()
        ref_opt.zero_grad(set_to_none=False)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out.loss, float(ref_loss.detach()), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} world {world} step {step} loss: {m}")
        worst = max(worst, abs(float(out.loss) - float(ref_loss.detach())))
    batch = _batch(name, sum(sizes_b), seed=7)
    with torch.no_grad():
        ev = engine.evaluate(_slice(batch, sizes_b, sizes_m, rank), return_logits=False)
        torch.testing.assert_close(ev.loss, float(ref(**batch).loss), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} world {world} evaluation loss: {m}")
    if staged.global_loss_name() is not None:  # refused on every rank before any collective
        with pytest.raises(ValueError, match="router load-balancing loss.*output_router_logits"):
            engine.forward_step(_slice(batch, sizes_b, sizes_m, rank))
    full = engine.full_state_dict()
    if rank == 0:
        expected = ref.state_dict()
        assert list(full) == list(expected), name
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name} world {world} {key}: {m}")
            worst = max(worst, float((full[key].double() - value.double()).abs().max()))
    return worst


NAMES = [*ZOO, *SIDE_INPUTS, *IMAGES, *SEQ2SEQ]


def zoo_worker(rank: int, world: int) -> dict[str, float]:
    torch.use_deterministic_algorithms(True)
    return {name: _run(rank, world, name) for name in NAMES}


def _check_world(world: int, quiet_s: float) -> None:
    runs = run_ranks(zoo_worker, world, timeout_s=budget_s(quiet_s))
    assert [list(r) for r in runs] == [NAMES] * world
    print(f"world {world} max |diff| " + " ".join(f"{n} {d:.1e}" for n, d in runs[0].items()))


@test_timeout(65)
def test_zoo_engine_parity_two_ranks():
    _check_world(2, 65)


@test_timeout(75)
def test_zoo_engine_parity_three_ranks():
    _check_world(3, 75)
