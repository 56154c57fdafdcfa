/* Hit-rate curves in one pass: LRU stack distances and the prefix counts that choose
 * the sampling units of miniature simulations (sim/curves.py).
 *
 * Stack: Mattson's LRU stack over the blocks of a tree-mode replay. A request touches
 * its prefix chain deepest block first, so a parent is always above (more recent than)
 * its children and the top C entries of the stack are a prefix-closed set: a tree,
 * whose LRU victim is a leaf, as in the cache. A block's stack distance -- the number
 * of distinct blocks used since it was last used -- is counted by a Fenwick tree over
 * access times (one mark per block, at its last access), so each lookup costs
 * O(log accesses):
 *
 *     index: Map      chain key -> time of last access (1, 2, ...)
 *     fen[]           Fenwick tree over times: 1 where a block's last access is
 *     hist[d]         tokens whose block was at distance d when asked for (counted
 *                     requests only); a capacity of C blocks hits every d < C
 *
 * All distances of a request are taken before any of its blocks move, since the cache
 * matches the whole prompt before it inserts: block i's distance is then larger than
 * its parent's, so "d < C" holds for a prefix of the chain, the request's hit at C.
 *
 * Prefixes: about how many requests pass through each block (a count-min sketch; the
 * sampling unit of a request is its first block that few enough requests share), and
 * an estimate of the distinct blocks (those whose key falls in 1/64 of the key space),
 * to place default capacities before any replay.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define NONE (-1)
#define ESTIMATE_SHIFT 6 /* the distinct-block estimate counts 1 key in 64 */
#define SKETCH_ROWS 4
#define SKETCH_BITS 21 /* 2M counters a row: 32 MB */

#include "_simmap.h" /* mix64, chain, Map */

/* A block id as 64 bits: itself when it fits, else its Python hash mixed (an alias of
 * two ids then needs a 64-bit collision). */
static int block_id(PyObject *obj, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block ids must be ints, got %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return 0;
        PyErr_Clear();
        Py_hash_t h = PyObject_Hash(obj);
        if (h == -1 && PyErr_Occurred()) return 0;
        v = mix64((uint64_t)h) ^ 0xa5a5a5a5a5a5a5a5ULL;
    }
    *out = v;
    return 1;
}

/* The ids of a request as 64-bit ints in ``*out`` (grown as needed); -1 on error. */
static Py_ssize_t read_ids(PyObject *ids_obj, uint64_t **out, Py_ssize_t *cap) {
    PyObject *ids = PySequence_Fast(ids_obj, "ids must be a list or tuple of block ids (ints >= 0)");
    if (!ids) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    if (n > *cap) {
        uint64_t *bigger = PyMem_Realloc(*out, (size_t)n * sizeof(uint64_t));
        if (!bigger) {
            Py_DECREF(ids);
            PyErr_NoMemory();
            return -1;
        }
        *out = bigger;
        *cap = n;
    }
    PyObject **items = PySequence_Fast_ITEMS(ids);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!block_id(items[i], &(*out)[i])) {
            Py_DECREF(ids);
            return -1;
        }
    Py_DECREF(ids);
    return n;
}

/* ------------------------------------------------------------------ Stack */

typedef struct {
    PyObject_HEAD
    Map index;         /* chain key -> time of last access */
    int32_t *fen;      /* Fenwick tree over times 1..fen_size (a power of two) */
    int64_t fen_size;
    int64_t now;       /* the last time handed out */
    int64_t *hist;     /* tokens by stack distance */
    int64_t hist_len;
    int64_t cold;      /* counted tokens of blocks never seen before */
    uint64_t *ids, *keys;
    int64_t *dist;
    Py_ssize_t cap;
} Stack;

static void fen_add(Stack *s, int64_t i, int32_t v) {
    for (; i <= s->fen_size; i += i & -i) s->fen[i] += v;
}

static int64_t fen_sum(const Stack *s, int64_t i) { /* marks at times 1..i */
    int64_t total = 0;
    for (; i > 0; i -= i & -i) total += s->fen[i];
    return total;
}

/* Double the Fenwick tree: node 2N covers (0, 2N], the whole old tree's sum (node N). */
static int fen_grow(Stack *s) {
    int64_t n = s->fen_size;
    int32_t *bigger = PyMem_Realloc(s->fen, (size_t)(2 * n + 1) * sizeof(int32_t));
    if (!bigger) {
        PyErr_NoMemory();
        return -1;
    }
    memset(bigger + n + 1, 0, (size_t)n * sizeof(int32_t));
    bigger[2 * n] = bigger[n];
    s->fen = bigger;
    s->fen_size = 2 * n;
    return 0;
}

