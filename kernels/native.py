"""The native CPU kernels (kernels/csrc/*.cpp): built with the system C++ compiler on first use,
cached, loaded with ctypes.

Why not aten: on the CPUs tandem runs on, aten's weight-only int4 and int8 GEMV read weights at
2-4 GB/s (bf16 activations, a layout built for larger M); these kernels take fp32 activations as
the residual stream has them and read GGUF's own Q4_1 blocks at close to the copy bandwidth.

Dispatch level: each source is compiled once per instruction-set level (csrc/simd.h):

    level     compiler flags                                  used when aten's level is
    default   (plain x86-64; the compiler may use SSE2)       DEFAULT (or a non-x86 CPU)
    avx2      -mavx2 -mfma -mf16c                             AVX2
    avx512    -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma    AVX512
    avx512vnni  avx512's and -mavx512vnni                     AVX512, on a CPU with AVX512-VNNI,
                                                              ATEN_CPU_CAPABILITY not set

AMX: the avx512vnni build also compiles csrc/int4_amx.cpp with -mamx-tile -mamx-int8 (the tile
kernel of the int4 "q4_1x"/"q4_kx" and the Q6_K "q6_kx" layouts). Whether the tiles may run is asked at run time, once per process
(`amx_available`: the CPUID bits, then Linux's arch_prctl(ARCH_REQ_XCOMP_PERM), which a VM may
refuse), and the layout is offered to the layout choice only where they may: a tile
instruction without the grant dies with SIGILL.

The level follows `torch.backends.cpu.get_cpu_capability()`, which honours
ATEN_CPU_CAPABILITY=default|avx2|avx512, so one host runs (and tests) every level up to its own.
aten has no VNNI level of its own: an explicit ATEN_CPU_CAPABILITY=avx512 therefore means plain
avx512 here too, which is how a VNNI host tests the non-VNNI code (vpmaddubsw + vpmaddwd where
vpdpbusd would be).

Cache: $TANDEM_HOME/native (default ~/.cache/tandem/native), one shared library per hash of
(sources, flags, compiler version), loaded only from a directory that only we can write and only
if its manifest's hash of its bytes still holds (kernels/native_cache.py). Processes that would
build the same library at once take turns on a lock file beside it (the second loads what the
first installed); a build writes a temporary file and renames it into place, so a reader never
sees half a library.
Threads: one persistent pool per loaded library (csrc/thread_pool.h), sized by `set_threads`,
which worker/runtime.py `configure_process` calls with the process's --threads; 1 (the
default) starts no thread. `set_active` limits how many of them a call uses, without starting
or stopping any (a core lease's per-step share). Results are bit-identical at every thread
count and limit.

A machine without a C++ compiler, or whose loader refuses the library (noexec, SELinux), gets
`NativeUnavailable` with the reason, logged once by `available()`; callers then fall back to
the aten kernels (kernels/quant_int4.py, quant_int8.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels import native_cache

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("copy_crc32c.cpp", "decode_layers.cpp", "int4_amx.cpp", "int4_linear.cpp", "int8_linear.cpp",
           "paged_decode.cpp", "q6k_linear.cpp", "rms_norm.cpp", "rotary_kv_write.cpp", "silu_and_mul.cpp",
           "thread_pool.cpp")
HEADERS = ("simd.h", "thread_pool.h")
MAX_THREADS = 256  # thread_pool.cpp kMaxThreads
LEVELS = ("default", "avx2", "avx512", "avx512vnni")
LEVEL_FLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}
LEVEL_FLAGS["avx512vnni"] = LEVEL_FLAGS["avx512"] + ["-mavx512vnni"]
# Flags one source gets at one level on top of the level's: the AMX tile kernel
# (csrc/int4_amx.cpp) only in the avx512vnni build, the level of every CPU with AMX. A compiler
# that does not know the flags builds that source without them (its entry points then say "no
# AMX"), so an older g++ still gets every other kernel.
SOURCE_LEVEL_FLAGS = {("int4_amx.cpp", "avx512vnni"): ["-mamx-tile", "-mamx-int8"]}
COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno", "-fvisibility=hidden"]

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    # name: argument types (every function returns int: 0 = ok, else a shape error code)
    "tandem_int4_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_int4a8_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_int4_amx_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_q4k_amx_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_q6k_amx_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_amx_available": [],
    "tandem_q4k_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
                          ctypes.c_int],
    "tandem_int8_linear": [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64],
    "tandem_q6k_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_q8_0_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_q5k_linear": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64],
    "tandem_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "tandem_rotary_kv_write": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr,
                               _ptr, _ptr, ctypes.c_int, _i64, _ptr],
    "tandem_paged_decode": [_ptr, _i64, _ptr, _ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _i64,
                            _ptr, _ptr, _ptr, _i64, _i64, _f32, _ptr, _i64],
    "tandem_copy_crc32c": [_i64, _ptr, _ptr, _ptr, _i64, ctypes.c_int, _i64, _ptr],
    "tandem_silu_and_mul": [_ptr, _i64, _i64, _i64, _ptr],
    "tandem_decode_layers": [_ptr, _i64, _ptr, _ptr, _ptr],
    "tandem_set_threads": [_i64],
    "tandem_threads": [],
    "tandem_set_active": [_i64],
    "tandem_active": [],
    "tandem_peak_threads": [],
    "tandem_reset_peak": [],
}
# tandem_set_threads' refusals (thread_pool.cpp)
_SET_THREADS_ERRORS = {
    1: f"is outside 1..{MAX_THREADS}",
    2: "was asked from inside a native kernel",
    3: "could not be started (the system refused a thread; the pool stays at 1)",
}
_threads = 1  # what set_threads asked for; applied to every library as it loads
_active = 0  # what set_active asked for (0: every thread of the pool); likewise applied
_loaded: dict[str, ctypes.CDLL] = {}


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (no compiler, not x86, build error)."""


