"""``lora_linear``'s GEMV path (:func:`moe_lora_compile.ops.triton.dense_kernels.lora_gemv_kernel`, a handful of
tokens) and its tuned-config table (:mod:`moe_lora_compile.ops.triton.configs`).

CPU: the kernel in Triton's interpreter, float32, tiny shapes, against the float64 oracle (``tests/support``) and the
GEMM path. GPU (``-m gpu``): bf16 at the decode shapes of GPT-OSS-20B and Qwen3-30B-A3B, both paths, a CUDA graph
replayed with new adapter ids, no recompile for a new T of the same token block.
"""

from __future__ import annotations

import json

import pytest
import torch

from support.oracle import lora_linear_oracle

from moe_lora_compile.ops.triton import configs as C
from moe_lora_compile.ops.triton import launch
from moe_lora_compile.ops.triton.configs import GemmConfig, LinearKernelConfig, ShrinkConfig
from moe_lora_compile.ops.triton.launch import lora_linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gemv_config(block_n=16, block_k=16, split_k=1, shrink_split=2, gemv=True, prefetch=False) -> LinearKernelConfig:
    """Tiny tiles for the interpreter; ``prefetch``: num_stages 2, the GEMV loads one K step ahead."""
    return LinearKernelConfig(BLOCK_M=16, per_token=True, gemv=gemv,
                              gemm=GemmConfig(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_SIZE_M=1, num_warps=4,
                                              num_stages=2 if prefetch else 1, SPLIT_K=split_k),
                              shrink=ShrinkConfig(BLOCK_K=16, SPLIT_K=shrink_split, num_warps=4, num_stages=1))


