"""The source syntax of ``data.input_cfg`` and ``eval.sets``: parsing, weights, tags, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.data.sources import SourceError, check_prompt_tags, prompt_of, read_sources, shares


@pytest.fixture
def files(tmp_path) -> Path:
    for name in ("a.jsonl.gz", "b.jsonl.gz", "c.jsonl.gz", "rec.jsonl.gz", "sup.jsonl.gz"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "shar").mkdir()
    return tmp_path


def write(directory: Path, text: str) -> Path:
    path = directory / "input_cfg.yaml"
    path.write_text(text)
    return path


def test_nested_groups_multiply_weights_and_pass_tags_down(files):
    """A user's NeMo-style mixture: a group's weight splits among its members by theirs, tags
    are inherited and overridden, relative paths resolve beside the file."""
    path = write(
        files,
        """
- cuts: a.jsonl.gz
  weight: 1
- weight: 1
  tags: {language: en, prompt: "Transcribe the {language} audio"}
  sources:
    - {name: bee, cuts: [b.jsonl.gz, c.jsonl.gz], weight: 1}
    - {recordings: rec.jsonl.gz, supervisions: sup.jsonl.gz, weight: 3, tags: {language: de}}
- {shar: shar, weight: 2, name: streamed}
""",
    )
    sources = read_sources(path, "data.input_cfg")
    assert [s.name for s in sources] == ["a", "bee", "rec", "streamed"]
    assert [s.kind for s in sources] == ["cuts", "cuts", "recordings", "shar"]
    assert sources[1].paths == (files / "b.jsonl.gz", files / "c.jsonl.gz")
    assert shares(sources) == pytest.approx(
        {"a": 0.25, "bee": 0.0625, "rec": 0.1875, "streamed": 0.5}
    )
    assert prompt_of(sources[2].tags, "prompt", None) == "Transcribe the de audio"
    assert prompt_of(sources[0].tags, "prompt", "default") == "default"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- {cuts: a.jsonl.gz, weight: 0}", "weight 0; weights must be positive"),
        ("- {cuts: a.jsonl.gz, weight: -1}", "weights must be positive"),
        ("- {cuts: missing.jsonl.gz}", "missing.jsonl.gz does not exist"),
        ("- {recordings: rec.jsonl.gz}", "needs its supervisions"),
        ("- {cuts: a.jsonl.gz, shar: shar}", "exactly one of"),
        ("- {cuts: a.jsonl.gz, wieght: 2}", "unknown keys wieght"),
        ("- {cuts: a.jsonl.gz}\n- {cuts: a.jsonl.gz}", "source names repeat (a)"),
        ("- {sources: []}", "sources must be a non-empty list"),
        ("[]", "expected a non-empty YAML list"),
        ("- [unclosed", "not valid YAML"),
        ("- {cuts: a.jsonl.gz, tags: [x]}", "tags must be a mapping"),
    ],
)
def test_a_bad_source_file_is_one_line_naming_the_problem(files, text, message):
    with pytest.raises(SourceError) as refused:
        read_sources(write(files, text), "data.input_cfg")
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).startswith("data.input_cfg=")


def test_a_prompt_naming_a_missing_tag_is_refused():
    with pytest.raises(SourceError, match="names tag 'language'"):
        prompt_of({"prompt": "Transcribe the {language} audio"}, "prompt", None)


def test_inline_sources_resolve_against_the_working_directory(files, monkeypatch):
    """``eval.sets`` given on the command line as a list."""
    monkeypatch.chdir(files)
    [source] = read_sources([{"name": "dev", "cuts": "a.jsonl.gz"}], "eval.sets")
    assert source.paths == (files / "a.jsonl.gz",) and source.weight == 1.0


def test_prompt_tags_need_a_pretrained_llm(files):
    """The presets' byte tokenizer has no prompt: a source asking for one is refused, not
    silently trained without it."""
    sources = read_sources([{"cuts": str(files / "a.jsonl.gz"), "tags": {"prompt": "Hi"}}], "x")
    with pytest.raises(SourceError, match="source a has prompt tags"):
        check_prompt_tags(sources, None, "data.input_cfg")
    check_prompt_tags(sources, "some/llm", "data.input_cfg")
