"""A model's own facts for spec-sheet planning, read from a meta-device build of its config.

``ConfigShape`` is what ``hf-cephalo plan / simulate --model <config>`` prices when the model is
not one of the hand-written ``specs.MODEL_SHAPES``: the ``ModelProfile`` the runtime plans with
(``profiler.model_facts.model_profile`` of the staged model: units, each layer's elements,
embedding / head split, ties), and per layer what the compute estimate needs: the matmul
elements one token runs through (experts weighted by the router's top-k share) and the keys one
query attends to (the sequence, or a sliding window). Pure data (no torch): the profiler builds
it (``profiler.config_shape``), ``specs.estimate_cluster_profile`` prices it like a
``ModelShape``. The formulas: docs/planner.md, "Spec-sheet formulas".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_cephalo.profiles.types import ModelProfile

__all__ = ["ConfigShape"]


@dataclass(frozen=True, kw_only=True)
class ConfigShape:
    """A transformers model's shape as the spec-sheet estimate prices it.

    Attributes:
        name: the model's name in profiles and plans (its config folder, Hub id or model_type).
        profile: the ``ModelProfile`` of the staged meta-device model (fp32 elements;
            ``unit_params`` where layers differ in size).
        hidden: hidden size h of the text model.
        heads: attention heads a (query heads).
        head_dim: elements of one head (``heads * head_dim`` = the attention width).
        kv_heads: key/value heads (grouped-query attention).
        vocab: vocabulary size V (the LM head's logits per token).
        seq_len: tokens per sample s the estimate prices.
        unit_matmul_params: per layer, the weight-matrix elements ONE token runs through
            (a routed expert's weights count top_k / num_experts of theirs; norms and biases
            not counted).
        unit_attention_span: per layer, the keys one query attends to: ``seq_len``, or
            ``min(seq_len, sliding_window)`` for a sliding-window (local) attention layer.
        layer_kinds: per layer, its attention kind as the config names it (``layer_types``)
            and ``+moe`` for a layer with routed experts.
        num_experts / experts_per_token: routed experts per MoE layer and the router's top-k
            (0 for a dense model).
        source: where the shape comes from (the config's path or id).
    """

    name: str
    profile: ModelProfile
    hidden: int
    heads: int
    head_dim: int
    kv_heads: int
    vocab: int
    seq_len: int
    unit_matmul_params: tuple[int, ...]
    unit_attention_span: tuple[int, ...]
    layer_kinds: tuple[str, ...]
    num_experts: int = 0
    experts_per_token: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        n = self.profile.num_units
        for field_name in ("unit_matmul_params", "unit_attention_span", "layer_kinds"):
            if len(getattr(self, field_name)) != n:
                raise ValueError(f"ConfigShape {self.name!r}: {field_name} has "
                                 f"{len(getattr(self, field_name))} entries, the model {n} layers")
        if self.seq_len < 1:
            raise ValueError(f"ConfigShape {self.name!r}: seq_len must be >= 1, got "
                             f"{self.seq_len} (CLI: --sequence-length)")

    @property
    def num_layers(self) -> int:
        return self.profile.num_units

    @property
    def unit_params(self) -> list[int]:
        """Elements of each layer, in order."""
        p = self.profile
        return list(p.unit_params) if p.unit_params is not None else \
            [p.params_per_unit] * p.num_units

    @property
    def params_per_layer(self) -> int:
        """The layers' mean element count (rounded): the size whose collectives are priced
        ([Note: layers of different sizes] in profiler/model_facts.py)."""
        sizes = self.unit_params
        return round(sum(sizes) / len(sizes))

    @property
    def num_params(self) -> int:
        return sum(self.unit_params) + self.profile.params_other

    @property
    def active_params(self) -> int:
        """Elements one token runs through: the layers' matmuls (experts by their top-k share)
        plus the root's (embedding, head)."""
        return sum(self.unit_matmul_params) + self.profile.params_other

    def layer_fwd_flops(self) -> float:
        """Forward FLOPs of one sample through one layer, the mean over layers:
        2·P_matmul·s + 4·s·span·(a·d) (QKᵀ and attention·V over the keys each query sees)."""
        s, width = self.seq_len, self.heads * self.head_dim
        total = sum(2.0 * p * s + 4.0 * s * span * width
                    for p, span in zip(self.unit_matmul_params, self.unit_attention_span))
        return total / self.num_layers

    def activation_bytes_per_sample(self) -> float:
        """fp32 activation bytes of one sample in the largest layer's recompute + backward
        (s·h·(34 + 5·a·span/h), doubled for fp32) plus the LM head's logits and their gradient
        (2·s·V·4)."""
        s, h, a = self.seq_len, self.hidden, self.heads
        layer = max(2.0 * s * h * (34 + 5 * a * span / h) for span in self.unit_attention_span)
        return layer + 2.0 * s * self.vocab * 4

    def lora_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of the attention projections LoRA adapts."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}

    def model_profile(self) -> ModelProfile:
        """The staged model's profile with fp32 hidden states at the unit boundary
        (4·s·h bytes per sample), named ``name``."""
        return replace(self.profile, name=self.name,
                       boundary_bytes_per_sample=4.0 * self.seq_len * self.hidden)