static int Stack_init(Stack *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
    if (map_init(&s->index, 1024) < 0) return -1;
    s->fen_size = 1024;
    s->fen = PyMem_Calloc((size_t)s->fen_size + 1, sizeof(int32_t));
    s->hist_len = 1024;
    s->hist = PyMem_Calloc((size_t)s->hist_len, sizeof(int64_t));
    if (!s->fen || !s->hist) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Stack_dealloc(Stack *s) {
    map_free(&s->index);
    PyMem_Free(s->fen);
    PyMem_Free(s->hist);
    PyMem_Free(s->ids);
    PyMem_Free(s->keys);
    PyMem_Free(s->dist);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int grow_scratch(Stack *s, Py_ssize_t n) {
    if (n <= s->cap) return 0;
    uint64_t *keys = PyMem_Realloc(s->keys, (size_t)n * sizeof(uint64_t));
    if (keys) s->keys = keys;
    int64_t *dist = PyMem_Realloc(s->dist, (size_t)n * sizeof(int64_t));
    if (dist) s->dist = dist;
    if (!keys || !dist) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* access(root_key, ids, unit, length, counted) -> blocks seen before (any distance).
 *
 * Block i weighs ``min((i+1)*unit, length) - min(i*unit, length)`` tokens: a partial
 * last block counts its own tokens, as ``hit_tokens`` does. */
static PyObject *Stack_access(Stack *s, PyObject *args) {
    unsigned long long root;
    PyObject *ids_obj;
    long long unit, length;
    int counted;
    if (!PyArg_ParseTuple(args, "KOLLp", &root, &ids_obj, &unit, &length, &counted)) return NULL;
    Py_ssize_t cap = s->cap;
    Py_ssize_t n = read_ids(ids_obj, &s->ids, &cap);
    if (n < 0 || grow_scratch(s, cap) < 0) return NULL;
    s->cap = cap;
    int64_t live = (int64_t)s->index.count, seen = 0;
    uint64_t key = root;
    for (Py_ssize_t i = 0; i < n; i++) { /* every distance before anything moves */
        s->keys[i] = key = chain(key, s->ids[i]);
        int64_t *t = map_find(&s->index, key);
        s->dist[i] = t ? live - fen_sum(s, *t) : NONE;
        seen += t != NULL;
    }
    if (counted)
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t lo = i * unit < length ? i * unit : length;
            int64_t hi = (i + 1) * unit < length ? (i + 1) * unit : length;
            int64_t d = s->dist[i];
            if (d == NONE) {
                s->cold += hi - lo;
                continue;
            }
            if (d >= s->hist_len) {
                int64_t len = s->hist_len;
                while (len <= d) len *= 2;
                int64_t *bigger = PyMem_Realloc(s->hist, (size_t)len * sizeof(int64_t));
                if (!bigger) return PyErr_NoMemory();
                memset(bigger + s->hist_len, 0, (size_t)(len - s->hist_len) * sizeof(int64_t));
                s->hist = bigger;
                s->hist_len = len;
            }
            s->hist[d] += hi - lo;
        }
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* deepest first: parents end above */
        int64_t *t = map_slot(&s->index, s->keys[i], 0);
        if (!t) return NULL;
        if (*t) fen_add(s, *t, -1);
        if (s->now + 1 > s->fen_size && fen_grow(s) < 0) return NULL;
        *t = ++s->now;
        fen_add(s, s->now, 1);
    }
    return PyLong_FromSsize_t(seen);
}

/* hits(capacities) -> counted tokens hit at each capacity (in blocks; None: unlimited). */
static PyObject *Stack_hits(Stack *s, PyObject *caps_obj) {
    PyObject *caps = PySequence_Fast(caps_obj, "capacities must be a sequence of ints or None");
    if (!caps) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(caps);
    PyObject *out = PyList_New(n);
    if (!out) goto fail;
    int64_t *prefix = PyMem_Malloc((size_t)(s->hist_len + 1) * sizeof(int64_t));
    if (!prefix) {
        PyErr_NoMemory();
        goto fail;
    }
    prefix[0] = 0;
    for (int64_t d = 0; d < s->hist_len; d++) prefix[d + 1] = prefix[d] + s->hist[d];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PySequence_Fast_GET_ITEM(caps, i);
        int64_t blocks = s->hist_len;
        if (c != Py_None) {
            long long v = PyLong_AsLongLong(c);
            if (v == -1 && PyErr_Occurred()) {
                PyMem_Free(prefix);
                goto fail;
            }
            if (v < 0) v = 0;
            if (v < blocks) blocks = v;
        }
        PyObject *hit = PyLong_FromLongLong(prefix[blocks]);
        if (!hit) {
            PyMem_Free(prefix);
            goto fail;
        }
        PyList_SET_ITEM(out, i, hit);
    }
    PyMem_Free(prefix);
    Py_DECREF(caps);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(caps);
    return NULL;
}

