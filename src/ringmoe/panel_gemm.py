"""Products of few rows by stacks of weight matrices on CPUs with AVX2: a small C kernel over panel-packed weights.

The products a decode step runs per expert have a handful of rows (a batch of 32 at top-2 of 8 experts: ~8 rows
per expert), and for them MKL and oneDNN stream the weights far below the memory's rate: the experts' products of
one step of the 4-layer small preset, 4 MB per layer, ran at 5-10 GB/s on the 2-core development machine (an AMD
EPYC with AVX2) where a plain read of the same bytes runs at 27-44 GB/s.  ``panel_gemm.c`` stores each matrix
once more as 16-column panels (``pack``) and multiplies up to 6 rows by a panel at a time with the products held in
registers, so the weight is read once, front to back, per 6 rows: measured side by side there (8 experts of
(1024, 256) and (256, 512), cold weights of 4 layers), 2-3x faster than the oneDNN-prepacked products at 2-128
rows, and from 8 to 512 rows per expert 102-166 GFLOP/s against oneDNN's 47-145 and MKL's 47-127
(``benchmarks/bench_decode.py`` measures whole decode steps).  ``routed_experts`` runs a MoE layer's whole
dropless routed part in one call (sort by expert, gathers, both rounds of products, activation, weighted sum).

Every output value is one sum over k in a fixed order (blocks of 64 terms summed in registers, added in turn:
the same arithmetic whatever the rows beside it): batch invariant, and within float32 rounding of torch's
product (float64 references in ``tests/test_panel_gemm.py``).

The C source is compiled once per machine at first use (the compiler ``cc``, -O3 -mavx2 -mfma; about a
second) into ``~/.cache/ringmoe/kernels`` (``$XDG_CACHE_HOME`` honoured) under a name hashing the source and the
flags, written to a staging file and renamed into place, so processes building at once never load half a file
(where that folder cannot be written, into a private temporary folder of the process).
Where it cannot be (no AVX2, not x86-64, no compiler, a failed build) ``available()`` is False and callers keep
torch's products.  OpenMP threads: torch's own runtime (the library links ``libgomp.so.1``, which the process
already holds from torch), as many as ``torch.get_num_threads()``.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["available", "pack", "grouped_linear", "routed_experts", "RoutedExperts"]

_LOG = logging.getLogger(__name__)
# the C sources built into one library (panel_gemm.c: the products; paged_attention.c: decode attention, used by
# ``ringmoe.attention.paged_cpu``; torch_ops.c: both as kernels of torch operators) and the header they share
_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("panel_gemm.c", "paged_attention.c", "torch_ops.c", "simd_exp.h"))
# -fexceptions: a torch error raised inside a kernel of torch_ops.c unwinds through its C frames
_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fexceptions", "-shared", "-fPIC")
_BUILD_SECONDS = 120


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ringmoe" / "kernels"


def _build(sources: dict[str, bytes], compiler: str) -> Path:
    """The shared library of ``sources`` ({file name: text}: the .c files compiled, the headers beside them),
    compiled unless a build of the same sources and flags is cached."""
    digest = hashlib.sha256(' '.join((compiler, *_FLAGS)).encode())
    for file_name, text in sorted(sources.items()):
        digest.update(file_name.encode() + b"\0" + hashlib.sha256(text).digest())
    name = f"panel_gemm-{digest.hexdigest()[:20]}.so"
    cache = _cache_dir()
    if (cache / name).is_file():
        return cache / name
    try:
        cache.mkdir(parents=True, exist_ok=True)
        return _compile_into(cache, name, sources, compiler)
    except OSError:
        # an unwritable cache: a folder of this process's own (mode 0700), never a fixed shared path such as
        # /tmp/<name>, where another local user could have left a library of that name to be loaded
        return _compile_into(Path(tempfile.mkdtemp(prefix="ringmoe-kernels-")), name, sources, compiler)


def _compile_into(folder: Path, name: str, sources: dict[str, bytes], compiler: str) -> Path:
    """Compile ``sources`` in a staging folder inside ``folder`` and rename the library to ``folder / name``."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".staging-") as staging:
        for file_name, text in sources.items():
            (Path(staging) / file_name).write_bytes(text)
        built = Path(staging) / "panel_gemm.so"
        c_files = [str(Path(staging) / file_name) for file_name in sorted(sources) if file_name.endswith(".c")]
        subprocess.run([compiler, *_FLAGS, *c_files, "-o", str(built)], check=True, capture_output=True,
                       timeout=_BUILD_SECONDS)
        os.replace(built, folder / name)
    return folder / name


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot run here (logged once, at INFO)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not all(source.is_file() for source in _SOURCES):
        _LOG.info("panel_gemm: no C compiler or source; torch's products are used")
        return None
    try:
        lib = ctypes.CDLL(str(_build({source.name: source.read_bytes() for source in _SOURCES}, compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        _LOG.info("panel_gemm: build failed (%s) %s; torch's products are used", error, detail.decode()[-500:])
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.panel_pack.argtypes = [ptr, i64, i64, i64, ptr]
    lib.panel_pack.restype = None
    lib.panel_grouped.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr, ctypes.c_int]
    lib.panel_grouped.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.panel_moe.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, f32, f32, ptr, ptr,
                              ctypes.c_int]
    lib.panel_moe.restype = ctypes.c_int
    lib.paged_cached_attention.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, f32, ptr,
                                           ptr, ctypes.c_int]
    lib.paged_cached_attention.restype = ctypes.c_int
    return lib


