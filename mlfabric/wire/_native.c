/*
 * mlfabric.wire._native: the data plane's per-byte loops in C (DESIGN §9).
 *
 * Every payload byte a daemon or a training process touches goes through one of these:
 *
 *   crc32(data, value=0) -> int
 *       zlib's CRC-32 (the IEEE polynomial, reflected), with PCLMULQDQ folding where the
 *       CPU has it (Gopal et al., "Fast CRC Computation for Generic Polynomials Using
 *       PCLMULQDQ Instruction", Intel, 2009; the constants are those of the reflected
 *       polynomial 0xEDB88320), else a slicing-by-8 table.
 *
 *   check(data, start, end, value, layout) -> (crc, bad)
 *       The CRC-32 of data[start:end] continuing from `value`, and the NaN/inf test of the
 *       float tensors overlapping that range, fused: the range goes through in 64 KiB pieces,
 *       each checksummed and then tested while it is still in the core's cache. `layout` is
 *       pack_layout()'s bytes: per tensor (offset, nbytes, kind) as three little-endian
 *       uint64, kind 0 none, 1 float32, 2 float64, 3 float16, 4 bfloat16. `bad` is the index
 *       of the first tensor found holding a NaN or an infinity in the range, or -1.
 *
 *   copy_crc(dst, src, value=0) -> int
 *       Copy src into the start of dst and return the CRC-32 of the bytes copied (continuing
 *       from `value`), in 16 KiB pieces: each piece is checksummed, then copied from the
 *       cache with non-temporal stores (a training process filling its push's memfd: 0.145
 *       CPU s/GB at 64 MiB, against 0.23 copying then checksumming each piece, and 0.2 for
 *       memcpy then CRC-32 over all of it).
 *
 * All three release the GIL while they run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define MLF_X86 1
#endif

#define PIECE_BYTES (64 * 1024)
#define COPY_PIECE_BYTES (16 * 1024) /* a piece the copy reads from L1 after its CRC */

/* ------------------------------------------------------------------ CRC-32: tables */

static uint32_t crc_table[8][256];

static void crc_init_tables(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
}

/* The reflected CRC without the pre- and post-inversion (crc32_le in Linux). */
static uint32_t crc_le_table(uint32_t crc, const uint8_t *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
              crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^
              crc_table[2][(w >> 40) & 0xff] ^ crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* ------------------------------------------------------------------ CRC-32: PCLMULQDQ folding */

#ifdef MLF_X86
static int have_pclmul = 0;

/* 16-byte aligned p, len a multiple of 16 and at least 64. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_le_pclmul_16(uint32_t crc, const uint8_t *p,
                                                                          size_t len) {
    const __m128i r2r1 = _mm_set_epi64x(0x00000001c6e41596LL, 0x0000000154442bd4LL);
    const __m128i r4r3 = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
    const __m128i r5 = _mm_set_epi64x(0, 0x0000000163cd6124LL);
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    const __m128i poly = _mm_set_epi64x(0x00000001F7011641LL, 0x00000001DB710641LL);
    __m128i x1 = _mm_load_si128((const __m128i *)p);
    __m128i x2 = _mm_load_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_load_si128((const __m128i *)(p + 32));
    __m128i x4 = _mm_load_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    p += 64;
    len -= 64;
    while (len >= 64) {
        __m128i y1 = _mm_clmulepi64_si128(x1, r2r1, 0x11);
        __m128i y2 = _mm_clmulepi64_si128(x2, r2r1, 0x11);
        __m128i y3 = _mm_clmulepi64_si128(x3, r2r1, 0x11);
        __m128i y4 = _mm_clmulepi64_si128(x4, r2r1, 0x11);
        x1 = _mm_clmulepi64_si128(x1, r2r1, 0x00);
        x2 = _mm_clmulepi64_si128(x2, r2r1, 0x00);
        x3 = _mm_clmulepi64_si128(x3, r2r1, 0x00);
        x4 = _mm_clmulepi64_si128(x4, r2r1, 0x00);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, y1), _mm_load_si128((const __m128i *)p));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, y2), _mm_load_si128((const __m128i *)(p + 16)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, y3), _mm_load_si128((const __m128i *)(p + 32)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, y4), _mm_load_si128((const __m128i *)(p + 48)));
        p += 64;
        len -= 64;
    }
    /* fold the four lanes into one */
    __m128i y;
    y = _mm_clmulepi64_si128(x1, r4r3, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, r4r3, 0x00), y), x2);
    y = _mm_clmulepi64_si128(x1, r4r3, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, r4r3, 0x00), y), x3);
    y = _mm_clmulepi64_si128(x1, r4r3, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, r4r3, 0x00), y), x4);
    while (len >= 16) {
        y = _mm_clmulepi64_si128(x1, r4r3, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, r4r3, 0x00), y),
                           _mm_load_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    /* 128 -> 64 bits (appends 32 zero bits) */
    y = _mm_clmulepi64_si128(r4r3, x1, 0x01);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), y);
    /* 64 -> 32 bits */
    __m128i x2f = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_clmulepi64_si128(x1, r5, 0x00);
    x1 = _mm_xor_si128(x1, x2f);
    /* Barrett reduction */
    __m128i t = x1;
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_clmulepi64_si128(x1, poly, 0x10);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_clmulepi64_si128(x1, poly, 0x00);
    x1 = _mm_xor_si128(x1, t);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

