/* MD5 of up to 16 independent byte streams at once: one AVX2 register lane per stream (appliance/store/md5lanes.py).
 *
 * An MD5 cannot be split within one stream (each 64-byte block needs the state the block before left), so one core
 * hashes one stream at ~0.6 GB/s whatever the code. Eight streams are eight independent chains, though, and the same
 * 64 rounds run on eight 32-bit lanes of a 256-bit register at once: ~3.4 GB/s of aggregate MD5 on one core here (the
 * "multi-buffer" MD5 of Intel's isa-l_crypto md5_mb and of minio/md5-simd, which MinIO uses for concurrent uploads).
 * The staging of a dataset from another tool, whose objects only an MD5 checks, hashes many objects at once.
 *
 * Sixteen run as two registers of eight, whose steps interleave (md5_sets, below): 1.1-1.3x the bytes per second.
 *
 * update(jobs): jobs is a list of up to 16 (state, data) pairs: state a writable 16-byte buffer (MD5's A, B, C, D as
 * little-endian words, RFC 1321), data a bytes-like object whose length is a multiple of 64 (whole blocks; the
 * padding is the caller's), or a list of such objects, hashed one after the other as one stream (the stager's
 * receive buffers of one object: a call takes all that is there, so the GIL is taken back once for many). Every job's blocks are hashed into its state; the GIL is released meanwhile. Lanes of
 * different lengths run together while two or more have blocks left; the last one runs alone, one block at a time.
 * LANES is 16 where the CPU has AVX2 (checked at import), else 1 (the same results, one stream at a time).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the states are read as little-endian words; md5lanes.py falls back to hashlib without this module"
#endif

static const uint32_t K[64] = {
    0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
    0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
    0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
    0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
    0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
    0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
    0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
    0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391};
static const int S[64] = {7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22,
                          5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20,
                          4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23,
                          6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21};

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* one stream, RFC 1321's loop */
static void md5_blocks(uint32_t st[4], const uint8_t *p, size_t nblocks) {
    uint32_t a = st[0], b = st[1], c = st[2], d = st[3];
    for (size_t blk = 0; blk < nblocks; blk++, p += 64) {
        uint32_t M[16];
        for (int i = 0; i < 16; i++) M[i] = le32(p + 4 * i);
        uint32_t aa = a, bb = b, cc = c, dd = d;
#pragma GCC unroll 64
        for (int i = 0; i < 64; i++) {
            uint32_t f;
            int g;
            if (i < 16) { f = (b & c) | (~b & d); g = i; }
            else if (i < 32) { f = (d & b) | (~d & c); g = (5 * i + 1) & 15; }
            else if (i < 48) { f = b ^ c ^ d; g = (3 * i + 5) & 15; }
            else { f = c ^ (b | ~d); g = (7 * i) & 15; }
            uint32_t t = a + f + K[i] + M[g];
            a = d; d = c; c = b;
            b = b + ((t << S[i]) | (t >> (32 - S[i])));
        }
        a += aa; b += bb; c += cc; d += dd;
    }
    st[0] = a; st[1] = b; st[2] = c; st[3] = d;
}

static int lanes = 1;
#define MAXJOBS 16

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))
/* K[i] in all 8 lanes, filled once at import (under the GIL, before any update): a step adds it from memory
 * rather than broadcasting K[i] into a register (two more operations a step, one on the shuffle units) */
static uint32_t K8[64][8] __attribute__((aligned(32)));
#define ROTL(x, s) _mm256_or_si256(_mm256_slli_epi32((x), (s)), _mm256_srli_epi32((x), 32 - (s)))

