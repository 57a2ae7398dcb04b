"""Our training step beside torchtitan's: same decoder shape, same tokens, same GPU, same run.

    python -m bench.bench_torchtitan                  # both GPU shapes on one GPU, bf16
    python -m bench.bench_torchtitan --cpu            # a tiny shape on 2 gloo ranks, fp32 (CI)

For each shape, our SALM and torchtitan's llama3 (``torchtitan==0.3.0``) each run in a fresh
``torch.distributed.run`` job (so peak memory is each model's own), parallelized by their own
code at the same settings: FSDP2 over all ranks, bf16 parameters with fp32 gradient reduction on
CUDA (fp32 on the CPU), per-block ``torch.compile`` (on CUDA; off on the CPU, where inductor
takes minutes), selective activation checkpointing. Where ours has no equivalent, torchtitan
keeps its defaults: its SAC policy (keep every other matmul's output), its fused QKV projection,
its compiled loss. Its ``partial_dtensor`` backend stands in for the default ``spmd_types``,
whose FSDP over more than one rank needs a newer torch than 2.13. Both train with the same AdamW
(fused, lr 1e-3, betas (0.9, 0.95), weight decay 0.1) and clip gradients to norm 1, each with its
own clipping, on one fixed batch of random tokens.

Text only: our SALM always runs its audio encoder, so ours is built with the smallest encoder
(width 8, no blocks) and each example has zero audio frames; the decoder then sees exactly the
tokens. What remains of the encoder and projector (mostly the projector's d_model x d_model
matrix: 0.4% of the parameters at d_model 2048) trains but is not counted. Attention: ours is
SDPA with ``is_causal``; torchtitan's language-model default is FlexAttention with a
max-autotuned block-causal mask, so its own ``ScaledDotProductAttention`` (causal, cuDNN's
kernel first where ours takes torch's default order) replaces it: the same kind of kernel, and
minutes less compiling. torchtitan's trainer also captures forward
and backward in a CUDA graph by default; that stays off, as ours has none.

Both get the same ``batch x seq_len`` tokens; ours predicts ``seq_len - 1`` targets per
sequence, and torchtitan's last label is ignored so that it trains on the same ones. FLOPs (for
MFU, against the datasheet peak of ``train.flops.peak_flops``) come from one formula for both,
``train.flops.sequence_flops`` of the decoder shape with no audio: 6 x (matmul weights per
position, output head included) x tokens, plus 12 x layers x heads x head_dim x seq_len**2 per
sequence for attention (no causal discount, as torchtitan counts). tokens/s counts every
position. The last line of stdout is the JSON of both rows per shape and the ratios ours /
torchtitan; each row's losses (every step, warm-up included) should start near ln(vocab) and
fall: a sanity check, not a claim that the two are equal. A tied head (Llama 3.2's shape) is
drawn by the head's rule in both (``train.models.init``).

On an H200 the GPU form takes about 3 minutes, nearly all of it in the 4 processes' start,
initialization and compilation (``build_s``, ``warmup_s`` in the JSON); the CPU form 15-30 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from train.flops import peak_flops, sequence_flops
from train.models.presets import LLAMA_3_2_1B_DECODER, get_preset
from train.models.shape import SALMConfig

REPO = Path(__file__).resolve().parents[1]

IMPLS = ("ours", "torchtitan")
IGNORE_INDEX = -100
LR = 1e-3
TOKENS_SEED = 0


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder: what both models are built at."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    rope_theta: float
    tied: bool


def decoder_shape(name: str, cfg: SALMConfig) -> Shape:
    """The decoder of ``cfg``, named ``name``."""
    return Shape(
        name,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.ffn_hidden,
        cfg.vocab_size,
        cfg.rope_theta,
        cfg.tie_embeddings,
    )


LLAMA_3_2_1B = decoder_shape("llama3.2_1b", SALMConfig(**LLAMA_3_2_1B_DECODER))
TINY = Shape("tiny", 64, 2, 4, 2, 128, 256, 10000.0, False)


@dataclasses.dataclass(frozen=True)
class Settings:
    """One mode of the bench: where it runs and how much of it."""

    device: str
    nproc: int
    shapes: tuple[Shape, ...]
    batch: int  # sequences per step, over all ranks
    seq_len: int
    warmup: int
    steps: int
    compile: bool


def settings(device: str, cpu: bool) -> Settings:
    """A GPU: both 1B shapes, 4 x 2048 tokens on one device. The CPU: the tiny shape on 2 gloo
    ranks, few steps, eager (under a minute on two cores)."""
    if cpu:
        return Settings("cpu", 2, (TINY,), 4, 32, 2, 4, compile=False)
    shapes = (decoder_shape("llm_1b", get_preset("llm_1b")), LLAMA_3_2_1B)
    return Settings(device, 1, shapes, 4, 2048, 3, 10, compile=True)


def salm_config(shape: Shape) -> SALMConfig:
    """Our SALM with ``shape`` as its decoder and the smallest own encoder (width 8, no
    blocks): the text-only batches give it no frames."""
    return SALMConfig(
        enc_dim=8,
        enc_layers=0,
        enc_heads=1,
        enc_ffn_hidden=8,
        d_model=shape.dim,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        ffn_hidden=shape.ffn_hidden,
        vocab_size=shape.vocab_size,
        rope_theta=shape.rope_theta,
        tie_embeddings=shape.tied,
    )


def step_flops(shape: Shape, batch: int, seq_len: int) -> float:
    """Training FLOPs of one step of ``batch`` sequences of ``seq_len`` tokens: the decoder's
    alone (no audio frames), by ``train.flops``; the same figure for both models."""
    return batch * float(sequence_flops(salm_config(shape), 0, seq_len))


def batch_tokens(shape: Shape, batch: int, seq_len: int) -> torch.Tensor:
    """The fixed (batch, seq_len) token ids both models train on, drawn on the CPU."""
    generator = torch.Generator().manual_seed(TOKENS_SEED)
    return torch.randint(0, shape.vocab_size, (batch, seq_len), generator=generator)


def make_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The same AdamW for both (torchtitan's default betas and weight decay)."""
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