def dispatch_level() -> str:
    """The level this process runs: aten's own (ATEN_CPU_CAPABILITY caps it)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "default"
    cap = torch.backends.cpu.get_cpu_capability().lower()
    if cap == "avx512" and not os.environ.get("ATEN_CPU_CAPABILITY") and _has_cpu_flag("avx512_vnni"):
        return "avx512vnni"
    return cap if cap in LEVEL_FLAGS else "default"


def level_env(level: str, env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` under which a new process runs `level` (on a host that has it):
    aten's ATEN_CPU_CAPABILITY, or for avx512vnni none at all (dispatch_level)."""
    if level not in LEVEL_FLAGS:
        raise ValueError(f"unknown native level {level!r}; expected one of {LEVELS}")
    out = {k: v for k, v in env.items() if k != "ATEN_CPU_CAPABILITY"}
    if level != "avx512vnni":
        out["ATEN_CPU_CAPABILITY"] = level
    return out


def split_zmm() -> bool:
    """Whether this CPU runs each 512-bit op as two 256-bit halves (AMD Zen 4: family 25 with
    AVX-512), for which the kernels are built with fewer dot chains (csrc/simd.h dot_chains).
    TANDEM_SPLIT_ZMM=1 or 0 overrides the detection (the tests build both ways)."""
    forced = os.environ.get("TANDEM_SPLIT_ZMM")
    if forced in ("0", "1"):
        return forced == "1"
    return _cpu_field("vendor_id") == "AuthenticAMD" and _cpu_field("cpu family") == "25" \
        and _has_cpu_flag("avx512f")


def _cpu_field(name: str) -> str | None:
    """The first value of `name` in /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def _has_cpu_flag(flag: str) -> bool:
    """Whether the kernel reports `flag` for this CPU (Linux /proc/cpuinfo; elsewhere: no)."""
    return flag in (_cpu_field("flags") or "").split()


def cache_root() -> Path:
    home = os.environ.get("TANDEM_HOME") or str(Path.home() / ".cache" / "tandem")
    return Path(home) / "native"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the kernels' sources and headers: names a version of the kernels (the build
    cache and kernels/layout_choice.py key on it)."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise NativeUnavailable("no C++ compiler found (install g++, e.g. `apt-get install g++`)")


def _build(level: str) -> Path:
    """The library for `level`: from the cache when its manifest vouches for it, else built."""
    cxx = _compiler()
    flags = COMMON_FLAGS + LEVEL_FLAGS[level] if platform.machine().lower() in ("x86_64", "amd64") \
        else COMMON_FLAGS
    if split_zmm():
        flags = flags + ["-DTANDEM_SPLIT_ZMM"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(source_digest().encode())
    digest.update(" ".join([cxx, *flags, version]).encode())
    digest.update(repr(sorted((src, f) for (src, lvl), f in SOURCE_LEVEL_FLAGS.items() if lvl == level)).encode())
    key = digest.hexdigest()
    out = native_cache.trusted_dir(cache_root()) / f"tandem_{level}_{key[:16]}.so"
    if native_cache.verified(out, key):
        return out
    # One build per library at a time: processes starting together (a prefill and a decode
    # worker on a fresh cache) each compiled the same sources on the same few cores, ~10 s of
    # g++ apiece; the second now waits for the first and loads what it installed.
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if native_cache.verified(out, key):
            return out
        with tempfile.TemporaryDirectory(dir=out.parent) as work:
            tmp = Path(work) / out.name
            _compile(cxx, flags, Path(work), tmp, level)
            native_cache.install(tmp, out, key)
    return out


def _compile(cxx: str, flags: list[str], work: Path, library: Path, level: str = "") -> None:
    """Each source to an object, as many compilers at once as this process has cores (the
    sources took ~10 s in one g++ run on one core), then one link. A source with flags of its
    own at this level (SOURCE_LEVEL_FLAGS) is compiled again without them if they fail."""
    compile_flags = [f for f in flags if f != "-shared"]

    def command(src: str, extra: list[str]) -> list[str]:
        return [cxx, *compile_flags, *extra, "-c", "-I", str(CSRC), str(CSRC / src), "-o", str(work / f"{src}.o")]

    jobs = []
    for src in SOURCES:
        extra = SOURCE_LEVEL_FLAGS.get((src, level), [])
        jobs.append([command(src, extra)] + ([command(src, [])] if extra else []))
    width = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    running: list[tuple[subprocess.Popen, list[list[str]]]] = []
    failures = []
    while jobs or running:
        while jobs and len(running) < width:
            tries = jobs.pop(0)
            running.append((subprocess.Popen(tries[0], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                            tries))
        proc, tries = running.pop(0)
        _, err = proc.communicate()
        if proc.returncode != 0:
            if len(tries) > 1:
                logging.getLogger("tandem.kernels").warning("%s failed, built without its level flags: %s",
                                                         tries[0][-3], err[-300:])
                jobs.append(tries[1:])
            else:
                failures.append(f"{' '.join(tries[0])}:\n{err[-2000:]}")
    if failures:
        raise NativeUnavailable("building the native kernels failed:\n" + "\n".join(failures))
    cmd = [cxx, *flags, *(str(work / f"{src}.o") for src in SOURCES), "-o", str(library)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NativeUnavailable(f"linking the native kernels failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")


@functools.lru_cache(maxsize=None)
def library(level: str | None = None) -> ctypes.CDLL:
    """The loaded kernels for `level` (default: this process's dispatch level). A library the
    loader refuses (a noexec mount, SELinux, a missing symbol) is NativeUnavailable too."""
    level = level or dispatch_level()
    if level not in LEVEL_FLAGS:
        raise ValueError(f"unknown native level {level!r}; expected one of {LEVELS}")
    path = _build(level)
    try:
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"loading {path} failed: {e}") from None
    if _threads != 1:
        try:
            _apply_threads(lib, _threads)
        except RuntimeError as e:  # the kernels still work, serially
            logging.getLogger("tandem.kernels").warning("%s; running the native kernels serially", e)
    if _active:
        lib.tandem_set_active(_active)
    _loaded[level] = lib
    return lib


def set_threads(n: int) -> None:
    """Run the native kernels on n threads in all, the calling thread included (1, the
    default: no extra thread, the serial code path). Applies to every library loaded now and
    to each one loaded later; builds nothing. Results do not depend on n (csrc/thread_pool.h)."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"native kernel threads must be an int in 1..{MAX_THREADS}, got {n!r}")
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"native kernel threads {n} {_SET_THREADS_ERRORS[1]}")
    for lib in _loaded.values():
        _apply_threads(lib, n)
    _threads = n


