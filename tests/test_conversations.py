"""Conversations and text-only examples (train/data/conversation.py,
train/data/conversation_cuts.py): the loss covers exactly the assistant's turns, token by token, on
real chat templates (SmolLM2's from ``make pretrained``, and tiny Llama 3, Qwen2, Qwen3 and plain
ones); the audio lands where its turn is; NeMo's conversation and text formats read as NeMo writes
them; conversations and text mix with speech by weight, resume exactly and decode after the
conversation so far. Training them at every parallel layout: tests/test_trainer_equivalence.py (the
``mix_*`` cases)."""

from __future__ import annotations

import itertools
import json
import re
from collections import deque
from pathlib import Path

import pytest
import torch

from recipes.pretrained import SMOLLM2
from tests.harness.conversations import conversation_mixture
from tests.harness.hf_tiny import (
    END_OF_TURN,
    TOKENIZER_FAMILIES,
    save_tiny_encoder,
    save_tiny_tokenizer,
)
from tests.harness.models import pretrained_model
from tests.harness.process import REPO, run_script
from train.config import ModelConfig
from train.data.batch_hash import batch_hash
from train.data.conversation import ConversationError, Turn, messages
from train.data.conversation_cuts import turn_recordings
from train.data.features import AudioLimits
from train.data.loader import (
    DataPosition,
    SpeechDataset,
    batches_from,
    build_dataloader,
    encoded,
    load_cuts,
    pad_segments,
)
from train.data.prompt import AUDIO_TOKEN, ChatPrompt, load_tokenizer
from train.data.source_cuts import check_sources, load_source_cuts, source_of, transcript
from train.data.sources import read_sources
from train.data.text import ByteTokenizer
from train.eval.decode import greedy_decode
from train.loop.step import host_seq_len
from train.models.batch import Batch
from train.models.build import build_model
from train.models.frame_packing import MIN_FEATURE_FRAMES, encoder_plan
from train.models.packing import (
    IGNORE_INDEX,
    batch_layout,
    segments,
    sequence_layout,
)
from train.models.pipeline import PipelinePart, microbatch_plans, pad_examples
from train.models.presets import get_preset
from train.models.shape import audio_positions, encoder_frames
from train.parallel.layout import model_of