def make(T, n_in, n_out, ids, L=3, R=8, bias=False, ranks=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    a = torch.randn(L, R, n_in, generator=g) * n_in ** -0.5
    b = torch.randn(L, n_out, R, generator=g) * R ** -0.5
    if ranks is not None:
        for slot, r in enumerate(ranks):
            a[slot, r:] = 0
            b[slot, :, r:] = 0
    bv = torch.randn(n_out, generator=g) if bias else None
    ids = torch.tensor(ids, dtype=torch.int32)
    return tuple(t.to(dtype) for t in (x, w, a, b)) + (ids,), None if bv is None else bv.to(dtype)


def run(args, bias, cfg, device=DEVICE):
    return lora_linear_triton(*(t.to(device) for t in args), bias=None if bias is None else bias.to(device),
                              config=cfg)


@pytest.mark.parametrize("T,n_in,n_out,ids,split_k,block_n,bias,extra", [
    (1, 64, 32, [0], 1, 16, False, {}),                 # one token, even N and K, no split
    (1, 64, 32, [-1], 4, 16, True, {}),                 # one token without adapter, split-K 4, bias
    (2, 64, 32, [1, 0], 1, 16, False, {}),              # two tokens of two slots (per-token B gather)
    (3, 64, 32, [-1, -1, -1], 1, 16, True, {}),         # all -1: base + bias only; BLOCK_T=4 with a padding row
    (4, 64, 32, [2, -1, 0, 2], 4, 16, True, {}),        # mixed: two tokens share a slot, one -1, split-K 4
    (4, 48, 32, [0, 0, 0, 0], 2, 16, False, {"L": 1}),  # one slot for every token (L = 1), split-K 2
    (2, 64, 20, [1, 2], 1, 8, False, {}),               # ragged N: 20 = 8 + 8 + 4 columns (masked last tile)
    (3, 40, 24, [0, -1, 1], 3, 16, True, {}),           # ragged K and split-K: slices 16, 16, 8 (masked last)
    (1, 40, 24, [2], 1, 16, False, {}),                 # ragged K, no split: one masked K step
    (4, 48, 24, [-1, -1, -1, -1], 2, 16, False, {}),    # split-K, all -1: no LoRA in any slice
    (4, 48, 32, [0, 1, 2, -1], 2, 16, False, {"ranks": (2, 5, 8)}),  # per-slot ranks zero-padded to R = 8
    (2, 32, 16, [1, 0], 1, 16, False, {"R": 6}),        # rank 6: BLOCK_R 16 with masked rank lanes
    (6, 32, 24, [0, -1, 2, 1, 1, -1], 2, 8, True, {}),  # T = 6: an 8-token block (GEMV_MAX_T), two padding rows
])
@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])  # the two main loops
def test_gemv_matches_oracle(T, n_in, n_out, ids, split_k, block_n, bias, extra, prefetch):
    args, bv = make(T, n_in, n_out, ids, bias=bias, **extra)
    y = run(args, bv, gemv_config(block_n=block_n, split_k=split_k, prefetch=prefetch))
    assert y.shape == (T, n_out) and y.dtype == torch.float32
    torch.testing.assert_close(y.cpu().double(), lora_linear_oracle(*args, bias=bv), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,split_k", [(1, 1), (4, 3)])  # one token, no split / four tokens, ragged split-K
def test_gemv_equals_gemm_path(T, split_k):
    """Same inputs through the GEMV and the GEMM (tl.dot, 16-row blocks): the same result."""
    args, bv = make(T, 40, 24, [0, -1, 2, 1][:T], bias=True, seed=4)
    y_gemv = run(args, bv, gemv_config(split_k=split_k))
    y_gemm = run(args, bv, gemv_config(split_k=split_k, gemv=False))
    torch.testing.assert_close(y_gemv, y_gemm, rtol=1e-5, atol=1e-5)


def test_gemv_nonfinite_slot_stays_in_its_tokens():
    """An inf in slot 1's B reaches only the token of slot 1 (each token gathers its own slot's B)."""
    args, _ = make(4, 32, 16, [0, 1, -1, 2], seed=3)
    ref = lora_linear_oracle(*args)
    b = args[3].clone()
    b[1, 0, 0] = float("inf")
    y = run(args[:3] + (b, args[4]), None, gemv_config(split_k=2)).cpu().double()
    others = args[4] != 1
    torch.testing.assert_close(y[others], ref[others], rtol=1e-4, atol=1e-4)
    assert not torch.isfinite(y[~others]).all()


def test_gemv_config_past_its_token_limit_runs_the_gemm(monkeypatch):
    """A ``gemv`` config at T > GEMV_MAX_T (a tuned entry applied to a larger batch) takes the GEMM, same result."""
    calls = []
    real = launch._launch_gemv
    monkeypatch.setattr(launch, "_launch_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    T = C.GEMV_MAX_T + 1
    args, _ = make(T, 32, 16, [i % 4 - 1 for i in range(T)])
    y = run(args, None, gemv_config())
    assert not calls
    torch.testing.assert_close(y.cpu().double(), lora_linear_oracle(*args), rtol=1e-4, atol=1e-4)
    run(make(2, 32, 16, [0, 1])[0], None, gemv_config())
    assert calls == [1]


# ----------------------------------------------------------------------------------------------------------------
# The heuristic and the tuned table
# ----------------------------------------------------------------------------------------------------------------

def _entry(block_n: int, gemv: bool = True) -> LinearKernelConfig:
    return gemv_config(block_n=block_n, gemv=gemv)


TABLE = {C.linear_shape_key(2880, 5120, 32): {"1": _entry(16), "2": _entry(32), "4": _entry(64), "8": _entry(128)},
         C.linear_shape_key(2880, 5120, 64): {"1": _entry(8)}}


@pytest.mark.parametrize("T,n_in,n_out,R,block_n", [
    (1, 2880, 5120, 32, 16),    # exact bucket
    (3, 2880, 5120, 32, 32),    # between buckets: the largest tuned T <= 3
    (15, 2880, 5120, 32, None),  # under twice the largest bucket, but its GEMV entry is past GEMV_MAX_T
    (16, 2880, 5120, 32, None),  # twice the largest bucket or more: the heuristic
    (1, 2880, 5120, 20, 16),    # rank 20 pads to 32: same key
    (1, 2880, 5120, 128, 8),    # rank 128 untuned: the nearest tuned rank (64) of the shape
    (1, 4096, 2880, 32, None),  # shape not in the table
])
def test_lookup_linear(T, n_in, n_out, R, block_n):
    found = C.lookup_linear(TABLE, T, n_in, n_out, R)
    assert (found is None if block_n is None else found.gemm.BLOCK_N == block_n)


def test_lookup_gemm_entry_serves_up_to_twice_its_bucket():
    table = {C.linear_shape_key(64, 32, 16): {"8": _entry(64, gemv=False)}}
    assert C.lookup_linear(table, 15, 64, 32, 16).gemm.BLOCK_N == 64  # a GEMM entry: up to 2x its bucket
    assert C.lookup_linear(table, 16, 64, 32, 16) is None


def test_lookup_below_all_buckets_takes_the_smallest():
    table = {C.linear_shape_key(64, 32, 16): {"4": _entry(16), "8": _entry(32)}}  # no bucket 1 or 2
    assert C.lookup_linear(table, 1, 64, 32, 16).gemm.BLOCK_N == 16


def test_linear_table_roundtrip_and_fallback(tmp_path, monkeypatch):
    path = tmp_path / C.linear_file_name("NVIDIA H200")
    assert path.name == "NVIDIA_H200_linear.json"
    C.write_linear_table(path, TABLE)
    assert C.read_linear_table(path) == TABLE
    assert C.read_linear_table(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text(json.dumps({"N=1,K=1,R=16": {"1": {"BLOCK_M": 16}}}))
    with pytest.raises(ValueError, match="bad.json.*missing keys"):
        C.read_linear_table(tmp_path / "bad.json")
    # get_linear_config: the table of this device's name, else the heuristic
    monkeypatch.setattr(C, "_load_linear", lambda name: TABLE)
    dev = torch.device("cpu")
    assert C.get_linear_config(dev, 2, 2880, 5120, 32) == TABLE[C.linear_shape_key(2880, 5120, 32)]["2"]
    assert C.get_linear_config(dev, 1, 4096, 2880, 32, num_sms=132) == C.default_linear_config(1, 4096, 2880, 132)


def test_shipped_linear_tables_parse():
    """Every shipped ``configs/*_linear.json`` loads (typed configs, known keys)."""
    for path in C.CONFIG_DIR.glob("*_linear.json"):
        for buckets in C.read_linear_table(path).values():
            assert all(int(T) >= 1 for T in buckets)


@pytest.mark.parametrize("T,gemv", [(1, True), (4, True), (5, False), (64, False)])  # GEMV up to 4 tokens
def test_default_linear_config_gemv(T, gemv):
    cfg = C.default_linear_config(T, 2880, 5120, num_sms=132)
    assert cfg.gemv == gemv and cfg.per_token
    if gemv:  # about 4 programs per SM stream the weight
        programs = -(-5120 // cfg.gemm.BLOCK_N) * cfg.gemm.SPLIT_K
        assert programs >= 4 * 132 or cfg.gemm.SPLIT_K == -(-2880 // (2 * cfg.gemm.BLOCK_K))


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 at real decode shapes
# ----------------------------------------------------------------------------------------------------------------

DECODE_SHAPES = [  # (in, out): fused q/k/v and o of GPT-OSS-20B and Qwen3-30B-A3B
    pytest.param(2880, 5120, id="gpt-oss-qkv"), pytest.param(4096, 2880, id="gpt-oss-o"),
    pytest.param(2048, 5120, id="qwen3-qkv"), pytest.param(4096, 2048, id="qwen3-o"),
]


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _bf16_case(T, n_in, n_out, L=8, R=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    a = torch.randn(L, R, n_in, generator=g) * n_in ** -0.5
    b = torch.randn(L, n_out, R, generator=g) * R ** -0.5
    bias = torch.randn(n_out, generator=g)
    return [t.bfloat16().cuda() for t in (x, w, a, b, bias)]


@pytest.mark.gpu
@pytest.mark.parametrize("n_in,n_out", DECODE_SHAPES)
@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("path", ["gemv", "gemm", "default"])
def test_gpu_paths_at_decode_shapes(T, n_in, n_out, path):
    """Both paths (and the shipped/heuristic choice) against the float64 reference, tokens of distinct adapters
    and one -1; the LoRA delta alone (a base-only run subtracted) is right too."""
    x, w, a, b, bias = _bf16_case(T, n_in, n_out)
    ids = torch.arange(T, dtype=torch.int32, device="cuda") % 8
    if T > 1:
        ids[-1] = -1
    cfg = None if path == "default" else C.default_linear_config(T, n_in, n_out, 132).replace(gemv=path == "gemv")
    if cfg is not None and path == "gemv":
        cfg = cfg.replace(**{"gemm.BLOCK_N": 32 if T <= 2 else 16})
    y = lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg)
    ref = lora_linear_oracle(*(t.cpu() for t in (x, w, a, b, ids)), bias=bias.cpu())
    assert _rel_err(y.cpu(), ref) < 1e-2
    none = torch.full_like(ids, -1)
    y0 = lora_linear_triton(x, w, a, b, none, bias=bias, config=cfg)
    ref0 = lora_linear_oracle(*(t.cpu() for t in (x, w, a, b, none)), bias=bias.cpu())
    assert _rel_err(y.cpu().double() - y0.cpu().double(), ref - ref0) < 5e-2


@pytest.mark.gpu
def test_gpu_gemv_in_a_cuda_graph_follows_the_ids():
    """Captured once, replayed after the adapter ids change in place (data, not a guard): the new result."""
    x, w, a, b, bias = _bf16_case(4, 2880, 5120)
    ids = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    cfg = C.default_linear_config(4, 2880, 5120, 132)
    assert cfg.gemv
    lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg)
    for new in ([7, -1, 7, 5], [-1, -1, -1, -1]):
        ids.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = lora_linear_oracle(*(t.cpu() for t in (x, w, a, b, ids)), bias=bias.cpu())
        assert _rel_err(y.cpu(), ref) < 1e-2


@pytest.mark.gpu
def test_gpu_gemv_new_token_count_does_not_recompile():
    """T is not specialized: T = 3 after T = 4 (same 4-token block) compiles nothing new."""
    from moe_lora_compile.ops.triton import dense_kernels as DK

    def cache_size(kernel):
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            return sum(len(v[0]) for v in caches.values())
        return sum(len(v) for v in kernel.cache.values())

    x, w, a, b, bias = _bf16_case(4, 2048, 5120)
    cfg = C.default_linear_config(4, 2048, 5120, 132)
    ids = torch.arange(4, dtype=torch.int32, device="cuda")
    lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg)
    before = cache_size(DK.lora_gemv_kernel), cache_size(DK.lora_shrink_rows_kernel)
    lora_linear_triton(x[:3], w, a, b, ids[:3], bias=bias, config=cfg)
    torch.cuda.synchronize()
    assert (cache_size(DK.lora_gemv_kernel), cache_size(DK.lora_shrink_rows_kernel)) == before
