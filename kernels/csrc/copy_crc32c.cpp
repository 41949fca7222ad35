// CRC32C (Castagnoli) over gather lists, optionally fused with the copy of each segment
// (kernels/copy_crc32c.py; used by kvtransfer/ to move KV blocks with their checksum).
//
// Why fused: a transfer that checksums and then copies reads every byte twice, the second time
// from cache at best. Here each 8-byte word is loaded once, folded into the CRC and stored, in
// three interleaved streams (the crc32 instruction has a latency of 3 cycles and a throughput
// of one per cycle), so the CRC hides behind the memory traffic of the copy. The three stream
// CRCs are joined with Mark Adler's zero-operator tables (crc32c.c, "crc32c_shift"): the CRC of
// A followed by B is shift_{|B|}(crc(A)) ^ crc0(B).
//
// Read-back (`verify`): after copying each chunk of at most kChunk bytes, the destination chunk
// is compared with its source while both are still in L1/L2 (memcmp: vector compares, cheaper
// than a second CRC), so a copy that did not land as read is detected without a second trip
// to memory.
//
// Streaming (`stream`, exclusive with verify): the words are stored with movnti, past the
// cache. An ordinary store first reads its destination line (read-for-ownership), so a copy
// out of memory moves three lines per line copied; streaming moves two, and the three
// interleaved streams keep more lines in flight: ~10.5 GB/s against memcpy's ~7 on one
// Sapphire Rapids core, 90 MiB. The destination then sits in memory, not in cache, which is
// why a read-back would cost a second trip and is not offered with it: the other side checks
// the CRC instead (kvtransfer/shm_backend.py). The call ends with an sfence, so every streamed
// store is visible before whatever the caller does next (its notification).
//
// Invariants: results equal crc32c.crc32c of the concatenated segments (tests/kernels), on
// any alignment and length; the state is the standard pre/post-inverted CRC, so `crc_in`
// continues a CRC exactly as crc32c.crc32c(data, value) does. No allocation, no threads: the
// caller (a KV I/O thread, GIL released by ctypes) owns the parallelism.
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define TANDEM_CRC_X86 1
#endif

namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // CRC32C, reflected
constexpr size_t kLong = 8192;           // bytes per stream in the long 3-way loop
constexpr size_t kShort = 256;           // ... and in the short one
// Read-back granule: one long 3-way group (a smaller chunk would only ever take the short
// loop, whose stream joins cost ~15% more); a chunk and its source are still in L1/L2 when
// compared.
constexpr size_t kChunk = 3 * kLong;

uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

void gf2_square(uint32_t* square, const uint32_t* mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

// The operator that appends `len` zero bytes to a CRC; len a power of two.
void zeros_op(uint32_t* even, size_t len) {
    uint32_t odd[32];
    odd[0] = kPoly;
    uint32_t row = 1;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd);  // 2 zero bits
    gf2_square(odd, even);  // 4 zero bits
    do {  // odd holds the operator for 4 zero bits, then 8 (one byte), 16, ...
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++) even[n] = odd[n];
}

struct Tables {
    uint32_t lng[4][256];
    uint32_t shrt[4][256];
    uint32_t byte[256];  // the portable path
    Tables() {
        fill(lng, kLong);
        fill(shrt, kShort);
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t crc = n;
            for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ kPoly : crc >> 1;
            byte[n] = crc;
        }
    }
    static void fill(uint32_t zeros[4][256], size_t len) {
        uint32_t op[32];
        zeros_op(op, len);
        for (uint32_t n = 0; n < 256; n++) {
            zeros[0][n] = gf2_times(op, n);
            zeros[1][n] = gf2_times(op, n << 8);
            zeros[2][n] = gf2_times(op, n << 16);
            zeros[3][n] = gf2_times(op, n << 24);
        }
    }
};

const Tables& tables() {
    static const Tables t;  // built once, thread-safe (C++11 magic statics)
    return t;
}