# A step: one forward, backward and optimizer step on this rank's tokens; returns the local
# summed next-token loss (detached), for the sanity print.
Step = Callable[[], torch.Tensor]


def build_ours(
    shape: Shape, run: Settings, device: torch.device, tokens: torch.Tensor, world: int
) -> tuple[torch.nn.Module, Step]:
    """Our model as the trainer builds it (meta init, ``parallelize``, sharded init), and its
    step on ``tokens`` with no audio."""
    from train.models.batch import Batch
    from train.models.build import build_model
    from train.models.loss import loss_for_backward
    from train.models.parallelize import ParallelizeOptions
    from train.parallel.dims import ParallelDims
    from train.parallel.distributed import clip_grad_norm
    from train.parallel.mesh import build_meshes

    cfg = salm_config(shape)
    options = ParallelizeOptions(activation_checkpointing="selective", compile=run.compile)
    meshes = build_meshes(ParallelDims(world_size=world), device.type)
    model = build_model(cfg, device, 1234, meshes, options)
    optimizer = make_optimizer(list(model.parameters()))
    rows = tokens.shape[0]
    features = torch.zeros(rows, 1, cfg.n_mels, device=device)  # one frame, length zero
    feature_lens = torch.zeros(rows, dtype=torch.long, device=device)
    token_lens = torch.full((rows,), run.seq_len, device=device)
    targets = torch.tensor(float(run.batch * (run.seq_len - 1)), device=device)
    sequences = torch.tensor(float(run.batch), device=device)

    def step() -> torch.Tensor:
        out = model(Batch(features, feature_lens, tokens, token_lens), seq_len=run.seq_len)
        loss_for_backward(out, targets, sequences, world).backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.nll_sum.detach()

    return model, step


