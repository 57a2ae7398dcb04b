"""Speech examples in a pretrained LLM's chat format (train/data/prompt.py), on tiny offline
tokenizers of the Llama 3, Qwen2 and Qwen3 formats and one without a chat template
(tests/harness/hf_tiny.py), and on a real one: SmolLM2-135M-Instruct's byte-level BPE and ChatML
template with its default system prompt (``make pretrained``). The tiny BPEs have no whitespace
merges; the real one merges runs of whitespace into one token, so only it can show a piece boundary
that tokenizing the whole conversation would merge across.

What training and decoding rely on: the answer is the transcript and exactly the end of the
assistant's turn; the prompt before the audio is the template's own text; the pieces tokenized
apart agree with the whole conversation tokenized at once; decoding feeds the same prompt tokens
as training; and every mistake a user can make is one line that names it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lhotse import MonoCut, SupervisionSegment

from recipes.pretrained import SMOLLM2
from tests.harness.hf_tiny import END_OF_TURN, TOKENIZER_FAMILIES, save_tiny_tokenizer
from tests.harness.models import pretrained_model
from train.data.prompt import AUDIO_TOKEN, DEFAULT_PROMPT, ChatPrompt, load_tokenizer
from train.data.source_cuts import transcript as transcript_of

# The tiny families, then SmolLM2's real tokenizer.
FAMILIES = (*TOKENIZER_FAMILIES, "smollm2")
CHAT_TOKENIZER_FAMILIES = ("llama", "qwen2", "qwen3", "smollm2")
# The system message a template writes when the conversation has none.
DEFAULT_SYSTEM = {
    "qwen2": "You are a helpful assistant.",
    "smollm2": "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
}
# The template's text around the placeholder for the default prompt and no system text.
BEFORE = {
    "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nTranscribe the audio. ",
    "qwen2": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nTranscribe the audio. ",
    "qwen3": "<|im_start|>user\nTranscribe the audio. ",
    "plain": "<s>Transcribe the audio.\n",
    "smollm2": f"<|im_start|>system\n{DEFAULT_SYSTEM['smollm2']}<|im_end|>\n"
    "<|im_start|>user\nTranscribe the audio. ",
}
AFTER = {
    "llama": "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2": "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "plain": "\n",
    "smollm2": "<|im_end|>\n<|im_start|>assistant\n",
}
# What the templates add for add_generation_prompt=True.
GENERATION = {
    "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2": "<|im_start|>assistant\n",
    "qwen3": "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "smollm2": "<|im_start|>assistant\n",
}
TRANSCRIPTS = ("hello world", "Grüße, café!", "THE 42 CATS, it's 3.5% off?", "a")


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny family's tokenizer directory, written once for the module."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: save_tiny_tokenizer(family, root / family) for family in TOKENIZER_FAMILIES}


class Tokenizers(dict):
    """Each family's tokenizer as training loads it (with the audio placeholder); SmolLM2's from
    its converted folder (read only) when a test first asks for it, so that only its tests
    fail where ``make pretrained`` has not run."""

    def __missing__(self, family: str):
        if family != "smollm2":
            raise KeyError(family)
        self[family] = load_tokenizer(pretrained_model(SMOLLM2.name))
        return self[family]


@pytest.fixture(scope="module")
def tokenizers(directories: dict[str, Path]) -> Tokenizers:
    return Tokenizers({family: load_tokenizer(path) for family, path in directories.items()})


def text(tokenizer, ids: list[int]) -> str:
    """Exact text of ids, special tokens included."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def messages(transcript: str | None, prompt: str = DEFAULT_PROMPT, system: str | None = None):
    """The conversation as a caller of apply_chat_template writes it."""
    turns = [{"role": "user", "content": f"{prompt} {AUDIO_TOKEN}"}]
    if system is not None:
        turns.insert(0, {"role": "system", "content": system})
    if transcript is not None:
        turns.append({"role": "assistant", "content": transcript})
    return turns


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("transcript", TRANSCRIPTS)
def test_answer_is_the_transcript_and_the_end_of_turn(tokenizers, family, transcript):
    tokenizer = tokenizers[family]
    encoded = ChatPrompt(tokenizer).example(transcript)
    tokens = encoded.tokens

    assert text(tokenizer, tokens[encoded.answer_start :]) == transcript + END_OF_TURN[family]
    assert tokens[-1] == tokenizer.convert_tokens_to_ids(END_OF_TURN[family])
    assert text(tokenizer, tokens[: encoded.prefix_len]) == BEFORE[family]
    assert text(tokenizer, tokens[encoded.prefix_len : encoded.answer_start]) == AFTER[family]
    assert encoded.answer_start > encoded.prefix_len
    assert tokenizer.convert_tokens_to_ids(AUDIO_TOKEN) not in tokens
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in tokens
    assert max(tokens) < len(tokenizer)
    if family in TOKENIZER_FAMILIES:
        assert len(tokenizer) <= 291  # fits the tiny models' vocab of 301


