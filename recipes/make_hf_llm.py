"""Write a small random-init Hugging Face decoder with its own tokenizer, for a pretrained-LLM
run that learns on CPU (recipes/train_asr_hf.yaml).

    python recipes/make_hf_llm.py --corpus data/corpus_asr --out data/hf/qwen2_asr

The decoder is Qwen2-shaped (q/k/v biases, GQA, tied embeddings; ``--hidden``, ``--layers``, ...)
and written with ``save_pretrained``: the same files a downloaded model has, so
``model.pretrained_llm`` takes it as it takes a real one. Its tokenizer is a ``tokenizers``
byte-level tokenizer with Qwen2's special tokens and ChatML chat template: by default with no
merges (each UTF-8 byte one token), or with ``--tokenizer bpe`` a BPE learnt offline from the
corpus's training transcripts. Nothing is downloaded.

Why bytes and width 64 (docs/performance.md, issue 36): trained from random weights on the
corpus's 2,823 sentences, word-sized BPE targets learn the audio far more slowly per step (52%
test WER after 1,000 steps against 36% with bytes), and width 128 cost 1.5x the step time
without learning faster per step.

Every choice that sets it apart from the project's byte-level preset decoder is an option, so
that each can be tried alone (bench/bench_hf_factors.py): ``--family llama`` (no q/k/v biases),
``--untied`` (an output head of its own), ``--tokenizer`` (bytes at ids 0-255, as the
preset's, or a BPE), ``--template none`` (the plain format of ``train.data.prompt``, with the
preset's pad, bos and eos ids), ``--init preset`` (the project's own rules by parameter name,
``train.models.init``, instead of transformers' normal(0, std)). With ``--family llama
--untied --template none --init preset`` and the preset's exact rows and epsilon, the directory
is the preset's decoder, its initial weights included (the same ``--seed`` as
``model.init_seed``).

The directory is written beside --out and renamed into place: it exists whole or not at all. It
records the options it was made with (``make_hf_llm.json``): an existing --out made with the
same options is left as it is, one made with others is refused.
"""

from __future__ import annotations

import argparse
import json
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
# The plain format's specials, in the order that puts them at the preset's ids (ByteTokenizer:
# pad 256, bos 257, eos 258) after the 256 bytes.
PLAIN_SPECIALS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
# The families written here -> whether their q/k/v projections carry biases.
FAMILIES = {"qwen2": True, "llama": False}
INITS = ("hf", "preset")  # transformers' normal(0, std), or train.models.init's rules by name
TOKENIZERS = ("bpe", "bytes")
TEMPLATES = ("chatml", "none")
OPTIONS_FILE = "make_hf_llm.json"  # the options a directory was made with, written into it


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


def bytes_only():
    """A byte-level tokenizer with no merges: byte b is token b, as in the preset's
    ByteTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def make_tokenizer(texts: Iterable[str], kind: str, template: str, vocab_size: int):
    """A tokenizer over a BPE learnt from ``texts`` (or bytes alone), with Qwen2's specials and
    ChatML, or the plain format's specials and no chat template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    model = byte_level_bpe(texts, vocab_size) if kind == "bpe" else bytes_only()
    if template == "chatml":
        specials, extra = QWEN2_SPECIALS, QWEN2_EXTRA
    else:
        specials, extra = PLAIN_SPECIALS, []
    model.add_special_tokens([AddedToken(t, special=True) for t in [*specials.values(), *extra]])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, **specials, extra_special_tokens=extra
    )
    if template == "chatml":
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def transcripts(corpus: Path) -> list[str]:
    """The training split's transcripts (never dev or test: the tokenizer must not learn them)."""
    from lhotse import CutSet

    cuts = CutSet.from_jsonl_lazy(corpus / "cuts_train.jsonl.gz")
    return [s.text for cut in cuts for s in cut.supervisions if s.text]


