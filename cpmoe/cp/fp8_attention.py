"""FP8 prefill attention on CUDA through cuDNN's graph API (`--kv-cache-dtype fp8_e4m3`).

    fp8_attention(q_nHD, k_mGD, v_mGD, scale, causal, lse=False) -> (o_nHD, lse_nH | None)
    fp8_attention_e4m3(...) -> (o8_nHD e4m3, o's descale, lse_nH | None)

q, k and v come in 16 bits, or already in e4m3 with their descale (q from `norm_rope_fp8`,
which scales the normed rows by a bound of the norm's weight instead of their amax; k and v
from FP8 pools).

n query rows against m keys, GQA heads as they are (G KV heads divide H). `causal` (n ==
m): row i sees keys [0, i]; else every key. With `lse`, also each row's log-sum-exp
(natural log, fp32), to merge with attention over other keys (a run after the start of its
sequence: its own keys causally, the keys before it in full; cuDNN's FP8 kernel takes no
bottom-right-aligned mask on Hopper, "only supported on Blackwell"). q, k and v are
quantized to e4m3 with per-tensor scales computed on the device (amax / 448: no host sync;
two Triton passes a tensor, `quantize`; a chunk's own K/V, read back from FP8 pools, come
widened times the checkpoint's k_scale / v_scale and are quantized again, while a cached
prefix's codes go in as stored with those scales as descales), cuDNN's `sdpa_fp8` runs
Q.K^T and P.V on FP8 tensor cores (P quantized with scale 448, probabilities being <= 1)
and writes O in e4m3 (the only output Hopper's FP8 kernel offers) with the scale of V (|o|
<= max |v|: o is a convex combination of v rows), halved for headroom; O is dequantized
once to q's dtype, in one pass into where the caller wants it (`out`), or handed on as it
is (`fp8_attention_e4m3`: the codes and their descale, for an FP8 o_proj to read). Inputs
already in FP8 (a pool's pages) are taken as they are with the descale they are given.

Graphs are built once per (n, m) bucket, heads and options and cached per device: n and m
are rounded up to a power of two (>= 128), the inputs are copied into buffers of the bucket
(quantization writes them anyway, the tail zeroed) and cuDNN's padding mask takes the real
lengths from device tensors (every call, so one graph serves a whole bucket), so a server
builds a handful of graphs (its warm-up chunk covers the common ones) and never one per new
prompt length (a build took 1.4 s of host time on the H200 with cuDNN 9.19).

Needs the `nvidia-cudnn-frontend` package (the `cuda` extra: `pip install
cpmoe[cuda]`), imported on first use; `install_hint()` says what is missing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from cpmoe.ops import launch
from cpmoe.ops.launch import tl, triton

E4M3_MAX = 448.0
_MIN_BUCKET = 128
_O_HEADROOM = 0.5  # O's scale: max |v| maps to 224, so rounding P up cannot overflow
PACKAGE = "nvidia-cudnn-frontend"


def install_hint() -> str | None:
    """None when cuDNN's frontend can be imported, else one line saying what to install."""
    if importlib.util.find_spec("cudnn") is None:
        return (f"--kv-cache-dtype fp8_e4m3 runs attention in FP8 through cuDNN on CUDA: "
                f"install {PACKAGE} (pip install 'cpmoe[cuda]', or "
                f"pip install --no-deps {PACKAGE}>=1.32)")
    return None


def bucket(n: int) -> int:
    """The graph dimension for a run of n rows (or keys)."""
    return max(_MIN_BUCKET, 1 << max(0, n - 1).bit_length())


