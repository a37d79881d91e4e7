"""Data loading per rank: whole-batch collation vs per-rank reading (issue 32).

Each rank trains a tiny ViT through the engine on scikit-learn's digits, read by a dataset whose
``__getitem__`` decodes a PNG and augments it (random crop, flip, rotation; the generators are
seeded per sample by the loader) and is then held to a fixed ``--read-ms`` (a timed transform:
a real decode + augment pipeline costs a few ms per image). Both collations run in ONE run, in
the same processes, alternating: ``collate="global_batch"`` (every rank reads and collates all
B samples of a step, keeps its b_i rows) and ``collate="global_width"`` (each rank reads its
b_i rows; the width exchange). Printed per world size (2 and 4 ranks, uneven plans): samples
read per rank per step (counted in ``__getitem__``, steady steps; the first step's one-time
collator check separately), each rank's data time per step (``next(loader)``, exchange
included), the step time (data + train step + optimizer step, the slowest rank), and the ratios
against the whole-batch baseline of the same run. Then the per-rank data work predicted for the
paper's Cluster B (64 ranks, B = 1024, ViT-e, the optimizer's plan on spec-sheet profiles) at
the per-read cost measured here.

    python benchmarks/bench_dataload.py [--read-ms 3] [--steps 6] [--repeats 2] [--worlds 2,4]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks  # this folder is on sys.path

PLANS = {2: ([8, 24], [4, 8]), 4: ([4, 6, 10, 12], [2, 3, 5, 6])}  # B = 32, uneven
MODES = ("global_batch", "global_width")


class DigitImages(torch.utils.data.Dataset):
    """The 1797 digits as 32x32 PNGs; ``__getitem__`` decodes one, crops 24x24 at a random
    place, flips it at random, rotates it by up to 10 degrees, resizes it to 16x16 and
    normalizes it to (3, 16, 16), then waits until ``read_ms`` have passed since the read
    began. ``reads`` counts the calls (this process)."""

    def __init__(self, read_ms: float) -> None:
        from PIL import Image
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.labels = digits.target.astype(np.int64)
        self.pngs = []
        for image in digits.images:
            pil = Image.fromarray((image * 255 / 16).astype(np.uint8)).resize((32, 32))
            buffer = io.BytesIO()
            pil.save(buffer, format="PNG")
            self.pngs.append(buffer.getvalue())
        self.read_s, self.reads, self.busy_s = read_ms / 1000, 0, 0.0

    def __len__(self) -> int:
        return len(self.pngs)

    def __getitem__(self, index: int) -> dict:
        from PIL import Image

        start = time.perf_counter()
        self.reads += 1
        image = Image.open(io.BytesIO(self.pngs[index])).convert("L")
        x, y = random.randint(0, 8), random.randint(0, 8)
        image = image.crop((x, y, x + 24, y + 24))
        if random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        image = image.rotate(float(np.random.uniform(-10, 10))).resize((16, 16))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)
        pixels = pixels.expand(3, -1, -1).contiguous()  # (3, 16, 16)
        left = self.read_s - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        self.busy_s += time.perf_counter() - start
        return {"pixel_values": pixels, "labels": int(self.labels[index])}


def _engine(world: int):
    import transformers

    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, num_labels=10,
                                    num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    intermediate_size=128)
    engine = CephaloEngine(stage_model(transformers.ViTForImageClassification(config)),
                           [1 / world] * world)
    return engine, torch.optim.SGD(engine.parameters(), lr=0.01)


class _ExchangeTimer:
    """Time spent in the loader's per-step exchanges (``StepExchange.gather``), this process."""

    spent_s = 0.0

    @classmethod
    def install(cls) -> None:
        from hf_cephalo.runtime.exchange import StepExchange

        gather = StepExchange.gather

        def timed(self, vector):
            start = time.perf_counter()
            try:
                return gather(self, vector)
            finally:
                cls.spent_s += time.perf_counter() - start

        StepExchange.gather = timed


