"""Every parameter tensor of a SALM, by name and shape, and how each layout places it.

Written from the model's shape alone (no torch), so the planner can price thousands of layouts
of a 70B model in well under a second. A unit test holds the inventory to the model's own
``named_parameters``, name by name, for every preset; another holds the per-rank bytes below to
what the trainer measures (``train/memory.py``).

Placement, as ``train.models.parallelize`` applies it:

- TP (LLM only): q/k/v projections, the FFN's w1/w3 and the output head are column-parallel
  (dim 0 split), the attention output and w2 row-parallel (dim 1 split); norms and the MoE
  router stay whole. Splits follow ``torch.chunk``: ``ceil(n / tp)`` rows, the last ranks fewer.
- LoRA (``train.models.lora``): an adapter's A is split like its base's input (row-parallel
  bases), its B like its base's output (column-parallel bases); the rest stays whole.
- EP: each expert tensor (experts, a, b) keeps ``experts / ep`` experts.
- FSDP2 (when it runs): every dense tensor's dim 0 is split over dp_shard x cp, each shard padded
  to ``ceil(n / shards)`` rows (FSDP2 allocates the padded shard). Experts are split over the
  efsdp ranks, on dim 0 while each rank still gets whole experts, else on dim 1.
- PP: a rank holds the tensors of its stages only (stage 0 the encoder, projector and
  embeddings; the last stage the final norm and head).

A pretrained encoder (``train.models.hf_encoder``) is listed under transformers' names, with the
tensors that never train (Whisper's position table, Parakeet's batch-norm statistics) marked
untrainable: they get no gradient and no optimizer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from train.models.hf_encoder_config import PARAKEET_ATTENTION_BIASES
from train.models.lora import adapter_names
from train.models.shape import OWN_ENCODER, SALMConfig, llm_head_dim, subsampled_lens

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class ParamTensor:
    """One parameter: its name in the whole model, shape, and how TP and EP treat it."""

    name: str
    shape: tuple[int, ...]
    block: int | None  # the LLM block holding it; None outside the LLM's blocks
    section: str  # "first" (stage 0 only), "block", "last" (last stage only)
    tp: str | None = None  # COLUMN, ROW or None (whole on every TP rank)
    expert: bool = False
    trainable: bool = True  # False: frozen whatever model.freeze says

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(name: str, out: int, inp: int, bias: bool, **kw) -> list[ParamTensor]:
    tensors = [ParamTensor(f"{name}.weight", (out, inp), **kw)]
    if bias:
        tensors.append(ParamTensor(f"{name}.bias", (out,), **kw))
    return tensors


def _adapted(
    prefix: str, module: str, out: int, inp: int, bias: bool, tp: str | None, cfg: SALMConfig, **kw
) -> list[ParamTensor]:
    """A projection of an LLM block with its LoRA adapter when ``cfg`` targets it: A (rank, in)
    split like the base's input under TP, B (out, rank) like the base's output."""
    tensors = _linear(f"{prefix}.{module}", out, inp, bias, tp=tp, **kw)
    if module in cfg.lora_targets:
        a, b = adapter_names(f"{prefix}.{module}")
        tensors.append(ParamTensor(a, (cfg.lora_rank, inp), tp=ROW if tp == ROW else None, **kw))
        tensors.append(ParamTensor(b, (out, cfg.lora_rank), tp=tp if tp == COLUMN else None, **kw))
    return tensors


def _block(
    prefix: str, dim: int, heads: int, kv_heads: int, ffn: int, cfg: SALMConfig, block: int | None
) -> list[ParamTensor]:
    """A transformer block's tensors; TP rules only for the LLM's blocks."""
    section = "first" if block is None else "block"
    llm = block is not None

    def rule(kind: str) -> str | None:
        return kind if llm else None

    head_dim = llm_head_dim(cfg) if llm else dim // heads
    bias = llm and cfg.qkv_bias
    kw = {"block": block, "section": section}
    # LoRA adapts the LLM's projections only (the encoder's blocks have no targets).
    adapted = cfg if llm else SALMConfig()
    tensors = [ParamTensor(f"{prefix}.attn_norm.weight", (dim,), **kw)]
    q, kv = heads * head_dim, kv_heads * head_dim
    tensors += _adapted(prefix, "attn.wq", q, dim, bias, rule(COLUMN), adapted, **kw)
    tensors += _adapted(prefix, "attn.wk", kv, dim, bias, rule(COLUMN), adapted, **kw)
    tensors += _adapted(prefix, "attn.wv", kv, dim, bias, rule(COLUMN), adapted, **kw)
    tensors += _adapted(prefix, "attn.wo", dim, q, False, rule(ROW), adapted, **kw)
    if llm and cfg.qk_norm:
        tensors.append(ParamTensor(f"{prefix}.attn.q_norm.weight", (head_dim,), **kw))
        tensors.append(ParamTensor(f"{prefix}.attn.k_norm.weight", (head_dim,), **kw))
    tensors.append(ParamTensor(f"{prefix}.ffn_norm.weight", (dim,), **kw))
    if llm and cfg.n_experts:
        e, h = cfg.n_experts, cfg.moe_hidden
        tensors += _linear(f"{prefix}.moe.router", e, dim, False, **kw)
        for name, shape in (("w1", (e, dim, h)), ("w3", (e, dim, h)), ("w2", (e, h, dim))):
            tensors.append(ParamTensor(f"{prefix}.moe.experts.{name}", shape, expert=True, **kw))
    else:
        tensors += _adapted(prefix, "ffn.w1", ffn, dim, False, rule(COLUMN), adapted, **kw)
        tensors += _adapted(prefix, "ffn.w3", ffn, dim, False, rule(COLUMN), adapted, **kw)
        tensors += _adapted(prefix, "ffn.w2", dim, ffn, False, rule(ROW), adapted, **kw)
    return tensors


FIRST = {"block": None, "section": "first"}


def _first(name: str, shape: tuple[int, ...], bias: bool = True, **kw) -> list[ParamTensor]:
    """A stage-0 layer's weight of ``shape``, and its bias (one per output) if ``bias``."""
    tensors = [ParamTensor(f"{name}.weight", shape, **FIRST, **kw)]
    return tensors + ([ParamTensor(f"{name}.bias", shape[:1], **FIRST, **kw)] if bias else [])