def quantize(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, heads, D] (16-bit; each row's heads contiguous, rows at any stride) -> (e4m3
    [rows, heads, D] holding x * s in its first n
    rows, zeros after; the descale 1/s as a [1, 1, 1, 1] float32 device tensor), s =
    448 / max |x| (448 where x is all 0), the product in float32 rounded once to e4m3
    (nearest even). No host sync. Where Triton runs (CUDA, the interpreter) two kernels:
    one reads x for its largest magnitude, one reads it again and writes the codes and the
    padding (the torch ops below took five passes and three launches more: with O's
    dequantization about 12 of the 77.5 ms of a 16K prefill's 12 layers on the H200 at
    b5d587a); else the same arithmetic in torch (the reference)."""
    n = x.shape[0]
    if launch.use_triton(x) and x.numel():
        if not x[0].is_contiguous():  # rows apart (v's columns of the QKV rows) read as such
            x = x.contiguous()
        cols = x[0].numel()
        block_r, block_c = _tile(cols)
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        out = torch.empty((rows, *x.shape[1:]), dtype=torch.float8_e4m3fn, device=x.device)
        descale = torch.empty(1, dtype=torch.float32, device=x.device)
        _amax_kernel[(triton.cdiv(n, block_r), cols // block_c)](
            x, amax, n, x.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8)
        _scale_cast_kernel[(triton.cdiv(rows, block_r), cols // block_c)](
            x, out, amax, descale, n, rows, cols, x.stride(0), BLOCK_R=block_r,
            BLOCK_C=block_c, num_warps=8)
        return out, descale.view(1, 1, 1, 1)
    amax = torch.linalg.vector_norm(x.reshape(-1), ord=float("inf")).float()
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    out = torch.zeros((rows, *x.shape[1:]), dtype=torch.float8_e4m3fn, device=x.device)
    out[:n].copy_((x.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX))
    return out, (amax / E4M3_MAX).view(1, 1, 1, 1)


def dequantize(x8: torch.Tensor, descale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (16-bit, x8's shape [n, ...]) <- x8 * descale (a 1-element float32 device tensor)
    in one pass, the product in float32 rounded once to out's dtype -> out."""
    if launch.use_triton(x8) and out.is_contiguous() and x8.is_contiguous() and out.numel():
        n, cols = out.shape[0], out[0].numel()
        block_r, block_c = _tile(cols)
        _dequant_kernel[(triton.cdiv(n, block_r), cols // block_c)](
            x8, out, descale, n, cols, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8)
        return out
    return out.copy_(x8.float() * descale.float().view(()))


def _tile(cols: int) -> tuple[int, int]:
    """A program's tile over [rows, cols] (8,192 elements): rows x the largest power of two
    <= 256 dividing cols. The masks fall on whole rows only, so every row's columns are
    loaded and stored 16 bytes at a time (a mask on each element's offset, against a length
    the kernel is not specialized on, made Triton move one element per access: the first
    version of these kernels, 1-byte FP8 accesses, ran at ~0.8 TB/s on an H100)."""
    block_c = 256
    while cols % block_c:
        block_c //= 2
    return _BLOCK // block_c, block_c


_BLOCK = 8192  # elements a program: 32 a thread at 8 warps


if triton is not None:
    _E4M3_MAX = tl.constexpr(E4M3_MAX)

    @triton.jit
    def _rows_tile(row_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program (i, j): rows [i * BLOCK_R, ..) x columns [j * BLOCK_C, ..) of rows
        row_stride elements apart -> (offsets, row indices)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        return rows[:, None].to(tl.int64) * row_stride + c[None, :], rows

    @triton.jit(do_not_specialize=["n"])
    def _amax_kernel(x_ptr, amax_ptr, n, x_st, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """amax[0] = max(amax[0], max |x| over this program's tile of x [n, cols], rows x_st
        apart); amax starts at 0 and magnitudes are >= 0, so the float maximum is an
        order-preserving one."""
        offs, rows = _rows_tile(x_st, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + offs, mask=(rows < n)[:, None], other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))

    @triton.jit(do_not_specialize=["n", "total"])
    def _scale_cast_kernel(x_ptr, out_ptr, amax_ptr, descale_ptr, n, total, cols, x_st,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """out [total, cols] = e4m3(x * 448 / amax) in rows < n (x's rows x_st apart), 0 in
        rows n.. (the bucket's padding); program (0, 0) also writes the descale amax / 448.
        An all-zero x (amax 0) takes amax 1. Divisions IEEE-rounded (`div_rn`), as torch's
        are."""
        amax = tl.load(amax_ptr)
        amax = tl.where(amax > 0, amax, 1.0)
        s = tl.math.div_rn(_E4M3_MAX + tl.zeros_like(amax), amax)
        x_offs, rows = _rows_tile(x_st, BLOCK_R, BLOCK_C)
        offs, _ = _rows_tile(cols, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + x_offs, mask=(rows < n)[:, None], other=0.0).to(tl.float32)
        q = tl.clamp(x * s, -_E4M3_MAX, _E4M3_MAX)
        tl.store(out_ptr + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"),
                 mask=(rows < total)[:, None])
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(descale_ptr, tl.math.div_rn(amax, _E4M3_MAX + tl.zeros_like(amax)))

    @triton.jit(do_not_specialize=["n"])
    def _dequant_kernel(x_ptr, out_ptr, descale_ptr, n, cols, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
        """out [n, cols] = x * descale, rounded once to out's dtype."""
        offs, rows = _rows_tile(cols, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + offs, mask=(rows < n)[:, None], other=0.0).to(tl.float32)
        y = x * tl.load(descale_ptr)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=(rows < n)[:, None])


@dataclass
class _Graph:
    graph: object
    tensors: dict[str, object]
    workspace: torch.Tensor


_GRAPHS: dict[tuple, _Graph] = {}  # built plans, by device and shape (a cache)
_HANDLES: dict[torch.device, object] = {}


def _handle(device: torch.device):
    import cudnn

    if device not in _HANDLES:
        with torch.cuda.device(device):
            _HANDLES[device] = cudnn.create_handle()
    handle = _HANDLES[device]
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    return handle


def _build(device: torch.device, nq: int, nk: int, heads: int, kv_heads: int, dim: int,
           causal: bool, stats: bool, scale: float) -> _Graph:
    import cudnn

    g, t = operation_graph(nq, nk, heads, kv_heads, dim, causal, stats, scale)
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=device)
    return _Graph(g, t, workspace)


def operation_graph(nq: int, nk: int, heads: int, kv_heads: int, dim: int, causal: bool,
                    stats: bool, scale: float, padding: bool = True) -> tuple[object, dict]:
    """The `sdpa_fp8` graph of a bucket, validated and lowered, before any plan -> (graph,
    its tensors by name). padding: the real lengths come from the `seq_len_q` /
    `seq_len_kv` device tensors; else the graph's lengths are the real ones (no such
    tensors; bench.fp8_attention_plans times both)."""
    import cudnn

    fp32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=fp32,
                      compute_data_type=fp32)

    def rows(name: str, n: int, h: int):  # [n, h, D] row-major, as [1, h, n, D] (BSHD)
        return g.tensor(name=name, dim=(1, h, n, dim), stride=(n * h * dim, dim, h * dim, 1),
                        data_type=cudnn.data_type.FP8_E4M3)

    def scalar(name: str):
        return g.tensor(name=name, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fp32)

    t = {"q": rows("q", nq, heads), "k": rows("k", nk, kv_heads), "v": rows("v", nk, kv_heads)}
    for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        t[name] = scalar(name)
    mask = {}
    if padding:
        for name in ("seq_len_q", "seq_len_kv"):
            t[name] = g.tensor(name=name, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1),
                               data_type=i32)
        mask = dict(use_padding_mask=True, seq_len_q=t["seq_len_q"],
                    seq_len_kv=t["seq_len_kv"])
    if causal:
        mask.update(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, right_bound=0)
    o, lse, amax_s, amax_o = g.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"],
        descale_v=t["descale_v"], descale_s=t["descale_s"], scale_s=t["scale_s"],
        scale_o=t["scale_o"], generate_stats=stats, attn_scale=scale, **mask)
    o.set_output(True).set_dim((1, heads, nq, dim)).set_stride(
        (nq * heads * dim, dim, heads * dim, 1)).set_data_type(cudnn.data_type.FP8_E4M3)
    if stats:  # [H, nq]: head-major
        lse.set_output(True).set_dim((1, heads, nq, 1)).set_stride(
            (nq * heads, nq, 1, 1)).set_data_type(fp32)
        t["lse"] = lse
    for name, amax in (("amax_s", amax_s), ("amax_o", amax_o)):
        amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fp32)
        t[name] = amax
    t["o"] = o
    g.validate()
    g.build_operation_graph()
    return g, t


