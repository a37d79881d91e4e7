"""Worker for tests/test_accelerate_launch.py, started by a real `accelerate launch`.

Builds CephaloTrainingArguments + CephaloAccelerator as CephaloTrainer does and checks, inside
the launched process, that Accelerate kept its own distributed type and real world size and
that its collectives, RNG synchronization and data loader handling behave. Every check is an
assert (a failure exits non-zero); a JSON summary goes to <out_dir>/rank<R>.json for the test.

Usage: check_accelerate.py OUT_DIR [train]   ("train" also runs CephaloTrainer end to end:
pydoc text -> BPE tokenizer -> tiny Llama -> train/evaluate/save -> from_pretrained + generate)
"""

import json
import os
import sys

import torch
from accelerate.utils import DistributedType, broadcast_object_list, gather_object, synchronize_rng_states
from torch.utils.data import DataLoader

from hf_cephalo.integrations.loop.accelerator import CephaloAccelerator, CephaloDistributedType, CephaloPlugin
from hf_cephalo.runtime.sampler import MicrobatchCollator, WeightedBatchSampler
from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments


def main(out_dir: str) -> None:
    env_world_size = int(os.environ["WORLD_SIZE"])
    env_rank = int(os.environ["RANK"])
    args = CephaloTrainingArguments(output_dir=os.path.join(out_dir, "trainer"), report_to="none")
    assert args.world_size == env_world_size, (args.world_size, env_world_size)
    assert args.process_index == env_rank
    accelerator = CephaloAccelerator(cephalo_plugin=CephaloPlugin.from_training_args(args))
    state = accelerator.state
    expected_type = DistributedType.MULTI_GPU if torch.cuda.is_available() else DistributedType.MULTI_CPU
    assert accelerator.distributed_type == expected_type, accelerator.distributed_type
    assert accelerator.cephalo_distributed_type is CephaloDistributedType.CEPHALO
    assert accelerator.num_processes == env_world_size and accelerator.process_index == env_rank
    n, rank = env_world_size, env_rank
    device = accelerator.device

    # gather / reduce / broadcast / pad_across_processes / gather_object
    t = torch.tensor([float(rank), 10.0 * rank], device=device)
    assert accelerator.gather(t).tolist() == [x for r in range(n) for x in (float(r), 10.0 * r)]
    assert accelerator.reduce(t, reduction="sum").tolist() == [sum(range(n)), 10.0 * sum(range(n))]
    assert torch.allclose(accelerator.reduce(t.clone(), reduction="mean").cpu(),
                          torch.tensor([sum(range(n)) / n, 10.0 * sum(range(n)) / n]))
    b = torch.full((3,), float(rank + 7), device=device)
    from accelerate.utils import broadcast
    assert broadcast(b, from_process=n - 1).tolist() == [float(n - 1 + 7)] * 3
    uneven = torch.arange(rank + 1, device=device, dtype=torch.float32)  # length rank+1
    padded = accelerator.pad_across_processes(uneven, pad_index=-1)
    assert padded.shape == (n,) and padded[: rank + 1].tolist() == uneven.tolist()
    assert gather_object([f"r{rank}"]) == [f"r{r}" for r in range(n)]
    objs = [{"rank": rank}]
    broadcast_object_list(objs, from_process=0)
    assert objs == [{"rank": 0}]

    # RNG synchronization: different seeds per rank, then synced to rank 0's state
    torch.manual_seed(1000 + rank)
    synchronize_rng_states(["torch"])
    draws = accelerator.gather(torch.rand(4, device=device).unsqueeze(0))
    assert all(torch.equal(draws[0], draws[r]) for r in range(n)), draws

    # Accelerate must not re-shard the weighted sampler's loader; a plain loader still is sharded
    data = list(range(37))
    sizes = [2 + 3 * r for r in range(n)]
    weighted = DataLoader(data, batch_sampler=WeightedBatchSampler(len(data), sizes, rank, seed=3),
                          collate_fn=MicrobatchCollator(lambda xs: list(xs), 2))
    prepared = accelerator.prepare(weighted)
    assert prepared is weighted
    my_steps = [sum(mbs, []) for mbs in prepared]
    plain = accelerator.prepare(DataLoader(data, batch_size=4))
    assert plain is not None and len(plain) == -(-len(data) // (4 * n))  # sharded by world size
    all_steps = gather_object([my_steps])
    assert len({len(s) for s in all_steps}) == 1  # same number of steps on every rank
    seen = [i for steps in all_steps for step in steps for i in step]
    assert sorted(seen) == data  # every sample exactly once per epoch across ranks
    for step in range(len(my_steps) - 1):
        assert len(my_steps[step]) == sizes[rank]

    summary = dict(train=train_end_to_end(out_dir, n) if "train" in sys.argv[2:] else None)
    summary.update(rank=rank, world_size=n, process_index=accelerator.process_index,
                   num_processes=accelerator.num_processes, distributed_type=str(accelerator.distributed_type),
                   backend=state.backend, cephalo_distributed_type=accelerator.cephalo_distributed_type.value,
                   plugin_global_batch_size=accelerator.cephalo_plugin.global_batch_size,
                   args_global_batch_size=args.cephalo_global_batch_size, use_cpu=args.use_cpu,
                   local_steps=[len(s) for s in my_steps])
    accelerator.wait_for_everyone()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(summary, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def train_end_to_end(out_dir: str, world_size: int) -> dict:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, default_data_collator

    from hf_cephalo.demo_data import group_texts, pydoc_text_dataset, train_bpe_tokenizer
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer

    texts = pydoc_text_dataset(max_chars=30_000)
    tokenizer = train_bpe_tokenizer(texts["text"], vocab_size=400)
    blocks = group_texts(texts, tokenizer, 32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    args = CephaloTrainingArguments(output_dir=os.path.join(out_dir, "clm"), report_to="none",
                                    max_steps=6, learning_rate=3e-3, logging_steps=1,
                                    save_strategy="no", disable_tqdm=True, seed=0)
    trainer = CephaloTrainer(model=model, args=args, train_dataset=blocks.select(range(40)),
                             eval_dataset=blocks.select(range(40, 51)), processing_class=tokenizer,
                             data_collator=default_data_collator)
    assert trainer.plan.batch_sizes == [2, 4][:world_size] or world_size != 2, trainer.plan
    trainer.train()
    eval_metrics = trainer.evaluate()
    save_dir = os.path.join(out_dir, "clm", "final")
    trainer.save_model(save_dir)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    sample = None
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        reloaded = LlamaForCausalLM.from_pretrained(save_dir).eval()
        reloaded_tokenizer = AutoTokenizer.from_pretrained(save_dir)
        prompt = reloaded_tokenizer("The assert statement", return_tensors="pt")
        generated = reloaded.generate(**prompt, max_new_tokens=8, do_sample=False)
        sample = reloaded_tokenizer.decode(generated[0])
        assert sample.startswith("The assert statement") and generated.shape[1] > prompt["input_ids"].shape[1]
    return dict(losses=losses, eval_loss=eval_metrics["eval_loss"], sample=sample)


if __name__ == "__main__":
    main(sys.argv[1])
