"""What-if planning from spec sheets: GPU and model tables -> an analytical ClusterProfile.

ESTIMATES ONLY. Peak TFLOP/s from vendor data sheets times an assumed efficiency, and
activation memory from a textbook formula, stand in for measurements until the profiler
(``hf-cephalo profile``) measures the real ones; a measured ``ClusterProfile`` replaces all of
this. Pure Python (no torch) so ``hf-cephalo plan`` starts fast. Per transformer layer and
sample: forward FLOPs 2·P_matmul·s + 4·s²·h, backward twice that; activation bytes
s·h·(34 + 5·a·s/h) for 16-bit activations (Korthikanti et al. 2022); a framework reserve; the
engine's buffers priced by the planner's memory model; collectives as a ring over the slowest
link. The formulas and their sources: docs/planner.md, "Spec-sheet formulas".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from hf_cephalo.profiles.config_shape import ConfigShape
from hf_cephalo.profiles.precision import (FASTEST_FIRST, PRECISIONS, check_rank_precisions,
                                           parse_rank_precisions, rank_precisions_tag)
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile
from hf_cephalo.units import GIB

__all__ = [
    "GPUSpec", "GPU_SPECS", "ModelShape", "MODEL_SHAPES", "ClusterSpec",
    "get_gpu_spec", "get_model_shape", "load_cluster_yaml", "estimate_device_profile",
    "estimate_comm_profile", "estimate_cluster_profile", "spec_precisions", "rank_precisions_for",
]



@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """Vendor spec-sheet figures of one GPU type.

    Attributes:
        name: type name used in cluster YAML files.
        memory_gib: device memory, GiB (vendor "GB" of GPU memory are binary capacities).
        fp32_tflops: peak fp32 (non-tensor) TFLOP/s.
        bf16_tflops: peak dense bf16 tensor-core TFLOP/s; None if the GPU has no bf16.
        fp16_tflops: peak dense fp16 TFLOP/s (tensor cores where the GPU has them; P100:
            its packed half-precision rate); None if the data sheet gives no fp16 figure.
        source: where the figures come from.
        memory_bandwidth_gbs: peak device-memory bandwidth, GB/s (10^9 bytes/s), the bound of
            decoding (``planner/generation.py``); None if not listed.
    """

    name: str
    memory_gib: float
    fp32_tflops: float
    bf16_tflops: float | None
    source: str
    fp16_tflops: float | None = None
    memory_bandwidth_gbs: float | None = None

    def tflops(self, precision: str) -> float | None:
        """The peak TFLOP/s column of ``precision`` (one of PRECISIONS); None: not listed."""
        return {"fp32": self.fp32_tflops, "bf16": self.bf16_tflops,
                "fp16": self.fp16_tflops}[precision]


_DATASHEET = "NVIDIA data sheet"
GPU_SPECS: dict[str, GPUSpec] = {s.name: s for s in [
    GPUSpec(name="L4", memory_gib=24, fp32_tflops=30.3, bf16_tflops=121.0,
            source=f"{_DATASHEET}, https://www.nvidia.com/en-us/data-center/l4/ "
                   "(BF16 242 TFLOPS is with sparsity; dense is half) "
                   "[fp16: FP16 tensor 242 TFLOPS with sparsity, dense half]",
            fp16_tflops=121.0),
    GPUSpec(name="A6000", memory_gib=48, fp32_tflops=38.7, bf16_tflops=154.8,
            source=f"{_DATASHEET} (RTX A6000), https://www.nvidia.com/en-us/design-visualization/"
                   "rtx-a6000/ (tensor 309.7 TFLOPS with sparsity; dense is half) "
                   "[fp16: FP16 tensor 309.7 with sparsity, dense half]",
            fp16_tflops=154.8),
    GPUSpec(name="P40", memory_gib=24, fp32_tflops=12.0, bf16_tflops=None,
            source=f"{_DATASHEET} (Tesla P40), https://www.nvidia.com/en-us/data-center/"
                   "tesla-p40/ (no bf16) "
                   "[fp16: no fp16 rate listed]",
            fp16_tflops=None),
    GPUSpec(name="P100", memory_gib=16, fp32_tflops=9.3, bf16_tflops=None,
            source=f"{_DATASHEET} (Tesla P100 PCIe 16 GB), https://www.nvidia.com/en-us/"
                   "data-center/tesla-p100/ (no bf16) "
                   "[fp16: half precision 18.7 TFLOPS, PCIe]",
            fp16_tflops=18.7),
    GPUSpec(name="V100-16GB", memory_gib=16, fp32_tflops=15.7, bf16_tflops=None,
            source=f"{_DATASHEET} (V100 SXM2), https://www.nvidia.com/en-us/data-center/v100/ "
                   "(no bf16; fp16 tensor 125) "
                   "[fp16: fp16 tensor 125]",
            fp16_tflops=125.0),
    GPUSpec(name="T4", memory_gib=16, fp32_tflops=8.1, bf16_tflops=None,
            source=f"{_DATASHEET}, https://www.nvidia.com/en-us/data-center/tesla-t4/ "
                   "(no bf16; fp16 tensor 65) "
                   "[fp16: mixed fp16/fp32 tensor 65]",
            fp16_tflops=65.0),
    GPUSpec(name="A10G", memory_gib=24, fp32_tflops=31.2, bf16_tflops=125.0,
            source=f"{_DATASHEET} of the A10, https://www.nvidia.com/en-us/data-center/products/"
                   "a10-gpu/ ; memory from https://aws.amazon.com/ec2/instance-types/g5/ (AWS "
                   "does not publish separate A10G peaks; treat as an upper estimate) "
                   "[fp16: A10 FP16 tensor 250 with sparsity, dense half]",
            fp16_tflops=125.0),
    GPUSpec(name="A100-40GB", memory_gib=40, fp32_tflops=19.5, bf16_tflops=312.0,
            source=f"{_DATASHEET} (A100 SXM), https://www.nvidia.com/en-us/data-center/a100/ "
                   "[fp16: FP16 tensor 312 dense]",
            fp16_tflops=312.0),
    GPUSpec(name="A100-80GB", memory_gib=80, fp32_tflops=19.5, bf16_tflops=312.0,
            source=f"{_DATASHEET} (A100 SXM), https://www.nvidia.com/en-us/data-center/a100/ "
                   "[fp16: FP16 tensor 312 dense]",
            fp16_tflops=312.0),
    GPUSpec(name="H100", memory_gib=80, fp32_tflops=67.0, bf16_tflops=989.4,
            source=f"{_DATASHEET} (H100 SXM), https://www.nvidia.com/en-us/data-center/h100/ "
                   "(BF16 1979 TFLOPS is with sparsity; dense is half) "
                   "[fp16: FP16 tensor 1979 with sparsity, dense half]",
            fp16_tflops=989.4),
    GPUSpec(name="H200", memory_gib=141, fp32_tflops=67.0, bf16_tflops=989.4,
            source=f"{_DATASHEET} (H200 SXM), https://www.nvidia.com/en-us/data-center/h200/ "
                   "(BF16 1979 TFLOPS is with sparsity; dense is half) "
                   "[fp16: FP16 tensor 1979 with sparsity, dense half]",
            fp16_tflops=989.4),
]}


# Peak memory bandwidth, GB/s, from the same data sheets (the GPU memory bandwidth row): the
# bound of decoding, where each step reads every weight and the KV cache (planner/generation.py)
_MEMORY_BANDWIDTH_GBS = {"L4": 300.0, "A6000": 768.0, "P40": 346.0, "P100": 732.0,
                         "V100-16GB": 900.0, "T4": 320.0, "A10G": 600.0, "A100-40GB": 1555.0,
                         "A100-80GB": 2039.0, "H100": 3350.0, "H200": 4800.0}
GPU_SPECS = {name: replace(spec, memory_bandwidth_gbs=_MEMORY_BANDWIDTH_GBS.get(name))
             for name, spec in GPU_SPECS.items()}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Transformer shape used for analytical profiles.

    Attributes:
        name: table key, e.g. ``"llama-3b"``.
        family: ``"gpt"`` (learned positions, tied head), ``"llama"`` (gated FFN, RMSNorm,
            no biases), ``"bert"`` or ``"vit"`` (bias + LayerNorm layers).
        num_layers, hidden, heads, ffn: layer count, hidden size, attention heads, FFN width.
        kv_heads: key/value heads (grouped-query attention, ``llama`` only); 0 = ``heads``.
        tied: the lm head shares the token embedding (``llama``: ``tie_word_embeddings``;
            ``gpt`` is always tied, ``bert`` / ``vit`` have no lm head).
        vocab: vocabulary size (classes for ``vit``).
        seq_len: tokens per sample used for planning (paper §4: 512; ViT: patches + class token).
        max_positions: learned position embeddings (``gpt``/``bert``/``vit``).
        nominal_params: the advertised parameter count, for the consistency check.
        source: where the shape comes from.
    """

    name: str
    family: str
    num_layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    max_positions: int = 0
    patch: int = 0
    kv_heads: int = 0
    tied: bool = False
    nominal_params: float
    source: str

    @property
    def _attention_params(self) -> int:
        """q and o (h x h each), k and v (h x kv_heads·head_dim each); no biases."""
        h = self.hidden
        kv = h * (self.kv_heads or self.heads) // self.heads
        return 2 * h * h + 2 * h * kv

    @property
    def params_per_layer(self) -> int:
        h, f = self.hidden, self.ffn
        if self.family == "llama":
            return self._attention_params + 3 * h * f + 2 * h  # gate/up/down; two RMSNorms
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # + biases and two LayerNorms

    @property
    def params_embed(self) -> int:
        """Parameters of the engine's embedding unit (a tied lm head included)."""
        h, v = self.hidden, self.vocab
        if self.family == "llama":
            return v * h
        if self.family == "gpt":
            return v * h + self.max_positions * h
        if self.family == "bert":  # word, positions, token type (2), LayerNorm
            return v * h + self.max_positions * h + 2 * h + 2 * h
        return 3 * self.patch ** 2 * h + h + h + self.seq_len * h  # vit: patches, CLS, positions

    @property
    def params_head(self) -> int:
        """Parameters of the engine's head unit (a tied lm head is in the embedding unit)."""
        h, v = self.hidden, self.vocab
        if self.family == "llama":
            return (0 if self.tied else v * h) + h  # lm head, final norm
        if self.family == "gpt":
            return 2 * h  # final LayerNorm (head tied)
        if self.family == "bert":
            return h * h + h  # pooler
        return 2 * h + h * v + v  # vit: final norm, classifier

    @property
    def head_ties_embedding(self) -> bool:
        return self.family == "gpt" or (self.family == "llama" and self.tied)

    @property
    def params_other(self) -> int:
        return self.params_embed + self.params_head

    @property
    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.params_other

    @property
    def matmul_params_per_layer(self) -> int:
        h, f = self.hidden, self.ffn
        if self.family == "llama":
            return self._attention_params + 3 * h * f
        return 4 * h * h + 2 * h * f

    def layer_fwd_flops(self) -> float:
        """Forward FLOPs of one sample through one layer: 2·P_matmul·s + 4·s²·h."""
        s, h = self.seq_len, self.hidden
        return 2.0 * self.matmul_params_per_layer * s + 4.0 * s * s * h

    def activation_bytes_per_sample(self) -> float:
        """fp32 activation bytes of one sample in one layer's recompute + backward, plus the
        logits of a language-model head (docs/planner.md, "Spec-sheet formulas")."""
        s, h, a = self.seq_len, self.hidden, self.heads
        layer = 2.0 * s * h * (34 + 5 * a * s / h)  # fp32: twice the 16-bit figure
        head = 2.0 * s * self.vocab * 4 if self.family in ("gpt", "llama", "bert") else 0.0
        return layer + head

    def lora_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of the attention projections LoRA adapts (k, v: grouped-query
        attention's kv_heads·head_dim for ``llama``)."""
        h = self.hidden
        kv = h * (self.kv_heads or self.heads) // self.heads if self.family == "llama" else h
        return {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h)}

    def model_profile(self) -> ModelProfile:
        """fp32 parameters (4 bytes; bf16 autocast keeps them fp32) and fp32 hidden states."""
        return ModelProfile(name=self.name, num_units=self.num_layers,
                            params_per_unit=self.params_per_layer, params_other=self.params_other,
                            params_embed=self.params_embed, params_head=self.params_head,
                            head_ties_embedding=self.head_ties_embedding, param_bytes=4.0,
                            boundary_bytes_per_sample=4.0 * self.seq_len * self.hidden)


MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape(name="gpt-1.3b", family="gpt", num_layers=24, hidden=2048, heads=16, ffn=8192,
               vocab=50257, seq_len=512, max_positions=2048, nominal_params=1.3e9,
               source="Brown et al. 2020 (GPT-3) Table 2.1 'GPT-3 XL'; 16 heads as in the "
                      "public GPT-Neo 1.3B config"),
    ModelShape(name="gpt-2.7b", family="gpt", num_layers=32, hidden=2560, heads=32, ffn=10240,
               vocab=50257, seq_len=512, max_positions=2048, nominal_params=2.7e9,
               source="Brown et al. 2020 (GPT-3) Table 2.1 'GPT-3 2.7B'"),
    ModelShape(name="gpt-6.7b", family="gpt", num_layers=32, hidden=4096, heads=32, ffn=16384,
               vocab=50257, seq_len=512, max_positions=2048, nominal_params=6.7e9,
               source="Brown et al. 2020 (GPT-3) Table 2.1 'GPT-3 6.7B'"),
    ModelShape(name="llama-3b", family="llama", num_layers=26, hidden=3200, heads=32, ffn=8640,
               vocab=32000, seq_len=512, nominal_params=3.4e9,
               source="OpenLLaMA 3B public config (openlm-research/open_llama_3b)"),
    ModelShape(name="llama-7b", family="llama", num_layers=32, hidden=4096, heads=32, ffn=11008,
               vocab=32000, seq_len=512, nominal_params=6.7e9,
               source="Touvron et al. 2023 (LLaMA) Table 2"),
    ModelShape(name="llama-3-8b", family="llama", num_layers=32, hidden=4096, heads=32,
               kv_heads=8, ffn=14336, vocab=128256, seq_len=512, tied=False,
               nominal_params=8.03e9,
               source="Meta Llama 3 8B config.json (meta-llama/Meta-Llama-3-8B: vocab_size 128256, "
                      "hidden_size 4096, intermediate_size 14336, 32 layers, 32 heads, 8 KV heads, "
                      "tie_word_embeddings false); 8.03B parameters as on its Hugging Face model "
                      "page (8,030,261,248 in the safetensors)"),
    ModelShape(name="llama-3.2-1b", family="llama", num_layers=16, hidden=2048, heads=32,
               kv_heads=8, ffn=8192, vocab=128256, seq_len=512, tied=True,
               nominal_params=1.24e9,
               source="Meta Llama 3.2 1B config.json (meta-llama/Llama-3.2-1B: vocab_size 128256, "
                      "hidden_size 2048, intermediate_size 8192, 16 layers, 32 heads, 8 KV heads, "
                      "tie_word_embeddings true); 1.24B parameters as on its Hugging Face model "
                      "page (1,235,814,400 in the safetensors)"),
    ModelShape(name="vit-g", family="vit", num_layers=40, hidden=1408, heads=16, ffn=6144,
               vocab=1000, seq_len=257, patch=14, nominal_params=1.0e9,
               source="Zhai et al. 2022 (Scaling Vision Transformers) Table 2, ViT-g/14 at 224 px"),
    ModelShape(name="vit-e", family="vit", num_layers=56, hidden=1792, heads=16, ffn=15360,
               vocab=1000, seq_len=257, patch=14, nominal_params=3.9e9,
               source="Chen et al. 2022 (PaLI) Table 1, ViT-e/14 at 224 px"),
    ModelShape(name="bert-large", family="bert", num_layers=24, hidden=1024, heads=16, ffn=4096,
               vocab=30522, seq_len=512, max_positions=512, nominal_params=3.4e8,
               source="Devlin et al. 2019 (BERT) §3, BERT-LARGE"),
]}