def threads() -> int:
    """The native kernels' thread count, as set by set_threads."""
    return _threads


def set_active(n: int) -> None:
    """Let each kernel call use at most n of the pool's threads, the calling thread included
    (0: all of them; more than the pool has: all of them), from the next call on. The pool's
    other threads sleep, woken only when the limit rises, so their cores are left to other
    processes; nothing is started or stopped (cheap enough to call before every engine step:
    a core lease, worker/core_share.py). Results do not depend on n."""
    global _active
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_THREADS:
        raise ValueError(f"native kernel active threads must be an int in 0..{MAX_THREADS}, got {n!r}")
    if n != _active:
        for lib in _loaded.values():
            lib.tandem_set_active(n)
        _active = n


def active() -> int:
    """The active-thread limit set by set_active (0: none)."""
    return _active


def peak_threads(reset: bool = False) -> int:
    """The most threads that ran parts of one kernel call since the last reset, over the
    loaded libraries (1 when every call ran on the calling thread alone); reset=True starts
    counting again."""
    peak = max((lib.tandem_peak_threads() for lib in _loaded.values()), default=1)
    if reset:
        for lib in _loaded.values():
            lib.tandem_reset_peak()
    return peak


def _apply_threads(lib: ctypes.CDLL, n: int) -> None:
    code = lib.tandem_set_threads(n)
    if code != 0:
        reason = _SET_THREADS_ERRORS.get(code, f"was refused (code {code})")
        raise (ValueError if code == 1 else RuntimeError)(f"native kernel threads {n} {reason}")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this process can use the native kernels; the reason it cannot is logged once."""
    try:
        library()
        return True
    except NativeUnavailable as e:
        logging.getLogger("tandem.kernels").warning("native CPU kernels unavailable, using aten's: %s", e)
        return False


@functools.lru_cache(maxsize=None)
def amx_available(level: str | None = None) -> bool:
    """Whether `level`'s build (default: this process's) has the AMX tile kernels and the OS
    lets this process use the tiles (csrc/int4_amx.cpp; asked once per process)."""
    try:
        return library(level).tandem_amx_available() == 1
    except NativeUnavailable:
        return False


def fp32_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [M, K <= width] as a contiguous fp32 [M, width], zero-padded: the activations every
    native linear kernel takes (padded columns meet zero weights)."""
    xf = x.float()
    if xf.shape[1] != width:
        xf = torch.nn.functional.pad(xf, (0, width - xf.shape[1]))
    return xf.contiguous()


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for ctypes, None (NULL) for an absent optional tensor."""
    return None if t is None else t.data_ptr()


def check(code: int, what: str) -> None:
    if code != 0:
        raise ValueError(f"native {what} refused its arguments (code {code})")