def _own_encoder(cfg: SALMConfig) -> list[ParamTensor]:
    c = cfg.enc_dim
    tensors = [
        *_first("encoder.conv1", (c, 1, 3, 3)),
        *_first("encoder.conv2", (c, c, 3, 3)),
        *_first("encoder.conv_out", (c, c * subsampled_lens(cfg.n_mels, 2))),
    ]
    for index in range(cfg.enc_layers):
        heads = cfg.enc_heads
        prefix = f"encoder.layers.{index}"
        tensors += _block(prefix, c, heads, heads, cfg.enc_ffn_hidden, cfg, None)
    return tensors + _first("encoder.norm", (c,), bias=False)


def _whisper_encoder(cfg: SALMConfig) -> list[ParamTensor]:
    """transformers' WhisperEncoder: convolutions, the frozen position table, pre-norm blocks."""
    c, f = cfg.enc_dim, cfg.enc_ffn_hidden
    tensors = [
        *_first("encoder.conv1", (c, cfg.n_mels, 3)),
        *_first("encoder.conv2", (c, c, 3)),
        *_first("encoder.embed_positions", (cfg.enc_positions, c), bias=False, trainable=False),
    ]
    for index in range(cfg.enc_layers):
        layer = f"encoder.layers.{index}"
        tensors += _first(f"{layer}.self_attn.k_proj", (c, c), bias=False)
        for name in ("v_proj", "q_proj", "out_proj"):
            tensors += _first(f"{layer}.self_attn.{name}", (c, c))
        tensors += _first(f"{layer}.self_attn_layer_norm", (c,))
        tensors += _first(f"{layer}.fc1", (f, c)) + _first(f"{layer}.fc2", (c, f))
        tensors += _first(f"{layer}.final_layer_norm", (c,))
    return tensors + _first("encoder.layer_norm", (c,))


def _feed_forward(name: str, dim: int, hidden: int, bias: bool) -> list[ParamTensor]:
    return _first(f"{name}.linear1", (hidden, dim), bias) + _first(
        f"{name}.linear2", (dim, hidden), bias
    )