static uint32_t crc_le(uint32_t crc, const uint8_t *p, size_t len) {
#ifdef MLF_X86
    if (have_pclmul && len >= 64 + 15) {
        size_t pre = (16 - ((uintptr_t)p & 15)) & 15;
        if (pre) {
            crc = crc_le_table(crc, p, pre);
            p += pre;
            len -= pre;
        }
        size_t body = len & ~(size_t)15;
        crc = crc_le_pclmul_16(crc, p, body);
        p += body;
        len -= body;
    }
#endif
    return len ? crc_le_table(crc, p, len) : crc;
}

/* zlib's crc32(): pre- and post-inverted. */
static uint32_t crc32_zlib(uint32_t value, const uint8_t *p, size_t len) {
    return ~crc_le(~value, p, len);
}

/* ------------------------------------------------------------------ NaN / inf */

enum { KIND_NONE = 0, KIND_F32 = 1, KIND_F64 = 2, KIND_F16 = 3, KIND_BF16 = 4 };

/* Whether any element of the (element-aligned) range is NaN or infinite: its exponent bits
 * are all ones. Plain loops over the raw words: the compiler vectorises them. */
static int nonfinite_u32(const uint8_t *p, size_t n, uint32_t mask) {
    uint32_t hit = 0;
    const uint8_t *end = p + n;
    for (; p + 4 <= end; p += 4) {
        uint32_t w;
        memcpy(&w, p, 4);
        hit |= (uint32_t)((w & mask) == mask);
    }
    return hit != 0;
}

static int nonfinite_u64(const uint8_t *p, size_t n, uint64_t mask) {
    uint64_t hit = 0;
    const uint8_t *end = p + n;
    for (; p + 8 <= end; p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        hit |= (uint64_t)((w & mask) == mask);
    }
    return hit != 0;
}

static int nonfinite_u16(const uint8_t *p, size_t n, uint16_t mask) {
    uint16_t hit = 0;
    const uint8_t *end = p + n;
    for (; p + 2 <= end; p += 2) {
        uint16_t w;
        memcpy(&w, p, 2);
        hit |= (uint16_t)((w & mask) == mask);
    }
    return hit != 0;
}

static int nonfinite(int kind, const uint8_t *p, size_t n) {
    switch (kind) {
    case KIND_F32: return nonfinite_u32(p, n, 0x7F800000u);
    case KIND_F64: return nonfinite_u64(p, n, 0x7FF0000000000000ull);
    case KIND_F16: return nonfinite_u16(p, n, 0x7C00u);
    case KIND_BF16: return nonfinite_u16(p, n, 0x7F80u);
    default: return 0;
    }
}

static size_t kind_size(int kind) {
    switch (kind) {
    case KIND_F32: return 4;
    case KIND_F64: return 8;
    case KIND_F16:
    case KIND_BF16: return 2;
    default: return 1;
    }
}

typedef struct {
    uint64_t offset, nbytes, kind;
} segment_t;

