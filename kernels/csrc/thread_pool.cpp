// The native kernels' thread pool (thread_pool.h says what it guarantees).
//
// Hand-off without a lock on the hot path: a job is published as one 64-bit claim word,
//
//     generation (32 bits) | active threads - 1 (8) | chunk count (12) | next chunk to claim (12)
//
// Threads claim chunk i by a compare-and-swap of that word from i to i + 1, so a thread that
// saw an old generation can never claim a chunk of a newer job with the old job's view; the
// job's fields are read only after a successful claim, and the caller rewrites them only once
// every chunk of the previous job is done (done_ == count). Waiting threads spin on the word
// for kSpinNs and then sleep on wake_; the caller publishes under m_ and notifies only when
// someone sleeps, so a pool that is kept busy never makes a system call.
//
// Active limit (tandem_set_active): a job runs on the first `active` threads only (the caller
// is thread 0, pool thread i is thread i). A pool thread at or above the limit takes no chunk
// of a job published under it (the limit travels in the job's word) and, once the limit is
// below it, parks on its own condition variable, woken only when the limit rises: it neither
// spins nor wakes per job, so the core it would use is left to another process (the prefill
// worker of a core lease, common/core_lease.py). Chunk boundaries depend on the active count,
// but each output is still computed by one thread in serial order: results do not change.
#include "thread_pool.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "simd.h"

namespace tandem {
namespace {

constexpr int kMaxThreads = 256;
constexpr int64_t kChunksPerThread = 4;
constexpr int64_t kMaxChunks = 0xfff;  // >= kMaxThreads * kChunksPerThread
// How long an idle thread (or the caller waiting for the last chunk) spins before it sleeps:
// long enough to bridge the gap between two kernels of one decode step, short enough that an
// idle worker process gives its core back at once.
constexpr std::chrono::nanoseconds kSpinNs(50000);

thread_local bool t_in_pool = false;  // set on pool threads and on a caller inside its job

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

inline uint32_t tag_of(uint64_t w) { return (uint32_t)(w >> 32); }
inline int active_of(uint64_t w) { return (int)((w >> 24) & 0xff) + 1; }
inline uint32_t count_of(uint64_t w) { return (uint32_t)(w >> 12) & 0xfff; }
inline uint32_t next_of(uint64_t w) { return (uint32_t)w & 0xfff; }

struct Job {
    ChunkFn fn;
    void* ctx;
    int64_t begin, end, per;  // chunk i: [begin + i * per, min(begin + (i + 1) * per, end))
};

class Pool {
  public:
    int threads() const { return threads_.load(std::memory_order_relaxed); }
    int active() const { return active_.load(std::memory_order_relaxed); }

    // Threads a job may use from the next parallel_for on (clamped to 1..threads() when the job
    // starts); 0 = all of them. Cheap: one store, plus a wake-up of parked threads when raised.
    int set_active(int64_t n) {
        if (n < 0 || n > kMaxThreads) return 1;
        int old = active_.exchange((int)n, std::memory_order_relaxed);
        if (n == 0 || n > old || old == 0) {
            std::lock_guard<std::mutex> g(m_);
            parked_cv_.notify_all();
        }
        return 0;
    }

    // The most threads that ran chunks of one job since the last reset (1 = only the caller).
    int peak() const { return peak_.load(std::memory_order_relaxed); }
    void reset_peak() { peak_.store(1, std::memory_order_relaxed); }

    // 0 = ok, 1 = n out of range, 2 = called from inside a parallel region, 3 = the system
    // refused a thread (the pool is then serial).
    int resize(int64_t n) {
        if (n < 1 || n > kMaxThreads) return 1;
        if (t_in_pool) return 2;
        std::lock_guard<std::mutex> held(use_);
        if (n == threads()) return 0;
        stop_workers();
        try {
            start_workers((int)n - 1);
        } catch (const std::system_error&) {
            stop_workers();
            return 3;
        }
        threads_.store((int)n, std::memory_order_relaxed);
        return 0;
    }

