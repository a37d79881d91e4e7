"""The pieces of [Note: collectives inside the engine's head] (hf_cephalo/runtime/head_calls.py) in one
process, no process group: how the replay combines the microbatches' gathers, what the step's
snapshot restores, and the torch.distributed guard. The multi-rank behaviour (different l_i,
an idle rank, stock-equal metrics, a refused all_reduce) is tests/test_trl_sft.py's.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

from hf_cephalo.runtime import head_calls as H


def test_combine_sums_counts_and_concatenates_rows():
    """0-dim gathers add up (a sum over the batch's items), rows concatenate in order, reduce
    sums elementwise; rows of different widths cannot be combined."""
    counts = [("gather", torch.tensor(3)), ("gather", torch.tensor(5))]
    assert H._combine(counts).item() == 8 and H._combine(counts).dim() == 0
    rows = [("gather", torch.tensor([1.0, 2.0])), ("gather", torch.tensor([3.0]))]
    assert H._combine(rows).tolist() == [1.0, 2.0, 3.0]
    sums = [("reduce", torch.tensor([1.0, 2.0])), ("reduce", torch.tensor([3.0, 4.0]))]
    assert H._combine(sums).tolist() == [4.0, 6.0]
    with pytest.raises(H.HeadCallError, match="cannot be concatenated"):
        H._combine([("gather", torch.zeros(1, 2)), ("gather", torch.zeros(1, 3))])
    with pytest.raises(H.HeadCallError, match="must not depend on the data"):
        H._answers([H._MicrobatchRecord(counts[:1]), H._MicrobatchRecord(counts)])


class _Trainer:
    pass


def test_snapshot_restores_plain_state_only():
    """Metric lists and counters come back as they were; plain attributes created since are
    removed; objects (a model, a tensor too large to copy) are left alone."""
    t = _Trainer()
    t._metrics = {"train": collections.defaultdict(list)}
    t._metrics["train"]["entropy"].append(1.0)
    t._total = 10
    t.model = torch.nn.Linear(2, 2)
    snap = H.snapshot_plain_state(t)
    t._metrics["train"]["entropy"].append(2.0)
    t._metrics["train"]["accuracy"].append(0.5)
    t._total += 7
    t._new = [1]
    t.model = torch.nn.Linear(3, 3)
    H.restore_plain_state(t, snap)
    assert dict(t._metrics["train"]) == {"entropy": [1.0]}
    assert isinstance(t._metrics["train"], collections.defaultdict) and t._total == 10
    assert not hasattr(t, "_new") and t.model.in_features == 3


def test_guard_refuses_raw_collectives_and_restores_them():
    """Inside a user call torch.distributed's collectives raise (recorded as the call's
    refusal); after it they are torch's again. A call outside a step runs as is."""
    original = dist.all_reduce
    calls = H.HeadCalls(_Trainer(), replay=lambda inputs, n: None, group=None,
                        device=torch.device("cpu"))
    assert calls.call(lambda: torch.tensor(1.0), fallback=lambda: torch.tensor(0.0)) == 1.0
    with calls.step([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}]):
        def loss():
            dist.all_reduce(torch.zeros(1))
            return torch.tensor(1.0)
        assert calls.call(loss, fallback=lambda: torch.tensor(-1.0)).item() == -1.0
    assert dist.all_reduce is original
    (record,) = calls._step.records
    assert "torch.distributed.all_reduce" in record.failure


def test_zero_row_inputs_keep_trailing_shapes_and_values():
    schema = H._schema({"input_ids": torch.zeros(3, 7, dtype=torch.long),
                        "cu_seq_lens_q": torch.zeros(4, dtype=torch.int32), "max_length_q": 5})
    inputs = H.zero_row_inputs(schema, torch.device("cpu"))
    assert inputs["input_ids"].shape == (0, 7) and inputs["input_ids"].dtype == torch.long
    assert inputs["cu_seq_lens_q"].shape == (0,) and inputs["max_length_q"] == 5
