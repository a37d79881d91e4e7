"""Generation on the sharded engine (issue 46 items 1-2; docs/generation.md).

Keyed sampling ([Note: keyed sampling] in engine/sampling.py): a sampled token is a function of
the logits and (seed, round, global row, position) only. The sharded decode modes ([Note: two
decode modes] in engine/generation.py): ``gather_once`` and ``sharded`` (lock-step, one
all-gather per layer per decode step) give token-identical completions to ONE process
decoding the whole batch, for every split of the rows over 2 ranks (b = [1, 3], [3, 1],
[0, 4]), with and without tied embeddings, sampled and greedy. Stock ``GRPOTrainer`` on one
process with ``hf_cephalo.reproducible_rollout`` trains on exactly the completions the engine
generates for the same rows and round. Encoder-decoders ([Note: encoder-decoder generation]):
T5 and BART over three splits (one where a rank's rows end first), LED, PEGASUS-X and T5Gemma
over one, both modes, equal one process (and greedy equals the model's own ``generate``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_ranks, test_timeout

VOCAB = 97
PROMPTS = [[1, 2, 3], [4, 7], [9, 9, 9, 9, 9], [11], [3, 4, 5, 6], [7, 8], [2], [6, 6, 1]]
SPLITS = ([1, 3], [3, 1], [0, 4])  # the first 4 prompts over 2 ranks
MODES = ("gather_once", "sharded")
ROUND = 7


def _params(do_sample: bool = True, **kw):
    from hf_cephalo import SamplingParams

    base = dict(max_new_tokens=10, do_sample=do_sample, temperature=0.9, top_k=40, top_p=0.95,
                eos_token_ids=(5, 17, 23, 42), pad_token_id=0, seed=3)
    return SamplingParams(**{**base, **kw})


def _qwen3(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=128, pad_token_id=0, eos_token_id=5,
                      tie_word_embeddings=tied)
    return Qwen3ForCausalLM(cfg).eval()


CASES = {  # name: (tied embeddings, SamplingParams overrides)
    "sampled": (False, dict()),
    "sampled_tied_min_p": (True, dict(top_k=None, top_p=1.0, min_p=0.05, temperature=1.3)),
    "greedy": (False, dict(do_sample=False)),
}


def _reference(case: str, prompts=PROMPTS[:4]):
    from hf_cephalo.runtime.generation import generate_rows

    tied, kw = CASES[case]
    return generate_rows(_qwen3(tied), prompts, list(range(len(prompts))), _params(**kw), ROUND)


# ---- keyed sampling, one process ----------------------------------------------------------
def test_sampling_params_refuse_bad_values():
    from hf_cephalo import SamplingParams

    for field, value in [("max_new_tokens", 0), ("temperature", 0.0), ("top_p", 1.5),
                         ("top_k", -1), ("min_p", 2.0)]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**{"max_new_tokens": 4, field: value})


def test_keyed_gumbel_max_samples_the_softmax():
    """argmax(l + Gumbel noise) over 20,000 keys: each token's frequency is its softmax
    probability within 4 standard errors; a key gives the same draw every time."""
    from hf_cephalo.engine.sampling import gumbel_noise, sample_key

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    keys = [sample_key(11, 2, row, 0) for row in range(20000)]
    picks = (logits + gumbel_noise(keys, 5)).argmax(-1)
    freq = torch.bincount(picks, minlength=5).double() / len(keys)
    p = logits.softmax(-1)
    se = (p * (1 - p) / len(keys)).sqrt()
    assert ((freq - p).abs() < 4 * se).all(), (freq, p)
    assert torch.equal(gumbel_noise(keys[:3], 5), gumbel_noise(keys[:3], 5))
    assert len({sample_key(0, 0, r, t) for r in range(50) for t in range(50)}) == 2500


def test_warpers_filter_as_transformers_does():
    """Top-k 2 then top-p: only the kept tokens are ever sampled."""
    from hf_cephalo.engine.sampling import KeyedSampler

    params = _params(top_k=2, top_p=1.0, max_new_tokens=1)
    scores = torch.tensor([[0.1, 3.0, 2.9, 0.0, -1.0]]).repeat(64, 1)
    sampler = KeyedSampler(params, list(range(64)), 0, 1, torch.device("cpu"))
    picks = sampler(torch.zeros(64, 1, dtype=torch.long), scores).argmax(-1)
    assert set(picks.tolist()) == {1, 2}


def test_kv_cache_bytes_count_the_decoder_layers_of_an_encoder_decoder():
    """The decode's memory price per cached token (``choose_mode`` picks the decode mode by
    it): 2 (K and V) x layers x KV heads x head dim x bytes; an encoder-decoder caches in its
    decoder layers only (self- and cross-attention), at T5's d_kv or BART's decoder heads."""
    import transformers

    from hf_cephalo.engine.generation import kv_cache_bytes_per_token as per_token

    llama = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2)
    t5 = transformers.T5Config(d_model=32, d_kv=4, num_heads=2, num_layers=3,
                               num_decoder_layers=1)
    bart = transformers.BartConfig(d_model=32, encoder_layers=3, decoder_layers=2,
                                   encoder_attention_heads=4, decoder_attention_heads=2)
    assert per_token(llama, 4) == 2 * 2 * 2 * 8 * 4
    assert per_token(t5, 4) == 2 * 1 * 2 * 4 * 4  # 1 decoder layer, 2 heads of d_kv 4
    assert per_token(bart, 2) == 2 * 2 * 2 * 16 * 2  # 2 decoder layers, 2 heads of 32 / 2


def test_keyed_decode_gives_its_length_without_transformers_warning():
    """The keyed decode states its length as max_length (prompt + new tokens): as
    max_new_tokens, generate warned "Both max_new_tokens and max_length" on every call once
    the model's generation_config had a max_length (Seq2SeqTrainer's evaluation sets it)."""
    import transformers
    from transformers.testing_utils import CaptureLogger

    from hf_cephalo.runtime import SamplingParams, generate_rows

    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                   num_heads=2, decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.generation_config.max_length = 20
    params = SamplingParams(max_new_tokens=5, do_sample=False, eos_token_ids=(63,),
                            pad_token_id=0)
    logger = transformers.utils.logging.get_logger("transformers.generation.utils")
    with CaptureLogger(logger) as captured:
        out = generate_rows(model, [[5, 6, 7], [8, 9]], [0, 1], params, 0)
    assert "max_new_tokens" not in captured.out, captured.out
    assert [len(c) for c in out.completions] == [5, 5]  # the length still holds


def test_rows_keep_their_completions_in_any_batch():
    """The same row index gives the same completion decoded alone, in another batch order or
    beside other rows: the batch composition does not enter the key."""
    from hf_cephalo.runtime.generation import generate_rows

    model, params = _qwen3(False), _params()
    whole = generate_rows(model, PROMPTS, list(range(8)), params, ROUND).completions
    order = [5, 0, 7, 2]
    part = generate_rows(model, [PROMPTS[i] for i in order], order, params, ROUND).completions
    assert part == [whole[i] for i in order]
    other_round = generate_rows(model, PROMPTS, list(range(8)), params, ROUND + 1).completions
    assert other_round != whole  # the round is part of the key
    assert any(len(c) < params.max_new_tokens for c in whole)  # some rows end at an EOS
    assert any(c and c[-1] in (5, 17, 23, 42) for c in whole)


# ---- the sharded engine, 2 ranks ------------------------------------------------------------
def _engine_cases(rank: int, world_size: int) -> dict:
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models.registry import stage_model

    out = {}
    for case, (tied, kw) in CASES.items():
        engine = CephaloEngine(stage_model(_qwen3(tied)), state_ratios=[0.7, 0.3])
        layers = engine.num_units
        for split in SPLITS:
            off, n = sum(split[:rank]), split[rank]
            for mode in MODES:
                engine.stats.reset()
                got = engine.generate(PROMPTS[off:off + n], list(range(off, off + n)),
                                      _params(**kw), ROUND, mode=mode)
                st = engine.stats
                out[(case, tuple(split), mode)] = dict(
                    completions=got.completions, mode=got.mode, steps=got.steps,
                    all_gathers=st.all_gather_count, all_reduces=st.all_reduce_count,
                    peak=st.peak_unsharded_numel, layers=layers,
                    root=engine.root.embed.numel + engine.root.head.numel,
                    unit=max(u.numel for u in engine.units),
                    full=sum(u.numel for u in engine.all_units()))
    out["refusals"] = _refusals(rank)
    out.update(_encoder_decoder_cases(rank))
    return out


ENC_DEC = ("t5", "bart")  # tests/zoo_fixtures.py SEQ2SEQ
ENC_DEC_KIN = ("led", "pegasus_x", "t5gemma")  # tests/zoo_fixtures.py SEQ2SEQ
ENC_DEC_SPLITS = ([1, 3], [0, 4], [3, 1])  # [3, 1]: row 3 ends (EOS) 4 steps before rows 0-1


def _enc_dec_params(name: str, do_sample: bool):
    """Keyed sampling over the model's own EOS and pad; greedy decoding under a generation
    config whose processors (no repeated token, at least 3 tokens) run before the sampler,
    so that the tiny random models' greedy completions are not one token repeated or an
    immediate EOS."""
    from transformers import GenerationConfig

    from tests.zoo_fixtures import build_zoo

    config = build_zoo(name, seed=3).generation_config
    eos = config.eos_token_id
    params = _params(do_sample, eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos),
                     pad_token_id=config.pad_token_id, max_new_tokens=6)
    return params, None if do_sample else GenerationConfig(no_repeat_ngram_size=1,
                                                           min_new_tokens=3)


def _encoder_decoder_cases(rank: int) -> dict:
    """T5 and BART ([Note: encoder-decoder generation]): the first 4 prompts as encoder
    inputs, both splits, both modes, sampled and greedy."""
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models.registry import stage_model
    from tests.zoo_fixtures import build_zoo

    out = {}
    for name in ENC_DEC:
        engine = CephaloEngine(stage_model(build_zoo(name, seed=3)), state_ratios=[0.7, 0.3])
        for split in ENC_DEC_SPLITS:
            off, n = sum(split[:rank]), split[rank]
            for mode in MODES:
                for do_sample in (True, False):
                    params, config = _enc_dec_params(name, do_sample)
                    engine.stats.reset()
                    got = engine.generate(PROMPTS[off:off + n], list(range(off, off + n)),
                                          params, ROUND, mode=mode, generation_config=config)
                    out[(name, tuple(split), mode, do_sample)] = dict(
                        completions=got.completions, start=got.decoder_start, mode=got.mode,
                        steps=got.steps, peak=engine.stats.peak_unsharded_numel,
                        full=sum(u.numel for u in engine.all_units()))
    for name in ENC_DEC_KIN:  # one split, sampled: their encoders' own boundaries and junctions
        engine = CephaloEngine(stage_model(build_zoo(name, seed=3)), state_ratios=[0.7, 0.3])
        rows = [0, 1, 2] if rank == 0 else [3]
        for mode in MODES:
            got = engine.generate([PROMPTS[r] for r in rows], rows,
                                  _enc_dec_params(name, True)[0], ROUND, mode=mode)
            out[(name, mode)] = got.completions
    return out


def _refusals(rank: int) -> dict:
    """Bad input on ONE rank: every rank raises before any gather (no hang), and the engine
    still generates afterwards; budgets pick or refuse a mode on every rank alike."""
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models.registry import stage_model

    engine = CephaloEngine(stage_model(_qwen3(False)), state_ratios=[0.5, 0.5])
    seen = {}
    bad = [[]] if rank == 1 else [[1, 2]]  # an empty prompt on rank 1 only
    try:
        engine.generate(bad, [rank], _params(), 0)
    except ValueError as exc:
        seen["empty"] = str(exc)
    from hf_cephalo.engine.generation import decode_memory_bytes

    between = (decode_memory_bytes(engine, 1, 12, "sharded") +
               decode_memory_bytes(engine, 1, 12, "gather_once")) // 2
    for name, budget in (("tiny", 10 if rank == 0 else None), ("between", between)):
        try:
            got = engine.generate([[1, 2]], [rank], _params(), 0, memory_budget_bytes=budget)
            seen[name] = got.mode
        except ValueError as exc:
            seen[name] = str(exc)
    seen["after"] = engine.generate([[1, 2]], [rank], _params(), 0).completions
    return seen


@pytest.fixture(scope="module")
def engine_results():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return run_ranks(_engine_cases, 2, timeout_s=240)


@test_timeout(40)
@pytest.mark.parametrize("case", list(CASES))
def test_completions_do_not_depend_on_the_plan(engine_results, case):
    """Every split of the 4 rows over 2 ranks, both modes: the concatenated completions are
    token-identical to one process decoding the whole batch."""
    ref = _reference(case).completions
    for split in SPLITS:
        for mode in MODES:
            got = [c for r in engine_results for c in r[(case, tuple(split), mode)]["completions"]]
            assert got == ref, (case, split, mode)


@test_timeout(40)
def test_decode_modes_gather_and_step_as_documented(engine_results):
    """gather_once: each unit all-gathered once, one all-reduce (the mode choice); sharded:
    the root once plus one all-gather per layer per decode step, and one lock-step all-reduce
    per step, every rank the same number of steps (the idle rank too), the peak gathered
    parameters at most the root and two layer units."""
    for key, r0 in engine_results[0].items():
        if key == "refusals" or key[0] in ENC_DEC + ENC_DEC_KIN:
            continue
        r1 = engine_results[1][key]
        _, _, mode = key
        assert r0["mode"] == r1["mode"] == mode
        if mode == "gather_once":
            assert r0["all_gathers"] == r0["layers"] + 2 and r0["all_reduces"] == 1
            assert r0["peak"] == r0["full"]
        else:
            assert r0["steps"] == r1["steps"] >= 1
            assert r0["all_gathers"] == 2 + r0["layers"] * r0["steps"], key
            assert r0["all_reduces"] == 1 + r0["steps"]
            assert r0["peak"] <= r0["root"] + 2 * r0["unit"] < r0["full"]


@test_timeout(40)
@pytest.mark.parametrize("name", ENC_DEC)
def test_encoder_decoder_completions_do_not_depend_on_the_plan(engine_results, name):
    """T5 and BART on 2 ranks (state 0.7 / 0.3; the rows split 1 + 3, 0 + 4, 3 + 1), both decode
    modes, sampled and greedy: the completions are token-identical to one process decoding the
    4 rows (``generate_rows``), which for greedy decoding is the model's own ``generate``
    (decoder start token, then the completion up to the EOS), and every decoding rank reports
    the decoder start token. The sharded mode holds less than the full weights."""
    from hf_cephalo.runtime.generation import generate_rows
    from tests.zoo_fixtures import build_zoo

    model = build_zoo(name, seed=3)
    prompts = PROMPTS[:4]
    for do_sample in (True, False):
        params, config = _enc_dec_params(name, do_sample)
        ref = generate_rows(model, prompts, list(range(4)), params, ROUND,
                            generation_config=config)
        start = (model.generation_config.decoder_start_token_id,)
        assert ref.decoder_start == start
        if not do_sample:  # greedy: transformers' own generate on the right-padded batch
            ids = torch.full((4, 5), params.pad_token_id)
            for j, row in enumerate(prompts):
                ids[j, :len(row)] = torch.tensor(row)
            mask = (ids != params.pad_token_id).long()
            stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                   do_sample=False, no_repeat_ngram_size=1,
                                   min_new_tokens=3).tolist()
            eos = set(params.eos_token_ids)
            assert [row[:1] for row in stock] == [list(start)] * 4
            assert ref.completions == [
                row[1:][:next((k + 1 for k, t in enumerate(row[1:]) if t in eos), 6)]
                for row in stock]
        for split in ENC_DEC_SPLITS:
            for mode in MODES:
                key = (name, tuple(split), mode, do_sample)
                runs = [r[key] for r in engine_results]
                got = [c for r in runs for c in r["completions"]]
                assert got == ref.completions, key
                assert all(r["mode"] == mode and r["start"] in (start, ()) for r in runs), key
                if mode == "sharded":
                    assert runs[0]["steps"] == runs[1]["steps"] >= 1, key
                    assert runs[0]["peak"] < runs[0]["full"], key


@test_timeout(40)
def test_encoder_decoder_kin_generate_in_both_modes(engine_results):
    """LED (its Longformer encoder pads the input to its window), PEGASUS-X (global tokens
    joined at the encoder boundary) and T5Gemma (Gemma stacks): rows split 3 + 1, sampled, both
    modes, token-identical to one process."""
    from hf_cephalo.runtime.generation import generate_rows
    from tests.zoo_fixtures import build_zoo

    for name in ENC_DEC_KIN:
        ref = generate_rows(build_zoo(name, seed=3), PROMPTS[:4], list(range(4)),
                            _enc_dec_params(name, True)[0], ROUND).completions
        for mode in MODES:
            assert [c for r in engine_results for c in r[(name, mode)]] == ref, (name, mode)


@test_timeout(40)
def test_bad_input_on_one_rank_is_refused_on_every_rank(engine_results):
    r0, r1 = (r["refusals"] for r in engine_results)
    assert "prompt(s) [0] are empty" in r1["empty"]
    assert "rank(s) [1] were refused" in r0["empty"]
    # 10 bytes on rank 0 hold no mode: both ranks refuse, rank 0's count named
    assert "1 rank(s) cannot hold even the layered sharded decode" in r0["tiny"]
    assert r0["tiny"] == r1["tiny"].replace("budget none", "budget 0.0 MiB") or \
        "1 rank(s) cannot hold even" in r1["tiny"]
    # a budget between the two modes' needs: auto picks the sharded decode on every rank
    assert r0["between"] == r1["between"] == "sharded"
    assert r0["after"] and r1["after"]  # the refusals left the engine usable


# ---- stock GRPOTrainer with reproducible_rollout --------------------------------------------
def _stock_grpo_completions(tmp_path):
    """One step of stock GRPOTrainer on ONE process with reproducible_rollout; returns the
    (prompt_ids, completion_ids) it trained on and the model's initial weights."""
    trl = pytest.importorskip("trl")
    import datasets

    import hf_cephalo
    from tests.trl_fixtures import load_tokenizer, offline_env, save_tokenizer

    offline_env()
    tok = load_tokenizer(save_tokenizer(str(tmp_path / "tok")))
    prompts = [f"Question {i}: what does the {w} statement do?"
               for i, w in enumerate(["for", "while", "with", "try"])]
    ds = datasets.Dataset.from_dict({"prompt": prompts})
    seen = []
    rollout = hf_cephalo.reproducible_rollout(seed=5)

    def recording(prompts, trainer):
        out = rollout(prompts, trainer)
        seen.append((out["prompt_ids"], out["completion_ids"]))
        return out

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    args = trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=8, max_steps=1,
                          report_to="none", use_cpu=True, bf16=False, seed=5,
                          temperature=0.8, top_k=30, logging_steps=1, save_strategy="no",
                          disable_tqdm=True)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw:
                              [float(len(c)) for c in completions], args=args,
                              train_dataset=ds, processing_class=tok, rollout_func=recording)
    trainer.train()
    return seen, weights, model.config, tok.eos_token_id, tok.pad_token_id


