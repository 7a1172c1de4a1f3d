"""Paged decode attention: one query per sequence against that sequence's keys in a paged
KV pool, returning the output and its natural-log LSE so CP ranks' partials merge exactly
(`cpmoe.ops.merge_partials`).

    paged_decode_attention(q_BHD, k_cache, v_cache, block_table_BP, kv_lens_B, scale,
                           num_splits=None, out_dtype=None, workspace=None,
                           quant_group=None, kv_scale=None)
        -> (o_BHD, lse_BH)

Legend: B rows (sequences), H local query heads, Hkv local KV heads, G = H // Hkv query
heads per KV head, D head dim, P max pages per row (block-table width), S splits.

Inputs:
- q_BHD [B, H, D], bf16/fp16/fp32, last dim contiguous; any D (non-powers of two masked).
- k_cache, v_cache [num_pages, page_size, Hkv, D], q's dtype or FP8 (e4m3fn / e5m2:
  `--kv-cache-dtype`, read times the layer's k_scale and v_scale: kv_scale [4] float32 on
  the device, `ops.norm`; None: 1; with a 16-bit q the codes are widened to float16 as
  they are and multiplied by a float16 q and float16 probabilities, the scales applied to
  the float32 scores and output), last dim contiguous
  (other strides are passed through, so views of a larger pool work); page_size a power of
  two.
- block_table_BP int32 [B, P]: row b's token t lives at page block_table[b, t // page_size],
  offset t % page_size. Entries past a row's ceil(kv_len / page_size) pages are never read.
- kv_lens_B int32 [B]: keys stored for the row, 0 <= kv_len <= P * page_size (checked only on
  the torch path: the kernel reads no value on the host). No causal mask: the query sees
  every stored key of its row. Query head h reads KV head h // G.

Outputs: o_BHD in out_dtype (default q's dtype), accumulated in fp32 and rounded once;
lse_BH float32 = logsumexp over the row's keys of scale * q.k (natural log). A row with no
key gets o = 0 and lse = -inf (it weighs zero in a merge).

CUDA (and TRITON_INTERPRET=1): a two-stage split-K Triton kernel. Stage 1 runs one program
per (row, KV head, split): it loads the G query heads of that KV head once and streams the
split's share of the row's keys, so each K/V tile is read once per KV head, and writes a
partial o and lse per split. Stage 2 merges the S partials of each (row, head). With S = 1
stage 1 writes o and lse directly (and with `quant_group`, o's FP8 rows) and stage 2 is
skipped. A split is a whole number of BLOCK_N-key tiles (64 keys; 32 when D > 128), so a
short row leaves some splits empty (they write o = 0, lse = -inf and weigh nothing).
CUDA-graph safe: grids depend only on shapes and num_splits, per-row split bounds are
computed on the device from kv_lens, and the work buffers (fp32 o [B, H, S, D] and lse
[B, H, S]) are sized by shapes only; pass `workspace=(o_part, lse_part)` of those shapes to
reuse buffers.

Default num_splits (`default_num_splits`): as many (row, KV head, split) programs as fit in
one wave of about four per SM, S = floor(4 * num_SMs / (B * Hkv)), but no split shorter
than 128 tokens of the longest row the table can hold (S <= P * page_size // 128) and at
most 64; at least 1. On an H200 (132 SMs) with Hkv = 4: B = 16 -> 8 splits, B = 32 -> 4,
B = 64 -> 2, B >= 67 -> 1 (no stage 2); B = 1 at 1K context -> 8. A tuned file's
PROGRAMS_PER_SM for the pools' attention kernel (`cpmoe.ops.launch.tuned`) replaces the
four. Measured on an H200 (bf16, H 32, Hkv 4, D 128, page 16, all rows full, S swept): for
B = 1..256 at 1K, 4K and 32K context the rule's S was the fastest or within 3% of it,
except B = 1 and 2 at 1K (7.4 vs 6.7 us). The ceil of the same ratio was up to 1.3x slower
(a second, mostly idle wave). Depends on shapes only, so a captured graph keeps its count.
Bandwidth reached (K/V bytes / time, graph replay): B = 16 at 32K 4.3 TB/s (about a
device-to-device copy's), B = 64 at 1K 3.3 TB/s, B = 256 at 1K 4.2.

CPU (or no Triton): `paged_decode_attention_ref`, a float32 torch expression vectorised over
the batch (gather the rows' pages, mask by kv_lens, softmax with lse); the kernel's reference.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from cpmoe.cp.kv_cache import KV_CACHE_DTYPES
from cpmoe.ops import pdl_args, triton, unit_kv_scale, use_triton
from cpmoe.ops.fp8 import offer_quantized
from cpmoe.ops.launch import tuned

if triton is not None:
    import triton.language as tl

    from cpmoe.ops.fp8 import quantize_rows  # FP8 output
    from cpmoe.ops.launch import wait_for_producer  # dependent launch

FP8_KV = tuple(d for d in KV_CACHE_DTYPES.values() if d)  # the FP8 pools of --kv-cache-dtype
_MIN_SPLIT_TOKENS = 128
_MAX_DEFAULT_SPLITS = 64
_PROGRAMS_PER_SM = 4
_DEFAULT_SMS = 132  # an H200; used when the tensors are not on a CUDA device (interpreter)
_REF_CHUNK_ELEMENTS = 1 << 24  # gathered K elements per chunk of rows in the reference


# ---- checks and dispatch -------------------------------------------------------------------

def _check_inputs(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table_BP: torch.Tensor, kv_lens_B: torch.Tensor) -> None:
    """Shape/dtype/device checks only (no value is read, so no host sync)."""
    if q_BHD.dim() != 3:
        raise ValueError(f"paged_decode_attention: q must be [B, H, D], got {tuple(q_BHD.shape)}")
    B, H, D = q_BHD.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("paged_decode_attention: k_cache/v_cache must both be [num_pages, "
                         f"page_size, Hkv, D], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    _, page, Hkv, Dk = k_cache.shape
    if Dk != D or Hkv == 0 or H % Hkv:
        raise ValueError(f"paged_decode_attention: q [B, H={H}, D={D}] does not fit KV heads "
                         f"[Hkv={Hkv}, D={Dk}] (need equal D and H divisible by Hkv)")
    if page < 1 or page & (page - 1):
        raise ValueError(f"paged_decode_attention: page_size must be a power of two, got {page}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q_BHD.dtype, *FP8_KV):
        raise ValueError(f"paged_decode_attention: k_cache and v_cache must both be q's dtype "
                         f"or FP8 (e4m3fn, e5m2); q, k_cache, v_cache are {q_BHD.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if (block_table_BP.dim() != 2 or block_table_BP.shape[0] != B
            or block_table_BP.dtype != torch.int32):
        raise ValueError(f"paged_decode_attention: block_table must be int32 [B={B}, P], got "
                         f"{block_table_BP.dtype} {tuple(block_table_BP.shape)}")
    if kv_lens_B.shape != (B,) or kv_lens_B.dtype != torch.int32:
        raise ValueError(f"paged_decode_attention: kv_lens must be int32 [B={B}], got "
                         f"{kv_lens_B.dtype} {tuple(kv_lens_B.shape)}")
    devices = {t.device for t in (q_BHD, k_cache, v_cache, block_table_BP, kv_lens_B)}
    if len(devices) != 1:
        raise ValueError(f"paged_decode_attention: inputs on several devices: {devices}")


def paged_decode_attention(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table_BP: torch.Tensor, kv_lens_B: torch.Tensor, scale: float,
                           num_splits: int | None = None, out_dtype: torch.dtype | None = None,
                           workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                           quant_group: int | None = None, kv_scale: torch.Tensor | None = None,
                           config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. -> (o_BHD [B, H, D] out_dtype, lse_BH [B, H] float32).
    quant_group == D: the last stage (stage 2, or stage 1 where there is one split) also
    quantizes each head's output to FP8 (one 1 x D group) and offers o viewed [B, H * D] to
    `quantize_act` (the FP8 o_proj then launches no quantization:
    `ops.fp8.offer_quantized`). config: stage 1's tile and launch
    (`stage1_config`'s keys; a benchmark's sweep), default `stage1_config`'s."""
    _check_inputs(q_BHD, k_cache, v_cache, block_table_BP, kv_lens_B)
    if kv_scale is not None and (kv_scale.shape != (4,) or kv_scale.dtype != torch.float32
                                 or kv_scale.device != q_BHD.device):
        raise ValueError(f"paged_decode_attention: kv_scale must be float32 [4] on "
                         f"{q_BHD.device}, got {kv_scale.dtype} {tuple(kv_scale.shape)} on "
                         f"{kv_scale.device}")
    out_dtype = out_dtype or q_BHD.dtype
    if not use_triton(q_BHD):
        o_BHD, lse_BH = paged_decode_attention_ref(q_BHD, k_cache, v_cache, block_table_BP,
                                                   kv_lens_B, scale, kv_scale)
        return o_BHD.to(out_dtype), lse_BH
    quant = quant_group == q_BHD.shape[2] and out_dtype in (torch.bfloat16, torch.float16)
    if kv_scale is None:
        kv_scale = unit_kv_scale(q_BHD.device)
    return _paged_decode_triton(q_BHD, k_cache, v_cache, block_table_BP, kv_lens_B, scale,
                                num_splits, out_dtype, workspace, quant, kv_scale, config)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_pages: int, page_size: int,
                       num_sms: int = _DEFAULT_SMS, programs_per_sm: int = _PROGRAMS_PER_SM
                       ) -> int:
    """Splits per (row, KV head) from shapes only (the rule is in the module docstring;
    programs_per_sm: its 4, or a tuned file's PROGRAMS_PER_SM)."""
    # floor, not ceil: programs past what runs at once form a second, mostly idle wave
    want = programs_per_sm * num_sms // max(1, batch * kv_heads)
    cap = max(1, max_pages * page_size // _MIN_SPLIT_TOKENS)
    return max(1, min(want, cap, _MAX_DEFAULT_SPLITS))


# ---- torch reference -----------------------------------------------------------------------

def paged_decode_attention_ref(q_BHD: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_table_BP: torch.Tensor,
                               kv_lens_B: torch.Tensor, scale: float,
                               kv_scale: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 -> (o_BHD float32, lse_BH float32). Reads kv_lens on the host (CPU path).
    FP8 pools' values are taken times kv_scale's k_scale and v_scale (in float32)."""
    B, H, D = q_BHD.shape
    _, page, Hkv, _ = k_cache.shape
    P = block_table_BP.shape[1]
    o_BHD = torch.zeros(B, H, D, dtype=torch.float32, device=q_BHD.device)
    lse_BH = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q_BHD.device)
    if B == 0:
        return o_BHD, lse_BH
    lens = kv_lens_B.to("cpu", torch.int64)
    if int(lens.min()) < 0 or int(lens.max()) > P * page:
        raise ValueError(f"paged_decode_attention: kv_lens must lie in [0, {P * page}] "
                         f"(block_table width {P} x page_size {page}), got "
                         f"[{int(lens.min())}, {int(lens.max())}]")
    pages_used = -(-int(lens.max()) // page)  # table columns any row reads
    rows_per_chunk = max(1, _REF_CHUNK_ELEMENTS // max(1, pages_used * page * Hkv * D))
    for b0 in range(0, B, rows_per_chunk):
        rows = slice(b0, min(B, b0 + rows_per_chunk))
        o_BHD[rows], lse_BH[rows] = _ref_rows(q_BHD[rows], k_cache, v_cache,
                                              block_table_BP[rows, :pages_used],
                                              kv_lens_B[rows], scale, kv_scale)
    return o_BHD, lse_BH


def _ref_rows(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              table_BP: torch.Tensor, kv_lens_B: torch.Tensor, scale: float,
              kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, D = q_BHD.shape
    num_pages, page, Hkv, _ = k_cache.shape
    L = table_BP.shape[1] * page
    # entries past a row's pages are arbitrary (-1, stale ids): clamp to read something
    # in range, then zero those slots (an unwritten slot may hold NaN, and 0 * NaN = NaN)
    pages_BP = table_BP.long().clamp(0, num_pages - 1)
    visible_BL = torch.arange(L, device=q_BHD.device)[None, :] < kv_lens_B[:, None].long()
    hidden_BL11 = ~visible_BL[:, :, None, None]
    k_BLKD = k_cache[pages_BP].reshape(B, L, Hkv, D).float().masked_fill(hidden_BL11, 0.0)
    v_BLKD = v_cache[pages_BP].reshape(B, L, Hkv, D).float().masked_fill(hidden_BL11, 0.0)
    if kv_scale is not None and k_cache.dtype in FP8_KV:
        k_BLKD, v_BLKD = k_BLKD * kv_scale[0], v_BLKD * kv_scale[1]
    q_BKGD = q_BHD.float().reshape(B, Hkv, H // Hkv, D)
    scores_BKGL = torch.einsum("bkgd,blkd->bkgl", q_BKGD, k_BLKD) * scale
    scores_BKGL = scores_BKGL.masked_fill(~visible_BL[:, None, None, :], float("-inf"))
    lse_BKG = torch.logsumexp(scores_BKGL, dim=-1)
    probs_BKGL = torch.exp(scores_BKGL - lse_BKG.nan_to_num(neginf=0.0)[..., None])
    o_BKGD = torch.einsum("bkgl,blkd->bkgd", probs_BKGL, v_BLKD)
    return o_BKGD.reshape(B, H, D), lse_BKG.reshape(B, H)


# ---- Triton ----------------------------------------------------------------------------------

def _paged_decode_triton(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table_BP: torch.Tensor, kv_lens_B: torch.Tensor, scale: float,
                         num_splits: int | None, out_dtype: torch.dtype,
                         workspace: tuple[torch.Tensor, torch.Tensor] | None, quant: bool,
                         kv_scale: torch.Tensor, config: dict | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, D = q_BHD.shape
    _, page, Hkv, _ = k_cache.shape
    P = block_table_BP.shape[1]
    if q_BHD.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_decode_attention: q, k_cache and v_cache need a contiguous "
                         "last (head-dim) axis")
    kv_fp8 = k_cache.dtype in FP8_KV
    cfg = dict(config or stage1_config(kv_fp8, D))
    per_sm = cfg.pop("PROGRAMS_PER_SM", _PROGRAMS_PER_SM)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, P, page, _sm_count(q_BHD.device), per_sm)
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    o_BHD = torch.empty(B, H, D, dtype=out_dtype, device=q_BHD.device)
    lse_BH = torch.empty(B, H, dtype=torch.float32, device=q_BHD.device)
    if B == 0:
        return o_BHD, lse_BH
    if num_splits == 1:  # stage 1 writes the result: the "split" axis has stride 0
        o_part, lse_part = o_BHD[:, :, None], lse_BH[:, :, None]
    else:
        o_part, lse_part = _workspace(workspace, B, H, num_splits, D, q_BHD.device)
    G = H // Hkv
    d_pad = max(16, triton.next_power_of_2(D))  # tl.dot needs every dim >= 16
    # FP8 codes widened to float16 as they are, their scales outside the dots (KV_F16),
    # unless q is float32 (then widened to float32 times the scales, exactly)
    ids = cfg.get("PAGE_IDS", 0)
    if ids < 0 or ids & (ids - 1):
        raise ValueError(f"paged_decode_attention: PAGE_IDS (block-table entries read at a "
                         f"time) must be 0 or a power of two, got {ids}")
    if ids and (cfg["BLOCK_N"] % page or ids * page % cfg["BLOCK_N"]):
        cfg["PAGE_IDS"] = 0  # a tile would straddle two reads of the table: per tile
    cfg["KV_F16"] = kv_fp8 and q_BHD.dtype != torch.float32 and cfg.get("KV_F16", True)
    k_in, v_in = k_cache, v_cache
    cfg["WORDS"] = cfg["KV_F16"] and q_BHD.is_cuda and D % 4 == 0 and all(
        st % 4 == 0 for st in (*k_cache.stride()[:3], *v_cache.stride()[:3],
                               k_cache.storage_offset(), v_cache.storage_offset()))
    if cfg["WORDS"]:  # four codes an int32 word (strides below in words)
        k_in, v_in = k_cache.view(torch.int32), v_cache.view(torch.int32)
    quant = quant and d_pad == D  # one group a head, a whole tile
    q8 = s_t = o_BHD  # any pointer when not quantizing
    if quant:  # o_proj's rows in FP8 and their scales, written by the last stage
        q8 = torch.empty(B, H * D, dtype=torch.float8_e4m3fn, device=q_BHD.device)
        s_t = torch.empty(H, B, dtype=torch.float32, device=q_BHD.device)
    _paged_decode_stage1[(B, Hkv, num_splits)](
        q_BHD, k_in, v_in, block_table_BP, kv_lens_B, o_part, lse_part, kv_scale, q8, s_t,
        scale * math.log2(math.e), q_BHD.stride(0), q_BHD.stride(1),
        k_in.stride(0), k_in.stride(1), k_in.stride(2),
        v_in.stride(0), v_in.stride(1), v_in.stride(2), block_table_BP.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        G, D, num_splits, PAGE=page, G_PAD=max(16, triton.next_power_of_2(G)), D_PAD=d_pad,
        IEEE=q_BHD.dtype == torch.float32, UPCAST=_interpreter_bf16(q_BHD.dtype),
        KV_FP8=kv_fp8, E5M2=k_cache.dtype == torch.float8_e5m2, QUANT=quant and num_splits == 1,
        **cfg, **pdl_args(q_BHD))
    if num_splits > 1:
        _paged_decode_stage2[(B, H)](
            o_part, lse_part, o_BHD, lse_BH, q8, s_t, o_part.stride(0), o_part.stride(1),
            o_part.stride(2), lse_part.stride(0), lse_part.stride(1), o_BHD.stride(0),
            o_BHD.stride(1), lse_BH.stride(0), B, D, num_splits,
            BLOCK_S=min(64, triton.next_power_of_2(num_splits)), D_PAD=d_pad, QUANT=quant,
            **pdl_args(q_BHD))
    if quant:
        offer_quantized(o_BHD.view(B, H * D), q8, s_t.t(), D)
    return o_BHD, lse_BH


def stage1_config(kv_fp8: bool, head_dim: int) -> dict:
    """Stage 1's keys a tile (BLOCK_N: 64, 32 when D > 128 to bound the [BLOCK_N, D] K/V
    tiles in registers), warps and pipeline stages. Swept on an H100 at 64 x 1,088 and 128 x
    1,280 keys (bench/decode_attention.py: 32-128 keys, 2-8 warps, 2-3 stages, 1-8 splits;
    bench/results/decode-attention-h100-318ad0c.log, decode-attention-fp8-h100-d2524f8.log):
    with `default_num_splits`' splits this tile was within 5% of the fastest for FP8 pools
    (two stages; three tie) and bf16 pools at 128 rows. For bf16 at 64 rows the sweep's
    fastest (one split, 8 warps, the next tile loaded into registers by the kernel itself)
    was 8% faster alone and moved the decode step by 0.6% (23.38 against 23.53 ms), so
    neither it nor that loop (318ad0c; Triton's two-stage pipeline waits for a tile's
    copies at the top of the iteration that uses it) was kept."""
    cfg = {"BLOCK_N": 32 if head_dim > 128 else 64, "num_warps": 4,
           "num_stages": 2 if kv_fp8 else 3, "PAGE_IDS": 0}
    # a tuned file's tiles (cpmoe.ops.launch.tuned), and its PROGRAMS_PER_SM for
    # `default_num_splits` (where the caller leaves num_splits to it)
    return cfg | tuned("attention_fp8" if kv_fp8 else "attention_16bit")


def _interpreter_bf16(dtype: torch.dtype) -> bool:
    """Triton's interpreter (3.9) returns garbage from tl.dot on bf16 operands, so there the
    kernel takes the dots in fp32 on the same bf16 values (bit-for-bit the same products)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _workspace(workspace: tuple[torch.Tensor, torch.Tensor] | None, B: int, H: int, S: int,
               D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 o_part [B, H, S, D] and lse_part [B, H, S]: the caller's, or new ones."""
    if workspace is None:
        return (torch.empty(B, H, S, D, dtype=torch.float32, device=device),
                torch.empty(B, H, S, dtype=torch.float32, device=device))
    o_part, lse_part = workspace
    ok = (o_part.shape == (B, H, S, D) and lse_part.shape == (B, H, S)
          and o_part.dtype == lse_part.dtype == torch.float32 and o_part.stride(3) == 1
          and o_part.device == lse_part.device == device)
    if not ok:
        raise ValueError(f"paged_decode_attention: workspace must be float32 ([{B}, {H}, {S}, "
                         f"{D}], [{B}, {H}, {S}]) on {device}, got {o_part.dtype} "
                         f"{tuple(o_part.shape)}, {lse_part.dtype} {tuple(lse_part.shape)}")
    return o_part, lse_part


if triton is not None:
    @triton.jit
    def _kv_tile(k_ptr, v_ptr, page, t, t_ok, kvh, k_sp, k_ss, k_sh, v_sp, v_ss, v_sh,
                 d, d_ok, PAGE: tl.constexpr):
        """The [BLOCK_N, D] K and V tiles of keys t (pages `page`), as stored (d indexes
        int32 words of four FP8 codes where the caller reads words)."""
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * k_sp + (t % PAGE)[:, None] * k_ss + kvh * k_sh
                    + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + page[:, None] * v_sp + (t % PAGE)[:, None] * v_ss + kvh * v_sh
                    + d[None, :], mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def _pages(bt_row, t, t_ok, PAGE: tl.constexpr):
        return tl.load(bt_row + t // PAGE, mask=t_ok, other=0).to(tl.int64)

    @triton.jit
    def _words_to_f16(w, E5M2: tl.constexpr):
        """[N, D / 4] int32 words of four FP8 codes each -> [N, D] their float16 values
        (exact), through two `cvt.rn.f16x2` a word. Loaded as bytes, Triton moves FP8 tiles
        a byte at a time (unpacked to a register each, or read from shared memory into the
        MMA layout byte by byte)."""
        fmt: tl.constexpr = "e5m2x2" if E5M2 else "e4m3x2"
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
            f"cvt.rn.f16x2.{fmt} x, lo; cvt.rn.f16x2.{fmt} y, hi; "
            "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
        codes = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [N, D / 4, 2, 2]: c0 c1 c2 c3
        return tl.reshape(codes, (w.shape[0], w.shape[1] * 4))

    @triton.jit
    def _widen(x, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr, KV_F16: tl.constexpr,
               WORDS: tl.constexpr, E5M2: tl.constexpr):
        """A K or V tile as the dots take it: 16-bit pools as stored; FP8 codes in float16
        (KV_F16, from int32 words with WORDS) or times their scale in q's dtype."""
        if WORDS:
            x = _words_to_f16(x, E5M2)
        elif KV_F16:
            x = x.to(tl.float16)
        elif KV_FP8:
            x = (x.to(tl.float32) * scale).to(dtype)
        return x

    @triton.jit
    def _attend_tile(q, k, v, t_ok, m, total, acc, k_scale, v_scale, qk_scale,
                     IEEE: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
                     KV_F16: tl.constexpr, WORDS: tl.constexpr, E5M2: tl.constexpr):
        """Online softmax over one tile of keys: (m, total, acc) updated in the log2 domain.
        KV_F16: q is float16 and the FP8 codes are widened to float16 as they are (exact),
        their scales applied outside the dots (k_scale in qk_scale, v_scale by the caller)."""
        k = _widen(k, k_scale, q.dtype, KV_FP8, KV_F16, WORDS, E5M2)
        if UPCAST:  # exact products of the 16-bit values, as the tensor cores form them
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(t_ok[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))  # finite: the tile has a valid key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = _widen(v, v_scale, q.dtype, KV_FP8, KV_F16, WORDS, E5M2)
        if UPCAST:  # p rounded to the 16-bit dtype as below, then exact products
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)  # 16-bit tensor cores, fp32 accumulate
        return m_new, total, acc * alpha[:, None] + pv

    @triton.jit
    def _store_o_fp8(q8_ptr, s8_ptr, o, b, heads, ok, n_heads, n_rows, d, HEAD_DIM):
        """Heads `heads` [R] of row b (o [R, HEAD_DIM], rounded to o's dtype; `ok`: the
        heads to write) as o_proj's FP8 rows, one group a head (`quantize_rows`): codes
        into q8 [B, H * D], scales into s8 [H, B], the layout `offer_quantized` is given."""
        q8, s8 = quantize_rows(o.to(tl.float32))
        tl.store(q8_ptr + (b * n_heads + heads[:, None]) * HEAD_DIM + d[None, :], q8,
                 mask=ok[:, None])
        tl.store(s8_ptr + heads * n_rows + b, s8, mask=ok)

    # a size that changes every step: no specialization on it (Triton would compile a
    # new variant, ~1 s, for each new residue mod 16 it meets while serving)
    @triton.jit(do_not_specialize=["bt_sb", "NUM_SPLITS", "l_sb", "l_sh"])  # l_*: H S, S
    def _paged_decode_stage1(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, kvs_ptr,
                             q8_ptr, s8_ptr, scale_log2,
                             q_sb, q_sh, k_sp, k_ss, k_sh, v_sp, v_ss, v_sh, bt_sb,
                             o_sb, o_sh, o_ss, l_sb, l_sh, l_ss, GROUP, HEAD_DIM, NUM_SPLITS,
                             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr,
                             D_PAD: tl.constexpr, IEEE: tl.constexpr,
                             UPCAST: tl.constexpr, PDL: tl.constexpr = False,
                             KV_FP8: tl.constexpr = False, KV_F16: tl.constexpr = False,
                             WORDS: tl.constexpr = False, E5M2: tl.constexpr = False,
                             PAGE_IDS: tl.constexpr = 0, QUANT: tl.constexpr = False):
        """KV_FP8: FP8 pools with the layer's scales at kvs_ptr[0:2] (read here so a
        captured graph keeps following them; 1: exact). KV_F16 (16-bit q): the codes are
        widened to float16 as they are (exact), q and p are float16, k_scale multiplies the
        float32 scores and v_scale the output; WORDS (CUDA): the codes are loaded as int32
        words and widened by `_words_to_f16`, because Triton moves 8-bit tiles a byte at a
        time (a plain cast staged the codes in shared memory and read them one by one into
        the MMA layout: 51 against 41 us on the H200 at batch 64 x 1K). Not KV_F16 (float32
        q): widened to q's dtype times the scales. PAGE_IDS > 0 (a power of two, BLOCK_N a
        multiple of PAGE): the block table is read PAGE_IDS entries at a time, before the
        loop over their keys, and each tile's pages are gathered from those registers;
        with 0 each tile reads its own entries, a load the tile's K/V addresses wait on,
        which keeps Triton's pipeline from copying a tile ahead of the one in use (its
        buffers stay single: the copies of tile i + 1 are issued after tile i's dots and
        waited for at the top of the next iteration). QUANT (one split, D_PAD == HEAD_DIM):
        each head's output, rounded to o's dtype, also goes to q8 [B, H * D] in FP8 with its
        scale at s8 [H, B], as stage 2 writes them where it runs (`quantize_rows`).
        """
        wait_for_producer(PDL)
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(lens_ptr + b)
        # whole BLOCK_N tiles per split; splits past the row's keys get an empty range
        per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, kv_len)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        bt_row = bt_ptr + b * bt_sb
        if WORDS:  # K/V read as int32 words of four codes (strides in words)
            dk = tl.arange(0, D_PAD // 4)
            dk_ok = dk < HEAD_DIM // 4
        else:
            dk = d
            dk_ok = d_ok
        q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        k_scale = tl.load(kvs_ptr)  # used by FP8 pools only
        v_scale = tl.load(kvs_ptr + 1)
        qk_scale = scale_log2
        if KV_F16:  # q in float16 (|q| past its range saturates), k_scale outside the dot
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            qk_scale = scale_log2 * k_scale
        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        total = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        if PAGE_IDS == 0:
            for t0 in range(start, end, BLOCK_N):
                t = t0 + n
                t_ok = t < end
                k, v = _kv_tile(k_ptr, v_ptr, _pages(bt_row, t, t_ok, PAGE), t, t_ok, kvh,
                                k_sp, k_ss, k_sh, v_sp, v_ss, v_sh, dk, dk_ok, PAGE)
                m, total, acc = _attend_tile(q, k, v, t_ok, m, total, acc, k_scale,
                                             v_scale, qk_scale, IEEE, UPCAST, KV_FP8, KV_F16,
                                             WORDS, E5M2)
        else:
            ids = tl.arange(0, PAGE_IDS)
            # start and every s0: whole pages and tiles (the launcher's condition)
            for s0 in range(start, end, PAGE_IDS * PAGE):
                s_end = tl.minimum(s0 + PAGE_IDS * PAGE, end)
                col = s0 // PAGE + ids
                block = tl.load(bt_row + col, mask=col * PAGE < s_end, other=0)
                for t0 in range(s0, s_end, BLOCK_N):
                    t = t0 + n
                    t_ok = t < s_end
                    at = tl.minimum((t - s0) // PAGE, PAGE_IDS - 1)
                    page = tl.gather(block, at, 0).to(tl.int64)
                    k, v = _kv_tile(k_ptr, v_ptr, page, t, t_ok, kvh, k_sp, k_ss, k_sh, v_sp,
                                    v_ss, v_sh, dk, dk_ok, PAGE)
                    m, total, acc = _attend_tile(q, k, v, t_ok, m, total, acc, k_scale,
                                                 v_scale, qk_scale, IEEE, UPCAST, KV_FP8,
                                                 KV_F16, WORDS, E5M2)
        empty = total == 0.0  # an empty split: o = 0, lse = -inf (weighs zero in stage 2)
        total = tl.where(empty, 1.0, total)
        o = acc / total[:, None]
        if KV_F16:
            o = o * v_scale
        lse = tl.where(empty, float("-inf"), (m + tl.log2(total)) * 0.6931471805599453)
        o = o.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + b * o_sb + heads[:, None] * o_sh + split * o_ss + d[None, :], o,
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + b * l_sb + heads * l_sh + split * l_ss, lse, mask=g_ok)
        if QUANT:  # one group a head: each row of the tile
            _store_o_fp8(q8_ptr, s8_ptr, o, b, heads, g_ok, tl.num_programs(1) * GROUP,
                         tl.num_programs(0), d, HEAD_DIM)

    # likewise: no specialization on the sizes that change every step (lp_*: H S, S)
    @triton.jit(do_not_specialize=["B", "NUM_SPLITS", "lp_sb", "lp_sh"])
    def _paged_decode_stage2(op_ptr, lp_ptr, o_ptr, lse_ptr, q_ptr, s_ptr, op_sb, op_sh, op_ss,
                             lp_sb, lp_sh, o_sb, o_sh, lse_sb, B, HEAD_DIM, NUM_SPLITS,
                             BLOCK_S: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr,
                             PDL: tl.constexpr = False):
        """QUANT (D_PAD == HEAD_DIM): the head's output, rounded to o's dtype, also goes to
        q [B, H * D] in FP8 with its scale at s [H, B] (`quantize_rows`, one group)."""
        wait_for_producer(PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        lp = lp_ptr + b * lp_sb + h * lp_sh
        m_vec = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
        for s0 in range(0, NUM_SPLITS, BLOCK_S):
            lse_s = tl.load(lp + s0 + s, mask=s0 + s < NUM_SPLITS, other=float("-inf"))
            m_vec = tl.maximum(m_vec, lse_s)
        m = tl.max(m_vec, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # no key at all: every weight below is 0
        w_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
        acc = tl.zeros([D_PAD], dtype=tl.float32)
        for s0 in range(0, NUM_SPLITS, BLOCK_S):
            s_ok = s0 + s < NUM_SPLITS
            w = tl.exp(tl.load(lp + s0 + s, mask=s_ok, other=float("-inf")) - m)
            o_s = tl.load(op_ptr + b * op_sb + h * op_sh + (s0 + s)[:, None] * op_ss
                          + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            acc += tl.sum(w[:, None] * o_s, axis=0)
            w_vec += w
        total = tl.sum(w_vec, axis=0)
        empty = total == 0.0
        total = tl.where(empty, 1.0, total)
        o = (acc / total).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + b * o_sb + h * o_sh + d, o, mask=d_ok)
        if QUANT:
            one = tl.arange(0, 1)
            _store_o_fp8(q_ptr, s_ptr, tl.reshape(o, [1, D_PAD]), b, h + one, one == 0,
                         tl.num_programs(1), B, d, HEAD_DIM)
        tl.store(lse_ptr + b * lse_sb + h, tl.where(empty, float("-inf"), m + tl.log(total)))
