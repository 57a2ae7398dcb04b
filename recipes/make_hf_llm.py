"""Write a small random-init Hugging Face decoder with its own tokenizer, for a pretrained-LLM
run that learns on CPU (recipes/train_asr_hf.yaml).

    python recipes/make_hf_llm.py --corpus data/corpus_asr --out data/hf/qwen2_asr

The decoder is Qwen2-shaped (q/k/v biases, GQA, tied embeddings; ``--hidden``, ``--layers``,
...), initialized by ``transformers`` and written with ``save_pretrained``: the same files a
downloaded model has, so ``model.pretrained_llm`` takes it as it takes a real one. The tokenizer
is a byte-level BPE trained offline with ``tokenizers`` on the corpus's training transcripts
(every byte is a token, so any text encodes), with Qwen2's special tokens and ChatML chat
template. Nothing is downloaded.

The directory is written beside --out and renamed into place: it exists whole or not at all; an
existing --out is left as it is.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

# Qwen2's chat format (ChatML), with its default system message when none is given.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
QWEN2_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
QWEN2_EXTRA = ["<|im_start|>"]
VOCAB_MULTIPLE = 64  # the embedding's rows, rounded up as real models round them


def byte_level_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens learnt from ``texts``: the 256 bytes and the
    most useful merges, so nothing is ever unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def chatml_tokenizer(texts: Iterable[str], vocab_size: int):
    """A Qwen2-style tokenizer (its specials and ChatML) over a BPE learnt from ``texts``."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(texts, vocab_size),
        **QWEN2_SPECIALS,
        extra_special_tokens=QWEN2_EXTRA,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def transcripts(corpus: Path) -> list[str]:
    """The training split's transcripts (never dev or test: the tokenizer must not learn them)."""
    from lhotse import CutSet

    cuts = CutSet.from_jsonl_lazy(corpus / "cuts_train.jsonl.gz")
    return [s.text for cut in cuts for s in cut.supervisions if s.text]


def write(args: argparse.Namespace) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = chatml_tokenizer(transcripts(args.corpus), args.bpe_vocab)
    # <|audio|> needs no row of its own (audio frames take its place), so the tokenizer's size
    # rounded up is the vocabulary.
    rows = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = Qwen2Config(
        vocab_size=rows,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=args.init_std or args.hidden**-0.5,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.tmp-", dir=args.out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)
        staging.rename(args.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.out}: Qwen2-shaped decoder, {params / 1e6:.2f}M parameters "
        f"({args.layers} layers, hidden {args.hidden}), tokenizer of {len(tokenizer)} tokens",
        file=sys.stderr,
    )
    return args.out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="made by make_corpus.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=352)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--bpe-vocab", type=int, default=512, help="bytes plus merges")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init-std",
        type=float,
        default=0.0,
        help="the weights' initial standard deviation (default hidden**-0.5; transformers' "
        "0.02 suits widths near 2,500 and leaves a narrow model's attention nearly uniform)",
    )
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"{args.out} exists; leaving it as it is", file=sys.stderr)
        return 0
    if not (args.corpus / "cuts_train.jsonl.gz").is_file():
        print(
            f"error: --corpus {args.corpus} has no cuts_train.jsonl.gz; make it first "
            "(make corpus-asr)",
            file=sys.stderr,
        )
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