def get_gpu_spec(name: str) -> GPUSpec:
    """Case-insensitive lookup; ValueError listing the known types."""
    for key, spec in GPU_SPECS.items():
        if key.lower() == str(name).lower():
            return spec
    raise ValueError(f"unknown GPU type {name!r}; known: {sorted(GPU_SPECS)}")


def get_model_shape(name: str) -> ModelShape:
    for key, shape in MODEL_SHAPES.items():
        if key.lower() == str(name).lower():
            return shape
    raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_SHAPES)}")


Shape = ModelShape | ConfigShape
"""What the spec-sheet estimate prices: a table shape, or a config's facts (``ConfigShape``)."""


def estimate_device_profile(gpu: str | GPUSpec, shape: Shape, *, efficiency: float = 0.5,
                            precision: str = "fp32", launch_overhead_s: float = 2e-4,
                            framework_reserve_bytes: float = GIB,
                            microbatch_sizes: Sequence[int] = (1, 2, 4, 8, 16)) -> DeviceProfile:
    """Analytical DeviceProfile of ``gpu`` running one layer of ``shape`` (an ESTIMATE).

    Args:
        efficiency: assumed fraction of peak reached by a layer (0 < e <= 1).
        precision: ``"fp32"`` (the paper's full-precision training), ``"bf16"`` or ``"fp16"``
            (peak from ``bf16_tflops`` / ``fp16_tflops``).
        launch_overhead_s: fixed per-microbatch time of one layer's kernels, seconds.
        framework_reserve_bytes: memory the framework keeps besides the model, bytes. The
            engine's buffers (units, the root's phases, collectives, stash) are not in the
            device profile: the planner prices them from the model profile (planner/memory.py).

    Raises:
        ValueError: unknown GPU, efficiency outside (0, 1], bf16 on a GPU without bf16.
    """
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu_spec(gpu)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    if precision == "fp32":
        peak = spec.fp32_tflops
    elif precision == "bf16":
        if spec.bf16_tflops is None:  # as the trainer's check_bf16_support refuses --bf16
            alt = ("fp16", f"plan for --fp16 (its fp16 rate, {spec.fp16_tflops} TFLOP/s)") \
                if spec.fp16_tflops is not None else \
                ("fp32", "its data sheet lists no fp16 rate, so plan in fp32")
            raise ValueError(f"{spec.name} has no bf16 support (compute capability < 8.0: the "
                             f"trainer refuses --bf16 on it and proposes --fp16); {alt[1]}: "
                             f"precision='{alt[0]}' (CLI: --precision {alt[0]})")
        peak = spec.bf16_tflops
    elif precision == "fp16":
        if spec.fp16_tflops is None:
            raise ValueError(f"{spec.name} has no fp16 figure in its data sheet; use fp32 "
                             "precision (precision='fp32'; CLI: --precision fp32)")
        peak = spec.fp16_tflops
    else:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    per_sample_s = shape.layer_fwd_flops() / (efficiency * peak * 1e12)
    ms = list(microbatch_sizes)
    fwd = [launch_overhead_s + m * per_sample_s for m in ms]
    bwd = [launch_overhead_s + 2 * m * per_sample_s for m in ms]
    fixed = framework_reserve_bytes  # engine buffers: planner/memory.py
    act = shape.activation_bytes_per_sample()
    return DeviceProfile(name=spec.name, memory_capacity_bytes=spec.memory_gib * GIB,
                         microbatch_sizes=ms, fwd_s=fwd, bwd_s=bwd,
                         compute_memory_bytes=[fixed + m * act for m in ms])


