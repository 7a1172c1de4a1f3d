"""How much does a concurrent all-gather slow compute down, NCCL vs copy engine?

On 2 GPUs (torchrun --nproc-per-node 2 bench/overlap_contention.py), per message size:
- all-gather alone: NCCL `all_gather_into_tensor` vs a copy-engine gather over PyTorch
  symmetric memory (each rank writes its rows into its own symmetric buffer, a device
  barrier, each rank copies its peers' buffers with cudaMemcpy, a second barrier);
- a compute kernel (bf16 matmul, cuDNN causal attention with GQA heads) alone, and with
  each all-gather running on a side stream at the same time: the compute's own time and the
  time until both are done.
Prints one table; every time is the median of CUDA-event spans, in ms.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, iters: int = 10) -> float:
    times = []
    for _ in range(iters + 2):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


class CopyEngineGather:
    def __init__(self, max_bytes: int, group) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device="cuda")
        self.handle = symm_mem.rendezvous(self.buf, group.group_name)
        self.rank, self.world = self.handle.rank, self.handle.world_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() * x.element_size() > self.buf.numel():
            raise ValueError(f"{x.numel() * x.element_size()} bytes exceed the symmetric buffer")
        mine = self.handle.get_buffer(self.rank, x.shape, x.dtype)
        mine.copy_(x)
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        self.handle.barrier(channel=0)
        for step in range(self.world):
            peer = (self.rank + step) % self.world
            src = x if peer == self.rank else self.handle.get_buffer(peer, x.shape, x.dtype)
            out[peer * x.shape[0]:(peer + 1) * x.shape[0]].copy_(src)
        self.handle.barrier(channel=1)
        return out


def main() -> None:
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    ce = CopyEngineGather(256 << 20, group)
    side = torch.cuda.Stream()

    def nccl_ag(x):
        out = x.new_empty((2 * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x)
        return out

    # correctness of the copy-engine gather
    x = torch.full((1024, 2048), float(rank + 1), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(ce(x), nccl_ag(x)), "copy-engine gather differs from NCCL"

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(1, 32, 32768, 128, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(1, 4, 32768, 128, dtype=torch.bfloat16, device="cuda")

    def matmul():
        for _ in range(2):
            a @ a

    def attention():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)

    rows = []
    for mib in (16, 64, 128):
        x = torch.randn(mib << 19, dtype=torch.bfloat16, device="cuda").view(-1, 2048)
        t_nccl = median_ms(lambda: nccl_ag(x))
        t_ce = median_ms(lambda: ce(x))
        rows.append(f"| all-gather {mib} MiB/rank | NCCL {t_nccl:.3f} ms "
                    f"({mib / 1024 / t_nccl * 1e3:.0f} GiB/s) | copy engine {t_ce:.3f} ms "
                    f"({mib / 1024 / t_ce * 1e3:.0f} GiB/s) |")
        for name, compute in (("matmul 2x8192^3", matmul), ("cuDNN attn 32K causal", attention)):
            alone = median_ms(compute)
            for label, gather in (("NCCL", nccl_ag), ("copy engine", ce)):
                spans = []

                def both():
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        gather(x)
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    compute()
                    e.record()
                    spans.append((s, e))
                    torch.cuda.current_stream().wait_stream(side)

                total = median_ms(both)
                comp = statistics.median(s.elapsed_time(e) for s, e in spans[2:])
                rows.append(f"| {name} + {label} AG {mib} MiB | compute alone {alone:.3f} | "
                            f"compute under AG {comp:.3f} ({comp / alone - 1:+.1%}) | "
                            f"both done {total:.3f} (serial would be "
                            f"{alone + (t_nccl if label == 'NCCL' else t_ce):.3f}) |")
    if rank == 0:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