def _measure(rank: int, world: int, mode: str, data: DigitImages, engine, optimizer,
             args, epoch: int) -> dict:
    from transformers import default_data_collator

    from hf_cephalo.runtime.data import weighted_loader

    sizes, micro = PLANS[world]
    loader = weighted_loader(data, default_data_collator, batch_sizes=sizes, rank=rank,
                             microbatch_size=micro[rank], seed=1, shuffle=True, collate=mode)
    loader.set_epoch(epoch)
    it = iter(loader)
    data_s, step_s, reads, read_s, exchange_s = [], [], [], [], []
    for step in range(args.steps + 1):
        dist.barrier()
        before, busy, exchanged = data.reads, data.busy_s, _ExchangeTimer.spent_s
        t0 = time.perf_counter()
        microbatches = next(it)
        t1 = time.perf_counter()
        engine.train_step(microbatches)
        optimizer.step()
        engine.zero_grad()
        t2 = time.perf_counter()
        if step == 0:  # the collator check reads one global batch once
            first_reads = data.reads - before
            continue
        data_s.append(t1 - t0)
        step_s.append(t2 - t0)
        reads.append(data.reads - before)
        read_s.append(data.busy_s - busy)
        exchange_s.append(_ExchangeTimer.spent_s - exchanged)
    return dict(data_s=data_s, step_s=step_s, reads=reads, read_s=read_s,
                exchange_s=exchange_s, first_reads=first_reads)


def _worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _ExchangeTimer.install()
    try:
        data = DigitImages(args.read_ms)
        engine, optimizer = _engine(world)
        results = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):  # alternate the modes: drift hits both alike
            for mode in MODES:
                results[mode].append(_measure(rank, world, mode, data, engine, optimizer, args,
                                              epoch=repeat))
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


def _run(world: int, args) -> list[dict]:
    port = free_port()
    results = dict(run_ranks(_worker, [(r, world, port, args) for r in range(world)],
                             timeout_s=1800))
    return [results[r] for r in range(world)]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(x for run in runs for x in run[key])


def _slowest(results: list[dict], mode: str) -> float:
    """Median over steps of the slowest rank's step time."""
    runs = [r[mode] for r in results]
    return statistics.median(max(run[k]["step_s"][j] for run in runs)
                             for k in range(len(runs[0])) for j in range(len(runs[0][k]["step_s"])))


def _report(world: int, results: list[dict]) -> float:
    """Print one world size's table; return the measured ms per read."""
    sizes, micro = PLANS[world]
    print(f"\n{world} ranks, b = {sizes}, m = {micro} (B = {sum(sizes)}); medians over "
          f"{sum(len(r['reads']) for r in results[0]['global_batch'])} steps per mode; "
          "whole = global_batch (the baseline), own = global_width")
    print(f"{'rank':>4} {'b_i':>4} | {'reads/step':>12} {'1st step':>8} | "
          f"{'read ms/step':>16} {'ratio':>6} | {'data ms/step':>16} {'ratio':>6} | "
          f"{'exchange':>8}")
    print(f"{'':>4} {'':>4} | {'whole':>6}{'own':>6} {'own':>8} | {'whole':>8}{'own':>8} {'':>6} | "
          f"{'whole':>8}{'own':>8} {'':>6} | {'ms/step':>8}")
    per_read = []
    for rank, result in enumerate(results):
        old, new = result["global_batch"], result["global_width"]
        read_old, read_new = 1e3 * _median(old, "read_s"), 1e3 * _median(new, "read_s")
        data_old, data_new = 1e3 * _median(old, "data_s"), 1e3 * _median(new, "data_s")
        per_read.append(read_old / _median(old, "reads"))
        print(f"{rank:>4} {sizes[rank]:>4} | {_median(old, 'reads'):>6.0f}"
              f"{_median(new, 'reads'):>6.0f} {new[0]['first_reads']:>8} | {read_old:>8.1f}"
              f"{read_new:>8.1f} {read_new / read_old:>6.2f} | {data_old:>8.1f}{data_new:>8.1f} "
              f"{data_new / data_old:>6.2f} | {1e3 * _median(new, 'exchange_s'):>8.1f}")
    old_step, new_step = _slowest(results, "global_batch"), _slowest(results, "global_width")
    print(f"step time (slowest rank): whole {1e3 * old_step:.1f} ms, own {1e3 * new_step:.1f} ms,"
          f" ratio {new_step / old_step:.2f} ({old_step / new_step:.2f}x faster). data ms/step "
          "includes the exchange, and in it the wait for the rank with the most rows")
    return statistics.median(per_read)


