"""Pretrained Hugging Face decoders in the project's own decoder: tiny random Llama, Qwen2 and
Qwen3 models that ``transformers`` builds and ``save_pretrained`` writes (nothing downloaded),
loaded through the state-dict map and held to ``transformers``' own logits."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
)

from tests.harness.hf_tiny import FAMILIES, save_tiny
from tests.harness.process import REPO, run_python
from tests.harness.workers.hf_load_worker import record
from train.models.hf_config import decoder_fields
from train.models.hf_weights import llm_state, load_llm_weights
from train.models.inventory import inventory
from train.models.salm import SALM
from train.models.shape import SALMConfig
from train.parallel.dims import ParallelDims

WORKER = REPO / "tests" / "harness" / "workers" / "hf_load_worker.py"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pretrained(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, save_tiny(family, tmp_path_factory.mktemp(family))


def our_model(directory: Path) -> SALM:
    model = SALM(SALMConfig(**decoder_fields(directory)))
    load_llm_weights(model, directory)
    return model.eval()


def test_logits_equal_transformers(pretrained) -> None:
    family, directory = pretrained
    ours = our_model(directory)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = torch.randint(0, 301, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got, _ = ours.llm(ours.llm.embed(tokens), torch.ones_like(tokens, dtype=torch.bool))
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-5 * scale, family


def test_every_file_tensor_lands_bitwise_and_nothing_else_is_missed(pretrained) -> None:
    _, directory = pretrained
    ours = our_model(directory)
    stored = load_file(directory / "model.safetensors")
    state = llm_state(ours)
    assert sorted(state) == sorted(stored)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor), name


def test_the_inventory_lists_the_loaded_model_exactly(pretrained) -> None:
    """The planner prices what the trainer builds: biases, q/k norms, a tied head."""
    _, directory = pretrained
    cfg = SALMConfig(**decoder_fields(directory))
    model = SALM(cfg)
    listed = [(item.name, item.shape) for item in inventory(cfg)]
    assert listed == [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def test_bf16_files_load_into_fp32(tmp_path) -> None:
    directory = save_tiny("qwen2", tmp_path / "bf16", dtype=torch.bfloat16)
    ours = our_model(directory)
    stored = load_file(directory / "model.safetensors")
    state = llm_state(ours)
    assert all(state[name].dtype == torch.float32 for name in stored)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor.float()), name


def test_a_hub_id_is_refused_with_how_to_fetch_it() -> None:
    with pytest.raises(ValueError, match=r"hub id.*hf download"):
        decoder_fields("Qwen/Qwen2.5-0.5B")


@pytest.mark.parametrize(
    ("remove", "message"),
    [("config.json", "no config.json"), ("model.safetensors", "no safetensors weights")],
)
def test_a_missing_file_is_named(pretrained, tmp_path, remove, message) -> None:
    _, directory = pretrained
    copy = tmp_path / "copy"
    copy.mkdir()
    for item in directory.iterdir():
        if item.name != remove:
            (copy / item.name).write_bytes(item.read_bytes())
    with pytest.raises(ValueError, match=message):
        decoder_fields(copy)


def test_an_unsupported_architecture_is_named(tmp_path) -> None:
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model_type 'gpt2'\) is not supported"):
        decoder_fields(tmp_path)


def test_an_option_our_blocks_lack_is_refused(tmp_path) -> None:
    save_tiny("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        decoder_fields(tmp_path)


@pytest.fixture(scope="module")
def every_family(tmp_path_factory) -> dict[str, Path]:
    return {family: save_tiny(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def one_process(every_family) -> dict[str, dict]:
    """Each family loaded into the tiny SALM by one plain process: the reference."""
    args = argparse.Namespace(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, lora_rank=0)
    return {family: record(directory, args) for family, directory in every_family.items()}


LORA_RANK, LORA_FAMILIES = 4, ["llama", "qwen2"]  # an untied and a tied head with biases


@pytest.fixture(scope="module")
def one_process_lora(every_family) -> dict[str, dict]:
    """LoRA on every projection, two steps, by one plain process: the reference."""
    args = argparse.Namespace(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, lora_rank=LORA_RANK)
    return {family: record(every_family[family], args) for family in LORA_FAMILIES}


def _load_under(layout: list[str], world: int, directories: list[Path], out: Path) -> dict:
    command = [str(WORKER), *layout, "--out", str(out), *map(str, directories)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = run_python(command, world, env, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    return torch.load(out)


@pytest.mark.parametrize(
    ("layout", "world", "families"),
    [
        # FSDP x TP: the vocabulary (301) splits unevenly over tp=2, GQA's 2 KV heads split,
        # the tied head and embedding shard over the vocabulary together.
        (["--dp-shard", "2", "--tp", "2"], 4, sorted(FAMILIES)),
        # HSDP (2 replicas of 2 shards), the shard dimension carried by context parallelism.
        (["--dp-replicate", "2", "--cp", "2"], 4, sorted(FAMILIES)),
        # Pipeline stages, each loading only its own blocks (an untied model: see below).
        (["--pp", "2", "--dp-shard", "1"], 2, ["llama"]),
    ],
    ids=["fsdp-tp", "hsdp-cp", "pp"],
)
def test_sharded_loading_matches_one_process(
    every_family, one_process, tmp_path, layout, world, families
) -> None:
    """Each rank reads only its shards, and the loaded model is the one-process model: the same
    weights bitwise, the same loss, the head still tied to the embedding, and training moves
    them alike (a head untied by sharding, or a missing RoPE recomputation, shows here)."""
    directories = [every_family[family] for family in families]
    loaded = _load_under(layout, world, directories, tmp_path / "out.pt")
    for family, directory in zip(families, directories, strict=True):
        want, got = one_process[family], loaded[str(directory)]
        assert got["params"].keys() == want["params"].keys(), family
        for name, param in want["params"].items():
            assert torch.equal(got["params"][name], param), f"{family}: {name}"
        assert got["tied"] == want["tied"] == (family != "llama")
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=0)
        assert abs(got["loss_after_step"] - want["loss"]) > 1e-3 * want["loss"], "no step taken"
        torch.testing.assert_close(
            got["loss_after_step"], want["loss_after_step"], rtol=1e-4, atol=0
        )
        held, full = sum(got["local_elements"].values()), sum(want["local_elements"].values())
        assert held <= 0.55 * full, f"{family}: a rank holds {held} of {full} LLM elements"


def test_a_tied_model_in_pipeline_stages_is_refused_in_one_line(every_family) -> None:
    cfg = SALMConfig(**decoder_fields(every_family["qwen2"]))
    with pytest.raises(ValueError, match="pp=2 with tied embeddings") as error:
        ParallelDims(2, pp=2).validate(cfg)
    assert "\n" not in str(error.value)


def test_gqa_kv_heads_tp_must_divide_is_refused_in_one_line(every_family) -> None:
    cfg = SALMConfig(**decoder_fields(every_family["llama"]))
    with pytest.raises(ValueError, match="tp=4 must divide the 2 KV heads"):
        ParallelDims(4, tp=4).validate(cfg)


def test_lora_trains_its_adapters_alone_and_alike_under_fsdp_and_tp(
    every_family, one_process, one_process_lora, tmp_path
) -> None:
    """peft's LoRA layers on every projection of a pretrained LLM: the adapted model starts as
    the model (B is zero), two steps move every adapter (A from the second), the encoder and the
    projector, and not one of the LLM's own weights; FSDP x TP (A whole beside column-parallel
    bases and split beside row-parallel ones) gives the one process's parameters."""
    directories = [every_family[family] for family in LORA_FAMILIES]
    layout = ["--dp-shard", "2", "--tp", "2", "--lora-rank", str(LORA_RANK)]
    loaded = _load_under(layout, 4, directories, tmp_path / "out.pt")
    for family, directory in zip(LORA_FAMILIES, directories, strict=True):
        want, got = one_process_lora[family], loaded[str(directory)]
        assert want["loss"] == one_process[family]["loss"], "the adapters changed the start"
        before, after = want["params"], want["params_after_steps"]
        moved = {name for name in before if not torch.equal(before[name], after[name])}
        adapters = {name for name in before if ".lora_" in name}
        assert len(adapters) == 2 * 7 * 2  # two blocks, seven projections, A and B
        llm_moved = {name for name in moved if name.startswith("llm.")}
        assert llm_moved == adapters, sorted(llm_moved ^ adapters)[:4]
        assert any(name.startswith("encoder.") for name in moved), "the encoder did not train"
        assert got["params_after_steps"].keys() == after.keys()
        for name, param in after.items():
            torch.testing.assert_close(
                got["params_after_steps"][name], param, rtol=1e-4, atol=1e-5, msg=name
            )
        torch.testing.assert_close(
            got["loss_after_step"], want["loss_after_step"], rtol=1e-5, atol=0
        )


