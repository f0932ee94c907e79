"""cuBLASLt's products y = x @ weight^T through an algorithm of its heuristic's list, chosen by the caller
(issue 17). torch asks cuBLASLt's heuristic for one algorithm and takes it; at a cached prompt's few rows
another one of the list can be faster (`reports.gemm_small_m`). Called through ctypes, on the library
torch loaded; CUDA only.

`Product(x, weight, y)` describes one bf16/fp16 product of those shapes and strides, `Product.algos(n)`
asks the heuristic for up to n algorithms, `Product.run(algo, x, weight, y)` multiplies with one of them on
torch's current stream (capturable in a CUDA graph: the workspace is fixed).
"""

import ctypes
import functools
import glob
import os
import re

import torch

# cublasLt.h's values (checked against the header where the wheel ships it: `constants`)
CONSTANTS = dict(
    CUBLAS_COMPUTE_32F=68,
    CUDA_R_32F=0,
    CUDA_R_16F=2,
    CUDA_R_16BF=14,
    CUBLAS_OP_N=0,
    CUBLAS_OP_T=1,
    CUBLASLT_MATMUL_DESC_TRANSA=3,
    CUBLASLT_MATMUL_DESC_TRANSB=4,
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES=1,
    CUBLASLT_ALGO_CONFIG_ID=0,
    CUBLASLT_ALGO_CONFIG_TILE_ID=1,
    CUBLASLT_ALGO_CONFIG_SPLITK_NUM=2,
    CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME=3,
    CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING=4,
    CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION=5,
    CUBLASLT_ALGO_CONFIG_STAGES_ID=6,
)
WORKSPACE_BYTES = 32 << 20
# An algorithm's configuration as `Product.algos` reports it: field -> CUBLASLT_ALGO_CONFIG_ attribute
CONFIG_FIELDS = dict(
    id="ID",
    tile="TILE_ID",
    splitk="SPLITK_NUM",
    reduction="REDUCTION_SCHEME",
    swizzle="CTA_SWIZZLING",
    custom="CUSTOM_OPTION",
    stages="STAGES_ID",
)


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _wheel_files(pattern: str) -> list[str]:
    """Files named `pattern` in the CUDA wheels beside torch (site-packages/nvidia/...)."""
    root = os.path.dirname(os.path.dirname(torch.__file__))
    return glob.glob(os.path.join(root, "nvidia", "**", pattern), recursive=True)


def _header() -> str | None:
    """cublasLt.h's text where the CUDA wheels ship it, else None."""
    for path in _wheel_files("cublasLt.h")[:1]:
        with open(path) as f:
            return f.read()
    return None


@functools.cache
def constants() -> tuple[dict, str]:
    """(CONSTANTS checked against the header, where they came from); RuntimeError where they differ."""
    text = _header()
    if text is None:
        return dict(CONSTANTS), "built in (no cublasLt.h found)"
    for name, value in CONSTANTS.items():
        found = re.search(rf"\b{name}\s*=\s*(\d+)", text)
        if found and int(found.group(1)) != value:
            raise RuntimeError(f"cublasLt.h has {name} = {found.group(1)}, this module {value}")
    return dict(CONSTANTS), "checked against cublasLt.h"