def _cluster_b(ms_per_read: float, workers: int) -> None:
    from hf_cephalo.planner.optimize import optimize
    from hf_cephalo.profiles.specs import ClusterSpec, estimate_cluster_profile

    machines = [["A10G"] * 8] * 2 + [["V100-16GB"] * 8] * 2 + [["T4"] * 8] * 4
    cluster = ClusterSpec(name="cluster-b", machines=machines, interconnect_gbps=100)
    B = 1024
    plan = optimize(estimate_cluster_profile(cluster, "vit-e"), B)
    iteration_s = plan.predicted_iteration_s
    names = [gpu for machine in machines for gpu in machine]
    print(f"\nCluster B (64 ranks), ViT-e, B = {B}: the optimizer's plan on spec-sheet profiles "
          f"(predicted iteration {iteration_s:.1f} s); data work per rank per step at "
          f"{ms_per_read:.2f} ms per read (measured above); wall time with {workers} loader "
          "workers per rank, as a share of the iteration")
    print(f"{'GPU':<10} {'ranks':>5} {'b_i':>4} | {'reads/step':>14} {'ratio':>6} | "
          f"{'CPU s/step':>14} | {f'wall s, {workers} workers':>22}")
    print(f"{'':<10} {'':>5} {'':>4} | {'whole':>7}{'own':>7} {'':>6} | {'whole':>7}{'own':>7} | "
          f"{'whole':>11}{'own':>11}")
    for gpu in dict.fromkeys(names):
        ranks = [r for r, n in enumerate(names) if n == gpu]
        own = max(plan.batch_sizes[r] for r in ranks)  # images: one width, no extra rows
        cpu_old, cpu_new = B * ms_per_read / 1e3, own * ms_per_read / 1e3
        wall_old, wall_new = cpu_old / workers, cpu_new / workers
        share_old, share_new = 100 * wall_old / iteration_s, 100 * wall_new / iteration_s
        print(f"{gpu:<10} {len(ranks):>5} {own:>4} | {B:>7}{own:>7} {B / own:>5.0f}x | "
              f"{cpu_old:>7.2f}{cpu_new:>7.3f} | {wall_old:>5.2f} ({share_old:>3.0f}%)"
              f"{wall_new:>6.3f} ({share_new:>3.1f}%)")
    print(f"(global_width also reads one global batch, {B} rows, once per loader: the collator "
          "check on the first step)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read-ms", type=float, default=3.0, help="ms per __getitem__")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode and repeat")
    parser.add_argument("--repeats", type=int, default=2, help="alternations of the two modes")
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--cluster-b-workers", type=int, default=8,
                        help="loader workers per rank assumed for the Cluster B prediction")
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: 2 ranks, 2 steps, 1 repeat (the suite's "
                             "check that the benchmark runs; numbers meaningless)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats, args.worlds, args.read_ms = 2, 1, "2", 0.5
    ms_per_read = None
    for world in (int(w) for w in args.worlds.split(",")):
        ms_per_read = _report(world, _run(world, args))
    _cluster_b(ms_per_read, args.cluster_b_workers)


if __name__ == "__main__":
    main()