def _engine_rollout(rank, world_size, weights, config, prompt_ids, eos, pad):
    from transformers import Qwen3ForCausalLM

    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models.registry import stage_model
    from hf_cephalo.runtime.generation import SamplingParams

    model = Qwen3ForCausalLM(config)
    model.load_state_dict(weights)
    engine = CephaloEngine(stage_model(model), state_ratios=[0.4, 0.6])
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=30, top_p=1.0,
                            eos_token_ids=(eos,), pad_token_id=pad, seed=5)
    off, n = (0, 1) if rank == 0 else (1, len(prompt_ids) - 1)  # b = [1, 3]
    return {mode: engine.generate(prompt_ids[off:off + n], list(range(off, off + n)), params,
                                  0, mode=mode).completions for mode in MODES}


@test_timeout(60, margin_s=120)
def test_reproducible_rollout_matches_the_engine(tmp_path):
    """What stock GRPOTrainer (one process, reproducible_rollout) trained on in its first
    step is what the engine on 2 ranks (b = [1, 3], r = 0.4 / 0.6) generates for the same
    rows and round, in both decode modes; groups (2 rows per prompt) get 2 different
    completions."""
    seen, weights, config, eos, pad = _stock_grpo_completions(tmp_path)
    prompt_ids, completions = seen[0]
    assert len(prompt_ids) == 4 and prompt_ids[0] == prompt_ids[1]  # whole groups, in order
    assert completions[0] != completions[1]
    results = run_ranks(_engine_rollout, 2, weights, config, prompt_ids, eos, pad,
                        timeout_s=240)
    for mode in MODES:
        assert results[0][mode] + results[1][mode] == completions, mode