    void run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx) {
        const int64_t n = end - begin;
        if (n <= 0) return;
        if (grain < 1) grain = 1;
        int threads = this->threads();
        const int limit = active();
        if (limit > 0 && limit < threads) threads = limit;
        if (threads <= 1 || t_in_pool || n < 2 * grain || !use_.try_lock()) {
            fn(ctx, begin, end);
            return;
        }
        std::lock_guard<std::mutex> held(use_, std::adopt_lock);
        if (workers_.empty()) {  // resized to 1 between the check and the lock
            fn(ctx, begin, end);
            return;
        }
        const int64_t units = (n + grain - 1) / grain;
        int64_t chunks = threads * kChunksPerThread;
        chunks = chunks < units ? chunks : units;
        chunks = chunks < kMaxChunks ? chunks : kMaxChunks;
        const int64_t per = (units + chunks - 1) / chunks * grain;
        chunks = (n + per - 1) / per;
        job_ = Job{fn, ctx, begin, end, per};
        done_.store(0, std::memory_order_relaxed);
        participants_.store(0, std::memory_order_relaxed);
        const uint64_t word = (uint64_t)(++generation_) << 32 | (uint64_t)(threads - 1) << 24 |
                              (uint64_t)chunks << 12;
        {
            std::lock_guard<std::mutex> g(m_);
            claim_.store(word, std::memory_order_release);
            if (sleepers_) wake_.notify_all();
        }
        t_in_pool = true;  // a parallel_for inside the body runs serially, not on this pool
        work(0);
        t_in_pool = false;
        wait_done((int64_t)chunks);
        const int ran = participants_.load(std::memory_order_relaxed);
        if (ran > peak_.load(std::memory_order_relaxed)) peak_.store(ran, std::memory_order_relaxed);
    }