/* words 8*half..8*half+7 of the 8 lanes' blocks, transposed: M[w] holds word w of each lane's block */
AVX2 static inline __attribute__((always_inline)) void load8(__m256i M[16], const uint8_t *const p[8], size_t at) {
    for (int half = 0; half < 2; half++) {
        __m256i r[8];
        for (int l = 0; l < 8; l++) r[l] = _mm256_loadu_si256((const __m256i *)(p[l] + at + half * 32));
        __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
        __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
        __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
        __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
        __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
        __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
        M[half * 8 + 0] = _mm256_permute2x128_si256(u0, u4, 0x20);
        M[half * 8 + 1] = _mm256_permute2x128_si256(u1, u5, 0x20);
        M[half * 8 + 2] = _mm256_permute2x128_si256(u2, u6, 0x20);
        M[half * 8 + 3] = _mm256_permute2x128_si256(u3, u7, 0x20);
        M[half * 8 + 4] = _mm256_permute2x128_si256(u0, u4, 0x31);
        M[half * 8 + 5] = _mm256_permute2x128_si256(u1, u5, 0x31);
        M[half * 8 + 6] = _mm256_permute2x128_si256(u2, u6, 0x31);
        M[half * 8 + 7] = _mm256_permute2x128_si256(u3, u7, 0x31);
    }
}

/* 8 x SETS streams, one per 32-bit lane of SETS registers: p[l] + blk * 64 is stream l's block; every stream runs
 * nblocks blocks. A step's b waits for the step before's, a chain of 5-6 vector operations, while a step is ~10
 * operations and the core issues 3-4 a cycle: one register of 8 streams leaves most of the vector units idle, and
 * a second, independent one (SETS 2: 16 streams) runs in that room (isa-l_crypto's md5_mb_x8x2_avx2 does the same).
 * 3.4-3.9 GB/s of MD5 on one core here against 3.1 for one set (2026-11-28, an AMD EPYC of family 25 with 512 KiB
 * of L2: bench/results/stage-medium/md5_rates.txt). */
AVX2 static inline __attribute__((always_inline)) void md5_sets(uint32_t *st[16], const uint8_t *p[16],
                                                                 size_t nblocks, const int sets) {
    __m256i a[2], b[2], c[2], d[2];
    for (int s = 0; s < sets; s++) {
        uint32_t **q = st + 8 * s;
        a[s] = _mm256_setr_epi32(q[0][0], q[1][0], q[2][0], q[3][0], q[4][0], q[5][0], q[6][0], q[7][0]);
        b[s] = _mm256_setr_epi32(q[0][1], q[1][1], q[2][1], q[3][1], q[4][1], q[5][1], q[6][1], q[7][1]);
        c[s] = _mm256_setr_epi32(q[0][2], q[1][2], q[2][2], q[3][2], q[4][2], q[5][2], q[6][2], q[7][2]);
        d[s] = _mm256_setr_epi32(q[0][3], q[1][3], q[2][3], q[3][3], q[4][3], q[5][3], q[6][3], q[7][3]);
    }
    const __m256i ones = _mm256_set1_epi32(-1);
    const __m256i zero = _mm256_setzero_si256();
    for (size_t blk = 0; blk < nblocks; blk++) {
        __m256i M[2][16];
        for (int s = 0; s < sets; s++) load8(M[s], p + 8 * s, blk * 64);
        __m256i aa[2], bb[2], cc[2], dd[2];
        for (int s = 0; s < sets; s++) { aa[s] = a[s]; bb[s] = b[s]; cc[s] = c[s]; dd[s] = d[s]; }
        /* What does not depend on the step's b is added first: a + M[g] + K[i] is ready steps ahead, and so is the
         * part of f without b: round 1's f is d ^ (b & (c ^ d)), round 2's (d & b) | (~d & c) is (d & b) + (~d & c)
         * (the two share no bit), round 3's b ^ (c ^ d), round 4's c ^ (b | ~d). */
#define STEP(i, g, PRE, ON_B)                                                                         \
    for (int s = 0; s < sets; s++) {                                                                  \
        __m256i A = a[s], B = b[s], C = c[s], D = d[s];                                               \
        __m256i t = _mm256_add_epi32(M[s][g], _mm256_load_si256((const __m256i *)K8[i]));             \
        t = _mm256_add_epi32(_mm256_add_epi32(A, t), PRE);                                            \
        t = _mm256_add_epi32(t, ON_B);                                                                \
        t = ROTL(t, S[i]);                                                                            \
        a[s] = D; d[s] = C; c[s] = B;                                                                 \
        b[s] = _mm256_add_epi32(B, t);                                                                \
    }
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) STEP(i, i, zero, _mm256_xor_si256(D, _mm256_and_si256(B, _mm256_xor_si256(C, D))))
#pragma GCC unroll 16
        for (int i = 16; i < 32; i++) STEP(i, (5 * i + 1) & 15, _mm256_andnot_si256(D, C), _mm256_and_si256(D, B))
#pragma GCC unroll 16
        for (int i = 32; i < 48; i++) STEP(i, (3 * i + 5) & 15, zero, _mm256_xor_si256(B, _mm256_xor_si256(C, D)))
#pragma GCC unroll 16
        for (int i = 48; i < 64; i++)
            STEP(i, (7 * i) & 15, zero, _mm256_xor_si256(C, _mm256_or_si256(B, _mm256_xor_si256(D, ones))))
#undef STEP
        for (int s = 0; s < sets; s++) {
            a[s] = _mm256_add_epi32(a[s], aa[s]); b[s] = _mm256_add_epi32(b[s], bb[s]);
            c[s] = _mm256_add_epi32(c[s], cc[s]); d[s] = _mm256_add_epi32(d[s], dd[s]);
        }
    }
    for (int s = 0; s < sets; s++) {
        uint32_t out[4][8];
        _mm256_storeu_si256((__m256i *)out[0], a[s]); _mm256_storeu_si256((__m256i *)out[1], b[s]);
        _mm256_storeu_si256((__m256i *)out[2], c[s]); _mm256_storeu_si256((__m256i *)out[3], d[s]);
        for (int l = 0; l < 8; l++)
            for (int w = 0; w < 4; w++) st[8 * s + l][w] = out[w][l];
    }
}