def test_the_recipe_writes_a_decoder_the_trainer_takes(corpus, tmp_path) -> None:
    """recipes/make_hf_llm.py (make hf-llm): a Qwen2 directory with tied embeddings, UTF-8
    bytes for tokens and ChatML (the recipe's choices, docs/performance.md issue 36), or a BPE
    learnt from the corpus's training transcripts; the trainer's reader takes both, transformers
    loads them. A rerun with the same options leaves the directory as it is; with other options,
    or over a directory an older maker wrote, it is refused (exit 2), not silently kept."""
    from recipes.make_hf_llm import OPTIONS_FILE, main
    from train.data.prompt import ChatPrompt, load_tokenizer

    out = tmp_path / "hf" / "qwen2"
    args = ["--corpus", str(corpus), "--out", str(out)]
    assert main(args) == 0
    fields = decoder_fields(out)
    assert fields["qkv_bias"] and fields["tie_embeddings"] and fields["d_model"] == 64
    tokenizer = load_tokenizer(out)
    assert len(tokenizer) <= fields["vocab_size"] + 1  # <|audio|> needs no row
    text = "seven hundred and twelve"
    assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode())
    prompt = ChatPrompt(tokenizer, "Transcribe the audio.", None).generation_prompt()
    assert tokenizer.decode(prompt.tokens).endswith("<|im_start|>assistant\n")
    assert AutoModelForCausalLM.from_pretrained(out, local_files_only=True).num_parameters() > 0
    stamp = (out / "config.json").stat().st_mtime_ns
    assert main(args) == 0 and (out / "config.json").stat().st_mtime_ns == stamp
    assert main([*args, "--tokenizer=bpe"]) == 2
    (out / OPTIONS_FILE).unlink()
    assert main(args) == 2 and (out / "config.json").stat().st_mtime_ns == stamp
    assert main(["--corpus", str(tmp_path), "--out", str(tmp_path / "x")]) == 2

    bpe = tmp_path / "hf" / "bpe"
    assert main(["--corpus", str(corpus), "--out", str(bpe), "--tokenizer=bpe"]) == 0
    tokenizer = load_tokenizer(bpe)
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) // 2
    assert len(tokenizer) <= decoder_fields(bpe)["vocab_size"] + 1