static PyObject *Stack_get_blocks(Stack *s, void *c) { return PyLong_FromSize_t(s->index.count); }
static PyObject *Stack_get_lookups(Stack *s, void *c) { return PyLong_FromLongLong(s->now); }
static PyObject *Stack_get_cold(Stack *s, void *c) { return PyLong_FromLongLong(s->cold); }

static PyMethodDef Stack_methods[] = {
    {"access", (PyCFunction)Stack_access, METH_VARARGS,
     "access(root_key, ids, unit, length, counted) -> blocks of the chain seen before"},
    {"hits", (PyCFunction)Stack_hits, METH_O, "hits(capacities in blocks, None: unlimited) -> counted hit tokens"},
    {NULL},
};

static PyGetSetDef Stack_getset[] = {
    {"blocks", (getter)Stack_get_blocks, NULL, "distinct blocks seen", NULL},
    {"lookups", (getter)Stack_get_lookups, NULL, "block lookups so far", NULL},
    {"cold", (getter)Stack_get_cold, NULL, "counted tokens of first-seen blocks (a miss at any capacity)", NULL},
    {NULL},
};

static PyTypeObject StackType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "prefixcache.sim.native._curves.Stack",
    .tp_basicsize = sizeof(Stack),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Stack(): LRU stack distances of a tree-mode replay's blocks, by token.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Stack_init,
    .tp_dealloc = (destructor)Stack_dealloc,
    .tp_methods = Stack_methods,
    .tp_getset = Stack_getset,
};

/* ------------------------------------------------------------------ Prefixes */

/* A count-min sketch (conservative update) of the requests through each block: it only
 * ever overestimates, which moves a request's unit deeper, never breaks a chain. */
typedef struct {
    PyObject_HEAD
    uint32_t *rows; /* SKETCH_ROWS x SKETCH_WIDTH */
    Map seen;       /* the keys in 1/64 of key space: the distinct-block estimate */
    uint64_t *ids;
    Py_ssize_t cap;
} Prefixes;

static int Prefixes_init(Prefixes *p, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
    p->rows = PyMem_Calloc((size_t)SKETCH_ROWS << SKETCH_BITS, sizeof(uint32_t));
    if (!p->rows) {
        PyErr_NoMemory();
        return -1;
    }
    return map_init(&p->seen, 1024);
}

