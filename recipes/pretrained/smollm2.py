"""SmolLM2-135M-Instruct from its Q4_1 GGUF to transformers' ``LlamaForCausalLM`` safetensors,
and the checks of a conversion against the GGUF as transformers loads it.

transformers reads the GGUF with the ``gguf`` package and dequantizes every tensor (undoing
llama.cpp's q/k row permutation); ``save_pretrained`` refuses such a model (it still carries its
``quantization_config``), so the weights move into a fresh ``LlamaForCausalLM`` of the same config
without it. They are kept in fp32: each Q4_1 block is ``d * q + m`` with fp16 ``d`` and ``m``,
which bf16 would round and fp32 holds exactly (540 MB; the trainer's parameters are fp32). The
tokenizer, its ChatML template (with SmolLM's default system prompt) and the generation config
(bos 1 ``<|im_start|>``, eos 2 ``<|im_end|>``) come from the GGUF's metadata.
"""

from __future__ import annotations

from pathlib import Path

import torch

BOS_ID, EOS_ID = 1, 2
# A chat prompt whose answer the model knows, and the word its greedy reply must contain.
CHAT_CHECK = ("What is the capital of France?", "Paris")


def load_gguf(path: Path):
    """The GGUF's model (dequantized, fp32, eval mode) and tokenizer, as transformers loads them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def convert(gguf: Path, out: Path):
    """Write ``out``: fp32 safetensors, config, generation config and tokenizer; returns the
    GGUF-loaded model and tokenizer for the checks."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    source, tokenizer = load_gguf(gguf)
    fields = source.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "architectures", "transformers_version"):
        fields.pop(key, None)
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return source, tokenizer


def chat_ids(tokenizer, question: str) -> torch.Tensor:
    """(1, L) token ids of one user turn with the template's generation prompt."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    return encoded["input_ids"]


@torch.no_grad()
def greedy_reply(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    ids = chat_ids(tokenizer, question).to(model.device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@torch.no_grad()
def check(out: Path, source, source_tokenizer) -> list[str]:
    """The converted model in ``out`` against the GGUF-loaded ``source``: logits on a chat
    prompt equal (fp32, bitwise), the special ids, the chat template's text, a sensible reply.
    Returns the findings as lines; raises on the first that fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    question, expected = CHAT_CHECK
    ids = chat_ids(tokenizer, question)
    if not torch.equal(ids, chat_ids(source_tokenizer, question)):
        raise ValueError("the converted tokenizer encodes the chat prompt unlike the GGUF's")
    difference = (model(ids).logits - source(ids).logits).abs().max().item()
    if difference != 0.0:
        raise ValueError(f"logits differ from the GGUF-loaded model's by {difference:.3g}")
    specials = (tokenizer.bos_token_id, tokenizer.eos_token_id)
    if specials != (BOS_ID, EOS_ID):
        raise ValueError(f"bos/eos ids are {specials}, expected {(BOS_ID, EOS_ID)}")
    reply = greedy_reply(model, tokenizer, question)
    if expected not in reply:
        raise ValueError(f"asked {question!r}, the converted model replied {reply!r}")
    return [
        f"logits on a {ids.shape[1]}-token chat prompt equal the GGUF-loaded model's (max |d| 0.0)",
        f"bos {BOS_ID} {tokenizer.bos_token}, eos {EOS_ID} {tokenizer.eos_token}",
        f"{question!r} -> {reply.strip()!r}",
    ]
