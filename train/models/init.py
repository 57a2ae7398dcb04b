"""Initial weights by parameter name, so every layout starts from the same model.

Each parameter's full initial value is drawn from a generator seeded by (init seed, canonical
name), never from a global RNG stream whose order depends on how modules were built or wrapped.
A rank then keeps only its own shard of that value. Models are built on the meta device,
parallelized, materialized with ``to_empty`` (each rank allocates its shards only) and filled
here, so the weights are bitwise those of a single process for the same ``model.init_seed``,
whatever the layout, and a model too large for one process can still be built. The cost is one
full parameter at a time on the CPU, never the whole model.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from train.models.hf_encoder import FrozenStatisticsNorm
from train.models.hf_encoder_config import PARAKEET_ATTENTION_BIASES
from train.models.lora import is_adapter_b
from train.models.moe import GroupedExperts

# Wrappers that sit between a module and its children without changing the model's meaning
# (peft's LoRA layer keeps the layer it adapts as ``base_layer``).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "base_layer.")
# Norm parameters that start at one (scales and variances); shifts and means start at zero.
NORM_ONES = frozenset({"weight", "running_var"})


def canonical_name(name: str) -> str:
    """A parameter's name as a plain single-process model has it (and as checkpoints store it)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def name_seed(init_seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{init_seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _fan_in(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        return module.in_channels * math.prod(module.kernel_size) // module.groups
    raise TypeError(f"no fan-in rule for {type(module).__name__}")


def initial_value(
    module: nn.Module, attr: str, shape: torch.Size, generator: torch.Generator
) -> torch.Tensor:
    """The full fp32 initial value of ``module.<attr>`` (torch's defaults for its layer types),
    on the CPU, where ``generator`` draws: the same values whatever the device and layout."""
    if isinstance(module, nn.RMSNorm | nn.LayerNorm | FrozenStatisticsNorm):
        fill = torch.ones if attr in NORM_ONES else torch.zeros
        return fill(shape, device="cpu")
    if attr in PARAKEET_ATTENTION_BIASES:  # zeros, as transformers constructs them
        return torch.zeros(shape, device="cpu")
    if isinstance(module, nn.Embedding):
        return torch.randn(shape, generator=generator, device="cpu")
    if isinstance(module, GroupedExperts):
        return torch.randn(shape, generator=generator, device="cpu") * shape[1] ** -0.5
    if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d):
        bound = 1 / math.sqrt(_fan_in(module))
        return torch.empty(shape, device="cpu").uniform_(-bound, bound, generator=generator)
    raise TypeError(f"no initialization rule for {type(module).__name__}.{attr}")


def linear_owners(model: nn.Module) -> dict[int, nn.Linear]:
    """The linear layer that owns each weight, by the weight's id: a tied embedding's matrix
    is also its output layer's weight, and is drawn by that layer's rule."""
    return {id(m.weight): m for m in model.modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def init_weights(model: nn.Module, init_seed: int) -> None:
    """Fill every parameter of ``model`` (plain or sharded DTensors, already materialized); a
    tied parameter once, under its first owner's name; a LoRA B matrix with zeros, so the
    adapted model starts as the model.

    A tied embedding is drawn by the output layer's rule (uniform within 1/sqrt(d_model), as
    an untied head; torchtitan likewise gives a tied weight its head's init): drawn from the
    embedding's N(0, 1), every logit would be N(0, d_model) and a from-scratch run at Llama 3.2
    1B's shape would start at a loss near 1,900 rather than near ln(vocab)."""
    owners = linear_owners(model)
    filled: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in filled:
                continue
            filled.add(id(param))
            name = canonical_name(f"{module_name}.{attr}" if module_name else attr)
            generator = torch.Generator().manual_seed(name_seed(init_seed, name))
            rule = owners.get(id(param), module)
            if is_adapter_b(name):
                full = torch.zeros(param.shape, dtype=param.dtype, device="cpu")
            else:
                full = initial_value(rule, attr, param.shape, generator).to(param.dtype)
            if isinstance(param, DTensor):
                shard = distribute_tensor(
                    full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                )
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)