def estimate_comm_profile(shape: Shape, world_size: int, bandwidth_gbps: float,
                          *, latency_s: float = 2e-5) -> CommProfile:
    """Ring all-gather / reduce-scatter time of one fp32 unit over ``bandwidth_gbps`` (Gbit/s)."""
    if bandwidth_gbps <= 0 or world_size < 1:
        raise ValueError(f"bandwidth_gbps ({bandwidth_gbps}) and world_size ({world_size}) "
                         "must be positive")
    unit_bytes = 4.0 * shape.params_per_layer
    t = (world_size - 1) / world_size * unit_bytes / (bandwidth_gbps * 1e9 / 8)
    t += (world_size - 1) * latency_s if world_size > 1 else 0.0
    return CommProfile(allgather_s=t, reducescatter_s=t)


@dataclass(kw_only=True)
class ClusterSpec:
    """A cluster described by GPU types per machine (rank order = machine order, GPU order).

    Attributes:
        name: free text.
        machines: GPU type names per machine.
        interconnect_gbps: network bandwidth between machines, Gbit/s.
        intra_machine_gbps: GPU-to-GPU bandwidth inside a machine, Gbit/s (default: PCIe 3.0
            x16, about 128 Gbit/s).
        host_ram_gib: per machine, its RAM in GiB (None entries or None: not known, the
            activation offload's pinned memory is then not limited).
    """

    name: str = "cluster"
    machines: list[list[str]]
    interconnect_gbps: float
    intra_machine_gbps: float = 128.0
    host_ram_gib: list[float | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.machines or not any(self.machines):
            raise ValueError(f"cluster {self.name!r}: no devices; list GPUs under 'machines'")
        for machine in self.machines:
            for g in machine:
                get_gpu_spec(g)
        for key in ("interconnect_gbps", "intra_machine_gbps"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"cluster {self.name!r}: {key} must be a positive number, got {v!r}")

        if self.host_ram_gib is not None:
            if len(self.host_ram_gib) != len(self.machines):
                raise ValueError(f"cluster {self.name!r}: host_ram_gib needs one entry per machine "
                                 f"({len(self.machines)}), got {self.host_ram_gib!r}")
            for v in self.host_ram_gib:
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                      or not math.isfinite(v) or v <= 0):
                    raise ValueError(f"cluster {self.name!r}: host_ram_gib must be positive "
                                     f"numbers (GiB), got {v!r}")

    @property
    def gpus(self) -> list[str]:
        return [g for machine in self.machines for g in machine]

    @property
    def machine_of_rank(self) -> list[int]:
        return [k for k, machine in enumerate(self.machines) for _ in machine]

    def host_memory_bytes(self) -> list[float] | None:
        """Per machine RAM in bytes, or None unless every machine has a figure."""
        if self.host_ram_gib is None or any(v is None for v in self.host_ram_gib):
            return None
        return [float(v) * GIB for v in self.host_ram_gib]


