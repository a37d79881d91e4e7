"""Which transformers classes train on hf_cephalo, checked one by one (issue 36).

For every causal LM in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and with
``--seq-cls`` every ``...ForSequenceClassification`` of a decoder in
``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES``), from the class's default config:

1. a tiny random model (sizes shrunk by ``models/shrink.tiny_config``; a field the default
   config leaves unset although the forward needs it set as a checkpoint or the user would,
   ``UNSET_DEFAULTS``; the transforms that
   change the math around the layers -- embedding / residual / attention multipliers, logit
   scaling and softcapping, the MoE router loss -- set to NON-default values where the config
   has them, so a skipped transform shows; norm weights moved off 1);
2. ``stage_model`` on it: staged, or refused with a reason;
3. for a staged model, an INDEPENDENT comparison (not the self-check's): a right-padded batch of
   5 rows (left-padded for classifiers) run as microbatches of 2 and 3 rows through ``embed`` /
   ``run_unit`` / ``head_loss`` (plus the global router loss), loss and every parameter gradient
   against the model's own ``model(**batch).loss.backward()`` (fp32, rtol 1e-5, atol 1e-6).

Status per class: ``exact`` (staged and equal), ``refused`` (with the reason; nothing would
run; this includes a tiny copy that does not build or run although transformers builds the
default config: the self-check refuses such a model the same way, and where the copy builds
but its forward fails on the batch, the reason is hf_cephalo's own refusal of it, which says
what inputs besides text the forward takes), ``not built`` (transformers
itself cannot build the class from its default config, on the meta device, e.g. it needs a
checkpoint-specific config), or ``WRONG`` (staged but not equal: a bug; the exit status is
then 1). ``--write-docs`` writes the table to docs/supported_models.md.

Run: ``python benchmarks/model_coverage.py [--seq-cls] [--write-docs] [--only NAME ...]``
(about 2 minutes for the causal LMs on 2 CPU cores; no downloads).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_cephalo.models import stage_model  # noqa: E402
from hf_cephalo.models.registry import UnsupportedModelError  # noqa: E402
from hf_cephalo.models.self_check import float64_copy  # noqa: E402
from hf_cephalo.models.shrink import TINY_MAX_NUMEL, tiny_config, tiny_numel  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                    "supported_models.md")

NON_DEFAULT = {  # config field -> value where the field exists (the transforms a path may skip)
    "embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5,
    "attention_multiplier": 0.3, "logit_scale": 0.7, "final_logit_softcapping": 3.0,
    "attn_logit_softcapping": 4.0, "scale_emb": 2.5, "dim_model_base": 48,
    "output_router_logits": True, "router_aux_loss_coef": 0.3, "aux_loss_coef": 0.3,
}

UNSET_DEFAULTS = {  # config field -> value (from the config) where the default config leaves it
    # None although the forward needs it: every checkpoint sets it (DeepSeek-V2's default has no
    # experts per token), or the user must (X-MOD: model.set_default_language(...))
    "num_experts_per_tok": lambda cfg: 2,
    "default_language": lambda cfg: (getattr(cfg, "languages", None) or [None])[0],
}


@dataclass
class Row:
    model_type: str
    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


def _config(model_type: str):
    config = configuration_auto.CONFIG_MAPPING[model_type]()
    text = config.get_text_config()
    for cfg in {id(config): config, id(text): text}.values():
        fields = cfg.to_dict()
        for key, value in NON_DEFAULT.items():
            if key in fields:
                setattr(cfg, key, value)
        for key, value in UNSET_DEFAULTS.items():
            if key in fields and fields[key] is None:
                setattr(cfg, key, value(cfg))
    return config


def _batch(config, classifier: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = config.get_text_config()
    vocab = text.vocab_size
    rows, seq = 5, 11
    ids = torch.randint(4, vocab - 8, (rows, seq), generator=g)
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else 0
    mask = torch.ones_like(ids)
    lengths = torch.tensor([11, 6, 9, 4, 11])
    pos = torch.arange(seq)[None, :]
    mask = (pos >= seq - lengths[:, None]).long() if classifier else \
        (pos < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad)
    batch = {"input_ids": ids, "attention_mask": mask}
    if classifier:
        batch["labels"] = torch.tensor([0, 1, 1, 0, 1]) % max(int(config.num_labels), 1)
    else:
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, 2] = -100
        batch["labels"] = labels
    return batch


def _staged_loss_and_grads(model, staged, batch, sizes=(2, 3)):
    start, mbs = 0, []
    for m in sizes:
        mbs.append({k: v[start:start + m] for k, v in batch.items()})
        start += m
    n = sum(staged.count_items(mb) for mb in mbs)
    model.zero_grad(set_to_none=True)
    staged.begin_step()
    try:
        total = 0.0
        for mb in mbs:
            hidden, ctx = staged.embed(mb)
            for i in range(staged.num_units):
                hidden = staged.run_unit(i, hidden, ctx)
            total = total + staged.head_loss(hidden, mb, ctx).loss_sum / n
        sums = staged.global_loss_sums()
        extra = 0.0 if sums is None else staged.finish_global_loss(sums)
        loss = total + extra
        loss.backward()
    finally:
        staged.end_step()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def compare(model, batch) -> str | None:
    """None when the staged loss and gradients equal the model's own, else what differs; on a
    difference in fp32, compared again in float64 (the self-check's rule: [Note: fp32 rounding
    or another computation] in models/self_check.py), and "rounding: ..." when equal there."""
    pristine = copy.deepcopy(model)
    problem = _compare_once(model, batch)
    if problem is None:
        return None
    try:
        again = _compare_once(float64_copy(pristine), batch)
    except Exception as exc:  # noqa: BLE001 - no float64 run: the fp32 verdict stands
        return f"{problem} (float64 did not run: {_short(exc)})"
    return problem if again is not None else f"rounding: {problem} in fp32, equal in float64"


def _compare_once(model, batch) -> str | None:
    staged = stage_model(model)
    staged.prepare_for_training()
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    out = ref(**batch)
    out.loss.backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    loss, grads = _staged_loss_and_grads(model, staged, batch)
    if not torch.allclose(loss.double(), out.loss.detach().double(), rtol=RTOL, atol=ATOL):
        return f"loss {float(loss):.7g} vs the model's {float(out.loss):.7g}"
    for key, g in grads.items():
        r = ref_grads[key]
        g = torch.zeros_like(r) if g is None and r is not None else g
        r = torch.zeros_like(g) if r is None and g is not None else r
        if g is not None and not torch.allclose(g, r, rtol=RTOL, atol=ATOL):
            return f"gradient of {key} off by {float((g - r).abs().max()):.3g}"
    return None


def check(model_type: str, class_name: str) -> Row:
    """Build, stage and compare one class (see the module docstring)."""
    t0 = time.perf_counter()
    cls = getattr(transformers, class_name, None)
    if cls is None:
        return Row(model_type, class_name, "not built", "not importable from transformers")
    classifier = class_name.endswith("ForSequenceClassification")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(_config(model_type))
            text = config.get_text_config()
            if classifier and getattr(text, "pad_token_id", None) is None:
                text.pad_token_id = 0
            config._attn_implementation = "eager"
            numel = tiny_numel(cls, config)
    except Exception as exc:  # noqa: BLE001 - the class does not build in transformers
        return Row(model_type, class_name, "not built", _short(exc), time.perf_counter() - t0)
    if numel > TINY_MAX_NUMEL:  # the self-check refuses it the same way (never allocated)
        return Row(model_type, class_name, "refused",
                   f"the tiny copy would hold {numel / 1e6:.0f}M parameters: its config has "
                   "sizes the self-check does not shrink", time.perf_counter() - t0)
    model = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = cls(config).float().eval()
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 1:
                        p.add_(0.1 * torch.randn(p.shape))
            batch = _batch(config, classifier)
            with torch.no_grad():  # (no graph left in a module that keeps its last state)
                model(**batch)  # transformers' own forward must run for a comparison to mean much
    except Exception as exc:  # noqa: BLE001 - the tiny copy does not build / run
        if not _default_builds(cls, model_type):
            return Row(model_type, class_name, "not built", _short(exc),
                       time.perf_counter() - t0)
        reason = _refusal(model)  # built, its forward failed: hf_cephalo's words
        return Row(model_type, class_name, "refused",
                   reason or f"the self-check's tiny copy does not build or run ({_short(exc)})",
                   time.perf_counter() - t0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = compare(model, batch)
    except UnsupportedModelError as exc:
        reason = str(exc).split(": ", 1)[-1].split(". Nothing was run")[0]
        return Row(model_type, class_name, "refused", reason, time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - staged, then failed: a bug of ours
        return Row(model_type, class_name, "WRONG", f"staged, then raised {_short(exc)}",
                   time.perf_counter() - t0)
    status = "exact" if problem is None or problem.startswith("rounding: ") else "WRONG"
    return Row(model_type, class_name, status, problem or "", time.perf_counter() - t0)


def _refusal(model) -> str | None:
    """hf_cephalo's reason for refusing ``model`` (a tiny copy whose own forward failed on the
    batch: the self-check runs the same forward and says what the model needs), or None where
    there is no model or stage_model gives no UnsupportedModelError."""
    if model is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stage_model(model)
    except UnsupportedModelError as exc:
        return str(exc).split(": ", 1)[-1].split(". Nothing was run")[0]
    except Exception:  # noqa: BLE001 - no reason in hf_cephalo's words
        return None
    return None


def _default_builds(cls: type, model_type: str) -> bool:
    """Whether transformers builds ``cls`` from its default config (on the meta device: no
    memory, no forward), i.e. whether a tiny copy that fails is the shrink's failure."""
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            cls(configuration_auto.CONFIG_MAPPING[model_type]())
        return True
    except Exception:  # noqa: BLE001
        return False


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) < 160 else text[:157] + "..."