# torch_ops.c's ``struct torch_api``: the libtorch functions it calls, in order, then three codes
_TORCH_FUNCTIONS = ("aoti_torch_library_init_impl", "aoti_torch_library_impl", "aoti_torch_get_data_ptr",
                    "aoti_torch_get_dim", "aoti_torch_get_sizes", "aoti_torch_get_dtype", "aoti_torch_get_device_type",
                    "aoti_torch_is_contiguous", "aoti_torch_empty_strided", "aoti_torch_delete_tensor_object",
                    "aoti_torch_check", "torch_get_num_threads", "aoti_torch_get_numel", "aoti_torch_call_dispatcher")
_TORCH_CODES = ("aoti_torch_dtype_float32", "aoti_torch_dtype_int64", "aoti_torch_device_type_cpu")


class _TorchApi(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _TORCH_FUNCTIONS] + [(name, ctypes.c_int32)
                                                                        for name in _TORCH_CODES]


@lru_cache(maxsize=None)
def register_torch_ops(namespace: str) -> bool:
    """Register ``torch_ops.c``'s CPU kernels for the operators of ``namespace`` that Python has defined
    (``ringmoe.operators``), so a compiled graph calls them without entering Python: True where they are registered
    (once per process), False where the library or a function of torch's C shim is missing here (the operators keep
    their Python kernels)."""
    lib = _library()
    libtorch = Path(torch.__file__).resolve().parent / "lib" / "libtorch_cpu.so"
    if lib is None or not libtorch.is_file():
        return False
    try:
        shim = ctypes.CDLL(str(libtorch))  # already loaded by torch: the same copy
        functions = [ctypes.cast(getattr(shim, name), ctypes.c_void_p).value for name in _TORCH_FUNCTIONS]
        codes = []
        for name in _TORCH_CODES:
            getter = getattr(shim, name)
            getter.restype, getter.argtypes = ctypes.c_int32, []
            codes.append(getter())
    except (OSError, AttributeError) as error:  # an older torch without the stable C shim
        _LOG.info("panel_gemm: torch's C shim lacks %s; the operators keep their Python kernels", error)
        return False
    register = lib.ringmoe_register_torch_ops
    register.argtypes, register.restype = [ctypes.POINTER(_TorchApi), ctypes.c_char_p], ctypes.c_int
    api = _TorchApi(*functions, *codes)
    return register(ctypes.byref(api), namespace.encode()) == 0