def _machine_gpus(entry: Any, where: str) -> list[str]:
    if isinstance(entry, Mapping) and "gpus" not in entry:
        raise ValueError(f"{where}: a machine needs 'gpus' (a list of GPU types or a mapping "
                         f"type -> count), got {dict(entry)!r}")
    gpus = entry.get("gpus") if isinstance(entry, Mapping) else entry
    if isinstance(gpus, Mapping):  # {A10G: 8}
        out = []
        for name, count in gpus.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"{where}: GPU count for {name!r} must be an integer >= 0, "
                                 f"got {count!r}")
            out += [str(name)] * count
    elif isinstance(gpus, list):
        out = []
        for g in gpus:
            if g is None or isinstance(g, (Mapping, list)):
                raise ValueError(f"{where}: GPU types must be names such as 'A10G', got {g!r}")
            out.append(str(g))
    else:
        raise ValueError(f"{where}: 'gpus' must be a list of GPU types or a mapping type -> "
                         f"count, got {gpus!r}")
    for g in out:
        try:
            get_gpu_spec(g)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def load_cluster_yaml(path: str | Path) -> ClusterSpec:
    """Read a cluster YAML (format in docs/profiles.md); ValueError naming the file and the
    field on a malformed file (wrong types included)."""
    import yaml

    where = f"cluster file {str(path)!r}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{where} is not valid YAML: {e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not a text file ({e}); give a cluster YAML") from None
    if not isinstance(data, Mapping) or "machines" not in data:
        raise ValueError(f"{where} needs a 'machines' list; see docs/profiles.md")
    if not isinstance(data["machines"], list):
        raise ValueError(f"{where}: 'machines' must be a list of machines, each with a 'gpus' "
                         f"list (e.g. '- gpus: [A10G, A10G]'), got {data['machines']!r}; see "
                         "docs/profiles.md")
    if "interconnect_gbps" not in data:
        raise ValueError(f"{where} needs 'interconnect_gbps' (Gbit/s between machines, e.g. "
                         "'interconnect_gbps: 50'); see docs/profiles.md")
    for key in ("interconnect_gbps", "intra_machine_gbps"):
        v = data.get(key, 128.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError(f"{where}: {key} must be a positive number (Gbit/s), got {v!r}")
    name = data.get("name", Path(path).stem)
    if not isinstance(name, (str, int, float)) or isinstance(name, bool):
        raise ValueError(f"{where}: 'name' must be text, got {name!r}")
    machines = [_machine_gpus(m, f"{where}: machines[{i}]")
                for i, m in enumerate(data["machines"])]
    default_ram = data.get("host_ram_gib")
    host_ram = [m.get("host_ram_gib", default_ram) if isinstance(m, Mapping) else default_ram
                for m in data["machines"]]
    extra = {k: v for k, v in data.items()
             if k not in ("name", "machines", "interconnect_gbps", "intra_machine_gbps",
                          "host_ram_gib")}
    try:
        return ClusterSpec(name=str(name), machines=machines,
                           interconnect_gbps=data["interconnect_gbps"],
                           intra_machine_gbps=data.get("intra_machine_gbps", 128.0),
                           host_ram_gib=None if all(v is None for v in host_ram) else host_ram,
                           extra=extra)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


LORA_TARGETS = ("q", "k", "v", "o")
"""Attention projections a spec-sheet LoRA estimate can adapt (``--lora-targets``)."""


def lora_params_per_layer(shape: Shape, rank: int, targets: Sequence[str] = ("q", "v")) -> int:
    """Elements of LoRA's A (r x in) and B (out x r) for ``targets`` in one layer of ``shape``.

    q, o: hidden -> hidden; k, v: hidden -> kv_heads·head_dim (grouped-query attention).
    Raises ValueError for rank < 1 or an unknown target (the message lists ``LORA_TARGETS``).
    """
    if int(rank) != rank or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank} (CLI: --lora-rank, "
                         "e.g. --lora-rank 8)")
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or not targets:
        raise ValueError(f"LoRA targets {list(targets)}: each must be one of {list(LORA_TARGETS)} "
                         "(attention projections), e.g. --lora-targets q v")
    dims = shape.lora_dims()
    return sum(int(rank) * (dims[t][0] + dims[t][1]) for t in targets)


