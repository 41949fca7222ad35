// A persistent thread pool for the native kernels: parallel_for over a range of independent
// items (output rows of a GEMV, (sequence, kv head) pairs of decode attention).
//
// One pool per loaded library (each dispatch level's .so has its own; a process normally loads
// one), sized by tandem_set_threads(n) (thread_pool.cpp), which kernels/native.py calls with the
// worker's --threads. n = 1, the default, starts no thread at all: every parallel_for is then a
// plain call of the body over the whole range, the single-threaded code path.
//
// Invariants the kernels rely on:
//   - The range is cut into contiguous chunks; each item belongs to exactly one chunk and each
//     chunk is run by exactly one thread, whole, with the code it would run serially. So every
//     output element is computed by one thread with the same arithmetic order whatever the
//     thread count: results are bit-identical across thread counts (and batch-invariant).
//   - The calling thread runs chunks too; it returns only when every chunk is done.
//   - A parallel_for issued from a pool thread, or while another thread holds the pool, runs
//     serially on the calling thread (no nesting, no deadlock, same results).
//   - Idle pool threads spin for at most ~50 us, then sleep on a condition variable (futex):
//     a decode worker never takes the other worker process's core when it has no work.
//   - An active limit (tandem_set_active(n), thread_pool.cpp) runs each job on the caller and
//     the first n - 1 pool threads only; the others are parked (asleep, not woken per job)
//     until the limit rises. The limit changes only how the range is cut, never who computes
//     an output's arithmetic or in what order: results stay bit-identical at every limit.
//
// Chunks are claimed dynamically (an atomic counter), several per thread: on a shared host a
// descheduled thread's chunks are taken by the others instead of stalling the whole call.
//
// Fork: the pool's threads do not survive fork(); tandem starts workers with subprocess (fork +
// exec), so a child never runs kernels with the parent's pool. A process that forks and then
// calls kernels without exec must call tandem_set_threads(1) in the child first.
#pragma once

#include <stdint.h>

namespace tandem {

// One chunk's work: items [begin, end) of the range, with the caller's context.
typedef void (*ChunkFn)(void* ctx, int64_t begin, int64_t end);

// Runs fn over [begin, end) in chunks of at least `grain` items, rounded to multiples of
// `grain` (so chunk boundaries fall on, e.g., cache-line boundaries of the output). Serial
// when the pool has one thread, when the range has fewer than 2 * grain items, or when
// called from a pool thread.
void parallel_for_chunks(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx);

// Threads of this library's pool, the calling thread included (1 = serial); the active limit
// may let a job use fewer.
int pool_threads();

// The lambda form the kernels use: body(begin, end) over contiguous chunks.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
    parallel_for_chunks(begin, end, grain,
                        [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); },
                        const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace tandem
