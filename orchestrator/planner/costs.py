"""The costs that order parallel layouts, each a pure function with the measurement or published
figure it comes from (docs/planner.md, "Step-time model").

Four constants are fitted, not measured one by one: ``StepConstants`` holds them, ``FITTED``
their values fitted to the rows of ``measurements.csv`` whose ``split`` is ``fit``
(``python -m orchestrator.planner.fit`` refits them; tests/test_planner_costs.py holds the
values here to that fit), so the held-out rows judge a model that has never seen them.
"""

from __future__ import annotations

from dataclasses import dataclass

# bench/bench_kernels.py, H100 80GB HBM3 (SXM, 700 W), torch 2.11, 2026-11-26: bf16 matmuls of
# 8,192 rows reach 52-69% of the datasheet peak at width 1,024, 66-73% at 2,048, 74-77% at
# 4,096 and 73-76% at 8,192; share = MATMUL_SHARE * w / (w + MATMUL_HALF_WIDTH).
MATMUL_SHARE = 0.80
MATMUL_HALF_WIDTH = 350
# NCCL point-to-point: a send/receive pair's fixed cost (kernel launch and the handshake) before
# its bytes move; nccl-tests' sendrecv latency on H100 over NVLink and InfiniBand is ~10-30 us.
P2P_LATENCY_S = 25e-6
# NCCL's own cost model of a ring collective's fixed time (src/graph/tuning.cc, ring, protocol
# Simple): a base latency, then one per ring step, over NVLink inside a node and over the
# network between nodes. An all-gather or reduce-scatter over n ranks in k nodes takes n - 1
# steps, k - 1 of them across nodes; an all-reduce twice as many.
RING_BASE_S = 8.4e-6
RING_STEP_NVLINK_S = 3.4e-6
RING_STEP_NETWORK_S = 9.6e-6


@dataclass(frozen=True)
class StepConstants:
    """The step-time constants fitted to measured steps, not to one kernel."""

    # A whole step against the sum of its kernels run alone (allocator, synchronisation,
    # kernels too small to fill the GPU): divides the GPU's work.
    step_efficiency: float
    # A microbatch costs as if it held this many more tokens per rank: the fixed costs of each
    # microbatch (kernel launches, a pipeline stage's receive and send, matmuls of few rows).
    microbatch_half_tokens: float
    # How FSDP's and HSDP's collectives overlap the compute: the two combine as
    # (compute^k + comm^k)^(1/k), so equal parts cost more than either alone (they compete for
    # the GPU's memory and SMs, and the first and last blocks' collectives wait); k -> inf: max.
    overlap_exponent: float
    # How much of the busiest pipeline rank's excess over the ranks' mean the step pays (1: the
    # busiest sets the pace, as 1F1B's steady state implies; 0: the mean, as if the ranks'
    # differences were absorbed by the schedule's slack and the asynchronous transfers).
    pipeline_imbalance: float

    def line(self) -> str:
        return (
            f"step efficiency {self.step_efficiency:.3f}, microbatch overhead "
            f"{self.microbatch_half_tokens:.0f} tokens, overlap exponent "
            f"{self.overlap_exponent:g}, pipeline imbalance paid {self.pipeline_imbalance:g}"
        )


FITTED = StepConstants(
    step_efficiency=0.775,
    microbatch_half_tokens=175.0,
    overlap_exponent=3.0,
    pipeline_imbalance=0.25,
)
# FITTED's error between layouts of the held-out sweeps of measurements.csv (fit.sweep_error:
# each row's log error less its sweep's mean, root mean square, as a ratio less one).
# Layouts predicted closer than this may measure in either order.
HELD_OUT_ERROR = 0.079


def matmul_share(width: float) -> float:
    """The share of peak a bf16 matmul of output width ``width`` reaches."""
    return MATMUL_SHARE * width / (width + MATMUL_HALF_WIDTH)


def microbatch_efficiency(tokens: float, constants: StepConstants = FITTED) -> float:
    """The share of its kernels' speed a microbatch of ``tokens`` positions per rank reaches."""
    return tokens / (tokens + constants.microbatch_half_tokens)


def overlapped_seconds(compute: float, comm: float, constants: StepConstants = FITTED) -> float:
    """Compute and the collectives that run beside it, together (costs.StepConstants)."""
    k = constants.overlap_exponent
    top = max(compute, comm)
    if top <= 0:
        return 0.0
    return top * ((compute / top) ** k + (comm / top) ** k) ** (1 / k)


def pipeline_pace(mean: float, busiest: float, constants: StepConstants = FITTED) -> float:
    """A pipeline's compute per step from its ranks' mean and its busiest rank's."""
    return mean + constants.pipeline_imbalance * (busiest - mean)


def bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The pipeline's idle time as a share of its compute: (pp - 1) / (microbatches x stages per
    rank), for 1F1B (one stage per rank) and interleaved 1F1B (Narayanan et al. 2021, as
    torch.distributed.pipelining schedules them)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (microbatches * max(1, stages_per_rank))


def ring_latency(ranks: int, nodes: int, all_reduce: bool = False) -> float:
    """A ring collective's fixed seconds over ``ranks`` ranks in ``nodes`` nodes, as NCCL's
    tuning model prices them (bytes aside): it grows with the ranks, faster across nodes."""
    if ranks <= 1:
        return 0.0
    rounds = 2 if all_reduce else 1
    steps, across = rounds * (ranks - 1), rounds * (min(max(1, nodes), ranks) - 1)
    return RING_BASE_S + (steps - across) * RING_STEP_NVLINK_S + across * RING_STEP_NETWORK_S


def transfer_seconds(nbytes: float, bytes_per_s: float, fixed_s: float = 0.0) -> float:
    """Moving ``nbytes`` at ``bytes_per_s`` after ``fixed_s`` of latency (the calls' fixed
    costs: ``ring_latency`` each, ``P2P_LATENCY_S`` a point-to-point transfer)."""
    return fixed_s + nbytes / bytes_per_s


def pipeline_transfers(pp: int, microbatches: int, stages_per_rank: int = 1) -> int:
    """Transfers on a 1F1B pipeline's critical path: each of the microbatches' activations
    forward and gradients backward, plus the warm-up and cool-down hops across the ranks'
    stages (pp - 1 each way)."""
    if pp <= 1:
        return 0
    return 2 * (microbatches * max(1, stages_per_rank) + pp - 1)
