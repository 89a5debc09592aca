/* The id rule's per-row work (state.py) in one pass, without the GIL: hash each message id, find its
 * table line, read its marks.
 *
 * Why native: in numpy the id check is ~8 whole-array calls, each walking the batch again after the
 * append's serialise/encrypt/write has flushed the caches (measured in place: ~180 us per 1,000-row
 * append, against ~300 us for all the rest of it). Here each id is touched once and its table line
 * is prefetched a block ahead. state.py keeps the numpy path as the reference and the fallback (no
 * C compiler); tests check that both give the same hashes, slots and answers.
 *
 * probe(offsets, data, array_offset, n, keys, table, log2_slots, floor, out_hashes, out_slots)
 *   offsets, data: an Arrow string/binary column's int32 offsets and data buffers
 *   keys: the 17 uint64 hash keys (16 word keys, then the length key) of state.py (_KEYS)
 *   table: the byte table of RecentIds; floor: the lowest mark that counts as remembered
 *   out_hashes: n uint64 (written); out_slots: 4 x n int64, row-major as RecentIds.slots returns
 *   -> (maybe_any, distinct): might any id be remembered, are the n hashes all different;
 *      None if an id is longer than 128 bytes (state.py hashes those with BLAKE2b: use its path), or
 *      if another thread changed the offsets while they were read (use the numpy path too).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define VECTOR_LEN 128
#define LINE_BITS 6
#define BLOCK 64 /* ids whose table lines are prefetched before their marks are read */

static const uint64_t POSITION_KEYS[4] = {0xC4CEB9FE1A85EC53ULL, 0xFF51AFD7ED558CCDULL, 0x9E3779B97F4A7C15ULL,
                                          0xD6E8FEB86659FD93ULL};

static inline uint64_t load_le64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

