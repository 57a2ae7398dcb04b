"""A speech example as one token sequence in a pretrained LLM's own chat format.

The conversation is the tokenizer's chat template rendered as system (optional), user (the
instruction and an audio placeholder) and assistant (the transcript). The model splices the
audio encoder's frames in where the placeholder was, and the loss covers only the answer.

The rendered text is cut in three pieces, each tokenized on its own (``add_special_tokens=False``:
templates that want a BOS write it themselves):

- before: the template up to the placeholder (``tokens[:prefix_len]``);
- after: from the placeholder to the start of the answer, i.e. the end of the user's turn and
  the assistant's header (``tokens[prefix_len:answer_start]``);
- answer: the transcript and the template's end-of-turn text up to and including the turn's
  end token (``tokens[answer_start:]``). The end token is the first special token the template
  writes after the assistant's content (Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``);
  whatever the template writes after it (ChatML's newline) is left out. A template that writes
  no special token there ends the answer with the eos token instead.

Before and after do not depend on the transcript, so they are rendered and tokenized once, and
training and decoding see the very same prompt tokens. The placeholder itself is never in the
tokens: ``prefix_len`` says where the audio goes. The transcript is tokenized as given: what a
template would do to the assistant's content (Llama 3 trims it) is not applied, so transcripts
come normalized from the data.

A tokenizer without a chat template gets a plain format::

    {bos}{system}\\n{prompt}\\n<|audio|>\\n{transcript}{eos}

(``{bos}`` only if the tokenizer has one, ``{system}\\n`` only if a system text is given).

A text chat without audio (``text_prompt``) is the same template rendered with the user's message
up to the assistant's answer (``{bos}{system}\\n{message}\\n`` in the plain format).

A conversation (``ChatPrompt.conversation``, ``train.data.conversation``) is the template rendered
whole, a placeholder in each audio turn's place (``Encoded.audio_at``), the loss on every
assistant message and its end of turn (``Encoded.spans``); each assistant message is found by
rendering the conversation up to it with and without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from train.data.conversation import ASSISTANT, SYSTEM, ConversationError, Turn, messages
from train.data.sources import prompt_of
from train.models.hf_config import FETCH_HINT

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

AUDIO_TOKEN = "<|audio|>"
DEFAULT_PROMPT = "Transcribe the audio."

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Two transcripts the template is rendered with: what differs between the renderings is the
# transcript, the rest must be the same (otherwise the prompt could not be cached).
PROBES = ("probe transcript one", "another probe 2")


@dataclass(frozen=True)
class Encoded:
    """Token ids of one example, the audio placeholders removed: where each audio goes
    (``audio_at``, in order: before ``tokens[i]``), and the token ranges the loss covers
    (``spans``: the assistant's turns; none in a generation prompt).

    The loss on token ``i`` is predicted at the position before it; the token right after an
    audio would be predicted at the audio's last frame, which the model's layout does not label,
    so it is never a target (a chat template puts the end of the user's turn there)."""

    tokens: list[int]
    audio_at: tuple[int, ...] = ()  # before which token each audio goes (none: text only)
    spans: tuple[tuple[int, int], ...] = ()  # [start, end) token ranges the loss covers

    def __post_init__(self) -> None:
        if list(self.audio_at) != sorted(self.audio_at) or any(
            not 0 <= at <= len(self.tokens) for at in self.audio_at
        ):
            raise ValueError(f"audio positions {self.audio_at} must be in order, within the tokens")
        previous = 0
        for start, end in self.spans:
            if not previous < start < end <= len(self.tokens) or any(
                start <= at < end for at in self.audio_at
            ):
                raise ValueError(
                    f"loss spans {self.spans} of {len(self.tokens)} tokens must be ordered, "
                    f"non-empty, after the first token and not start at an audio "
                    f"({self.audio_at})"
                )
            previous = end - 1

    @property
    def prefix_len(self) -> int:
        """The tokens before the first audio (an ASR example's prompt before its audio)."""
        return self.audio_at[0] if self.audio_at else 0

    @property
    def answer_start(self) -> int:
        """The first token of the last span (the answer decoding writes); the end of a
        generation prompt."""
        return self.spans[-1][0] if self.spans else len(self.tokens)

    def up_to_answer(self) -> Encoded:
        """What decoding feeds to write the last answer: the tokens before it, with every
        audio (a conversation's audio all comes before its last answer)."""
        return Encoded(self.tokens[: self.answer_start], self.audio_at)

    def target_mask(self) -> list[bool]:
        """For each token, whether the loss covers it."""
        mask = [False] * len(self.tokens)
        for start, end in self.spans:
            mask[start:end] = [True] * (end - start)
        return mask


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``directory`` (offline) with AUDIO_TOKEN as a special token.

    The token is added only if absent, so a tokenizer saved after loading keeps the same id.
    """
    directory = Path(directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{directory}: no tokenizer files (tokenizer.json or tokenizer_config.json); "
            f"{FETCH_HINT}"
        )
    from transformers import AutoTokenizer  # slow import, only where a tokenizer is loaded

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if tokenizer.eos_token is None:
        raise ValueError(
            f"{directory}: the tokenizer has no eos token; set eos_token in "
            f"{directory / 'tokenizer_config.json'} to the token that ends an answer"
        )
    if AUDIO_TOKEN not in tokenizer.all_special_tokens:
        tokenizer.add_special_tokens(
            {"extra_special_tokens": [AUDIO_TOKEN]}, replace_extra_special_tokens=False
        )
    return tokenizer


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """Every special token of the tokenizer but the audio placeholder."""
    named = set(tokenizer.all_special_tokens)
    added = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return (named | added) - {AUDIO_TOKEN}


def generation_config_eos(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """eos_token_id of generation_config.json next to the tokenizer (int or list), if any."""
    name = getattr(tokenizer, "name_or_path", "")
    path = Path(name) / "generation_config.json"
    if not name or not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(i) for i in eos}


def text_prompt(
    tokenizer: PreTrainedTokenizerBase, message: str, system: str | None = None
) -> list[int]:
    """The generation prompt of a text chat's one user turn (the template's default system
    text unless ``system`` is given), tokenized as ``ChatPrompt`` tokenizes its pieces, so the
    ids are those ``apply_chat_template(..., add_generation_prompt=True)`` returns. Texts with
    a special token are refused: it would be read as the template's own (ending a turn)."""
    for what, text in (("message", message), ("system text", system or "")):
        for token in (AUDIO_TOKEN, *special_tokens(tokenizer)):
            if token in text:
                raise ValueError(f"the {what} {text[:80]!r} contains the special token {token}")
    if tokenizer.chat_template is None:
        head = f"{system}\n" if system is not None else ""
        rendered = f"{tokenizer.bos_token or ''}{head}{message}\n"
    else:
        messages = [{"role": "user", "content": message}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


class ChatPrompt:
    """Encodes transcripts as training examples and prompts for decoding (module docstring)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt: str = DEFAULT_PROMPT,
        system: str | None = None,
    ) -> None:
        for what, text in (("prompt", prompt), ("system text", system or "")):
            if AUDIO_TOKEN in text:
                raise ValueError(
                    f"the {what} {text!r} contains the audio placeholder {AUDIO_TOKEN}; "
                    f"leave it out, it is added after the prompt"
                )
        if AUDIO_TOKEN not in tokenizer.get_vocab():
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has no {AUDIO_TOKEN} token; "
                f"load it with train.data.prompt.load_tokenizer"
            )
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token")
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.system = system
        self.variants: dict[tuple[str, str | None], ChatPrompt] = {}  # by (prompt, system)
        self.specials = special_tokens(tokenizer)
        self.template_name = f"the chat template of {tokenizer.name_or_path!r}"

        if tokenizer.chat_template is None:
            bos = tokenizer.bos_token or ""
            head = f"{system}\n" if system is not None else ""
            before, after = f"{bos}{head}{prompt}\n", "\n"
            self.end_text = tokenizer.eos_token
            self.template_name = f"the plain format of {tokenizer.name_or_path!r}"
        else:
            before, after, self.end_text = self.split_template()

        self.before = self.tokenize(before)
        self.after = self.tokenize(after)
        self.end_id = self.tokenize(self.end_text)[-1]
        if not self.after:
            raise ValueError(
                f"{self.template_name} puts the answer right after the audio placeholder; "
                f"at least one text token must sit between them"
            )
        self.eos_ids: frozenset[int] = frozenset(
            {tokenizer.eos_token_id, self.end_id} | generation_config_eos(tokenizer)
        )
        self.pad_id: int = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )

    def messages(self, transcript: str | None) -> list[dict[str, str]]:
        """The conversation: system (if any), user with the placeholder, assistant (if given)."""
        messages = [{"role": "user", "content": f"{self.prompt} {AUDIO_TOKEN}"}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        if transcript is not None:
            messages.append({"role": "assistant", "content": transcript})
        return messages

    def split_template(self) -> tuple[str, str, str]:
        """Render the template and cut it into before/after the placeholder and end-of-turn text.

        Rendered with two different transcripts, the text around the transcript must be the
        same; otherwise the prompt would depend on the transcript.
        """
        pieces = set()
        for probe in PROBES:
            text = self.tokenizer.apply_chat_template(self.messages(probe), tokenize=False)
            start = text.rfind(probe)
            if start < 0:
                raise ValueError(f"{self.template_name} changes the transcript {probe!r}")
            prefix, rest = text[:start], text[start + len(probe) :]
            pieces.add((prefix, self.end_of_turn(rest) or self.tokenizer.eos_token))
        if len(pieces) != 1:
            raise ValueError(
                f"{self.template_name} renders different prompts for different transcripts"
            )
        ((prefix, end_text),) = pieces
        if prefix.count(AUDIO_TOKEN) != 1:
            raise ValueError(
                f"{self.template_name} renders the audio placeholder {prefix.count(AUDIO_TOKEN)} "
                f"times instead of once; it must keep the user's content as given"
            )
        before, after = prefix.split(AUDIO_TOKEN)
        return before, after, end_text

    def end_of_turn(self, rest: str) -> str | None:
        """What the template writes after an answer up to and including the first special
        token there (the longest one if several start there), or None without one."""
        found = [(rest.find(token), -len(token), token) for token in self.specials if token in rest]
        if not found:
            return None
        at, _, token = min(found)
        return rest[: at + len(token)]

    def for_tags(self, tags: Mapping[str, Any]) -> ChatPrompt:
        """The prompt a cut's source tags ask for (``prompt:``/``system:``, train/data/sources.py):
        this one when they name none, else a variant made once and kept."""
        key = (prompt_of(tags, "prompt", self.prompt), prompt_of(tags, "system", self.system))
        if key == (self.prompt, self.system):
            return self
        if key not in self.variants:
            self.variants[key] = ChatPrompt(self.tokenizer, *key)
        return self.variants[key]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text, no special tokens added around it."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def example(self, transcript: str) -> Encoded:
        """A training example: the prompt, then the transcript up to and including the end of
        the assistant's turn (nothing after it); answer_start is the first transcript token."""
        for token in (AUDIO_TOKEN, *self.specials):
            if token in transcript:
                raise ValueError(
                    f"the transcript {transcript[:80]!r} contains the special token {token}"
                )
        answer = self.tokenize(transcript + self.end_text)
        tokens = self.before + self.after + answer
        answer_start = len(self.before) + len(self.after)
        return Encoded(tokens, (len(self.before),), ((answer_start, len(tokens)),))

    def conversation(self, turns: Sequence[Turn]) -> Encoded:
        """A conversation as a training example (``train.data.conversation``): the template's
        rendering, the audio where its turn is, the loss on each assistant message and its end
        of turn; the system text of this prompt's tags when the conversation has none. Each
        audio turn's frames go where its turn is."""
        for turn in turns:
            for token in (AUDIO_TOKEN, *self.specials):
                if token in turn.text:
                    raise ConversationError(
                        f"the {turn.role}'s text {turn.text[:80]!r} contains the special "
                        f"token {token}"
                    )
        merged = messages(turns)
        chat = [{"role": m.role, "content": m.content(AUDIO_TOKEN)} for m in merged]
        if chat[0]["role"] != SYSTEM and self.system is not None:
            chat.insert(0, {"role": SYSTEM, "content": self.system})
        tokens: list[int] = []
        spans, audio_at = [], []
        for text, is_answer in self.conversation_pieces(chat):
            if is_answer:
                ids = self.tokenize(text)
                spans.append((len(tokens), len(tokens) + len(ids)))
                tokens += ids
                continue
            first, *rest = text.split(AUDIO_TOKEN)
            tokens += self.tokenize(first)
            for piece in rest:  # each audio, then the text up to the next one
                audio_at.append(len(tokens))
                tokens += self.tokenize(piece)
        audio_turns = sum(message.audio_turns for message in merged)
        if len(audio_at) != audio_turns:  # each audio turn's frames need their place
            raise ConversationError(
                f"{self.template_name} renders {len(audio_at)} of a conversation's "
                f"{audio_turns} audio placeholders; it must keep the user's content as given"
            )
        return Encoded(tokens, tuple(audio_at), tuple(spans))

    def conversation_pieces(self, chat: list[dict[str, str]]) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, whether the loss covers it) pieces, up to the
        end of the last assistant message's turn. Each assistant message is found by rendering
        the conversation up to it with and without it: the template must render the earlier
        messages the same way every time and keep the assistant's text as given."""
        if self.tokenizer.chat_template is None:  # the plain format (module docstring)
            pieces, head = [], self.tokenizer.bos_token or ""
            for message in chat:
                if message["role"] == ASSISTANT:
                    pieces += [(head, False), (message["content"] + self.tokenizer.eos_token, True)]
                    head = ""
                else:
                    head += message["content"] + "\n"
            return pieces
        pieces, done = [], ""
        last = max(i for i, message in enumerate(chat) if message["role"] == ASSISTANT)
        for index, message in enumerate(chat):
            if message["role"] != ASSISTANT:
                continue
            head = self.tokenizer.apply_chat_template(
                chat[:index], tokenize=False, add_generation_prompt=True
            )
            whole = self.tokenizer.apply_chat_template(chat[: index + 1], tokenize=False)
            content = message["content"]
            if not head.startswith(done) or not whole.startswith(head + content):
                raise ConversationError(
                    f"{self.template_name} renders a conversation's earlier messages or the "
                    f"assistant's text {content[:60]!r} differently as it goes on; such a "
                    "template cannot mark the assistant's turns"
                )
            end = self.end_of_turn(whole[len(head) + len(content) :])
            if end is None and index != last:
                raise ConversationError(
                    f"{self.template_name} ends an assistant turn with no special token; "
                    "train on conversations with one assistant turn"
                )
            answer = content + (end if end is not None else self.tokenizer.eos_token)
            pieces += [(head[len(done) :], False), (answer, True)]
            done = head + answer
        return pieces

    def generation_prompt(self) -> Encoded:
        """What decoding feeds: example()'s tokens up to answer_start (answer_start == len)."""
        return Encoded(self.before + self.after, (len(self.before),))

    def decode(self, ids: list[int]) -> str:
        """Answer ids as text: cut at the first eos id, special tokens skipped, stripped."""
        ids = list(ids)
        end = next((i for i, token in enumerate(ids) if token in self.eos_ids), len(ids))
        text = self.tokenizer.decode(
            ids[:end], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text.strip()