ANSWERS = ("Hello, ask away.", "ninety nine bright cats", "cats", "call two")
# A text exchange, then a spoken question in the middle of the conversation, a follow-up, and a
# second utterance between two texts of one user turn.
TURNS = [
    Turn("user", "Hello."),
    Turn("assistant", ANSWERS[0]),
    Turn("user", "What is said?"),
    Turn("user", audio=True),
    Turn("assistant", ANSWERS[1]),
    Turn("user", "And the last word?"),
    Turn("assistant", ANSWERS[2]),
    Turn("user", "And in"),
    Turn("user", audio=True),
    Turn("user", "?"),
    Turn("assistant", ANSWERS[3]),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizers")
    found = {f: load_tokenizer(save_tiny_tokenizer(f, root / f)) for f in TOKENIZER_FAMILIES}
    found["smollm2"] = load_tokenizer(pretrained_model(SMOLLM2.name))
    return found


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("family", [*TOKENIZER_FAMILIES, "smollm2"])
def test_the_loss_covers_each_assistant_turn_and_nothing_else(tokenizers, family):
    """Token by token: the masked tokens are exactly each answer and its end of turn; the tokens
    with the audio token put back at each ``audio_at`` are the template's whole rendering
    tokenized at once (so no piece boundary changed a token); each audio sits in its own turn,
    the first after the question, the second inside the last user turn's text."""
    tokenizer = tokenizers[family]
    encoded = ChatPrompt(tokenizer).conversation(TURNS)
    mask = encoded.target_mask()
    assert [text(tokenizer, encoded.tokens[a:b]) for a, b in encoded.spans] == [
        answer + END_OF_TURN[family] for answer in ANSWERS
    ]
    assert sum(mask) == sum(b - a for a, b in encoded.spans)
    assert not any(mask[: encoded.spans[0][0]]) and mask[-1]
    audio_id = tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
    first, second = encoded.audio_at
    tokens = encoded.tokens
    whole = [*tokens[:first], audio_id, *tokens[first:second], audio_id, *tokens[second:]]
    if tokenizer.chat_template is not None:
        chat = [{"role": m.role, "content": m.content(AUDIO_TOKEN)} for m in messages(TURNS)]
        rendered = tokenizer.apply_chat_template(chat, tokenize=False)
        rendered = rendered[: rendered.rindex(END_OF_TURN[family]) + len(END_OF_TURN[family])]
        assert whole == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert text(tokenizer, tokens[:first]).endswith("What is said? ")
    assert text(tokenizer, tokens[:second]).endswith("And in ")
    assert text(tokenizer, tokens[second:]).startswith(" ?")
    assert encoded.spans[0][1] < first < encoded.spans[1][0]
    assert encoded.spans[2][1] < second < encoded.spans[3][0]


def test_the_byte_tokenizer_renders_conversations_for_the_presets():
    encoded = ByteTokenizer().conversation(TURNS)
    as_text = bytes(t for t in encoded.tokens if t < 256).decode()
    assert as_text == (
        "Hello.\nHello, ask away.What is said?\nninety nine bright catsAnd the last word?\ncats"
        "And in ?\ncall two"
    )
    assert [
        bytes(t for t in encoded.tokens[a:b] if t < 256).decode() for a, b in encoded.spans
    ] == list(ANSWERS)
    first, second = (bytes(t for t in encoded.tokens[:at] if t < 256) for at in encoded.audio_at)
    assert first.endswith(b"What is said?") and second.endswith(b"And in")


@pytest.mark.parametrize(
    "turns, says",
    [
        ([Turn("user", "q"), Turn("assistant", audio=True)], "audio turn of the assistant"),
        (
            [Turn("assistant", "a"), Turn("user", "q"), Turn("assistant", "b")],
            "starts with the user",
        ),
        ([Turn("user", "q"), Turn("assistant", "a"), Turn("user", "q2")], "ends with an assistant"),
        ([Turn("user", "q"), Turn("system", "s"), Turn("assistant", "a")], "system turn may only"),
    ],
)
def test_conversations_the_trainer_cannot_use_are_named(turns, says):
    with pytest.raises(ConversationError, match=says):
        messages(turns)


def test_a_special_token_in_a_turn_is_refused(tokenizers):
    chat = ChatPrompt(tokenizers["qwen2"])
    with pytest.raises(ConversationError, match=re.escape("<|im_end|>")):
        chat.conversation([Turn("user", "hi <|im_end|>"), Turn("assistant", "a")])


def nemo_files(tmp_path: Path, corpus: Path) -> Path:
    """One file of each NeMo conversation and text type, as NeMo's readers take them, and the
    input_cfg naming them."""
    cut = next(
        iter(load_source_cuts(read_sources([{"cuts": str(corpus / "cuts_dev.jsonl.gz")}], "x")[0]))
    )
    audio = Path(cut.recording.sources[0].source)
    (tmp_path / "audio.wav").symlink_to(audio)
    multimodal = [
        {
            "id": "mm-0",
            "conversations": [
                {"from": "User", "type": "text", "value": "Repeat:"},
                {"from": "User", "type": "audio", "value": "audio.wav", "duration": cut.duration},
                {"from": "Assistant", "type": "text", "value": "the words"},
            ],
        },
        {  # two audio turns, each its own segment
            "id": "mm-1",
            "conversations": [
                {"from": "User", "type": "audio", "value": "audio.wav", "duration": cut.duration},
                {"from": "User", "type": "audio", "value": "audio.wav", "duration": cut.duration},
                {"from": "Assistant", "type": "text", "value": "both"},
            ],
        },
    ]
    share_gpt = [
        {
            "id": "sg-0",
            "sound": "audio.wav",
            "conversations": [
                {"from": "human", "value": "Listen: <speech> What is it?"},
                {"from": "gpt", "value": "speech"},
            ],
        },
        {
            "id": "sg-1",
            "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}],
        },
    ]
    sft = [
        {
            "system": "Be brief.",
            "conversations": [
                {"from": "User", "value": "Hi"},
                {"from": "Assistant", "value": "Hi."},
            ],
        }
    ]
    for name, lines in (("mm.jsonl", multimodal), ("sg.jsonl", share_gpt), ("sft.jsonl", sft)):
        (tmp_path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "src.txt").write_text("one two\nthree four\n")
    (tmp_path / "tgt.txt").write_text("two one\nfour three\n")
    (tmp_path / "questions.txt").write_text("Reverse:\n")
    config = tmp_path / "input_cfg.yaml"
    config.write_text(
        f"- {{type: multimodal_conversation, manifest_filepath: {tmp_path / 'mm.jsonl'}, "
        "audio_locator_tag: '<audio>', tags: {system_prompt: Listen well.}}\n"
        f"- {{type: share_gpt, manifest_filepath: {tmp_path / 'sg.jsonl'}, audio_locator_tag: x}}\n"
        f"- {{type: nemo_sft_jsonl, paths: {tmp_path / 'sft.jsonl'}}}\n"
        f"- {{type: txt_pair, source_paths: {tmp_path / 'src.txt'}, "
        f"target_paths: {tmp_path / 'tgt.txt'}, questions_path: {tmp_path / 'questions.txt'}}}\n"
    )
    return config


def test_nemo_conversation_and_text_types_read_as_nemo_writes_them(corpus, tmp_path, tokenizers):
    said = []
    sources = read_sources(nemo_files(tmp_path, corpus), "data.input_cfg")
    checks = check_sources(sources, 30.0, AudioLimits(16000), said.append)
    assert said == [] and sources[0].tags == {"system": "Listen well."}
    cuts = {cut.id: cut for check in checks for cut in load_source_cuts(check.source)}
    recordings = {cut_id: turn_recordings(cut) for cut_id, cut in cuts.items()}
    counts = [len(recordings[i]) for i in ("mm-0", "mm-1", "sg-0", "sg-1", "src-1")]
    assert counts == [1, 2, 1, 0, 0]
    assert recordings["mm-0"][0].duration == pytest.approx(recordings["sg-0"][0].duration, 1e-3)
    assert not any(cut.has_recording for cut in cuts.values())
    assert [transcript(cuts[i]) for i in ("mm-0", "sg-0", "sg-1", "src-1")] == [
        "the words",
        "speech",
        "4",
        "four three",
    ]
    chat = ChatPrompt(tokenizers["qwen2"])
    rendered = {
        cut_id: text(
            tokenizers["qwen2"],
            chat.for_tags(cuts[cut_id].custom["tags"])
            .conversation([Turn(**t) for t in cuts[cut_id].custom["conversation"]])
            .tokens,
        )
        for cut_id in ("mm-0", "sg-0", "src-0")
    }
    assert "system\nListen well.<|im_end|>" in rendered["mm-0"]
    assert "user\nRepeat: " in rendered["mm-0"]
    two = chat.conversation([Turn(**t) for t in cuts["mm-1"].custom["conversation"]])
    assert len(two.audio_at) == 2 and two.audio_at[0] < two.audio_at[1]
    assert "user\nListen:  What is it?" in rendered["sg-0"]  # the audio between the spaces
    assert "user\nReverse: one two<|im_end|>" in rendered["src-0"]
    sft = next(cut for cut in cuts.values() if cut.id.startswith("sft"))
    assert sft.custom["conversation"][0] == {"role": "system", "text": "Be brief."}


def test_text_pairs_with_unequal_files_are_refused_by_name(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").write_text("one\n")
    sources = read_sources(
        [{"text_pairs": [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]}], "x"
    )
    with pytest.raises(ValueError, match="different numbers of lines"):
        check_sources(sources, 8.0, AudioLimits(16000), print)


MIXTURE_BUDGET = 8.0  # seconds a batch holds: a conversation with two utterances is ~5


@pytest.fixture(scope="module")
def mixture(corpus, tmp_path_factory) -> tuple[Path, Path]:
    return conversation_mixture(corpus, tmp_path_factory.mktemp("mixture"))


def mixture_loader(checks, dp_rank: int, num_workers: int = 0):
    return lambda epoch, position: build_dataloader(
        checks,
        max_duration=MIXTURE_BUDGET,
        job_seed=3,
        dp_rank=dp_rank,
        dp_size=2,
        num_workers=num_workers,
        text=ByteTokenizer(),
        buckets=2,
        epoch=epoch,
        position=position,
    )


def test_text_and_conversations_mix_with_speech_and_resume_exactly(mixture):
    """Batches hold text-only examples (no frames), conversations (one or two audio segments)
    and ASR cuts together or apart; each segment sits before its token and each example's
    labels are its answers; a job resumed mid-epoch, with a worker, reads the very batches the
    first job would have read next."""
    checks = check_sources(
        read_sources(mixture[0], "data.input_cfg"), MIXTURE_BUDGET, AudioLimits(16000), print
    )
    first = list(
        itertools.islice(batches_from(mixture_loader(checks, 1), DataPosition.start(1)), 24)
    )
    sources = [source for _, batch in first for source in batch["sources"]]
    assert {"asr", "spoken", "text"} <= set(sources)
    assert any(set(batch["sources"]) == {"text"} for _, batch in first), "no text-only batch"
    assert any(batch["feature_lens"].shape[1] == 2 for _, batch in first), "no second segment"
    for _, batch in first:
        lens = batch["feature_lens"]
        segments = (lens > 0).sum(1).tolist()
        for source, count in zip(batch["sources"], segments, strict=True):
            assert count == {"asr": 1, "text": 0}.get(source, count) and count <= 2
        audio = audio_positions(get_preset("tiny"), lens)
        seq_len = int((audio.sum(1) + batch["token_lens"]).max())
        layout = sequence_layout(
            audio,
            batch["tokens"],
            batch["token_lens"],
            seq_len,
            batch["audio_at"],
            batch["target_mask"],
        )
        for row in range(len(lens)):
            labels = layout.labels[row][layout.labels[row] != IGNORE_INDEX].tolist()
            tokens, mask = batch["tokens"][row].tolist(), batch["target_mask"][row].tolist()
            assert labels == [t for t, m in zip(tokens, mask, strict=True) if m]
            # Segment k starts after audio_at[k] tokens and the earlier segments' positions.
            starts = [
                int(batch["audio_at"][row, k]) + int(audio[row, :k].sum())
                for k in range(segments[row])
            ]
            where = layout.is_audio[row].nonzero().flatten().tolist()
            assert where == [
                start + i for k, start in enumerate(starts) for i in range(int(audio[row, k]))
            ]
    for taken, workers in ((4, 1), (9, 0)):
        saved = json.loads(json.dumps(first[taken - 1][0].state()))
        start, replay = DataPosition.resume(saved, 1)
        resumed = next(batches_from(mixture_loader(checks, 1, workers), start, replay))
        assert batch_hash(resumed[1]) == batch_hash(first[taken][1]), f"after {taken} batches"


def test_conversations_decode_after_the_conversation_so_far(mixture):
    """Each sequence of a batch decodes after its own prompt (its conversation up to its last
    answer, with one or two audio segments, or none), exactly as it decodes alone; a cut's
    audio reads again (evaluation decodes a rank's first batch again as its filler)."""
    checks = check_sources(read_sources(mixture[1], "eval.sets"), None, AudioLimits(16000), print)
    cuts = [cut for check in checks for cut in itertools.islice(load_source_cuts(check.source), 3)]
    featurize = SpeechDataset(ByteTokenizer()).featurize
    found = [[torch.from_numpy(f) for f in featurize.segments(cut)] for cut in cuts]
    assert [len(segments) for segments in found] == [1, 1, 2, 0, 0, 0]
    again = [[torch.from_numpy(f) for f in featurize.segments(cut)] for cut in cuts]
    pairs = zip(itertools.chain(*found), itertools.chain(*again), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)  # a cut reads again (a filler)
    prompts = [encoded(ByteTokenizer(), cut).up_to_answer() for cut in cuts]
    assert all(prompt.tokens[-1] == ord("\n") for prompt in prompts)
    model = build_model(get_preset("tiny"), torch.device("cpu"), init_seed=7).eval()
    padded, lens = pad_segments(found, featurize.bins)
    together = greedy_decode(model, padded, lens, 6, lambda mine: mine, prompt=prompts)
    alone = [
        greedy_decode(model, *pad_segments([f], featurize.bins), 6, lambda mine: mine, prompt=[p])[
            0
        ]
        for f, p in zip(found, prompts, strict=True)
    ]
    assert together == alone
    assert [source_of(cut) for cut in cuts] == ["spoken"] * 3 + ["text"] * 3


def test_the_learning_runs_data_reads_as_its_recipe_names_it(corpus, tmp_path):
    """recipes/make_conversations.py on a corpus: its source files (paths relative to
    themselves) read and check with every cut usable, the speech chat's with its capitals (and
    without them), the spoken answers are functions of what is said, and the train split's
    conversations carry a second question."""
    out = tmp_path / "conversations"
    done = run_script(
        REPO / "recipes/make_conversations.py", "--corpus", str(corpus), "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    chat = ["asr", "spoken", "capitals"]
    for name, names in (
        *((name, ["asr", "spoken", "sums"]) for name in ("input_cfg", "eval_sets", "test_sets")),
        *((f"speech_chat_{name}", chat) for name in ("input_cfg", "eval_sets", "test_sets")),
        ("speech_chat_no_text_input_cfg", ["asr", "spoken"]),
    ):
        said = []
        checks = check_sources(
            read_sources(out / f"{name}.yaml", name), 30.0, AudioLimits(16000), said.append
        )
        assert said == [] and [c.source.name for c in checks] == names, name
    # The capitals held out for the test are asked nowhere in training.
    questions = {
        split: set((out / f"capitals_{split}.src.txt").read_text().splitlines())
        for split in ("train", "dev", "test")
    }
    assert len(questions["test"]) == 24 and questions["dev"] == questions["train"]
    assert not questions["test"] & questions["train"]
    answers = (out / "capitals_test.tgt.txt").read_text().splitlines()
    assert answers[0] == "The capital of Germany is Berlin."
    spoken = [
        json.loads(line) for line in (out / "conversations_dev.jsonl").read_text().splitlines()
    ]
    texts = {cut.id: transcript(cut) for cut in load_cuts(corpus / "cuts_dev.jsonl.gz")}
    for line in spoken:
        question, audio, answer = line["conversations"]
        words = texts[line["id"].removeprefix("qa-")].split()
        expected = {"first": words[0], "last": words[-1], "many": str(len(words))}
        assert answer["value"] == next(v for k, v in expected.items() if k in question["value"])
        assert (out / audio["value"]).is_file()
    train = (out / "conversations_train.jsonl").read_text().splitlines()
    assert sum(len(json.loads(line)["conversations"]) == 5 for line in train) > len(train) // 2


def step_of(model, batch: Batch, plan) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss sum of ``batch`` and every parameter's gradient, encoded as ``plan`` says."""
    model.zero_grad()
    out = model(batch, encoder_plan=plan)
    out.nll_sum.backward()
    return out.nll_sum.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("encoder", ["own", "whisper"])
def test_only_audio_is_encoded_packed_and_the_step_is_the_same(mixture, tmp_path, encoder):
    """A batch mixing one-segment speech, two-segment conversations and text alone pads each
    example to the batch's most segments and each segment to the longest: the encoder runs on
    the segments that hold audio (at least one row, for a text-only batch), packed, its blocks
    on their real frames alone, and the loss and every gradient are those of the padded
    encoder within fp32 rounding (the own encoder; Whisper's, in 30-s windows)."""
    checks = check_sources(
        read_sources(mixture[0], "data.input_cfg"), MIXTURE_BUDGET, AudioLimits(16000), print
    )
    loaded = [
        b
        for _, b in itertools.islice(
            batches_from(mixture_loader(checks, 1), DataPosition.start(1)), 24
        )
    ]
    mixed = next(b for b in loaded if (b["feature_lens"] > 0).sum(1).unique().numel() > 1)
    text_only = next(b for b in loaded if set(b["sources"]) == {"text"})
    cfg = get_preset("tiny")
    if encoder == "whisper":
        directory = save_tiny_encoder("whisper", tmp_path / "whisper")
        cfg = model_of(ModelConfig(pretrained_encoder=str(directory)))
    model = build_model(cfg, torch.device("cpu"), init_seed=7)
    encoded_rows, block_frames = [], []
    model.encoder.register_forward_pre_hook(lambda _m, args: encoded_rows.append(len(args[0])))
    model.encoder.layers[0].register_forward_pre_hook(
        lambda _m, args: block_frames.append(args[0].shape[:2])
    )
    for loaded_batch in (mixed, text_only):
        batch = Batch.of(loaded_batch)
        plan = encoder_plan(model.cfg, model.encoder, batch.feature_lens)
        assert plan.rows is not None and plan.packing is not None
        padded_loss, padded_grads = step_of(model, batch, None)
        loss, grads = step_of(model, batch, plan)
        held = batch.feature_lens[batch.feature_lens > 0]
        assert encoded_rows[-2:] == [batch.feature_lens.numel(), max(len(held), 1)]
        frames = int(encoder_frames(model.cfg, held).sum()) if len(held) else 0
        empty = int(encoder_frames(model.cfg, torch.tensor(MIN_FEATURE_FRAMES)))
        assert block_frames[-1] == (1, frames or empty)  # no padding in the blocks
        torch.testing.assert_close(loss, padded_loss, rtol=1e-5, atol=0)
        assert len(grads) == len(padded_grads)
        for got, want in zip(grads, padded_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_pipelines_first_stage_encodes_each_microbatchs_segments_with_audio(mixture):
    """Under a pipeline the schedule splits the batch into microbatches itself: the runner
    hands the first stage each microbatch's encoder plan, read on the host, and the stage
    takes them in microbatch order, encoding the rows with audio alone, packed, with the padded
    stage's output within fp32 rounding."""
    checks = check_sources(
        read_sources(mixture[0], "data.input_cfg"), MIXTURE_BUDGET, AudioLimits(16000), print
    )
    loaded = itertools.islice(batches_from(mixture_loader(checks, 1), DataPosition.start(1)), 24)
    batch = next(b for _, b in loaded if len(b["sources"]) >= 4 and len(set(b["sources"])) > 1)
    batch = pad_examples(Batch.of(batch).with_prompt(), 2)
    model = build_model(get_preset("tiny"), torch.device("cpu"), init_seed=7)
    stage = PipelinePart(model, range(model.cfg.n_layers), first=True, last=True).eval()
    encoded_rows = []
    stage.encoder.register_forward_pre_hook(lambda _m, args: encoded_rows.append(len(args[0])))
    queued = microbatch_plans(stage, batch, 2, torch.device("cpu"))
    half = len(batch.tokens) // 2
    micro = [Batch(*(t[i * half : (i + 1) * half] for t in batch)) for i in range(2)]
    expected = [encoder_plan(model.cfg, stage.encoder, m.feature_lens) for m in micro]
    for got, want in zip(queued, expected, strict=True):
        assert (got.rows is None) == (want.rows is None)
        assert got.rows is None or got.rows.tolist() == want.rows.tolist()
        assert got.packing.slots.tolist() == want.packing.slots.tolist()
    assert any(p.rows is not None for p in expected), "no microbatch with an empty segment"
    with torch.no_grad():
        for m, plan in zip(micro, expected, strict=True):
            seq_len = host_seq_len(m, model)
            layout = batch_layout(m, audio_positions(model.cfg, segments(*m[:2])[1]), seq_len)
            stage.encoder_plans = deque([plan])
            held = stage(*m, token_mask=layout.token_mask)
            assert not stage.encoder_plans  # taken
            padded = stage(*m, token_mask=layout.token_mask)
            torch.testing.assert_close(held, padded, rtol=1e-5, atol=1e-6)
            rows_encoded = m.feature_lens.numel() if plan.rows is None else len(plan.rows)
            assert encoded_rows[-2:] == [rows_encoded, m.feature_lens.numel()]