def _parakeet_encoder(cfg: SALMConfig) -> list[ParamTensor]:
    """transformers' ParakeetEncoder: subsampling convolutions (a full one, then a depthwise
    and a pointwise one per further halving), then FastConformer blocks: two half-step FFNs
    around relative-position attention and a convolution module, whose batch norm's
    statistics are frozen."""
    c, f, ch = cfg.enc_dim, cfg.enc_ffn_hidden, cfg.enc_conv_channels
    bias, conv_bias = cfg.enc_bias, cfg.enc_conv_bias
    tensors = _first("encoder.subsampling.layers.0", (ch, 1, 3, 3))
    for stage in range(1, cfg.enc_subsampling.bit_length() - 1):  # modules: conv, ReLU, ...
        tensors += _first(f"encoder.subsampling.layers.{3 * stage - 1}", (ch, 1, 3, 3))
        tensors += _first(f"encoder.subsampling.layers.{3 * stage}", (ch, ch, 1, 1))
    tensors += _first("encoder.subsampling.linear", (c, ch * (cfg.n_mels // cfg.enc_subsampling)))
    for index in range(cfg.enc_layers):
        layer = f"encoder.layers.{index}"
        tensors += _feed_forward(f"{layer}.feed_forward1", c, f, bias)
        head = (cfg.enc_heads, c // cfg.enc_heads)
        tensors += [
            ParamTensor(f"{layer}.self_attn.{name}", head, **FIRST)
            for name in PARAKEET_ATTENTION_BIASES
        ]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += _first(f"{layer}.self_attn.{name}", (c, c), bias)
        tensors += _first(f"{layer}.self_attn.relative_k_proj", (c, c), bias=False)
        tensors += _first(f"{layer}.conv.pointwise_conv1", (2 * c, c, 1), conv_bias)
        tensors += _first(f"{layer}.conv.depthwise_conv", (c, 1, cfg.enc_conv_kernel), conv_bias)
        tensors += _first(f"{layer}.conv.norm", (c,))
        for name in ("running_mean", "running_var"):
            tensors.append(ParamTensor(f"{layer}.conv.norm.{name}", (c,), trainable=False, **FIRST))
        tensors += _first(f"{layer}.conv.pointwise_conv2", (c, c, 1), conv_bias)
        tensors += _feed_forward(f"{layer}.feed_forward2", c, f, bias)
        for name in CONFORMER_NORMS:
            tensors += _first(f"{layer}.{name}", (c,))
    return tensors


CONFORMER_NORMS = (
    "norm_feed_forward1",
    "norm_self_att",
    "norm_conv",
    "norm_feed_forward2",
    "norm_out",
)
ENCODER_INVENTORIES = {
    OWN_ENCODER: _own_encoder,
    "whisper": _whisper_encoder,
    "parakeet": _parakeet_encoder,
}


def inventory(cfg: SALMConfig) -> list[ParamTensor]:
    """The model's parameters in ``named_parameters`` order."""
    d = cfg.d_model
    tensors = ENCODER_INVENTORIES[cfg.encoder](cfg)
    tensors += _first("projector.0", (d, cfg.projector_stride * cfg.enc_dim))
    tensors += _first("projector.2", (d, d))
    tensors.append(ParamTensor("llm.embed.weight", (cfg.vocab_size, d), **FIRST))
    for index in range(cfg.n_layers):
        tensors += _block(
            f"llm.layers.{index}", d, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg, index
        )
    last = {"block": None, "section": "last"}
    tensors.append(ParamTensor("llm.norm.weight", (d,), **last))
    if not cfg.tie_embeddings:  # a tied head is the embedding: named_parameters lists it once
        tensors += _linear("llm.lm_head", cfg.vocab_size, d, False, tp=COLUMN, **last)
    return tensors


def stage_param_counts(tensors: list[ParamTensor], n_layers: int) -> tuple[list[int], int, int]:
    """(parameters per LLM block, the first stage's extra, the last stage's extra): what the
    pipeline's balanced split weighs."""
    blocks = [0] * n_layers
    first = last = 0
    for tensor in tensors:
        if tensor.section == "block":
            blocks[tensor.block] += tensor.numel
        elif tensor.section == "first":
            first += tensor.numel
        else:
            last += tensor.numel
    return blocks, first, last