def lora_model_profile(model: ModelProfile, shape: Shape, rank: int,
                       targets: Sequence[str] = ("q", "v"),
                       frozen_bytes_per_param: float = 4.0) -> ModelProfile:
    """``model`` (the shape's full fine-tuning profile) as LoRA trains it: each unit gains the
    adapter's elements, only those train (16 B each with fp32 AdamW), every base element is
    frozen at ``frozen_bytes_per_param`` (4 fp32, 2 bf16). Compute times are left as for full
    fine-tuning (an upper bound: LoRA skips the base weights' gradient GEMMs)."""
    adapter = lora_params_per_layer(shape, rank, targets)
    per_layer = None if model.unit_params is None else \
        dict(unit_params=[n + adapter for n in model.unit_params],
             unit_trainable=[adapter] * model.num_units)
    return replace(model, name=f"{model.name}+lora-r{int(rank)}-{''.join(targets)}",
                   params_per_unit=model.params_per_unit + adapter, **(per_layer or {}),
                   trainable_params=model.num_units * adapter,
                   trainable_per_unit=adapter, trainable_embed=0, trainable_head=0,
                   frozen_bytes_per_param=frozen_bytes_per_param)


def _model_in_precision(shape: Shape, precision: str) -> ModelProfile:
    """``shape.model_profile()`` with the element sizes of ``precision``'s default job."""
    model = shape.model_profile()
    if precision == "fp32":
        return model
    return replace(model, gathered_param_bytes=2.0,
                   boundary_bytes_per_sample=model.boundary_bytes_per_sample / 2)


