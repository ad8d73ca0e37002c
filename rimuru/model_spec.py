"""The numbers of a model that memory planning needs, read from a Hugging Face config.json.

A `ModelSpec` is built once and never changes. It knows nothing about devices or dtypes of a run;
page sizes are derived from it by `rimuru.memory.geometry`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESETS_DIR = Path(__file__).parent / "presets"

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# Architectures whose routed experts use `intermediate_size` (they have no `moe_intermediate_size`).
_EXPERT_WIDTH_IS_INTERMEDIATE = {"mixtral", "olmoe"}
# Architectures whose attention projections (q, k, v) carry a bias even though the config has no flag.
_QKV_BIAS_BY_DEFAULT = {"qwen2_moe"}
# Architectures with RMSNorm on q and k per head (Qwen3 family) or over the whole projection (OLMoE).
_PER_HEAD_QK_NORM = {"qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
_FULL_WIDTH_QK_NORM = {"olmoe"}
# Qwen3.5-MoE (the multimodal wrapper and its text model): always renormalises the top-k routing weights
# and always gates attention output, whatever the config says (transformers hard-codes both; the public
# configs carry no norm_topk_prob), and without layer_types every 4th layer is full attention.
_QWEN3_5 = {"qwen3_5_moe", "qwen3_5_moe_text"}
_QWEN3_5_FULL_ATTENTION_INTERVAL = 4
# Qwen3-Next: the same hybrid layers; transformers always gates attention output, and its config defaults are
# full attention every 4th layer, norm_topk_prob true and partial_rotary_factor 0.25 (used where config.json omits
# them).
_QWEN3_NEXT = {"qwen3_next"}
_QWEN3_NEXT_PARTIAL_ROTARY_FACTOR = 0.25

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1}


class ModelSpecError(ValueError):
    """A config.json that Rimuru cannot plan memory for (missing or inconsistent fields)."""


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype, or of a dtype name such as "bfloat16"."""
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ModelSpecError(f"unknown dtype {dtype!r}; known names: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _require(d: dict[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ModelSpecError(f"config.json lacks required field {key!r} (model_type={d.get('model_type')!r})")
    return d[key]


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    # Width of the dense MLP of layers that are not MoE (0 when every layer is MoE and none is given).
    intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    attention_bias: bool
    attn_output_gate: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    eos_token_id: tuple[int, ...]
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # Fraction of each attention head's dims that rotary rotates (Qwen3.5: 0.25 of 256).
    partial_rotary_factor: float = 1.0

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        if not isinstance(config, dict):
            raise ModelSpecError(f"expected a config dict, got {type(config).__name__}")
        # Qwen3.5 (multimodal) nests the language model under text_config; outer keys fill gaps.
        text = config.get("text_config")
        d = {**config, **text} if isinstance(text, dict) else dict(config)
        model_type = str(config.get("model_type") or d.get("model_type") or "")
        if not model_type:
            raise ModelSpecError("config.json has no model_type")

        hidden = int(_require(d, "hidden_size"))
        layers = int(_require(d, "num_hidden_layers"))
        heads = int(_require(d, "num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)

        num_experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
        if num_experts <= 0:
            raise ModelSpecError(f"{model_type!r} config has no routed experts (num_experts / num_local_experts)")
        if model_type in _EXPERT_WIDTH_IS_INTERMEDIATE:
            moe_inter = int(_require(d, "intermediate_size"))
            dense_inter = 0
        else:
            moe_inter = int(_require(d, "moe_intermediate_size"))
            dense_inter = int(d.get("intermediate_size") or 0)
        top_k = int(_require(d, "num_experts_per_tok"))
        if not 0 < top_k <= num_experts:
            raise ModelSpecError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")

        qwen3_5 = model_type in _QWEN3_5
        qwen3_next = model_type in _QWEN3_NEXT
        if (qwen3_5 or qwen3_next) and d.get("layer_types") is None and not d.get("full_attention_interval"):
            d["full_attention_interval"] = _QWEN3_5_FULL_ATTENTION_INTERVAL
        layer_types = cls._layer_types(d, layers)
        moe_layers = cls._moe_layers(d, layers)

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = d.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None)
        partial_factor = d.get("partial_rotary_factor") or (
            rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
        if partial_factor is None and qwen3_next:
            partial_factor = _QWEN3_NEXT_PARTIAL_ROTARY_FACTOR
        partial_factor = float(partial_factor if partial_factor is not None else 1.0)
        if not 0.0 < partial_factor <= 1.0:
            raise ModelSpecError(f"partial_rotary_factor={partial_factor} must be in (0, 1]")
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=layers,
            vocab_size=int(_require(d, "vocab_size")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_inter,
            intermediate_size=dense_inter,
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=qwen3_5 or bool(d.get("norm_topk_prob", model_type in {"mixtral", *_QWEN3_NEXT})),
            layer_types=layer_types,
            moe_layers=moe_layers,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            max_position_embeddings=int(d.get("max_position_embeddings") or 0),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            attention_bias=bool(d.get("attention_bias", model_type in _QKV_BIAS_BY_DEFAULT)),
            attn_output_gate=qwen3_5 or qwen3_next or bool(d.get("attn_output_gate", False)),
            linear_num_key_heads=int(d.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(d.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(d.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(d.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim") or 0),
            eos_token_id=eos_ids,
            hf_config=dict(config),
            partial_rotary_factor=partial_factor,
        )

    @staticmethod
    def _layer_types(d: dict[str, Any], layers: int) -> tuple[str, ...]:
        given = d.get("layer_types")
        if given is not None:
            types = tuple(str(t) for t in given)
            if len(types) != layers:
                raise ModelSpecError(f"layer_types has {len(types)} entries, num_hidden_layers={layers}")
            bad = sorted({t for t in types} - {FULL_ATTENTION, LINEAR_ATTENTION})
            if bad:
                raise ModelSpecError(f"unsupported layer types {bad}; expected {FULL_ATTENTION!r}/{LINEAR_ATTENTION!r}")
            return types
        interval = d.get("full_attention_interval")
        if interval and d.get("linear_num_value_heads"):
            # Hybrid without an explicit list: every interval-th layer is full attention (Qwen3-Next rule).
            return tuple(FULL_ATTENTION if (i + 1) % int(interval) == 0 else LINEAR_ATTENTION for i in range(layers))
        return (FULL_ATTENTION,) * layers

    @staticmethod
    def _moe_layers(d: dict[str, Any], layers: int) -> tuple[bool, ...]:
        # Same rule as the HF Qwen MoE models: layer i is sparse unless listed in mlp_only_layers,
        # and only every decoder_sparse_step-th layer is sparse.
        step = int(d.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in (d.get("mlp_only_layers") or [])}
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelSpec:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_hf_config(json.loads(path.read_text()))

    @classmethod
    def from_preset(cls, name: str) -> ModelSpec:
        path = PRESETS_DIR / f"{name}.json"
        if not path.is_file():
            raise ModelSpecError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
        return cls.from_hf_config(json.loads(path.read_text()))

    # ------------------------------------------------------------------ derived values

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layer_ids)

    @property
    def expert_matrix_numel(self) -> int:
        """Elements of one of W1 / W3 / W2 of one expert (all three are f x d or d x f)."""
        return self.moe_intermediate_size * self.hidden_size

    @property
    def num_routed_experts_total(self) -> int:
        return self.num_moe_layers * self.num_experts

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short convolution over q, k and v of a linear-attention layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def routed_expert_params(self) -> int:
        return self.num_routed_experts_total * 3 * self.expert_matrix_numel

    def non_expert_params(self) -> int:
        """Every weight that is not a routed expert: embeddings, attention, norms, routers, shared experts.

        Counted from the architecture as transformers builds it (MTP heads and vision towers excluded).
        """
        h = self.hidden_size
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h  # embed, lm_head, final norm
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        for i in range(self.num_hidden_layers):
            total += 2 * h  # input and post-attention RMSNorm
            if self.layer_types[i] == FULL_ATTENTION:
                total += h * q_out * (2 if self.attn_output_gate else 1) + 2 * h * kv_out + q_out * h
                if self.attention_bias:
                    total += q_out + 2 * kv_out
                if self.model_type in _PER_HEAD_QK_NORM:
                    total += 2 * self.head_dim
                elif self.model_type in _FULL_WIDTH_QK_NORM:
                    total += q_out + kv_out
            else:
                vh = self.linear_num_value_heads
                total += h * (self.linear_conv_dim + self.linear_value_dim + 2 * vh)  # in_proj qkv, z, b, a
                total += self.linear_conv_dim * self.linear_conv_kernel_dim  # depthwise conv, no bias
                total += 2 * vh + self.linear_value_head_dim  # dt_bias, A_log, gated norm
                total += self.linear_value_dim * h  # out_proj
            if self.moe_layers[i]:
                total += h * self.num_experts  # router
                if self.shared_expert_intermediate_size:
                    total += 3 * h * self.shared_expert_intermediate_size + h  # shared expert + its gate
            else:
                total += 3 * h * self.intermediate_size
        return total

    def routed_expert_bytes(self, dtype: Any = "bfloat16") -> int:
        return self.routed_expert_params() * dtype_bytes(dtype)

    def non_expert_bytes(self, dtype: Any = "bfloat16") -> int:
        return self.non_expert_params() * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: Any = "bfloat16") -> int:
        return len(self.attention_layer_ids) * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes(dtype)

    def state_bytes_per_request(self, dtype: Any = "bfloat16") -> int:
        """A hybrid model's per-request state over all linear-attention layers, unpadded: the recurrent state
        [Hv, dk, dv] in fp32 and the conv state [conv_dim, kernel - 1] in `dtype` (0 for other models)."""
        rec = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.linear_conv_dim * max(0, self.linear_conv_kernel_dim - 1) * dtype_bytes(dtype)
        return len(self.linear_layer_ids) * (rec + conv)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers or len(self.moe_layers) != self.num_hidden_layers:
            raise ModelSpecError("layer_types and moe_layers must have one entry per layer")
        if self.is_hybrid and not (self.linear_num_value_heads and self.linear_key_head_dim):
            raise ModelSpecError("linear_attention layers need linear_num_value_heads and linear_*_head_dim")
        if math.prod((self.hidden_size, self.moe_intermediate_size)) <= 0:
            raise ModelSpecError("hidden_size and moe_intermediate_size must be positive")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_model_spec(name_or_dir: str | Path) -> ModelSpec:
    """A preset name (see `preset_names()`) or a directory holding a config.json."""
    path = Path(name_or_dir)
    if path.is_dir():
        return ModelSpec.from_pretrained(path)
    if str(name_or_dir) in preset_names():
        return ModelSpec.from_preset(str(name_or_dir))
    raise ModelSpecError(
        f"{name_or_dir!r} is neither a directory with config.json nor a preset ({', '.join(preset_names())})"
    )