AVX2 static void md5x8(uint32_t *st[16], const uint8_t *p[16], size_t nblocks) { md5_sets(st, p, nblocks, 1); }
AVX2 static void md5x16(uint32_t *st[16], const uint8_t *p[16], size_t nblocks) { md5_sets(st, p, nblocks, 2); }
#endif

/* One stream's data in a call: segments of whole blocks, hashed one after the other. */
typedef struct {
    const uint8_t **p;
    size_t *nb;
    Py_ssize_t nseg, cur;
} stream_t;

/* n <= MAXJOBS streams: those with blocks together (16 at a time where more than 8 have some, else 8) while two or
 * more have blocks, the last alone */
static void run(int n, uint32_t *st[MAXJOBS], stream_t s[MAXJOBS]) {
    for (;;) {
        int active = 0, last = -1;
        size_t least = 0;
        for (int i = 0; i < n; i++) {
            while (s[i].cur < s[i].nseg && !s[i].nb[s[i].cur]) s[i].cur++;
            if (s[i].cur < s[i].nseg) {
                size_t k = s[i].nb[s[i].cur];
                if (!active || k < least) least = k;
                active++;
                last = i;
            }
        }
        if (!active) return;
#if defined(__x86_64__) && defined(__GNUC__)
        if (active >= 2 && lanes > 1) {
            int width = active > 8 ? 16 : 8, l = 0;
            uint32_t junk[16][4]; /* lanes without blocks: they reread an active lane's bytes into a discarded state */
            uint32_t *sx[16];
            const uint8_t *px[16];
            for (int i = 0; i < n; i++)
                if (s[i].cur < s[i].nseg) { sx[l] = st[i]; px[l++] = s[i].p[s[i].cur]; }
            for (; l < width; l++) {
                memcpy(junk[l], st[last], 16);
                sx[l] = junk[l];
                px[l] = s[last].p[s[last].cur];
            }
            if (width == 16) md5x16(sx, px, least);
            else md5x8(sx, px, least);
            for (int i = 0; i < n; i++)
                if (s[i].cur < s[i].nseg) { s[i].p[s[i].cur] += least * 64; s[i].nb[s[i].cur] -= least; }
            continue;
        }
#endif
        for (int i = 0; i < n; i++)
            for (; s[i].cur < s[i].nseg; s[i].cur++) md5_blocks(st[i], s[i].p[s[i].cur], s[i].nb[s[i].cur]);
    }
}

