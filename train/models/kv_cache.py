"""Keys and values kept per attention layer while a batch is decoded greedily.

The first pass (the prompt, "prefill") sees whole left-padded prompts laid out (B, P): it
attends causally, never to padding, and stores its keys and values. Every later pass sees one
new position per sequence, laid out (1, B): the batch stands where the sequence usually does,
so tensor-parallel layers, which shard or gather the sequence dimension, work on the batch
unchanged. RoPE is relative, so left padding shifts every position of a sequence alike and
changes no score.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, key_valid: torch.Tensor) -> None:
        """``key_valid`` (B, P + new tokens): false at each prompt's left padding."""
        self.key_valid = key_valid
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over the cache and the new ``k``, ``v`` (B, T, heads, head_dim),
        which it stores; the output in the layout of ``q``."""
        if self.keys is None:
            return self._prefill(q, k, v)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (B, 1, heads, head_dim)
        self.keys[:, self.length] = k[:, 0]
        self.values[:, self.length] = v[:, 0]
        self.length += 1
        keys, values = self.keys[:, : self.length], self.values[:, : self.length]
        mask = self.key_valid[:, None, None, : self.length]
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )
        return y.transpose(1, 2).transpose(0, 1)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, prompt = q.shape[:2]
        total = self.key_valid.shape[1]
        self.keys = k.new_zeros((batch, total, *k.shape[2:]))
        self.values = v.new_zeros((batch, total, *v.shape[2:]))
        self.keys[:, :prompt], self.values[:, :prompt] = k, v
        self.length = prompt
        causal = torch.ones(prompt, prompt, dtype=torch.bool, device=q.device).tril()
        # A padding query may see itself, so that no row of the softmax is empty.
        itself = torch.eye(prompt, dtype=torch.bool, device=q.device)
        visible = self.key_valid[:, None, :prompt] | itself
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=(causal & visible)[:, None],
            enable_gqa=True,
        )
        return y.transpose(1, 2)
