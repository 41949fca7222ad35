"""The native kernels' thread pool (kernels/csrc/thread_pool.h, kernels/native.py set_threads):
results bit-equal at 1, 2 and 4 threads for int4 linear, int8 linear and paged decode attention
(each output element is computed by one thread, in the serial order), on shapes whose rows or
(sequence, kv head) pairs do not split evenly, at every native level this host runs; the number
of threads a process gains; idle threads asleep; bad thread counts refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import kernels.paged_attention as pa
from kernels import native, quant_int4, quant_int8
from kernels.attention import plan_paged_attention

ROOT = Path(__file__).resolve().parents[2]
LEVELS = list(native.LEVELS[: native.LEVELS.index(native.dispatch_level()) + 1])
THREADS = (1, 2, 4)
# (N, K): N not a multiple of the 16-row grain or of any chunk count; K not a multiple of 32
# (int4 pads it) and the model's shapes.
SHAPES = [(33, 64), (100, 80), (1000, 576), (577, 1536)]
ROWS = [1, 3, 9]


@pytest.fixture(autouse=True)
def serial_afterwards():
    yield
    native.set_threads(1)


def at_each_thread_count(run):
    """run() at 1, 2 and 4 threads (and 1 again); the outputs, which must all be equal."""
    outs = []
    for t in (*THREADS, 1):
        native.set_threads(t)
        outs.append(run())
    return outs


def assert_all_equal(outs):
    for i, y in enumerate(outs[1:], 1):
        assert torch.equal(y, outs[0]), f"output at thread setting #{i} differs from 1 thread"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_linear_is_bit_equal_at_every_thread_count(level, n, k):
    gen = torch.Generator().manual_seed(n * k)
    packed = quant_int4.pack(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen),
                             torch.device("cpu"), layout="q4_1")
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 3
        assert_all_equal(at_each_thread_count(lambda: quant_int4.int4_linear_native(x, packed, level)))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_linear_is_bit_equal_at_every_thread_count(level, n, k):
    gen = torch.Generator().manual_seed(n + k)
    packed = quant_int8.pack(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen),
                             torch.device("cpu"), layout="native")
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        assert_all_equal(at_each_thread_count(lambda: quant_int8.int8_linear_native(x, packed, level)))


def decode_inputs(lens, num_heads, num_kv_heads, head_dim, cache_dtype, block_size=16):
    """q, k_cache, v_cache and the decode plan of one decode token per sequence of `lens`, the
    blocks scattered over the cache."""
    g = torch.Generator().manual_seed(sum(lens))
    need = [-(-s // block_size) for s in lens]
    num_blocks = 2 * sum(need) + 1
    ids = torch.randperm(num_blocks, generator=g)[:sum(need)].to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, used in enumerate(need):
        tables[b, :used] = ids[sum(need[:b]):sum(need[:b]) + used]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    plan = plan_paged_attention(cu, torch.tensor(lens, dtype=torch.int32), tables, block_size).decode
    return q, k_cache, v_cache, plan


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,num_heads,num_kv_heads", [
    ([100], 9, 3),                        # batch 1: 3 pairs over 2 and 4 threads
    ([1, 15, 17, 100, 33, 2, 64], 6, 2),  # 14 ragged pairs
    ([5, 40, 300], 4, 1),                 # one kv head per sequence, very unequal lengths
])
def test_paged_decode_is_bit_equal_at_every_thread_count(level, cache_dtype, lens, num_heads, num_kv_heads):
    q, k_cache, v_cache, plan = decode_inputs(lens, num_heads, num_kv_heads, 64, cache_dtype)

    def run():
        out = torch.full_like(q, float("nan"))
        pa.paged_decode_native(q, k_cache, v_cache, plan, 0.125, out, level)
        assert not out.isnan().any()
        return out

    assert_all_equal(at_each_thread_count(run))


def test_concurrent_callers_get_the_serial_results():
    """Two Python threads in the kernels at once (ctypes releases the GIL): one holds the pool,
    the other runs serially; neither waits on the other's job or changes its numbers."""
    gen = torch.Generator().manual_seed(7)
    packed = quant_int4.pack(torch.randn(1000, 576, generator=gen), None, torch.device("cpu"), layout="q4_1")
    xs = [torch.randn(4, 576, generator=gen) for _ in range(2)]
    expected = [quant_int4.int4_linear_native(x, packed) for x in xs]
    native.set_threads(2)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def caller(i):
        for _ in range(30):
            got[i].append(quant_int4.int4_linear_native(xs[i], packed))

    workers = [threading.Thread(target=caller, args=(i,)) for i in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for i in (0, 1):
        assert len(got[i]) == 30 and all(torch.equal(y, expected[i]) for y in got[i])


@pytest.mark.parametrize("bad", [0, -1, native.MAX_THREADS + 1, True, 2.0, "2", None])
def test_bad_thread_counts_are_refused_with_a_clear_error(bad):
    native.library()
    native.set_threads(2)
    with pytest.raises(ValueError, match="native kernel threads"):
        native.set_threads(bad)
    assert native.threads() == 2  # a refused count changes nothing
    assert native.library().tandem_threads() == 2


def test_the_library_refuses_bad_counts_itself():
    lib = native.library()
    for bad in (0, -3, native.MAX_THREADS + 1):
        assert lib.tandem_set_threads(bad) == 1
    assert lib.tandem_threads() == 1


def test_a_library_loaded_later_takes_the_count_set_before():
    """configure_process sets the count before any kernel has loaded: the library picks it up."""
    out = run_python("""
        from kernels import native
        native.set_threads(3)
        print(native.library().tandem_threads())
    """)
    assert out.strip() == "3"


# The subprocess counts its own tasks: the test process has torch's and pytest's threads.
THREAD_COUNT_SCRIPT = """
    import os, time, torch
    from kernels import native, quant_int4
    from worker.runtime import configure_process

    def tasks():
        return sorted(os.listdir("/proc/self/task"))

    def pool_threads():
        return [t for t in tasks() if open(f"/proc/self/task/{t}/comm").read().strip() == "tandem-kernels"]

    def state(tid):  # the field after "(comm)" in /proc/.../stat: R running, S sleeping
        return open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]

    packed = quant_int4.pack(torch.randn(1000, 576), None, torch.device("cpu"), layout="q4_1")
    x = torch.randn(8, 576)
    configure_process(1)
    for _ in range(3):
        quant_int4.int4_linear_native(x, packed)  # torch and the library fully started
    before = len(tasks())
    print("serial", len(pool_threads()))
    configure_process(2)
    for _ in range(20):
        quant_int4.int4_linear_native(x, packed)
    print("extra", len(tasks()) - before, len(pool_threads()))
    configure_process(2)
    quant_int4.int4_linear_native(x, packed)
    print("again", len(tasks()) - before)
    # Idle: the pool thread stops spinning within ~50 us and sleeps. Polled, not timed: on a
    # loaded host a thread due to sleep may wait its turn on a core first.
    (tid,) = pool_threads()
    deadline = time.monotonic() + 10
    while state(tid) != "S" and time.monotonic() < deadline:
        time.sleep(0.01)
    print("idle", state(tid))
    configure_process(4)
    quant_int4.int4_linear_native(x, packed)
    print("four", len(tasks()) - before)
    configure_process(1)
    print("back", len(tasks()) - before, len(pool_threads()))
"""


def run_python(script: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_threads_2_adds_one_native_thread_which_sleeps_when_idle():
    lines = dict(line.split(" ", 1) for line in run_python(THREAD_COUNT_SCRIPT).splitlines())
    assert lines["serial"] == "0"       # threads=1: no pool thread at all
    assert lines["extra"] == "1 1"      # threads=2: exactly one more task, the pool's
    assert lines["again"] == "1"        # the same count again starts nothing
    assert lines["idle"] == "S"         # no work: asleep, not spinning
    assert lines["four"] == "3"         # the calling thread is one of the four
    assert lines["back"] == "0 0"       # 1 again: the pool's threads are joined


# -- the active limit (native.set_active: a core lease's per-step share) -------------------

@pytest.fixture
def no_limit_afterwards():
    yield
    native.set_active(0)


@pytest.mark.parametrize("level", LEVELS)
def test_results_are_bit_equal_at_every_active_limit(level, no_limit_afterwards):
    gen = torch.Generator().manual_seed(11)
    packed = quant_int4.pack(torch.randn(577, 1536, generator=gen), None, torch.device("cpu"), layout="q4_1")
    x = torch.randn(3, 1536, generator=gen)
    q, k_cache, v_cache, plan = decode_inputs([1, 15, 17, 100, 33, 2, 64], 6, 2, 64, torch.float32)

    def run():
        out = torch.full_like(q, float("nan"))
        pa.paged_decode_native(q, k_cache, v_cache, plan, 0.125, out, level)
        return quant_int4.int4_linear_native(x, packed, level), out

    native.set_threads(1)
    serial = run()
    native.set_threads(4)
    for limit in (1, 2, 3, 4, 0, 9, 2):
        native.set_active(limit)
        for got, want in zip(run(), serial):
            assert torch.equal(got, want), f"active limit {limit} changed a result"


def test_no_call_uses_more_threads_than_the_limit(no_limit_afterwards):
    """The pool's own count of the threads that ran chunks of one call: at most the limit,
    exactly 1 at limit 1, and more than 1 when the limit allows (polled, bounded: on a loaded
    host a woken thread may find every chunk taken)."""
    packed = quant_int4.pack(torch.randn(4096, 576), None, torch.device("cpu"), layout="q4_1")
    x = torch.randn(4, 576)
    native.set_threads(4)
    for limit in (1, 2):
        native.set_active(limit)
        native.peak_threads(reset=True)
        for _ in range(300):
            quant_int4.int4_linear_native(x, packed)
        assert native.peak_threads() <= limit, f"a call ran on more than {limit} threads"
        if limit == 1:
            assert native.peak_threads() == 1
    native.set_active(2)
    native.peak_threads(reset=True)
    for _ in range(3000):
        quant_int4.int4_linear_native(x, packed)
        if native.peak_threads() == 2:
            break
    assert native.peak_threads() == 2, "the second thread never ran a chunk: the count is broken"


@pytest.mark.parametrize("bad", [-1, native.MAX_THREADS + 1, True, 1.0, "2", None])
def test_bad_active_limits_are_refused(bad, no_limit_afterwards):
    native.set_active(2)
    with pytest.raises(ValueError, match="active threads"):
        native.set_active(bad)
    assert native.active() == 2 and native.library().tandem_active() == 2
    assert native.library().tandem_set_active(-1) == 1


# Pool threads over the limit are parked: they neither run chunks nor wake per call, which
# /proc shows as context switches that do not move while calls go on (an active thread
# sleeps after each call here, the calls being spaced, so its count moves every call).
PARKED_SCRIPT = """
    import os, time, torch
    from kernels import native, quant_int4

    def pool_threads():
        tasks = sorted(os.listdir("/proc/self/task"))
        return [t for t in tasks if open(f"/proc/self/task/{t}/comm").read().strip() == "tandem-kernels"]

    def switches(tid):
        fields = dict(l.split(":") for l in open(f"/proc/self/task/{tid}/status").read().splitlines() if ":" in l)
        return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])

    packed = quant_int4.pack(torch.randn(4096, 576), None, torch.device("cpu"), layout="q4_1")
    x = torch.randn(4, 576)
    native.set_threads(4)
    native.set_active(2)
    for _ in range(20):
        quant_int4.int4_linear_native(x, packed)
    time.sleep(0.2)  # the parked ones are asleep on their own condition variable by now
    before = {t: switches(t) for t in pool_threads()}
    for _ in range(50):
        quant_int4.int4_linear_native(x, packed)
        time.sleep(0.002)
    moved = sorted(switches(t) - before[t] for t in before)
    print("threads", len(before))
    print("still", sum(1 for m in moved if m == 0))
    native.set_active(0)
    for _ in range(50):
        quant_int4.int4_linear_native(x, packed)
        time.sleep(0.002)
    after = {t: switches(t) for t in before}
    print("woken", sum(1 for t in before if after[t] > before[t]))
"""


def test_threads_over_the_limit_stay_asleep_until_it_rises():
    lines = dict(line.split(" ", 1) for line in run_python(PARKED_SCRIPT).splitlines())
    assert lines["threads"] == "3"  # 4 in all, the caller included
    assert lines["still"] == "2"    # limit 2: pool threads 2 and 3 never woke
    assert lines["woken"] == "3"    # no limit: every pool thread took part again