/* update(jobs): see the top of the file. A job's data is one bytes-like object or a list of them, hashed in turn. */
static PyObject *update(PyObject *self, PyObject *jobs) {
    PyObject *seq = PySequence_Fast(jobs, "update() takes a list of (state, data) pairs");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAXJOBS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "update() takes at most %d jobs", MAXJOBS);
        return NULL;
    }
    PyObject *parts[MAXJOBS] = {NULL};   /* each job's data as a sequence (a one-item tuple for a single buffer) */
    Py_buffer sb[MAXJOBS];
    int states = 0;
    Py_buffer *db = NULL;          /* every segment's buffer, jobs one after the other */
    Py_ssize_t total = 0, held = 0;
    const uint8_t **pp = NULL;
    size_t *nn = NULL;
    uint32_t *st[MAXJOBS];
    stream_t sm[MAXJOBS];
    PyObject *ret = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *job = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *state, *data;
        if (!PyArg_ParseTuple(job, "OO", &state, &data)) goto done;
        parts[i] = (PyList_Check(data) || PyTuple_Check(data)) ? PySequence_Fast(data, "data") : PyTuple_Pack(1, data);
        if (!parts[i]) goto done;
        total += PySequence_Fast_GET_SIZE(parts[i]);
    }
    db = PyMem_Calloc(total ? total : 1, sizeof(Py_buffer));
    pp = PyMem_Calloc(total ? total : 1, sizeof(*pp));
    nn = PyMem_Calloc(total ? total : 1, sizeof(*nn));
    if (!db || !pp || !nn) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *state = PyTuple_GetItem(PySequence_Fast_GET_ITEM(seq, i), 0);
        if (!state) goto done;
        if (PyObject_GetBuffer(state, &sb[states], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        states++;
        if (sb[i].len != 16) {
            PyErr_SetString(PyExc_ValueError, "a state is 16 bytes and data whole 64-byte blocks");
            goto done;
        }
        st[i] = (uint32_t *)sb[i].buf; /* little-endian hosts only (x86-64, aarch64): the state's words */
        sm[i].p = pp + held;
        sm[i].nb = nn + held;
        sm[i].nseg = PySequence_Fast_GET_SIZE(parts[i]);
        sm[i].cur = 0;
        for (Py_ssize_t k = 0; k < sm[i].nseg; k++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts[i], k), &db[held], PyBUF_C_CONTIGUOUS) < 0)
                goto done;
            held++;
            if (db[held - 1].len % 64) {
                PyErr_SetString(PyExc_ValueError, "a state is 16 bytes and data whole 64-byte blocks");
                goto done;
            }
            sm[i].p[k] = (const uint8_t *)db[held - 1].buf;
            sm[i].nb[k] = (size_t)db[held - 1].len / 64;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    run((int)n, st, sm);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&db[k]);
    for (int i = 0; i < states; i++) PyBuffer_Release(&sb[i]);
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(parts[i]);
    PyMem_Free(db);
    PyMem_Free(pp);
    PyMem_Free(nn);
    Py_DECREF(seq);
    return ret;
}

static PyMethodDef methods[] = {
    {"update", update, METH_O,
     "update([(state, data), ...]): hash up to 16 streams' whole blocks, lanes at once (data: a buffer or a list)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_md5lanes", "MD5 of up to 16 streams at once (AVX2)",
                                    -1, methods};

PyMODINIT_FUNC PyInit__md5lanes(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) lanes = 16;
    for (int i = 0; i < 64; i++)
        for (int l = 0; l < 8; l++) K8[i][l] = K[i];
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "LANES", lanes) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