/* ------------------------------------------------------------------ Python functions */

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    PyObject *data;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "O|k:crc32", &data, &value)) return NULL;
    Py_buffer view;
    if (get_buffer(data, &view, 0, "data") < 0) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32_zlib((uint32_t)value, (const uint8_t *)view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_check(PyObject *self, PyObject *args) {
    PyObject *data, *layout;
    Py_ssize_t start, end;
    unsigned long value;
    if (!PyArg_ParseTuple(args, "OnnkO:check", &data, &start, &end, &value, &layout)) return NULL;
    Py_buffer view, lay;
    if (get_buffer(data, &view, 0, "data") < 0) return NULL;
    if (get_buffer(layout, &lay, 0, "layout") < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (start < 0 || end < start || end > view.len || lay.len % (Py_ssize_t)sizeof(segment_t)) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&lay);
        PyErr_Format(PyExc_ValueError, "check: range [%zd, %zd) of a %zd-byte buffer, or a layout of %zd bytes",
                     start, end, view.len, lay.len);
        return NULL;
    }
    const uint8_t *base = (const uint8_t *)view.buf;
    const segment_t *segs = (const segment_t *)lay.buf;
    size_t nsegs = (size_t)lay.len / sizeof(segment_t);
    uint32_t crc = ~(uint32_t)value;
    long bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (size_t pos = (size_t)start; pos < (size_t)end;) {
        size_t stop = pos + PIECE_BYTES < (size_t)end ? pos + PIECE_BYTES : (size_t)end;
        crc = crc_le(crc, base + pos, stop - pos);
        for (size_t i = 0; bad < 0 && i < nsegs; i++) {
            const segment_t *s = &segs[i];
            if (s->kind == KIND_NONE || s->offset >= stop || s->offset + s->nbytes <= pos) continue;
            /* the overlap, widened to whole elements (an element split across pieces is tested
             * whole by the piece where it ends; bytes before `start` were final already) */
            size_t size = kind_size((int)s->kind);
            size_t lo = pos > s->offset ? pos : (size_t)s->offset;
            size_t hi = stop < s->offset + s->nbytes ? stop : (size_t)(s->offset + s->nbytes);
            lo -= (lo - s->offset) % size;
            hi -= (hi - s->offset) % size;
            if (hi > lo && nonfinite((int)s->kind, base + lo, hi - lo)) bad = (long)i;
        }
        pos = stop;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyBuffer_Release(&lay);
    return Py_BuildValue("(kl)", (unsigned long)~crc, bad);
}

/* Copy n bytes from src (in cache) to dst with non-temporal stores where dst is 16-byte
 * aligned: the destination's lines are written without being read first (no read for
 * ownership), as memcpy does for large copies. The caller fences. */
static void copy_out(uint8_t *dst, const uint8_t *src, size_t n) {
#ifdef MLF_X86
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (n < head + 64) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), e = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), e);
    }
#endif
    memcpy(dst, src, n);
}

static PyObject *py_copy_crc(PyObject *self, PyObject *args) {
    PyObject *dst, *src;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "OO|k:copy_crc", &dst, &src, &value)) return NULL;
    Py_buffer d, s;
    if (get_buffer(dst, &d, 1, "dst") < 0) return NULL;
    if (get_buffer(src, &s, 0, "src") < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (s.len > d.len) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&s);
        PyErr_Format(PyExc_ValueError, "copy_crc: %zd bytes do not fit a %zd-byte buffer", s.len, d.len);
        return NULL;
    }
    uint32_t crc = ~(uint32_t)value;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t pos = 0; pos < s.len; pos += COPY_PIECE_BYTES) {
        size_t n = (size_t)(s.len - pos < COPY_PIECE_BYTES ? s.len - pos : COPY_PIECE_BYTES);
        const uint8_t *from = (const uint8_t *)s.buf + pos;
        crc = crc_le(crc, from, n); /* the source piece is in cache now: */
        copy_out(((uint8_t *)d.buf) + pos, from, n);
    }
#ifdef MLF_X86
    _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return PyLong_FromUnsignedLong(~crc);
}

static PyObject *py_implementation(PyObject *self, PyObject *noargs) {
#ifdef MLF_X86
    if (have_pclmul) return PyUnicode_FromString("pclmul");
#endif
    return PyUnicode_FromString("table");
}

static PyMethodDef methods[] = {
    {"crc32", py_crc32, METH_VARARGS, "crc32(data, value=0) -> int: zlib's CRC-32 of data."},
    {"check", py_check, METH_VARARGS,
     "check(data, start, end, value, layout) -> (crc, bad): CRC-32 of data[start:end] from value, "
     "fused with the NaN/inf test of the tensors in layout (index of the first bad one, or -1)."},
    {"copy_crc", py_copy_crc, METH_VARARGS,
     "copy_crc(dst, src, value=0) -> int: copy src into dst, return the CRC-32 of the bytes copied."},
    {"implementation", py_implementation, METH_NOARGS, "implementation() -> 'pclmul' or 'table'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mlfabric.wire._native",
                                    "The data plane's per-byte loops in C.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init_tables();
#ifdef MLF_X86
    unsigned int a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) have_pclmul = (c & bit_PCLMUL) && (c & bit_SSE4_1);
#endif
    return PyModule_Create(&module);
}