def spec_precisions(gpu: str | GPUSpec) -> tuple[str, ...]:
    """Precisions the spec sheet of ``gpu`` gives a rate for, fastest first (bf16 > fp16 >
    fp32): what ``--precision auto`` picks from and what a per-rank list is checked against."""
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu_spec(gpu)
    return tuple(p for p in FASTEST_FIRST if spec.tflops(p) is not None)


def rank_precisions_for(cluster: ClusterSpec, precision: str | Sequence[str]) -> list[str]:
    """Per rank of ``cluster`` the precision of ``precision``: one name (every rank), ``"auto"``
    (each GPU's fastest spec-sheet precision) or a per-rank list / comma string.

    Raises ValueError: a list of the wrong length or a GPU without the precision (naming the
    rank and the GPU)."""
    gpus = cluster.gpus
    supported = [spec_precisions(g) for g in gpus]
    if isinstance(precision, str) and precision in PRECISIONS:
        # one precision for all: estimate_device_profile refuses it with the proposal
        return [precision] * len(gpus)
    out = parse_rank_precisions(precision, len(gpus))
    if out is None:  # auto
        out = [s[0] for s in supported]
    check_rank_precisions(out, gpus, supported)
    return out


def estimate_cluster_profile(cluster: ClusterSpec, model: str | Shape, **kwargs) -> ClusterProfile:
    """Analytical ClusterProfile (spec-sheet ESTIMATE) for ``model`` on ``cluster``: a table
    name, a ``ModelShape`` or a config's ``ConfigShape``.

    ``kwargs`` go to ``estimate_device_profile`` (efficiency, precision, ...). With
    ``precision`` bf16 / fp16 the model is priced as the trainer runs ``--bf16`` / ``--fp16`` by
    default (``cephalo_param_dtype='auto'``): units gathered and all-gathered in the low dtype
    (``ModelProfile.gathered_param_bytes`` = 2, so AG time halves, ``cost.unit_comm``), fp32
    gradients and reduce-scatters, 2-byte boundary activations; the profile's precision tag
    records it. ``precision`` may also be ``"auto"`` or a per-rank list (``rank_precisions_for``):
    each rank's device profile is then estimated at its own precision, and when the ranks
    differ the model is priced with fp32 all-gathers and fp32 boundary activations (the engine
    gathers the fp32 master and each rank casts locally: docs/engine.md "Precision per rank");
    ``extra["rank_precisions"]`` records the list.
    """
    precision = kwargs.pop("precision", "fp32")
    shape = model if isinstance(model, (ModelShape, ConfigShape)) else get_model_shape(model)
    gpus = cluster.gpus
    per_rank = rank_precisions_for(cluster, precision)
    multi = sum(1 for m in cluster.machines if m) > 1
    bw = min(cluster.interconnect_gbps, cluster.intra_machine_gbps) if multi \
        else cluster.intra_machine_gbps
    cache: dict[tuple[str, str], DeviceProfile] = {}
    devices = []
    for g, p in zip(gpus, per_rank):
        if (g, p) not in cache:
            cache[g, p] = estimate_device_profile(g, shape, precision=p, **kwargs)
        devices.append(cache[g, p])
    uniform = per_rank[0] if len(set(per_rank)) == 1 else "fp32"
    extra = {"cluster": cluster.name, "model_shape": shape.name,
             "dtype": rank_precisions_tag(per_rank)}
    if not (isinstance(precision, str) and precision in PRECISIONS):
        extra["rank_precisions"] = list(per_rank)
    return ClusterProfile(model=_model_in_precision(shape, uniform), devices=devices,
                          comm=estimate_comm_profile(shape, len(gpus), bw),
                          source="spec-sheet estimate", offload_activations=True,
                          machine_of_rank=cluster.machine_of_rank,
                          host_memory_bytes=cluster.host_memory_bytes(),
                          extra=extra)