def classes(seq_cls: bool) -> list[tuple[str, str]]:
    pairs = sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
    if seq_cls:
        decoders = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        pairs += sorted((t, n) for t, n in
                        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.items()
                        if t in decoders)
    out = []
    for model_type, names in pairs:
        for name in (names if isinstance(names, (tuple, list)) else (names,)):
            out.append((model_type, name))
    return out


def render(rows: list[Row]) -> str:
    built = [r for r in rows if r.status != "not built"]
    exact = [r for r in rows if r.status == "exact"]
    wrong = [r for r in rows if r.status == "WRONG"]
    lines = [
        "# Supported models",
        "",
        "Generated by `python benchmarks/model_coverage.py --seq-cls --write-docs` with "
        f"transformers {transformers.__version__} and torch {torch.__version__.split('+')[0]}; "
        "do not edit by hand.",
        "",
        "Each class of transformers' causal-LM mapping (and each decoder's sequence "
        "classifier) as a tiny random model from its default config (where it leaves a "
        "field the forward needs unset, the value a checkpoint or the user sets: the experts "
        "per token, X-MOD's default language), with embedding / "
        "residual / attention multipliers, logit scaling and softcapping and the MoE router "
        "loss set to non-default values where the config has them: `exact` means "
        "hf_cephalo stages it and its staged loss and every gradient over two microbatches "
        "equal the model's own (fp32, rtol 1e-5 / atol 1e-6; where fp32 rounding of the "
        "reordered sums exceeds that, as for Gemma 4's scaled embeddings, equal in float64 "
        "at the same tolerances, and the fp32 difference is shown); `refused` means hf_cephalo refuses it before "
        "anything runs, with the reason shown (including a tiny copy for the self-check that "
        "does not build or run: such a model is refused the same way); `not built` means "
        "transformers itself cannot build the class from its default config (a real "
        "checkpoint's config may build, and then the self-check decides).",
        "",
        f"Of {len(rows)} classes, {len(built)} build; of those {len(exact)} are exact "
        f"({100.0 * len(exact) / max(len(built), 1):.0f}%), "
        f"{len([r for r in rows if r.status == 'refused'])} refused, {len(wrong)} wrong.",
        "",
        "| model type | class | status | reason |",
        "|---|---|---|---|",
    ]
    for r in rows:
        detail = r.detail.replace("|", "\\|") if r.status != "exact" or r.detail else ""
        lines.append(f"| {r.model_type} | `{r.name}` | {r.status} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-cls", action="store_true",
                        help="also every decoder's ...ForSequenceClassification")
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOCS}")
    parser.add_argument("--only", nargs="*", help="class names to check (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help="Qwen3ForCausalLM only, no docs written (the suite's check that "
                             "the sweep runs)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.only, args.write_docs = ["Qwen3ForCausalLM"], False
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rows = []
    t0 = time.perf_counter()
    for model_type, name in classes(args.seq_cls):
        if args.only and name not in args.only:
            continue
        row = check(model_type, name)
        rows.append(row)
        print(f"{row.status:9s} {name:48s} {row.seconds:6.2f}s  {row.detail[:110]}", flush=True)
    built = [r for r in rows if r.status != "not built"]
    exact = [r for r in rows if r.status == "exact"]
    wrong = [r for r in rows if r.status == "WRONG"]
    print(f"\n{len(rows)} classes, {len(built)} build, {len(exact)} exact "
          f"({100.0 * len(exact) / max(len(built), 1):.1f}% of those that build), "
          f"{len(built) - len(exact) - len(wrong)} refused, {len(wrong)} WRONG; "
          f"{time.perf_counter() - t0:.0f} s")
    if args.write_docs:
        with open(DOCS + ".tmp", "w") as f:
            f.write(render(rows))
        os.replace(DOCS + ".tmp", DOCS)
        print(f"wrote {os.path.normpath(DOCS)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