def available() -> bool:
    """Can this machine run the kernel (x86-64 with AVX2, a C compiler; built on the first call)."""
    return _library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) or a stack (G, N, K), float32 on a CPU -> its panel copy (G, N * K) (G = 1 for a matrix):
    the same bytes in the order ``grouped_linear`` reads them."""
    lib = _library()
    if lib is None:
        raise RuntimeError("panel_gemm is not available on this machine (panel_gemm.available())")
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() not in (2, 3):
        raise TypeError(f"weight must be a float32 CPU matrix or stack, got {weight.dtype} {tuple(weight.shape)}")
    stack = weight.detach().reshape(-1, *weight.shape[-2:]).contiguous()
    groups, n, k = stack.shape
    out = torch.empty(groups, n * k, dtype=torch.float32)
    lib.panel_pack(stack.data_ptr(), groups, n, k, out.data_ptr())
    return out


def grouped_linear(x: torch.Tensor, counts: list[int], packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (R, K) float32, sorted by group with ``counts[g]`` rows of group g, times each group's matrix W_g (N, K)
    of ``packed`` (G, N * K) from ``pack`` -> (R, N) = x_rows @ W_g.T per group."""
    lib = _library()
    groups = packed.shape[0]
    if (lib is None or len(counts) != groups or sum(counts) != x.shape[0] or min(counts, default=0) < 0
            or x.dtype != torch.float32 or packed.dtype != torch.float32 or not packed.is_contiguous()
            or x.device.type != "cpu"):
        raise ValueError(f"grouped_linear: x {tuple(x.shape)} {x.dtype} with counts of {len(counts)} groups does "
                         f"not match packed {tuple(packed.shape)} (or the kernel is not available)")
    k = x.shape[1]
    if packed.shape[1] != out_features * k:
        raise ValueError(f"grouped_linear: packed {tuple(packed.shape)} is not of ({out_features}, {k}) matrices")
    x = x.contiguous()
    return _named("ringmoe::panel_grouped_linear", _grouped, lib, x, counts, packed, out_features)


def _named(name: str, fn, *args):
    """fn(*args), recorded under ``name`` when a torch profiler runs (a record costs ~16 us: only then)."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


def _grouped(lib: ctypes.CDLL, x: torch.Tensor, counts: list[int], packed: torch.Tensor, out_features: int):
    groups, k = packed.shape[0], x.shape[1]
    offsets = (ctypes.c_int64 * (groups + 1))(*itertools.accumulate(counts, initial=0))
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0] and lib.panel_grouped(x.data_ptr(), offsets, groups, packed.data_ptr(), out_features,
                                        k, y.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("panel_gemm: out of memory for the work list")
    return y


def routed_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, ffn_size: int, gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None, limit: float | None = None,
                   alpha: float = 1.702) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's routed output, dropless, in one call: x (T, H) float32, topk_idx (T, k) int64 expert indices,
    topk_weight (T, k) float32; the experts' stacks as panel copies (``pack``), gate_up (E, 2F * H) = [gate; up],
    down (E, H * F); optional biases (E, 2F), (E, H) float32; ``limit``: gpt-oss's clamped activation, else
    silu(gate) * up.  Returns y (T, H) float32 = for each token the sum over its k assignments, in expert order, of
    weight x down(act(gate_up x)), and the assignments per expert (E,) int64.  The sort by expert, the gathers, the
    activation (with its own vectorised exp: a series to r^7 after range reduction, within float32 rounding) and
    the weighted sum run in C.  (``RoutedExperts``: the same with the stacks checked once, for repeated calls.)"""
    return RoutedExperts(gate_up, down, ffn_size, gate_up_bias, down_bias)(x, topk_idx, topk_weight, limit, alpha)