static void Prefixes_dealloc(Prefixes *p) {
    PyMem_Free(p->rows);
    map_free(&p->seen);
    PyMem_Free(p->ids);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static inline uint32_t *cell(Prefixes *p, uint64_t key, int row) {
    uint64_t h = mix64(key + (uint64_t)row * 0x9e3779b97f4a7c15ULL);
    return &p->rows[((size_t)row << SKETCH_BITS) + (h >> (64 - SKETCH_BITS))];
}

static uint32_t estimate(Prefixes *p, uint64_t key) {
    uint32_t least = UINT32_MAX;
    for (int r = 0; r < SKETCH_ROWS; r++) {
        uint32_t c = *cell(p, key, r);
        if (c < least) least = c;
    }
    return least;
}

/* The keys of blocks ``start`` up to ``start + CHUNK`` (at most ``n``) of ``p->ids``, the
 * chain going on from ``*key``, into ``keys`` (their number returned), their cells
 * fetched: a chain's keys are known before any count is read, so the cache misses of
 * a chunk are taken together, not one after another. */
#define CHUNK 16
static Py_ssize_t chunk_keys(Prefixes *p, uint64_t *key, Py_ssize_t start, Py_ssize_t n, uint64_t *keys) {
    Py_ssize_t m = n - start < CHUNK ? n - start : CHUNK;
    for (Py_ssize_t i = 0; i < m; i++) {
        keys[i] = *key = chain(*key, p->ids[start + i]);
        for (int r = 0; r < SKETCH_ROWS; r++) __builtin_prefetch(cell(p, keys[i], r));
    }
    return m;
}

/* add(root_key, ids): one request through its chain. */
static PyObject *Prefixes_add(Prefixes *p, PyObject *args) {
    unsigned long long root;
    PyObject *ids_obj;
    if (!PyArg_ParseTuple(args, "KO", &root, &ids_obj)) return NULL;
    Py_ssize_t n = read_ids(ids_obj, &p->ids, &p->cap);
    if (n < 0) return NULL;
    uint64_t key = root, keys[CHUNK];
    for (Py_ssize_t start = 0; start < n; start += CHUNK) {
        Py_ssize_t m = chunk_keys(p, &key, start, n, keys);
        for (Py_ssize_t i = 0; i < m; i++) {
            uint32_t least = estimate(p, keys[i]);
            if (least < UINT32_MAX)
                for (int r = 0; r < SKETCH_ROWS; r++) { /* conservative update */
                    uint32_t *c = cell(p, keys[i], r);
                    if (*c == least) *c = least + 1;
                }
            if (mix64(keys[i]) >> (64 - ESTIMATE_SHIFT) == 0 && !map_slot(&p->seen, keys[i], 0)) return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* unit(root_key, ids, most) -> (key, depth) of the first block that at most ``most``
 * requests pass through (the last block when every one is busier); (0, 0) for no ids. */
static PyObject *Prefixes_unit(Prefixes *p, PyObject *args) {
    unsigned long long root;
    PyObject *ids_obj;
    long long most;
    if (!PyArg_ParseTuple(args, "KOL", &root, &ids_obj, &most)) return NULL;
    Py_ssize_t n = read_ids(ids_obj, &p->ids, &p->cap);
    if (n < 0) return NULL;
    uint64_t key = 0, k = root, keys[CHUNK];
    Py_ssize_t depth = 0;
    for (Py_ssize_t start = 0; start < n && depth == start; start += CHUNK) {
        Py_ssize_t m = chunk_keys(p, &k, start, n, keys);
        for (Py_ssize_t i = 0; i < m; i++, depth++) {
            key = keys[i];
            if ((long long)estimate(p, key) <= most) break;
        }
    }
    if (depth == n && n) depth--;
    return Py_BuildValue("Kn", (unsigned long long)key, depth);
}

/* shared(most) -> about how many distinct blocks more than ``most`` requests pass through. */
static PyObject *Prefixes_shared(Prefixes *p, PyObject *arg) {
    long long most = PyLong_AsLongLong(arg);
    if (most == -1 && PyErr_Occurred()) return NULL;
    long long n = 0;
    for (size_t i = 0; i <= p->seen.mask; i++)
        if (p->seen.keys[i] && (long long)estimate(p, p->seen.keys[i]) > most) n++;
    return PyLong_FromLongLong(n << ESTIMATE_SHIFT);
}

static PyObject *Prefixes_get_blocks(Prefixes *p, void *c) {
    return PyLong_FromLongLong((long long)p->seen.count << ESTIMATE_SHIFT);
}

static PyMethodDef Prefixes_methods[] = {
    {"add", (PyCFunction)Prefixes_add, METH_VARARGS, "add(root_key, ids): count one request's chain"},
    {"shared", (PyCFunction)Prefixes_shared, METH_O, "shared(most) -> distinct blocks above the units (estimated)"},
    {"unit", (PyCFunction)Prefixes_unit, METH_VARARGS,
     "unit(root_key, ids, most) -> key of the first block at most `most` requests share"},
    {NULL},
};

static PyGetSetDef Prefixes_getset[] = {
    {"blocks", (getter)Prefixes_get_blocks, NULL, "distinct blocks (estimated from 1 key in 64)", NULL},
    {NULL},
};

static PyTypeObject PrefixesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "prefixcache.sim.native._curves.Prefixes",
    .tp_basicsize = sizeof(Prefixes),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Prefixes(): about how many requests pass through each block of a trace's tree.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Prefixes_init,
    .tp_dealloc = (destructor)Prefixes_dealloc,
    .tp_methods = Prefixes_methods,
    .tp_getset = Prefixes_getset,
};

static struct PyModuleDef curves_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefixcache.sim.native._curves",
    .m_doc = "Compiled parts of hit-rate curves (see _curves.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__curves(void) {
    if (PyType_Ready(&StackType) < 0 || PyType_Ready(&PrefixesType) < 0) return NULL;
    PyObject *m = PyModule_Create(&curves_module);
    if (!m) return NULL;
    Py_INCREF(&StackType);
    if (PyModule_AddObject(m, "Stack", (PyObject *)&StackType) < 0) {
        Py_DECREF(&StackType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PrefixesType);
    if (PyModule_AddObject(m, "Prefixes", (PyObject *)&PrefixesType) < 0) {
        Py_DECREF(&PrefixesType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
