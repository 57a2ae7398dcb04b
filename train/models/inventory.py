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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from train.models.lora import adapter_names
from train.models.shape import SALMConfig, encoder_lens, llm_head_dim

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


def inventory(cfg: SALMConfig) -> list[ParamTensor]:
    """The model's parameters in ``named_parameters`` order."""
    c, d = cfg.enc_dim, cfg.d_model
    first = {"block": None, "section": "first"}
    tensors = [
        ParamTensor("encoder.conv1.weight", (c, 1, 3, 3), **first),
        ParamTensor("encoder.conv1.bias", (c,), **first),
        ParamTensor("encoder.conv2.weight", (c, c, 3, 3), **first),
        ParamTensor("encoder.conv2.bias", (c,), **first),
        *_linear("encoder.conv_out", c, c * encoder_lens(cfg.n_mels), True, **first),
    ]
    for index in range(cfg.enc_layers):
        heads = cfg.enc_heads
        prefix = f"encoder.layers.{index}"
        tensors += _block(prefix, c, heads, heads, cfg.enc_ffn_hidden, cfg, None)
    tensors.append(ParamTensor("encoder.norm.weight", (c,), **first))
    tensors += _linear("projector.0", d, c, True, **first)
    tensors += _linear("projector.2", d, d, True, **first)
    tensors.append(ParamTensor("llm.embed.weight", (cfg.vocab_size, d), **first))
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