def preset_init(model, shape_fields: dict, seed: int) -> None:
    """Overwrite ``model``'s weights with the project's own initial values for the same
    decoder (train.models.init: embedding N(0, 1), or the head's rule where tied; projections
    uniform(+-1/sqrt(fan_in)), norms one), drawn by parameter name from ``seed`` as
    ``model.init_seed`` draws them."""
    import torch

    from train.models.build import build_model
    from train.models.hf_weights import llm_state
    from train.models.shape import SALMConfig

    ours = build_model(SALMConfig(**shape_fields), torch.device("cpu"), seed)
    state = {name: tensor.detach() for name, tensor in llm_state(ours).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_head = ["lm_head.weight"] if shape_fields["tie_embeddings"] else []
    if sorted(missing) != tied_head or unexpected:
        raise RuntimeError(f"preset init: missing {missing}, unexpected {unexpected}")


def write(args: argparse.Namespace) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = make_tokenizer(
        transcripts(args.corpus), args.tokenizer, args.template, args.bpe_vocab
    )
    # <|audio|> needs no row of its own (audio frames take its place), so the tokenizer's size
    # rounded up is the vocabulary.
    rows = -(-len(tokenizer) // args.vocab_multiple) * args.vocab_multiple
    tied = not args.untied
    shape = {
        "d_model": args.hidden,
        "ffn_hidden": args.ffn,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "n_kv_heads": args.kv_heads,
        "vocab_size": rows,
        "qkv_bias": FAMILIES[args.family],
        "tie_embeddings": tied,
        "norm_eps": args.norm_eps,
    }
    config_class = Qwen2Config if args.family == "qwen2" else LlamaConfig
    config = config_class(
        vocab_size=rows,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=shape["norm_eps"],
        tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        initializer_range=args.init_std or args.hidden**-0.5,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.init == "preset":
        preset_init(model, shape, args.seed)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.tmp-", dir=args.out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / OPTIONS_FILE).write_text(json.dumps(recorded(args), indent=1) + "\n")
        staging.chmod(0o755)
        staging.rename(args.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.out}: {args.family} decoder, {params / 1e6:.2f}M parameters "
        f"({args.layers} layers, hidden {args.hidden}, {'tied' if tied else 'untied'} head, "
        f"{args.init} init), {args.tokenizer} tokenizer of {len(tokenizer)} tokens, "
        f"template {args.template}",
        file=sys.stderr,
    )
    return args.out


def recorded(args: argparse.Namespace) -> dict:
    """The options that shape the directory (what OPTIONS_FILE holds)."""
    return {key: value for key, value in sorted(vars(args).items()) if key not in ("corpus", "out")}


def kept(args: argparse.Namespace) -> int:
    """An existing --out made with these options is left as it is (0); one made with others, or
    by an older maker that did not record them, is refused in one line (2): a recipe whose
    decoder changed must not train on the old one unnoticed."""
    record = args.out / OPTIONS_FILE
    made = json.loads(record.read_text()) if record.is_file() else None
    if made == recorded(args):
        print(f"{args.out} exists; leaving it as it is", file=sys.stderr)
        return 0
    if made is None:
        why = f"by an older make_hf_llm.py (no {OPTIONS_FILE} in it)"
    else:
        changed = [
            f"{k} {made.get(k)!r} -> {v!r}" for k, v in recorded(args).items() if made.get(k) != v
        ]
        why = f"with other options ({', '.join(changed)})"
    print(
        f"error: --out {args.out} exists, made {why}; remove it to make it anew "
        f"(rm -r {args.out}), or give another --out",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="made by make_corpus.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--bpe-vocab", type=int, default=512, help="bytes plus merges")
    parser.add_argument("--seed", type=int, default=0, help="--init preset: model.init_seed")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2")
    parser.add_argument("--untied", action="store_true", help="an output head of its own")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="bytes")
    parser.add_argument("--template", choices=TEMPLATES, default="chatml")
    parser.add_argument("--init", choices=INITS, default="hf")
    parser.add_argument(
        "--vocab-multiple",
        type=int,
        default=64,
        help="the embedding's rows: the tokenizer's size rounded up to this, as real models do",
    )
    parser.add_argument("--norm-eps", type=float, default=1e-6, help="RMSNorm's epsilon")
    parser.add_argument(
        "--init-std",
        type=float,
        default=0.0,
        help="the weights' initial standard deviation (default hidden**-0.5; transformers' "
        "0.02 suits widths near 2,500 and leaves a narrow model's attention nearly uniform)",
    )
    args = parser.parse_args(argv)
    if args.out.exists():
        return kept(args)
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