def stand_ins_for_torchtitan() -> None:
    """Let torchtitan 0.3.0's llama3 import on this torch. It imports, with every model, two
    things a dense llama3 under ``partial_dtensor`` never runs: torch's
    ``fsdp.DataParallelMeshDims`` (torch 2.13; torch 2.11 lacks it), used for the spmd_types
    and full_dtensor backends' meshes only, and its MoE all-to-all Triton kernels
    (``models.common.decoder`` -> ``moe`` -> ``token_dispatcher`` ->
    ``distributed.minimal_async_ep``), while a CPU build of torch comes without Triton. Where
    either is missing, a placeholder takes its name (the kernels' placeholders refuse to
    run)."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
    if importlib.util.find_spec("triton") is not None:
        return

    def needs_triton(*args, **kwargs):
        raise RuntimeError("torchtitan's MinimalAsyncEP needs triton")

    module = types.ModuleType("torchtitan.distributed.minimal_async_ep")
    kernels = ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config")
    for name in kernels:
        setattr(module, name, needs_triton)
    module.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})
    sys.modules[module.__name__] = module


def titan_config(shape: Shape, seq_len: int):
    """torchtitan's llama3 config at ``shape``, built as its own flavours are, with its causal
    SDPA attention instead of FlexAttention."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = llama3._build_llama3_layers(
        n_layers=shape.n_layers,
        dim=shape.dim,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        hidden_dim=shape.ffn_hidden,
        rope=ComplexRoPE.Config(
            dim=shape.dim // shape.n_heads, max_seq_len=seq_len, theta=shape.rope_theta
        ),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    embedding_init = llama3._EMBEDDING_SKIP_INIT if shape.tied else llama3._EMBEDDING_INIT
    return llama3.Llama3Model.Config(
        dim=shape.dim,
        vocab_size=shape.vocab_size,
        enable_weight_tying=shape.tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size, embedding_dim=shape.dim, param_init=embedding_init
        ),
        norm=RMSNorm.Config(normalized_shape=shape.dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=shape.dim,
            out_features=shape.vocab_size,
            param_init=llama3._output_linear_init(shape.dim),
        ),
        layers=layers,
    )


def build_torchtitan(
    shape: Shape, run: Settings, device: torch.device, tokens: torch.Tensor, world: int
) -> tuple[torch.nn.Module, Step]:
    """torchtitan's llama3 as its trainer builds it (meta init, ``parallelize_llama``,
    ``init_weights``), and its trainer's step body on ``tokens``."""
    stand_ins_for_torchtitan()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3.parallelize import parallelize_llama

    # Where torch sees no accelerator torchtitan still names "cuda" for its device meshes.
    parallel_dims.device_type = device.type
    # Its default backend, spmd_types, leaves FSDP's parameters plain tensors that only a
    # fully_shard newer than torch 2.13 shards over more than one rank.
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = titan_config(shape, run.seq_len).build()
    precision = "bfloat16" if device.type == "cuda" else "float32"
    training = TrainingConfig(
        local_batch_size=tokens.shape[0], seq_len=run.seq_len, mixed_precision_param=precision
    )
    compile_config = CompileConfig(enable=run.compile)
    with tempfile.TemporaryDirectory() as dump_folder:
        model = parallelize_llama(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=SelectiveAC.Config(),
            dump_folder=dump_folder,
        )
    if device.type == "cpu":
        # torchtitan sets FSDP's gradient divide factor to 1, reduced as a PREMUL_SUM, which
        # gloo lacks: a plain sum is the same thing.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss.Config().build(compile_config=compile_config)
    optimizer = make_optimizer(list(model.parameters()))
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)
    targets = torch.tensor(run.batch * (run.seq_len - 1), device=device)

    def step() -> torch.Tensor:
        pred = model(tokens)
        loss, _ = loss_fn(pred, labels, targets)
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach() * targets

    return model, step


BUILDERS = {"ours": build_ours, "torchtitan": build_torchtitan}


