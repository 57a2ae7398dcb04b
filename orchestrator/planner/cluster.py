"""The clusters the planner prices layouts for (their GPUs: contract/gpus.py).

The inter-node default, 50 GB/s per GPU, is one 400 Gb/s InfiniBand NDR (or equivalent Ethernet)
adapter per GPU, as on DGX/HGX H100 systems; ``--inter-node-gbps`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.gpus import GPU

GIB = 2**30
DEFAULT_INTER_NODE_GBPS = 50.0  # GB/s per GPU: one 400 Gb/s NIC per GPU


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