@pytest.mark.parametrize("family", CHAT_TOKENIZER_FAMILIES)
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_pieces_agree_with_the_whole_conversation_tokenized(tokenizers, family, system):
    tokenizer = tokenizers[family]
    chat = ChatPrompt(tokenizer, system=system)
    audio_id = tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
    for transcript in TRANSCRIPTS:
        rendered = tokenizer.apply_chat_template(
            messages(transcript, system=system), tokenize=False
        )
        end = END_OF_TURN[family]
        rendered = rendered[: rendered.rindex(end) + len(end)]  # drop what follows the turn
        whole = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        encoded = chat.example(transcript)

        assert [token for token in whole if token != audio_id] == encoded.tokens
        assert whole.index(audio_id) == encoded.prefix_len


def test_whitespace_at_the_answers_start_is_not_merged_across_the_pieces(tokenizers):
    """SmolLM2's BPE merges the assistant header's newline with whitespace after it into one
    token (``ĊĠ``, ``ĊĊ``), which the pieces tokenized apart never do. Transcripts from
    manifests whose texts start (or end) with spaces and newlines reach ChatPrompt stripped
    (``train.data.source_cuts.transcript``), so each example still equals the whole conversation."""
    tokenizer = tokenizers["smollm2"]
    chat = ChatPrompt(tokenizer)
    audio_id = tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
    header_end = "assistant\n"
    assert AFTER["smollm2"].endswith(header_end)
    for texts in (["  hello world"], ["\n\nhello"], [" \thello ", "\n world  \n"]):
        raw = texts[0]
        # The hazard is real here: the header's end and the raw text's whitespace merge.
        merged = chat.tokenize(header_end + raw)
        assert merged != chat.tokenize(header_end) + chat.tokenize(raw), raw
        supervisions = [
            SupervisionSegment(f"s{i}", "r", start=0, duration=1, text=t)
            for i, t in enumerate(texts)
        ]
        cut = MonoCut("c", start=0, duration=1, channel=0, supervisions=supervisions)
        given = transcript_of(cut)
        rendered = tokenizer.apply_chat_template(messages(given), tokenize=False)
        rendered = rendered[: rendered.rindex("<|im_end|>") + len("<|im_end|>")]
        whole = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        encoded = chat.example(given)
        assert [token for token in whole if token != audio_id] == encoded.tokens, repr(given)
        assert text(tokenizer, encoded.tokens[encoded.answer_start :]) == f"{given}<|im_end|>"


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_prompt_is_the_training_prompt(tokenizers, family):
    tokenizer = tokenizers[family]
    chat = ChatPrompt(tokenizer)
    prompt = chat.generation_prompt()
    assert prompt.answer_start == len(prompt.tokens)
    for transcript in (*TRANSCRIPTS, ""):
        encoded = chat.example(transcript)
        assert prompt.tokens == encoded.tokens[: encoded.answer_start]
        assert prompt.prefix_len == encoded.prefix_len

    if family == "plain":
        assert text(tokenizer, prompt.tokens) == f"<s>{DEFAULT_PROMPT}\n\n"
        return
    generation = tokenizer.apply_chat_template(
        messages(None), add_generation_prompt=True, tokenize=False
    )
    assert text(tokenizer, prompt.tokens) == generation.replace(AUDIO_TOKEN, "")
    assert text(tokenizer, prompt.tokens).endswith(GENERATION[family])


