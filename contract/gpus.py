"""The GPUs the planner prices layouts for, and the trainer's MFU divides by.

Peak dense bf16 FLOP/s (no sparsity), memory and bandwidths are NVIDIA's datasheet figures:
H100 SXM5 / PCIe / NVL, H200 SXM, GH200, H20 (the Hopper datasheets and the H200 product
brief), A100 80GB SXM (the A100 datasheet), B200 (the DGX B200 / HGX B200 datasheet, per GPU).
``h100-hbm2e`` is the H100 SXM with 96 GB of HBM2e at 2.4 TB/s that Meta's Grand Teton hosts
carry, which torchtitan's published benchmarks ran at a 500 W power limit. torchtitan puts its
real peak between the SXM's and the NVL's; the table takes the NVL's 835 TFLOP/s, the lower
end (with the SXM's 989 the planner's predictions for those runs are 25-28% fast).
NVLink is the per-GPU bidirectional figure; the planner uses half of it per direction.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    key: str  # what --gpu takes
    cuda_name: str  # matched against torch.cuda.get_device_name (more specific first)
    memory_gib: float
    peak_bf16_flops: float
    hbm_gbps: float
    nvlink_gbps: float  # bidirectional, per GPU


GPUS: tuple[GPU, ...] = (
    GPU("h100-pcie", "H100 PCIe", 80, 756e12, 2000, 600),
    GPU("h100-nvl", "H100 NVL", 94, 835e12, 3900, 600),
    GPU("h100-hbm2e", "H100 96GB HBM2e", 96, 989e12, 2400, 900),
    GPU("h100", "H100", 80, 989e12, 3350, 900),
    GPU("h200", "H200", 141, 989e12, 4800, 900),
    GPU("h20", "H20", 96, 148e12, 4000, 900),
    GPU("gh200", "GH200", 96, 989e12, 4000, 900),
    GPU("b200", "B200", 180, 2250e12, 8000, 1800),
    GPU("a100", "A100", 80, 312e12, 2039, 600),
)

GPU_KEYS = tuple(gpu.key for gpu in GPUS)


def gpu_preset(key: str) -> GPU:
    for gpu in GPUS:
        if gpu.key == key.lower():
            return gpu
    raise ValueError(f"unknown GPU {key!r}: choose one of {', '.join(g.key for g in GPUS)}")


def gpu_of_device(device_name: str) -> GPU | None:
    """The GPU whose ``cuda_name`` the name CUDA reports contains (None: not in the table)."""
    for gpu in GPUS:
        if gpu.cuda_name in device_name:
            return gpu
    return None
