"""Block-scaled weight formats: dequantize (at load, or for reference) and quantize.

- Block FP8 (HF `X.weight_scale_inv`, DeepSeek-V4 `X.scale`): q float8_e4m3fn [N, K] and
  s [ceil(N/bn), ceil(K/bk)] (float32, or ue8m0 = float8_e8m0fnu / raw bytes, 2^(byte-127));
  W = q * s on each [bn, bk] block; the last block of a dim may be partial.
- MXFP4 (DeepSeek-V4 routed experts): e2m1 values packed two per byte [N, K/2] (low nibble
  the even input, high nibble the odd one; int8, uint8 or float4_e2m1fn_x2), one ue8m0
  scale per 32 inputs [N, K/32]: a block of [1, 32].

A slice of a weight is dequantized from the slice of the scale grid covering it; `offset`
says where the weight slice starts inside its first block (0 on block-aligned cuts).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# 1 / 448 rounded to float32 (a Python float holding that value): activation scales are
# amax times it, in `quantize_act_ref` and in the kernels alike
INV_FP8_MAX = float(torch.tensor(1.0) / torch.tensor(FP8_MAX))
MXFP4_BLOCK = (1, 32)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_DTYPES = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2}
                                         if hasattr(torch, "float4_e2m1fn_x2") else set())
# safetensors dtype names of checkpoint tensors
FP8_NAMES = {"F8_E4M3"}
FP4_NAMES = {"I8", "U8", "F4", "F4_E2M1", "F4_E2M1FN_X2"}
UE8M0_NAMES = {"F8_E8M0", "U8"}


def is_packed_fp4(dtype: torch.dtype) -> bool:
    return dtype in _FP4_DTYPES


def scale_to_float(s: torch.Tensor) -> torch.Tensor:
    """A scale grid in float32: ue8m0 bytes are 2^(byte - 127) (byte 255 is NaN)."""
    if s.dtype in (torch.float8_e8m0fnu, torch.uint8):
        e = s.view(torch.uint8).to(torch.float32)
        return torch.where(e == 255, torch.nan, torch.exp2(e - 127.0))
    return s.to(torch.float32)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[.., K/2] packed e2m1 -> float32 [.., K]."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    pairs = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 in [0, 16)) [.., K] -> uint8 [.., K/2] (even input low)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def expand_scale(s: torch.Tensor, shape: tuple[int, int], block: tuple[int, int],
                 offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Per-element float32 scales [shape] of a weight slice starting at `offset` inside the
    first block of the scale grid `s`."""
    full = scale_to_float(s).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
               offset: tuple[int, int] = (0, 0), dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """W = q * s: a [N, K] FP8 (or [N, K/2] packed MXFP4) slice -> dtype [N, K]."""
    values = unpack_fp4(q) if is_packed_fp4(q.dtype) else q.to(torch.float32)
    w = values * expand_scale(s, tuple(values.shape), block, offset)
    return w.to(dtype)


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q float8_e4m3fn [N, K], s float32 [ceil(N/bn), ceil(K/bk)]) with
    s = amax(block) / 448, so every block's largest value maps to +-448 (all-zero blocks
    get s = 1)."""
    N, K = w.shape
    bn, bk = block
    gn, gk = scale_grid((N, K), block)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(gn * bn, gk * bk)[:N, :K].contiguous(), s