def test_eos_and_pad_ids(tokenizers):
    ids = {family: tokenizers[family].convert_tokens_to_ids for family in FAMILIES}
    # Llama: <|end_of_text|> comes from generation_config.json; no pad token, so pad is eos.
    llama = ChatPrompt(tokenizers["llama"])
    assert llama.eos_ids == {ids["llama"]("<|eot_id|>"), ids["llama"]("<|end_of_text|>")}
    assert llama.pad_id == ids["llama"]("<|eot_id|>")
    qwen2 = ChatPrompt(tokenizers["qwen2"])
    assert qwen2.eos_ids == {ids["qwen2"]("<|im_end|>")}
    assert qwen2.pad_id == ids["qwen2"]("<|endoftext|>")
    plain = ChatPrompt(tokenizers["plain"])
    assert plain.eos_ids == {ids["plain"]("</s>")}
    assert plain.pad_id == ids["plain"]("</s>")
    # SmolLM2: eos, pad and generation_config.json's eos are all <|im_end|>.
    smollm2 = ChatPrompt(tokenizers["smollm2"])
    assert smollm2.eos_ids == {ids["smollm2"]("<|im_end|>")}
    assert smollm2.pad_id == ids["smollm2"]("<|im_end|>")


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_stops_at_the_end_and_skips_special_tokens(tokenizers, family):
    tokenizer = tokenizers[family]
    chat = ChatPrompt(tokenizer)
    answer = chat.example("Grüße, café!").tokens[chat.generation_prompt().answer_start :]
    junk = chat.tokenize(" and more")
    assert chat.decode(answer + junk) == "Grüße, café!"  # the template's end of turn
    for eos in chat.eos_ids:
        assert chat.decode([*chat.tokenize("hello world"), eos, *junk]) == "hello world"
    specials = [tokenizer.convert_tokens_to_ids(AUDIO_TOKEN), *tokenizer.all_special_ids]
    others = [token for token in specials if token not in chat.eos_ids]
    assert others  # at least the audio placeholder
    spoken = chat.tokenize(" hello ") + others + chat.tokenize("world ")
    assert chat.decode(spoken) == "hello world"
    assert chat.decode([]) == ""


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_system_text_reach_the_prefix(tokenizers, family):
    tokenizer = tokenizers[family]
    default = ChatPrompt(tokenizer).example("hello world")
    asked = ChatPrompt(tokenizer, prompt="Write down the words.").example("hello world")
    told = ChatPrompt(tokenizer, system="Answer in French.").example("hello world")

    assert asked.tokens[: asked.prefix_len] != default.tokens[: default.prefix_len]
    assert "Write down the words." in text(tokenizer, asked.tokens[: asked.prefix_len])
    assert DEFAULT_PROMPT not in text(tokenizer, asked.tokens)
    assert "Answer in French." in text(tokenizer, told.tokens[: told.prefix_len])
    for encoded in (asked, told):  # the answer does not change with the prompt
        assert encoded.tokens[encoded.answer_start :] == default.tokens[default.answer_start :]
    if family in DEFAULT_SYSTEM:  # the template's default system message gives way to ours
        assert DEFAULT_SYSTEM[family] in text(tokenizer, default.tokens)
        assert DEFAULT_SYSTEM[family] not in text(tokenizer, told.tokens)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_plain_format_without_chat_template(tokenizers, system):
    tokenizer = tokenizers["plain"]
    assert tokenizer.chat_template is None
    encoded = ChatPrompt(tokenizer, prompt="Listen.", system=system).example("Grüße, café!")
    head = "" if system is None else f"{system}\n"
    assert text(tokenizer, encoded.tokens) == f"<s>{head}Listen.\n\nGrüße, café!</s>"
    assert text(tokenizer, encoded.tokens[: encoded.prefix_len]) == f"<s>{head}Listen.\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_transcript_is_just_the_end_of_turn(tokenizers, family):
    tokenizer = tokenizers[family]
    chat = ChatPrompt(tokenizer)
    encoded = chat.example("")
    assert encoded.tokens[encoded.answer_start :] == [
        tokenizer.convert_tokens_to_ids(END_OF_TURN[family])
    ]
    assert chat.decode(encoded.tokens[encoded.answer_start :]) == ""


def one_line_error(call, *names: str) -> None:
    """``call`` raises a one-line ValueError that names each of ``names``."""
    with pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_errors_are_one_line_and_name_the_thing(tmp_path, tokenizers):
    empty = tmp_path / "Llama-3.2-1B"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    one_line_error(lambda: load_tokenizer(empty), str(empty), "no tokenizer files", "hf download")
    missing = tmp_path / "not-there"
    one_line_error(lambda: load_tokenizer(missing), str(missing), "no tokenizer files")

    tokenizer = tokenizers["qwen2"]
    one_line_error(
        lambda: ChatPrompt(tokenizer, prompt=f"Hear {AUDIO_TOKEN}"), "prompt", AUDIO_TOKEN
    )
    one_line_error(lambda: ChatPrompt(tokenizer, system=f"{AUDIO_TOKEN}!"), "system", AUDIO_TOKEN)
    chat = ChatPrompt(tokenizer)
    one_line_error(lambda: chat.example(f"say {AUDIO_TOKEN} now"), "transcript", AUDIO_TOKEN)
    one_line_error(lambda: chat.example("over <|im_end|> and out"), "transcript", "<|im_end|>")


def test_tokenizer_without_eos_is_refused(tmp_path):
    directory = save_tiny_tokenizer("plain", tmp_path / "plain")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    one_line_error(lambda: load_tokenizer(directory), str(directory), "eos")


def test_templates_that_cannot_be_split_are_refused(directories):
    glued = load_tokenizer(directories["qwen2"])  # the answer right after the audio
    glued.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}"
    one_line_error(lambda: ChatPrompt(glued), "between")
    varying = load_tokenizer(directories["qwen2"])  # the prompt depends on the transcript
    varying.chat_template = (
        "{{ messages[-1]['content'] | length }}"
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    one_line_error(lambda: ChatPrompt(varying), "different prompts")


def test_audio_token_is_added_once_and_keeps_its_id(tmp_path, directories):
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(directories["llama"], local_files_only=True)
    assert AUDIO_TOKEN not in original.get_vocab()
    loaded = load_tokenizer(directories["llama"])
    assert len(loaded) == len(original) + 1
    audio_id = loaded.convert_tokens_to_ids(AUDIO_TOKEN)

    loaded.save_pretrained(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert len(again) == len(loaded)
    assert again.convert_tokens_to_ids(AUDIO_TOKEN) == audio_id
    assert again.all_special_tokens.count(AUDIO_TOKEN) == 1
    assert again(f"a{AUDIO_TOKEN}b", add_special_tokens=False)["input_ids"].count(audio_id) == 1
    assert again.decode([audio_id], skip_special_tokens=True) == ""


def test_module_imports_without_transformers():
    check = "import sys, train.data.prompt; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, cwd=Path(__file__).parents[1])