def measure(impl: str, shape: Shape, run: Settings) -> dict | None:
    """One model in this torchrun job: warm-up, timed steps; rank 0's figures (None on other
    ranks)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(run.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)  # torchtitan's initialization draws from torch's generator
    rows = run.batch // world
    tokens = batch_tokens(shape, run.batch, run.seq_len)[rank * rows : (rank + 1) * rows]
    started = time.perf_counter()
    model, step = BUILDERS[impl](shape, run, device, tokens.to(device), world)
    built = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    losses = [step() for _ in range(run.warmup)]
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warm = time.perf_counter()
    losses += [step() for _ in range(run.steps)]
    sync()
    step_time = (time.perf_counter() - warm) / run.steps
    summed = torch.stack(losses).float()
    dist.all_reduce(summed)  # the global mean next-token loss of each step
    mean_losses = (summed / (run.batch * (run.seq_len - 1))).tolist()
    result = {
        "impl": impl,
        "shape": shape.name,
        "params_m": params / 1e6,
        "build_s": built - started,
        "warmup_s": warm - built,  # compilation happens here
        "step_time_s": step_time,
        "tokens_per_s": run.batch * run.seq_len / step_time,
        "losses": mean_losses,
        "mfu": None,
        "peak_allocated_gib": None,
        "peak_reserved_gib": None,
    }
    if device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(device), os.environ)
        flops = step_flops(shape, run.batch, run.seq_len)
        result.update(
            gpu=torch.cuda.get_device_name(device),
            mfu=flops / step_time / (world * peak) if peak else None,
            peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
        )
    dist.destroy_process_group()
    return result if rank == 0 else None


def run_child(impl: str, shape: Shape, run: Settings) -> dict:
    """``measure`` in a fresh torchrun job of ``run.nproc`` ranks; its JSON line back."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={run.nproc}",
        "-m",
        "bench.bench_torchtitan",
        "--child",
        impl,
        "--shape",
        shape.name,
        *(["--cpu"] if run.device == "cpu" else ["--device", run.device]),
    ]
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if run.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # a core per rank
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} at {shape.name} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def run(device: str = "cuda", cpu: bool = False) -> dict:
    """Both models at each shape of the mode (``cpu``: the tiny shape on 2 gloo ranks; else
    both 1B shapes on ``device``); the rows and, per shape, the ratios ours / torchtitan."""
    mode = settings(device, cpu)
    rows, ratios = [], []
    for shape in mode.shapes:
        pair = {}
        for impl in IMPLS:
            pair[impl] = run_child(impl, shape, mode)
            print(json.dumps(pair[impl]), file=sys.stderr, flush=True)  # as each one ends
        rows += pair.values()
        ratios.append({"shape": shape.name, **ratio(pair["ours"], pair["torchtitan"])})
    return {
        "device": mode.device,
        "ranks": mode.nproc,
        "batch": mode.batch,
        "seq_len": mode.seq_len,
        "warmup": mode.warmup,
        "steps": mode.steps,
        "compile": mode.compile,
        "ln_vocab": {shape.name: math.log(shape.vocab_size) for shape in mode.shapes},
        "rows": rows,
        "ratios": ratios,
    }


RATIO_KEYS = ("tokens_per_s", "mfu", "peak_allocated_gib", "peak_reserved_gib")


def ratio(ours: dict, titan: dict) -> dict:
    """ours / torchtitan for each figure both have (None where either lacks it)."""
    return {
        key: ours[key] / titan[key] if ours[key] is not None and titan[key] else None
        for key in RATIO_KEYS
    }


def cell(value: float | None, form: str) -> str:
    return "n/a" if value is None else format(value, form)


def table(result: dict) -> str:
    """The rows and ratios as one markdown table."""
    lines = [
        "| shape | model | params M | step s | tokens/s | MFU | peak alloc GiB | "
        "peak reserved GiB | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        losses = row["losses"]
        lines.append(
            f"| {row['shape']} | {row['impl']} | {row['params_m']:.1f} | "
            f"{row['step_time_s']:.3f} | {row['tokens_per_s']:.0f} | "
            f"{cell(row['mfu'], '.1%')} | {cell(row['peak_allocated_gib'], '.1f')} | "
            f"{cell(row['peak_reserved_gib'], '.1f')} | {losses[0]:.3f} -> {losses[-1]:.3f} |"
        )
    for r in result["ratios"]:
        lines.append(
            f"| {r['shape']} | ours / torchtitan | | | {cell(r['tokens_per_s'], '.2f')} | "
            f"{cell(r['mfu'], '.2f')} | {cell(r['peak_allocated_gib'], '.2f')} | "
            f"{cell(r['peak_reserved_gib'], '.2f')} | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cpu", action="store_true", help="the tiny shape on 2 gloo ranks")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one model in a torchrun job
        mode = settings(args.device, args.cpu)
        shape = next(shape for shape in mode.shapes if shape.name == args.shape)
        row = measure(args.child, shape, mode)
        if row is not None:
            print(json.dumps(row), flush=True)
        return
    result = run(args.device, args.cpu)
    print(
        f"{result['batch']} x {result['seq_len']} tokens on {result['device']} "
        f"({result['ranks']} rank(s)), {result['steps']} timed steps after {result['warmup']}, "
        f"compile {result['compile']}; ln(vocab) {result['ln_vocab']}"
    )
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