class RoutedExperts:
    """``routed_experts`` for one layer's stacks: they are checked when it is made, and a call checks only the
    tokens' tensors (a decode step calls it once per MoE layer: the stacks' checks cost ~15 us a call).  Holds the
    panel copies and the biases themselves (each call reads their current addresses)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, ffn_size: int,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):
        experts = gate_up.shape[0]
        hidden = down.shape[1] // ffn_size if ffn_size > 0 and down.dim() == 2 else -1
        if (_library() is None or gate_up.dim() != 2 or down.dim() != 2 or hidden <= 0
                or gate_up.shape[1] != 2 * ffn_size * hidden or tuple(down.shape) != (experts, hidden * ffn_size)
                or any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
                       for w in (gate_up, down))
                or (gate_up_bias is not None and tuple(gate_up_bias.shape) != (experts, 2 * ffn_size))
                or (down_bias is not None and tuple(down_bias.shape) != (experts, hidden))):
            raise ValueError(f"routed_experts: the stacks {tuple(gate_up.shape)} {gate_up.dtype}, {tuple(down.shape)} "
                             f"{down.dtype} (biases {None if gate_up_bias is None else tuple(gate_up_bias.shape)}, "
                             f"{None if down_bias is None else tuple(down_bias.shape)}) are not panel copies of "
                             f"ffn_size {ffn_size} (or the kernel is not available)")
        self.gate_up, self.down, self.biases = gate_up, down, (gate_up_bias, down_bias)
        self.experts, self.hidden, self.ffn_size = experts, hidden, ffn_size

    def holds(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None,
              down_bias: torch.Tensor | None) -> bool:
        """Was it made for these very tensors (a re-packed stack or a replaced bias needs a new call)."""
        return (self.gate_up is gate_up and self.down is down and self.biases[0] is gate_up_bias
                and self.biases[1] is down_bias)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, limit: float | None = None,
                 alpha: float = 1.702) -> tuple[torch.Tensor, torch.Tensor]:
        """(y (T, H) float32, assignments per expert (E,) int64) for x (T, H) float32, topk_idx (T, k) int64,
        topk_weight (T, k) float32 (``routed_experts``)."""
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.hidden
                or topk_idx.dtype != torch.int64 or topk_idx.device.type != "cpu" or topk_idx.dim() != 2
                or topk_weight.dtype != torch.float32 or topk_weight.device.type != "cpu"
                or topk_idx.shape != topk_weight.shape or topk_idx.shape[0] != x.shape[0]):
            raise ValueError(f"routed_experts: x {tuple(x.shape)} {x.dtype}, topk_idx {tuple(topk_idx.shape)} "
                             f"{topk_idx.dtype}, topk_weight {tuple(topk_weight.shape)} {topk_weight.dtype} do not "
                             f"match the stacks {tuple(self.gate_up.shape)}, {tuple(self.down.shape)} of ffn_size "
                             f"{self.ffn_size}")
        biases = [None if b is None else b.detach().to(torch.float32).contiguous() for b in self.biases]
        return _named("ringmoe::panel_routed_experts", self._run, x.contiguous(), topk_idx.contiguous(),
                      topk_weight.contiguous(), biases, limit, alpha)

    def _run(self, x, topk_idx, topk_weight, biases, limit, alpha):
        tokens, experts = x.shape[0], self.experts
        y = torch.empty(tokens, self.hidden, dtype=torch.float32)
        counts = torch.empty(experts, dtype=torch.int64)
        # (the library not kept on self: a model holding this call stays deep-copyable)
        status = _library().panel_moe(x.data_ptr(), tokens, self.hidden, topk_idx.data_ptr(), topk_weight.data_ptr(),
                                      topk_idx.shape[1], experts, self.gate_up.data_ptr(), _address(biases[0]),
                                      self.down.data_ptr(), _address(biases[1]), self.ffn_size,
                                      -1.0 if limit is None else float(limit), float(alpha), y.data_ptr(),
                                      counts.data_ptr(), torch.get_num_threads())
        if status == -2:
            raise ValueError(f"routed_experts: topk_idx holds an expert index outside [0, {experts})")
        if status != 0:
            raise MemoryError("panel_gemm: out of memory for a MoE layer's buffers")
        return y, counts


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