@functools.cache
def _lib() -> ctypes.CDLL:
    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")  # torch loads its cuBLAS first
    names = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    for name in names + _wheel_files("libcublasLt.so*"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("cuBLASLt not found")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


class Product:
    """y [M, N] = x [M, K] @ weight [N, K]^T in cuBLASLt's column-major terms: y^T = weight @ x^T, so A =
    weight read transposed, B = x, D = y; float32 accumulation, rows contiguous."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor):
        c, lib = constants()[0], _lib()
        types = {torch.bfloat16: c["CUDA_R_16BF"], torch.float16: c["CUDA_R_16F"]}
        if x.dtype not in types or weight.dtype != x.dtype or y.dtype != x.dtype:
            raise TypeError(f"x, weight and y must share a dtype of {list(types)}")
        (m, k), n = x.shape, weight.shape[0]
        if weight.shape[1] != k or tuple(y.shape) != (m, n):
            raise ValueError(
                f"expected x [M, K], weight [N, K], y [M, N], got {x.shape}, {weight.shape}, {y.shape}"
            )
        self.device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        self.shape = (m, n, k)
        dtype = types[x.dtype]
        self.desc = ctypes.c_void_p()
        compute, scale = c["CUBLAS_COMPUTE_32F"], c["CUDA_R_32F"]
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), compute, scale), "desc")
        for attr, op in (("TRANSA", "CUBLAS_OP_T"), ("TRANSB", "CUBLAS_OP_N")):
            value = ctypes.c_int32(c[op])
            _check(
                lib.cublasLtMatmulDescSetAttribute(
                    self.desc, c[f"CUBLASLT_MATMUL_DESC_{attr}"], ctypes.byref(value), ctypes.c_size_t(4)
                ),
                attr,
            )
        self.layouts = []
        for rows, cols, ld in ((k, n, weight.stride(0)), (k, m, x.stride(0)), (n, m, y.stride(0))):
            layout = ctypes.c_void_p()
            _check(
                lib.cublasLtMatrixLayoutCreate(
                    ctypes.byref(layout),
                    dtype,
                    ctypes.c_uint64(rows),
                    ctypes.c_uint64(cols),
                    ctypes.c_int64(ld),
                ),
                "layout",
            )
            self.layouts.append(layout)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def algos(self, count: int) -> list[tuple[Algo, dict]]:
        """Up to `count` algorithms of the heuristic's list, in its order, each with its configuration
        (CONFIG_FIELDS) and workspace bytes; only those that fit WORKSPACE_BYTES."""
        c, lib = constants()[0], _lib()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                pref, c["CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES"], ctypes.byref(size), ctypes.c_size_t(8)
            ),
            "preference",
        )
        results, returned = (_Heuristic * count)(), ctypes.c_int(0)
        a, b, d = self.layouts
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                _handle(self.device), self.desc, a, b, d, d, pref, count, results, ctypes.byref(returned)
            ),
            "heuristic",
        )
        lib.cublasLtMatmulPreferenceDestroy(pref)
        out = []
        for result in results[: returned.value]:
            if result.state != 0:
                continue
            config = dict(workspace=int(result.workspace_size), waves=float(result.waves))
            for field, attr in CONFIG_FIELDS.items():
                value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
                lib.cublasLtMatmulAlgoConfigGetAttribute(
                    ctypes.byref(result.algo),
                    c[f"CUBLASLT_ALGO_CONFIG_{attr}"],
                    ctypes.byref(value),
                    ctypes.c_size_t(4),
                    ctypes.byref(written),
                )
                config[field] = value.value
            algo = Algo()
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(result.algo), ctypes.sizeof(Algo))
            out.append((algo, config))
        return out

    def run(self, algo: Algo, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
        """y = x @ weight^T with `algo` on torch's current stream; tensors of the described shapes."""
        if (x.shape[0], weight.shape[0], x.shape[1]) != self.shape:
            raise ValueError(f"expected the shapes (M, N, K) {self.shape}")
        a, b, d = self.layouts
        workspace = _workspace(self.device)
        _check(
            _lib().cublasLtMatmul(
                _handle(self.device),
                self.desc,
                ctypes.byref(self.alpha),
                ctypes.c_void_p(weight.data_ptr()),
                a,
                ctypes.c_void_p(x.data_ptr()),
                b,
                ctypes.byref(self.beta),
                ctypes.c_void_p(y.data_ptr()),
                d,
                ctypes.c_void_p(y.data_ptr()),
                d,
                ctypes.byref(algo),
                ctypes.c_void_p(workspace.data_ptr()),
                ctypes.c_size_t(WORKSPACE_BYTES),
                ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
            ),
            "cublasLtMatmul",
        )