def o_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """O's 16-bit dtype: q's, or v's where q came in e4m3 (`norm_rope_fp8`)."""
    for x in (q, v):
        if x.dtype.itemsize > 1:
            return x.dtype
    raise ValueError("fp8_attention: with q and v both in FP8, pass `out` for O's dtype")


def _as_fp8(x: torch.Tensor, rows: int, descale: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit x -> `quantize`; FP8 x (a pool's) -> padded to `rows`, with its descale."""
    if x.dtype != torch.float8_e4m3fn:
        return quantize(x, rows)
    assert descale is not None, "FP8 inputs need their descale"
    if rows > x.shape[0]:  # zero-padded through the bytes (e4m3 0 is byte 0)
        padded = torch.zeros((rows, *x.shape[1:]), dtype=torch.uint8, device=x.device)
        padded[:x.shape[0]].copy_(x.view(torch.uint8))
        x = padded.view(torch.float8_e4m3fn)
    return x.contiguous(), descale.float().view(1, 1, 1, 1)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, lse: bool = False, k_descale: torch.Tensor | None = None,
                  v_descale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  q_descale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See the module docstring: q [n, H, D], k / v [m, G, D], each 16-bit or e4m3 (then
    with its descale) -> (o [n, H, D] in q's 16-bit dtype (v's where q is e4m3), written
    into `out` when given, lse [n, H] fp32 or None)."""
    out = torch.empty(q.shape, dtype=o_dtype(q, v), device=q.device) if out is None else out
    o8, o_descale, stats = fp8_attention_e4m3(q, k, v, scale, causal, lse, k_descale,
                                              v_descale, q_descale)
    if q.shape[0]:
        dequantize(o8, o_descale, out)
    return out, stats


def fp8_attention_e4m3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool, lse: bool = False, k_descale: torch.Tensor | None = None,
                       v_descale: torch.Tensor | None = None,
                       q_descale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`fp8_attention` with O left as cuDNN writes it -> (o8 e4m3 [n, H, D], contiguous;
    its descale, a 1-element float32 device tensor: o = o8 * descale; lse [n, H] or None).
    For an FP8 GEMM that reads O next (`cp.attention`'s o_proj offer)."""
    (n, H, D), (m, G) = q.shape, k.shape[:2]
    if causal and n != m:
        raise ValueError(f"fp8_attention: a causal call needs as many keys as queries, got "
                         f"{m} and {n}")
    if n == 0:
        return (torch.empty(0, H, D, dtype=torch.float8_e4m3fn, device=q.device),
                torch.ones(1, dtype=torch.float32, device=q.device),
                q.new_empty(0, H, dtype=torch.float32) if lse else None)
    nq, nk = bucket(n), bucket(m)
    key = (q.device, nq, nk, H, G, D, causal, lse, scale)
    if key not in _GRAPHS:
        _GRAPHS[key] = _build(q.device, nq, nk, H, G, D, causal, lse, scale)
    built = _GRAPHS[key]
    q8, dq = _as_fp8(q, nq, q_descale)
    k8, dk = _as_fp8(k, nk, k_descale)
    v8, dv = _as_fp8(v, nk, v_descale)
    dev = q.device
    o8 = torch.empty((nq, H, D), dtype=torch.float8_e4m3fn, device=dev)
    o_descale = dv / _O_HEADROOM
    stats = torch.empty(H, nq, dtype=torch.float32, device=dev) if lse else None
    pack = variant_pack(built.tensors, (q8, dq), (k8, dk), (v8, dv), o8, o_descale, n, m,
                        stats)
    built.graph.execute(pack, built.workspace, handle=_handle(dev))
    return (o8[:n], o_descale.reshape(1),
            None if stats is None else stats[:, :n].t().contiguous())


def variant_pack(t: dict, q8: tuple, k8: tuple, v8: tuple, o8: torch.Tensor,
                 o_descale: torch.Tensor, n: int, m: int, stats: torch.Tensor | None
                 ) -> dict:
    """The buffers of one `operation_graph` call: q8 / k8 / v8 (codes, descale), O's codes
    and descale, the real lengths n and m (where the graph takes them), the lse buffer."""
    dev = o8.device
    consts = _constants(dev)
    pack = {t["q"]: q8[0], t["k"]: k8[0], t["v"]: v8[0], t["descale_q"]: q8[1],
            t["descale_k"]: k8[1], t["descale_v"]: v8[1],
            t["descale_s"]: consts[0:1].view(1, 1, 1, 1),
            t["scale_s"]: consts[1:2].view(1, 1, 1, 1),
            t["scale_o"]: (1.0 / o_descale).view(1, 1, 1, 1), t["o"]: o8,
            t["amax_s"]: torch.empty(1, 1, 1, 1, dtype=torch.float32, device=dev),
            t["amax_o"]: torch.empty(1, 1, 1, 1, dtype=torch.float32, device=dev)}
    for name, length in (("seq_len_q", n), ("seq_len_kv", m)):  # fills: no host copy
        if name in t:
            pack[t[name]] = torch.full((1, 1, 1, 1), length, dtype=torch.int32, device=dev)
    if stats is not None:
        pack[t["lse"]] = stats
    return pack


_CONSTANTS: dict[torch.device, torch.Tensor] = {}


def _constants(device: torch.device) -> torch.Tensor:
    """P's descale and scale (1 / 448, 448) on the device, made once."""
    if device not in _CONSTANTS:
        _CONSTANTS[device] = torch.tensor([1.0 / E4M3_MAX, E4M3_MAX], dtype=torch.float32,
                                          device=device)
    return _CONSTANTS[device]


def warm_up(device: torch.device, heads: int, kv_heads: int, dim: int, scale: float,
            max_rows: int, max_keys: int = 0) -> int:
    """Build before the first request -> graphs built: the square causal graphs of every
    bucket up to `max_rows` (a server's prefill chunk), and for a chunk of max_rows after a
    cached prefix (extend, `cp.attention.fp8_runs_apply`) its causal graph with the
    log-sum-exp and the full-attention graphs of its prefix for every key bucket up to
    `max_keys` (a rank's K/V capacity). A shorter last chunk of a prompt builds its own on
    first use (about 1.4 s each)."""
    wanted = []
    n = _MIN_BUCKET
    while n <= bucket(max_rows):
        wanted.append((n, n, True, False))
        n *= 2
    if max_keys:
        rows = bucket(max_rows)
        wanted.append((rows, rows, True, True))
        m = _MIN_BUCKET
        while m <= bucket(max_keys):
            wanted.append((rows, m, False, True))
            m *= 2
    built = 0
    for n, m, causal, lse in wanted:
        if (device, n, m, heads, kv_heads, dim, causal, lse, scale) in _GRAPHS:
            continue
        x = torch.zeros(n, heads, dim, dtype=torch.bfloat16, device=device)
        kv = torch.zeros(m, kv_heads, dim, dtype=torch.bfloat16, device=device)
        fp8_attention(x, kv, kv, scale, causal=causal, lse=lse)
        built += 1
    return built
