"""MoE checkpoints both ways, class by class: the sharded reader and the streamed writer against
transformers' own ``from_pretrained`` / ``save_pretrained`` (issue 49).

For every causal LM that docs/supported_models.md (the coverage sweep, benchmarks/model_coverage.py)
lists as exact and whose transformers conversion mapping has a ``WeightConverter`` (MoE experts
stored one tensor per expert, fused qkv, ...), on the sweep's tiny random model:

1. ``save_pretrained(max_shard_size=...)`` writes the stock folder (several files);
2. ``from_pretrained_sharded`` resolves it (keys, merged experts, shapes: the checks that refuse
   run here, before any trainer profiles), and the engine's checkpoint reader
   (``loading.CheckpointSource``) reads every parameter whole and in random sub-ranges: each
   equals ``from_pretrained``'s parameter bit for bit;
3. the streamed writer (``export.plan_hf_files`` + ``write_hf_files``, what ``save_model`` and
   ``hf-cephalo export`` run, here from one in-memory unit) writes the same files as
   ``save_pretrained`` of the loaded model: same file names and split, same index, the same keys
   per file, every tensor bit for bit.

Status per class: ``exact`` (all equal), ``refused`` (a conversion other than stacked experts:
NotImplementedError from ``from_pretrained_sharded`` with the conversion named), ``not saved``
(transformers' own ``save_pretrained`` fails on the tiny config), ``WRONG`` (anything else:
exit status 1).

    python benchmarks/moe_checkpoints.py [--only Qwen3MoeForCausalLM ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.model_coverage import DOCS, _config  # noqa: E402
from hf_cephalo.models.shrink import tiny_config  # noqa: E402

MAX_SHARD = "200KB"


def converted_classes() -> list[tuple[str, str]]:
    """(model type, class name) of the exact causal LMs whose checkpoints transformers converts
    (a ``WeightConverter`` in its conversion mapping for the class)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    with open(DOCS) as f:
        rows = re.findall(r"\| (\S+) \| `(\w+ForCausalLM)` \| exact \|", f.read())
    out = []
    for model_type, name in rows:
        model = _meta_model(model_type, name)
        if any(isinstance(c, WeightConverter) for c in get_model_conversion_mapping(model)):
            out.append((model_type, name))
    return out


def _tiny(model_type: str):
    config = tiny_config(_config(model_type))
    config._attn_implementation = "eager"
    return config


def _meta_model(model_type: str, name: str):
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return getattr(transformers, name)(_tiny(model_type))


def _check_reads(folder: str, cls, state: dict[str, torch.Tensor]) -> None:
    """The engine's checkpoint reader gives every parameter, whole and in sub-ranges."""
    from safetensors import safe_open

    from hf_cephalo.engine.checkpoint_files import read_range
    from hf_cephalo.engine.checkpoint_keys import checkpoint_key_map
    from hf_cephalo.engine.loading import CheckpointSource
    from hf_cephalo.runtime.pretrained import from_pretrained_sharded

    meta = from_pretrained_sharded(folder, model_class=cls)
    files = meta.cephalo_checkpoint
    source = CheckpointSource(files, checkpoint_key_map(meta, files.weight_map), 0)
    names: dict[int, list[str]] = {}
    for name, p in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    infos = [SimpleNamespace(fqn=n[0], aliases=tuple(n), shape=tuple(state[n[0]].shape))
             for n in names.values()]
    source.check(infos)
    rng = random.Random(0)
    for info in infos:
        want = state[info.fqn].reshape(-1)
        n = want.numel()
        ranges = [(0, n)] + [sorted((rng.randrange(n + 1), rng.randrange(n + 1)))
                             for _ in range(3)]
        for lo, hi in ranges:
            got = torch.empty(hi - lo, dtype=want.dtype)
            for path, key, shape, s, t, dest in source._reads(info, lo, hi, got):
                with safe_open(path, framework="pt") as f:
                    dest.copy_(read_range(f, key, tuple(shape), s, t, dest.dtype))
            assert torch.equal(got, want[lo:hi]), f"read {info.fqn}[{lo}:{hi}] differs"


def _check_writes(model, root: str) -> None:
    """The streamed writer writes what ``save_pretrained`` writes."""
    from safetensors.torch import load_file

    from hf_cephalo.engine import export

    state = model.state_dict()
    first: dict[int, str] = {}  # tied aliases name one tensor, as in the engine's units
    sources = {k: export.SavedTensor(0, first.setdefault(v.data_ptr(), k), tuple(v.shape),
                                     v.dtype) for k, v in state.items()}
    plan = export.plan_hf_files(model, sources, max_shard_size=MAX_SHARD,
                                total_parameters=model.num_parameters())
    stock, ours = os.path.join(root, "stock"), os.path.join(root, "ours")
    model.save_pretrained(stock, max_shard_size=MAX_SHARD)
    os.makedirs(ours)
    unit = SimpleNamespace(index=0, tensors=state)
    export.write_hf_files(ours, plan, iter([unit] * len(plan.unit_order)), buffers={})
    names = sorted(n for n in os.listdir(stock) if n.startswith("model"))
    assert names == sorted(os.listdir(ours)), (names, sorted(os.listdir(ours)))
    for name in names:
        if name.endswith(".json"):
            with open(os.path.join(stock, name)) as a, open(os.path.join(ours, name)) as b:
                assert json.load(a) == json.load(b), f"{name} differs"
            continue
        want, got = load_file(os.path.join(stock, name)), load_file(os.path.join(ours, name))
        assert list(want) == list(got), f"{name}: keys {sorted(set(want) ^ set(got))[:4]}"
        bad = [k for k in want if not torch.equal(want[k], got[k])]
        assert not bad, f"{name}: tensors {bad[:4]} differ"


def check(model_type: str, name: str) -> tuple[str, str]:
    """(status, detail) of one class (see the module docstring)."""
    cls = getattr(transformers, name)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = cls(_tiny(model_type)).float()
        with torch.no_grad():  # norms off 1, biases off 0: a misplaced tensor shows
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn(p.shape))
        folder = os.path.join(root, "saved")
        try:
            model.save_pretrained(folder, max_shard_size=MAX_SHARD)
        except Exception as exc:  # noqa: BLE001 - transformers' own save fails (config checks)
            return "not saved", f"save_pretrained: {type(exc).__name__}: {str(exc)[-100:]}"
        loaded = cls.from_pretrained(folder, dtype=torch.float32)
        try:
            _check_reads(folder, cls, loaded.state_dict())
        except NotImplementedError as exc:
            return "refused", str(exc).split(";")[0]
        except (AssertionError, ValueError) as exc:
            return "WRONG", f"load: {exc}"
        try:
            _check_writes(loaded, os.path.join(root, "write"))
        except (AssertionError, NotImplementedError, ValueError) as exc:
            return "WRONG", f"save: {type(exc).__name__}: {exc}"
    return "exact", ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="class names (default: all)")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    rows = [(t, n, *check(t, n)) for t, n in converted_classes()
            if not args.only or n in args.only]
    for model_type, name, status, detail in rows:
        print(f"{status:8s} {model_type:18s} {name:34s} {detail[:120]}")
    counts = {s: sum(r[2] == s for r in rows) for s in ("exact", "refused", "not saved", "WRONG")}
    print(f"\n{len(rows)} classes with converted checkpoints: {counts}; "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if counts["WRONG"] else 0


if __name__ == "__main__":
    sys.exit(main())