inline uint32_t shift(const uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

// CRC state (inverted) over src[0, len), storing each byte at dst when kCopy.
template <bool kCopy>
uint32_t crc_portable(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t len) {
    const uint32_t* table = tables().byte;
    for (size_t i = 0; i < len; i++) {
        uint8_t b = src[i];
        if (kCopy) dst[i] = b;
        crc = table[(crc ^ b) & 0xff] ^ (crc >> 8);
    }
    return crc;
}

#ifdef TANDEM_CRC_X86
// movnti has no alignment requirement; an unaligned word only splits across write-combining
// buffers (the cache's KV blocks and torch's allocations are 64-byte aligned).
inline void store_nt(uint8_t* dst, uint64_t word) {
    _mm_stream_si64(reinterpret_cast<long long*>(dst), static_cast<long long>(word));
}

// Whole groups of three `block`-byte streams; advances src, dst and len past them.
template <bool kCopy, bool kStream>
__attribute__((target("sse4.2"))) uint32_t three_way(uint32_t crc, const uint8_t*& src, uint8_t*& dst,
                                                    size_t& len, size_t block,
                                                    const uint32_t zeros[4][256]) {
    while (len >= 3 * block) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        const uint8_t* end = src + block;
        do {
            uint64_t a, b, c;
            std::memcpy(&a, src, 8);
            std::memcpy(&b, src + block, 8);
            std::memcpy(&c, src + 2 * block, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
            if (kStream) {
                store_nt(dst, a);
                store_nt(dst + block, b);
                store_nt(dst + 2 * block, c);
                dst += 8;
            } else if (kCopy) {
                std::memcpy(dst, &a, 8);
                std::memcpy(dst + block, &b, 8);
                std::memcpy(dst + 2 * block, &c, 8);
                dst += 8;
            }
            src += 8;
        } while (src < end);
        crc = shift(zeros, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
        crc = shift(zeros, crc) ^ static_cast<uint32_t>(c2);
        src += 2 * block;
        if (kCopy) dst += 2 * block;
        len -= 3 * block;
    }
    return crc;
}

template <bool kCopy, bool kStream>
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const uint8_t* src, uint8_t* dst,
                                                 size_t len) {
    const Tables& t = tables();
    while (len && (reinterpret_cast<uintptr_t>(src) & 7)) {
        uint8_t b = *src++;
        if (kCopy) *dst++ = b;
        crc = _mm_crc32_u8(crc, b);
        len--;
    }
    crc = three_way<kCopy, kStream>(crc, src, dst, len, kLong, t.lng);
    crc = three_way<kCopy, kStream>(crc, src, dst, len, kShort, t.shrt);
    uint64_t c = crc;
    while (len >= 8) {
        uint64_t w;
        std::memcpy(&w, src, 8);
        if (kCopy) {
            std::memcpy(dst, &w, 8);
            dst += 8;
        }
        c = _mm_crc32_u64(c, w);
        src += 8;
        len -= 8;
    }
    crc = static_cast<uint32_t>(c);
    while (len--) {
        uint8_t b = *src++;
        if (kCopy) *dst++ = b;
        crc = _mm_crc32_u8(crc, b);
    }
    return crc;
}

bool have_hw() {
    static const bool yes = __builtin_cpu_supports("sse4.2");
    return yes;
}
#endif

// kStream falls back to ordinary stores where there is no movnti (not x86, or no SSE4.2 for the
// CRC loop it lives in): the bytes and the CRC are the same either way.
template <bool kCopy, bool kStream = false>
uint32_t crc_any(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t len) {
#ifdef TANDEM_CRC_X86
    if (have_hw()) return crc_hw<kCopy, kStream>(crc, src, dst, len);
#endif
    return crc_portable<kCopy>(crc, src, dst, len);
}

}  // namespace

// CRC32C over n segments (srcs[i], sizes[i] bytes), continuing from crc_in (a finished CRC, as
// crc32c.crc32c's `value`), into *crc_out. With dsts (non-NULL) each segment is also copied to
// dsts[i] in the same pass (a segment must not overlap its destination). flags: 1 (verify) compares
// each copied chunk with its source right after its copy, both still in cache; 2 (stream)
// stores past the cache (see the top), and cannot be combined with verify.
// corrupt_at >= 0 is a test seam: the byte at that offset of the concatenated stream is flipped
// in the destination after its copy, before the comparison, so tests can show that the check
// catches a bad write. Returns 0; 1 for a negative count or size; 2 when a copied chunk does not
// read back as its source (the copy went on: *crc_out is still the source's CRC).
extern "C" __attribute__((visibility("default"))) int tandem_copy_crc32c(
    int64_t n, const int64_t* srcs, const int64_t* dsts, const int64_t* sizes, int64_t crc_in,
    int flags, int64_t corrupt_at, uint32_t* crc_out) {
    const bool verify = flags & 1, stream = flags & 2;
    if (n < 0 || (flags & ~3) || (verify && stream)) return 1;
    for (int64_t i = 0; i < n; i++)
        if (sizes[i] < 0) return 1;
    uint32_t crc = ~static_cast<uint32_t>(crc_in);
    bool mismatch = false;
    int64_t pos = 0;  // offset of the current chunk in the concatenated stream
    for (int64_t i = 0; i < n; i++) {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(srcs[i]);
        size_t len = static_cast<size_t>(sizes[i]);
        if (dsts == nullptr) {
            crc = crc_any<false>(crc, src, nullptr, len);
            pos += static_cast<int64_t>(len);
            continue;
        }
        uint8_t* dst = reinterpret_cast<uint8_t*>(dsts[i]);
        while (len) {
            size_t step = len < kChunk ? len : kChunk;
            crc = stream ? crc_any<true, true>(crc, src, dst, step) : crc_any<true>(crc, src, dst, step);
            if (corrupt_at >= pos && corrupt_at < pos + static_cast<int64_t>(step))
                dst[corrupt_at - pos] ^= 0x5A;
            if (verify && std::memcmp(dst, src, step) != 0) mismatch = true;
            src += step;
            dst += step;
            len -= step;
            pos += static_cast<int64_t>(step);
        }
    }
#ifdef TANDEM_CRC_X86
    if (stream) _mm_sfence();
#endif
    *crc_out = ~crc;
    return mismatch ? 2 : 0;
}