def test_the_recipe_can_write_the_presets_own_decoder(corpus, tmp_path) -> None:
    """make_hf_llm.py with every factor set to the preset's (Llama, untied, bytes, plain format,
    preset init, shape, eps, no rounding) writes the preset's decoder: the trainer reads the
    tiny preset's shape back, and its weights equal a preset model's at the same init seed, so
    bench/bench_hf_factors.py's comparison starts from one model. Its tokenizer's ids are the
    ByteTokenizer's, and the plain format puts a transcript after the audio as bytes and eos."""
    from recipes.make_hf_llm import main
    from train.data.prompt import ChatPrompt, load_tokenizer
    from train.data.text import ByteTokenizer
    from train.models.build import build_model
    from train.models.presets import get_preset, model_shape

    out = tmp_path / "preset_as_hf"
    args = ["--family=llama", "--untied", "--tokenizer=bytes", "--template=none", "--init=preset"]
    exact = ["--hidden=64", "--ffn=128", "--vocab-multiple=1", "--norm-eps=1e-5", "--seed=7"]
    assert main(["--corpus", str(corpus), "--out", str(out), *args, *exact]) == 0
    shape = model_shape("tiny", str(out))
    assert shape == get_preset("tiny")
    preset = build_model(shape, torch.device("cpu"), init_seed=7)
    loaded = build_model(shape, torch.device("cpu"), init_seed=8)
    load_llm_weights(loaded, out)
    mine, theirs = llm_state(preset), llm_state(loaded)
    assert mine.keys() == theirs.keys() and "lm_head.weight" in mine
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    text = "dix-sept, héllo"
    encoded = ChatPrompt(load_tokenizer(out), ".", None).example(text)
    assert encoded.tokens[encoded.answer_start :] == ByteTokenizer().encode(text)[1:]
