"""GPUs and clusters the planner prices layouts for.

Peak dense bf16 FLOP/s (no sparsity), memory and bandwidths are NVIDIA's datasheet figures:
H100 SXM5 / PCIe / NVL, H200 SXM, GH200, H20 (the Hopper datasheets and the H200 product
brief), A100 80GB SXM (the A100 datasheet), B200 (the DGX B200 / HGX B200 datasheet, per GPU).
NVLink is the per-GPU bidirectional figure; the planner uses half of it per direction. The
inter-node default, 50 GB/s per GPU, is one 400 Gb/s InfiniBand NDR (or equivalent Ethernet)
adapter per GPU, as on DGX/HGX H100 systems; ``--inter-node-gbps`` overrides it.

``train.flops`` reads the same table to turn the trainer's FLOPs into MFU on a real GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
DEFAULT_INTER_NODE_GBPS = 50.0  # GB/s per GPU: one 400 Gb/s NIC per GPU


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


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: GPU
    memory_gib: float | None = None  # usable memory per GPU; None: the GPU's
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    intra_node_gbps: float | None = None  # None: half the GPU's NVLink figure

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("--gpus and --gpus-per-node must be at least 1")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(
                f"--gpus {self.gpus} is not a whole number of nodes of {self.gpus_per_node}"
            )

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    @property
    def memory_bytes(self) -> float:
        return (self.memory_gib or self.gpu.memory_gib) * GIB

    @property
    def nvlink_bytes_per_s(self) -> float:
        return (self.intra_node_gbps or self.gpu.nvlink_gbps / 2) * 1e9

    @property
    def network_bytes_per_s(self) -> float:
        return self.inter_node_gbps * 1e9