  private:
    // Claims and runs chunks of the current job until none is left, as thread `index` (0: the
    // caller): a job whose active count leaves this thread out is not touched.
    void work(int index) {
        uint64_t w = claim_.load(std::memory_order_acquire);
        int64_t counted = -1;  // the generation this thread last counted itself in (-1: none)
        for (;;) {
            const uint32_t next = next_of(w), count = count_of(w);
            if (next >= count || index >= active_of(w)) return;
            if (!claim_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire))
                continue;
            // Chunk `next` is ours: job_ stays this job's until its last chunk is done.
            if (counted != (int64_t)tag_of(w)) {  // before the chunk runs, so the caller's wait sees it
                participants_.fetch_add(1, std::memory_order_relaxed);
                counted = (int64_t)tag_of(w);
            }
            const Job job = job_;
            const int64_t b = job.begin + (int64_t)next * job.per;
            const int64_t e = b + job.per < job.end ? b + job.per : job.end;
            job.fn(job.ctx, b, e);
            if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == (int64_t)count) {
                std::lock_guard<std::mutex> g(m_);
                done_cv_.notify_all();
            }
            w = claim_.load(std::memory_order_acquire);
        }
    }

    void wait_done(int64_t chunks) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; spins++) {
            cpu_relax();
            if ((spins & 255) == 255 && std::chrono::steady_clock::now() - t0 > kSpinNs) {
                std::unique_lock<std::mutex> lk(m_);
                done_cv_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == chunks; });
                return;
            }
        }
    }

    // Pool thread `index` (1-based: the caller is thread 0).
    void worker_main(int index, uint32_t seen) {
        t_in_pool = true;
        for (;;) {
            park_while_over_limit(index);
            const auto t0 = std::chrono::steady_clock::now();
            uint64_t w;
            for (int spins = 0; tag_of(w = claim_.load(std::memory_order_acquire)) == seen; spins++) {
                if (stop_.load(std::memory_order_relaxed)) return;
                cpu_relax();
                if ((spins & 255) == 255 && std::chrono::steady_clock::now() - t0 > kSpinNs) {
                    std::unique_lock<std::mutex> lk(m_);
                    ++sleepers_;
                    wake_.wait(lk, [&] {
                        return stop_.load(std::memory_order_relaxed) ||
                               tag_of(claim_.load(std::memory_order_acquire)) != seen;
                    });
                    --sleepers_;
                }
            }
            if (stop_.load(std::memory_order_relaxed)) return;
            seen = tag_of(w);
            work(index);  // returns at once when the job's active count leaves this thread out
        }
    }

    bool over_limit(int index) const {
        const int limit = active();
        return limit > 0 && index >= limit;
    }

    // Sleeps while the active limit leaves this thread out (no spinning, no wake-up per job).
    void park_while_over_limit(int index) {
        if (!over_limit(index)) return;
        std::unique_lock<std::mutex> lk(m_);
        parked_cv_.wait(lk, [&] { return stop_.load(std::memory_order_relaxed) || !over_limit(index); });
    }

    // Pool threads block every signal: a signal for the process (SIGINT, SIGTERM) is handled
    // by a thread the interpreter knows, never by one inside a kernel.
    void start_workers(int count) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        const uint32_t seen = tag_of(claim_.load(std::memory_order_acquire));
        try {
            for (int i = 0; i < count; i++) {
                workers_.emplace_back([this, i, seen] { worker_main(i + 1, seen); });
                pthread_setname_np(workers_.back().native_handle(), "tandem-kernels");
            }
        } catch (...) {
            pthread_sigmask(SIG_SETMASK, &old, nullptr);
            throw;
        }
        pthread_sigmask(SIG_SETMASK, &old, nullptr);
    }

    void stop_workers() {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_.store(true, std::memory_order_relaxed);
            wake_.notify_all();
            parked_cv_.notify_all();
        }
        for (auto& t : workers_) t.join();
        workers_.clear();
        stop_.store(false, std::memory_order_relaxed);
        threads_.store(1, std::memory_order_relaxed);
    }

    std::mutex use_;  // held by the one caller running a job, and by resize
    std::mutex m_;    // guards sleeping and waking (sleepers_, the waits on wake_ and done_cv_)
    std::condition_variable wake_, done_cv_, parked_cv_;
    std::vector<std::thread> workers_;
    std::atomic<uint64_t> claim_{0};
    std::atomic<int64_t> done_{0};
    std::atomic<bool> stop_{false};
    std::atomic<int> threads_{1};
    std::atomic<int> active_{0};        // set_active's limit; 0 = every thread
    std::atomic<int> participants_{0};  // threads that ran a chunk of the current job
    std::atomic<int> peak_{1};          // the most participants_ of one job since reset_peak
    uint32_t generation_ = 0;  // under use_
    int sleepers_ = 0;         // under m_
    Job job_{};
};

// Never destroyed: joining threads from a static destructor at exit can hang behind a thread
// the exiting process no longer schedules; the OS ends them with the process.
Pool& pool() {
    static Pool* p = new Pool();
    return *p;
}

}  // namespace

void parallel_for_chunks(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx) {
    pool().run(begin, end, grain, fn, ctx);
}

int pool_threads() { return pool().threads(); }

}  // namespace tandem

// n threads in all, the calling thread included: n - 1 pool threads are started (1: none).
// Returns 0, or 1 for n outside 1..256, 2 when called from a kernel, 3 when the system refused
// a thread (the pool is left serial).
TANDEM_API int tandem_set_threads(int64_t n) { return tandem::pool().resize(n); }

TANDEM_API int tandem_threads() { return tandem::pool_threads(); }

// Threads each job may use from now on, the calling thread included (0 = all the pool has;
// more than the pool has means all of it). Returns 0, or 1 for n outside 0..256.
TANDEM_API int tandem_set_active(int64_t n) { return tandem::pool().set_active(n); }

TANDEM_API int tandem_active() { return tandem::pool().active(); }

// The most threads that ran chunks of one parallel_for since the last tandem_reset_peak (a
// test's check that a limit holds), and its reset.
TANDEM_API int tandem_peak_threads() { return tandem::pool().peak(); }

TANDEM_API int tandem_reset_peak() {
    tandem::pool().reset_peak();
    return 0;
}