/* Offsets are read with memcpy: an Arrow buffer made from Python bytes need not be 4-byte aligned. */
static inline int32_t load_i32(const unsigned char *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Multilinear: sum of the zero-padded little-endian 8-byte words times their keys, plus the length
 * times the length key, mod 2^64 (state.id_hashes, the same numbers). */
static inline uint64_t hash_id(const unsigned char *p, int32_t len, const uint64_t *keys) {
    uint64_t h = (uint64_t)len * keys[VECTOR_LEN / 8];
    int32_t i = 0, w = 0;
    for (; i + 8 <= len; i += 8, w++) h += load_le64(p + i) * keys[w];
    if (i < len) {
        unsigned char tail[8] = {0};
        memcpy(tail, p + i, (size_t)(len - i));
        h += load_le64(tail) * keys[w];
    }
    return h;
}

/* Are the n hashes all different? Open addressing over a table of 2..4 x n positions. */
static int all_distinct(const uint64_t *h, Py_ssize_t n, int *failed) {
    if (n < 2) return 1;
    size_t size = 1;
    while (size < (size_t)n * 2) size <<= 1;
    uint32_t *at = PyMem_RawCalloc(size, sizeof(uint32_t)); /* row + 1, 0 for empty */
    if (at == NULL) {
        *failed = 1;
        return 0;
    }
    int distinct = 1;
    size_t mask = size - 1;
    for (Py_ssize_t r = 0; r < n && distinct; r++) {
        size_t i = (size_t)(h[r] >> 32) & mask;
        while (at[i]) {
            if (h[at[i] - 1] == h[r]) {
                distinct = 0;
                break;
            }
            i = (i + 1) & mask;
        }
        at[i] = (uint32_t)(r + 1);
    }
    PyMem_RawFree(at);
    return distinct;
}

/* Offsets [array_offset, array_offset + n] must lie in the offsets buffer and point into data
 * (0 <= n < UINT32_MAX here: no sum below overflows). */
static int check_offsets(const Py_buffer *offsets_b, const Py_buffer *data_b, Py_ssize_t array_offset, Py_ssize_t n) {
    if (array_offset < 0 || array_offset > offsets_b->len / (Py_ssize_t)sizeof(int32_t) - 1 - n) {
        PyErr_SetString(PyExc_ValueError, "the offsets buffer is shorter than the rows given");
        return 0;
    }
    const unsigned char *offsets = (const unsigned char *)offsets_b->buf + array_offset * 4;
    for (Py_ssize_t r = 0; r < n; r++) {
        int32_t start = load_i32(offsets + 4 * r), end = load_i32(offsets + 4 * (r + 1));
        if (start < 0 || end < start || end > data_b->len) {
            PyErr_SetString(PyExc_ValueError, "a value's offsets fall outside its data buffer");
            return 0;
        }
    }
    return 1;
}

static PyObject *probe(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer offsets_b, data_b, keys_b, table_b, hashes_b, slots_b;
    Py_ssize_t array_offset, n;
    int log2_slots, floor_mark;
    if (!PyArg_ParseTuple(args, "y*y*nny*y*iiw*w*", &offsets_b, &data_b, &array_offset, &n, &keys_b, &table_b,
                          &log2_slots, &floor_mark, &hashes_b, &slots_b))
        return NULL;
    PyObject *result = NULL;
    const unsigned char *offsets = (const unsigned char *)offsets_b.buf;
    const unsigned char *data = (const unsigned char *)data_b.buf;
    const Py_ssize_t data_len = data_b.len;
    uint64_t keys[VECTOR_LEN / 8 + 1];
    const uint8_t *table = (const uint8_t *)table_b.buf;
    uint64_t *hashes = (uint64_t *)hashes_b.buf;
    int64_t *slots = (int64_t *)slots_b.buf;
    if (n < 0 || n >= UINT32_MAX || keys_b.len < (Py_ssize_t)sizeof(keys) ||
        hashes_b.len / (Py_ssize_t)sizeof(uint64_t) < n || slots_b.len / (4 * (Py_ssize_t)sizeof(int64_t)) < n ||
        (uintptr_t)hashes_b.buf % sizeof(uint64_t) || (uintptr_t)slots_b.buf % sizeof(int64_t) ||
        log2_slots < 1 || log2_slots > 40 || table_b.len < ((Py_ssize_t)1 << log2_slots)) {
        PyErr_SetString(PyExc_ValueError, "probe: buffers do not match the sizes given");
        goto done;
    }
    memcpy(keys, keys_b.buf, sizeof(keys));
    if (!check_offsets(&offsets_b, &data_b, array_offset, n)) goto done;
    offsets += array_offset * 4;
    int too_long = 0;
    for (Py_ssize_t r = 0; r < n; r++)
        if (load_i32(offsets + 4 * (r + 1)) - load_i32(offsets + 4 * r) > VECTOR_LEN) too_long = 1;
    if (too_long) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    int position_bits = log2_slots < LINE_BITS ? log2_slots : LINE_BITS;
    int line_bits = log2_slots - position_bits;
    uint64_t slot_mask = ((uint64_t)1 << log2_slots) - 1;
    int maybe_any = 0, distinct = 1, failed = 0, changed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t start = 0; start < n && !changed; start += BLOCK) {
        Py_ssize_t stop = start + BLOCK < n ? start + BLOCK : n;
        for (Py_ssize_t r = start; r < stop; r++) {
            /* Checked again as read: without the GIL another thread may be writing the offsets (a
             * buffer shared with a bytearray or numpy array), and a changed one must not be followed. */
            int32_t first = load_i32(offsets + 4 * r), end = load_i32(offsets + 4 * (r + 1));
            if (first < 0 || end < first || end > data_len || end - first > VECTOR_LEN) {
                changed = 1;
                break;
            }
            uint64_t h = hash_id(data + first, end - first, keys);
            uint64_t line = line_bits > 0 ? (h >> (64 - line_bits)) << position_bits : 0;
            hashes[r] = h;
            for (int k = 0; k < 4; k++)
                slots[k * n + r] = (int64_t)(((h * POSITION_KEYS[k]) >> (64 - position_bits)) + line);
            __builtin_prefetch(table + line);
        }
        if (!maybe_any && !changed) {
            for (Py_ssize_t r = start; r < stop; r++) { /* masked: out_slots is the caller's memory too */
                uint8_t lowest = table[(uint64_t)slots[r] & slot_mask];
                for (int k = 1; k < 4; k++) {
                    uint8_t m = table[(uint64_t)slots[k * n + r] & slot_mask];
                    if (m < lowest) lowest = m;
                }
                if (lowest >= floor_mark) {
                    maybe_any = 1;
                    break;
                }
            }
        }
    }
    if (!changed) distinct = all_distinct(hashes, n, &failed);
    Py_END_ALLOW_THREADS
    if (changed) { /* the numpy path answers (its own reads are bounds-checked) */
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_BuildValue("(OO)", maybe_any ? Py_True : Py_False, distinct ? Py_True : Py_False);
done:
    PyBuffer_Release(&offsets_b);
    PyBuffer_Release(&data_b);
    PyBuffer_Release(&keys_b);
    PyBuffer_Release(&table_b);
    PyBuffer_Release(&hashes_b);
    PyBuffer_Release(&slots_b);
    return result;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS, "Hash ids, compute their table slots, and check them against the table."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_idrule", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__idrule(void) { return PyModule_Create(&module); }
