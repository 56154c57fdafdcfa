/* The offline optimum for the trace simulator: Belady with bypass on the flat block
 * sequence, streaming.
 *
 * sim/optimum.py's ``belady`` is the reference and the oracle of tests/sim/test_optimum.py;
 * this file computes exactly its answer (the same hit or miss at every access, so the same
 * hit tokens and block hits) in memory that grows with the distinct blocks of a trace,
 * not with its accesses, in three passes over temporary files:
 *
 *     add() per request     (context, id) -> dense block number (the id map);
 *       pass 1                the numbers appended to  blocks  (u32 per access), the
 *                             request's (blocks, input length) to  requests  (2 x i64)
 *     first solve()         blocks  read backwards in chunks; each access's next use
 *       pass 2                (the position of its block's next access, or NEVER) written
 *                             to  next  (u32 per access); needs last[block] only
 *     solve(capacities)     blocks,  next  and  requests  read forward in chunks, each
 *       pass 3                chunk fed to one Belady state per capacity in turn
 *
 * Passes 1 and 2 do not depend on the capacity: a capacity sweep pays them once. The files
 * are unlinked temporaries in the directory given; the id map is freed before pass 2.
 *
 * The id map: a node per distinct id, appended at its block number (its low word, context
 * and flags: 16 bytes), chained from one of a power of two of buckets (4 bytes each).
 * NOTE: not open addressing, whose table would be rebuilt in fresh memory at every
 * growth: here only the bucket heads are, and the node array grows in place. An id is
 * exact whatever its size, as a key of the reference's dict is: from 2**64 up its two
 * high words are kept by block number in a side array (WIDE: token traces' 128-bit prefix
 * hashes), and one outside [0, 2**192) is numbered by a Python dict (OTHER), as a
 * pre-hashed trace may hold any integer.
 *
 * One Belady state: ``where[block]``, the block's slot in a max-heap of the resident
 * blocks keyed by next use, or NOT_RESIDENT. A hit moves its block's key to the block's
 * next use (later than the present one: up the heap) or, without one, drops the block,
 * as the reference does; a miss with a next use is admitted when there is room, else it
 * replaces the top of the heap when that is used later, else it bypasses. Next uses are
 * positions, so no two resident keys tie and the victim is the reference's. A capacity
 * of at least the number of distinct blocks never evicts: a resident flag suffices.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "_simmap.h" /* mix64 */

#define CHUNK ((size_t)1 << 18) /* the default chunk: accesses (and request records, and
                                  segments of pass 3) per buffer, read or write */
#define AHEAD 16 /* ids whose map slots are being fetched at once */
#define NEVER UINT32_MAX /* the next use of a block used no more */
#define MAX_ACCESSES (UINT32_MAX - 1)
#define NOT_RESIDENT UINT32_MAX /* where[] of a block not in the cache */
#define MAX_BLOCKS (UINT32_MAX - 1)
#define OTHER 0x80000000u /* key flag: an id outside [0, 2**192), numbered by a dict */
#define WIDE 0x40000000u  /* key flag: an id from 2**64 up, its high words kept apart */
#define MAX_CONTEXT (WIDE - 1)

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

static PyObject *SIXTY_FOUR; /* the int 64, for shifts */


/* A block access's position in the sequence: its next use, a heap's key. */
typedef uint32_t pos_t;

/* ------------------------------------------------------------------ files */

/* Each returns 0 or an errno value; a file shorter than a read asks for is EIO. */

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int pwrite_all(int fd, const void *buf, size_t n, int64_t off) {
    const char *p = buf;
    while (n) {
        ssize_t k = pwrite(fd, p, n, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return 0;
}

static int pread_all(int fd, void *buf, size_t n, int64_t off) {
    char *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, n, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (k == 0) return EIO;
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return 0;
}

/* An unlinked temporary file in ``dir``, or -1 with a Python error set. */
static int temp_file(const char *dir) {
    size_t n = strlen(dir) + 32;
    char *path = PyMem_RawMalloc(n);
    if (!path) {
        PyErr_NoMemory();
        return -1;
    }
    snprintf(path, n, "%s/prefixcache-optimum-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, dir);
    } else {
        unlink(path);
        fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    PyMem_RawFree(path);
    return fd;
}

/* ------------------------------------------------------------------ memory */

/* Zeroed memory; a large block asks for transparent huge pages: the id map, last[] and
 * where[] are read at random, and a 4 KB page per access would miss the TLB each time. */
static void *big_calloc(size_t n, size_t size) {
    size_t bytes = n * size;
    char *p = PyMem_RawCalloc(n ? n : 1, size);
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)1 << 21;
    if (p && bytes >= 2 * huge) {
        uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1), hi = ((uintptr_t)p + bytes) & ~(huge - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE); /* a hint: failure costs only speed */
    }
#endif
    return p;
}

/* ------------------------------------------------------------------ the id map */

/* An id as add() reads it, with its context and hash. */
typedef struct {
    uint64_t w0, w1, w2; /* the id's 64-bit words, low first; OTHER: w0 is its index in ``others`` */
    uint64_t hash;
    uint32_t ctx; /* the context | WIDE (w1 or w2 set) | OTHER (outside [0, 2**192)) */
} Key;

/* One distinct id, at its block number: nodes are appended in the order ids first come. */
typedef struct {
    uint64_t w0;
    uint32_t ctx;  /* as Key's; with WIDE, w1 and w2 are in IdMap.wide[2 * number] */
    uint32_t next; /* the next node of its bucket, + 1; 0 ends the chain */
} Node;

typedef struct {
    uint32_t *heads; /* per bucket: its first node + 1, 0 when empty */
    size_t mask;
    Node *nodes; /* by block number */
    size_t count, cap;
    uint64_t *wide;  /* (w1, w2) per block number, for the WIDE ones; NULL until one comes */
    size_t wide_cap; /* block numbers it has room for */
} IdMap;

static inline uint64_t key_hash(uint32_t ctx, uint64_t w0, uint64_t w1, uint64_t w2) {
    uint64_t seed = mix64(((uint64_t)ctx << 1) | 1);
    if (ctx & WIDE) seed = mix64(w1 ^ mix64(w2 ^ seed));
    return mix64(w0 ^ seed);
}

static int idmap_alloc(IdMap *m, size_t buckets) {
    memset(m, 0, sizeof(*m));
    m->heads = big_calloc(buckets, sizeof(uint32_t));
    m->mask = buckets - 1;
    return m->heads ? 0 : -1;
}

static void idmap_free(IdMap *m) {
    PyMem_RawFree(m->heads);
    PyMem_RawFree(m->nodes);
    PyMem_RawFree(m->wide);
    memset(m, 0, sizeof(*m));
}

static inline int node_is(const IdMap *m, uint32_t number, const Key *k) {
    const Node *e = &m->nodes[number];
    return e->w0 == k->w0 && e->ctx == k->ctx &&
           (!(k->ctx & WIDE) || (m->wide[2 * (size_t)number] == k->w1 && m->wide[2 * (size_t)number + 1] == k->w2));
}

/* The block number of ``k``, a new one (and *added) when it is new. Room is reserved. */
static inline uint32_t idmap_number(IdMap *m, const Key *k, int *added) {
    uint32_t *head = &m->heads[k->hash & m->mask];
    for (uint32_t j = *head; j; j = m->nodes[j - 1].next)
        if (node_is(m, j - 1, k)) return j - 1;
    uint32_t number = (uint32_t)m->count++;
    m->nodes[number] = (Node){k->w0, k->ctx, *head};
    if (k->ctx & WIDE) {
        m->wide[2 * (size_t)number] = k->w1;
        m->wide[2 * (size_t)number + 1] = k->w2;
    }
    *head = number + 1;
    *added = 1;
    return number;
}

/* ``array`` (of ``*cap`` items of ``size`` bytes) with room for ``need``; -1 when out of memory.
 * NOTE: doubling by realloc: a large block is remapped, not copied, and its pages stay. */
static int grow(void **array, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 1024;
    while (cap2 < need) cap2 *= 2;
    void *grown = PyMem_RawRealloc(*array, cap2 * size);
    if (!grown) return -1;
    *array = grown;
    *cap = cap2;
    return 0;
}

/* Room for ``extra`` more ids (at most one per bucket on average), and for their high
 * words when ``wide``; -1 when out of memory. */
static int idmap_reserve(IdMap *m, size_t extra, int wide) {
    size_t need = m->count + extra;
    if (grow((void **)&m->nodes, &m->cap, need, sizeof(Node)) < 0) return -1;
    if (wide && grow((void **)&m->wide, &m->wide_cap, need, 2 * sizeof(uint64_t)) < 0) return -1;
    if (need <= m->mask + 1) return 0;
    size_t buckets = m->mask + 1;
    while (buckets < need) buckets *= 2;
    uint32_t *heads = big_calloc(buckets, sizeof(uint32_t));
    if (!heads) return -1;
    PyMem_RawFree(m->heads);
    m->heads = heads;
    m->mask = buckets - 1;
    for (size_t i = 0; i < m->count; i++) { /* relink every node into its new bucket */
        Node *e = &m->nodes[i];
        uint64_t w1 = e->ctx & WIDE ? m->wide[2 * i] : 0, w2 = e->ctx & WIDE ? m->wide[2 * i + 1] : 0;
        uint32_t *head = &heads[key_hash(e->ctx, e->w0, w1, w2) & m->mask];
        e->next = *head;
        *head = (uint32_t)i + 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ one Belady state */

typedef struct {
    int64_t cap;     /* blocks; -1: never evicts */
    uint32_t *where; /* heap slot (unlimited: 0) of each resident block, else NOT_RESIDENT */
    pos_t *key;      /* heap: next use of the block in each slot (max at 0) */
    uint32_t *blk;   /* heap: the block in each slot */
    size_t size;
    int prefix;      /* every block of the request so far hit */
    int64_t prefix_hits, hit_tokens, block_hits;
} State;

static inline void heap_place(State *s, size_t i, pos_t key, uint32_t b) {
    s->key[i] = key;
    s->blk[i] = b;
    s->where[b] = (uint32_t)i;
}

static void sift_up(State *s, size_t i) {
    pos_t key = s->key[i];
    uint32_t b = s->blk[i];
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (s->key[parent] >= key) break;
        heap_place(s, i, s->key[parent], s->blk[parent]);
        i = parent;
    }
    heap_place(s, i, key, b);
}

static void sift_down(State *s, size_t i) {
    pos_t key = s->key[i];
    uint32_t b = s->blk[i];
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= s->size) break;
        if (child + 1 < s->size && s->key[child + 1] > s->key[child]) child++;
        if (s->key[child] <= key) break;
        heap_place(s, i, s->key[child], s->blk[child]);
        i = child;
    }
    heap_place(s, i, key, b);
}

static void heap_remove(State *s, size_t i) {
    s->where[s->blk[i]] = NOT_RESIDENT;
    size_t last = --s->size;
    if (i == last) return;
    heap_place(s, i, s->key[last], s->blk[last]);
    sift_down(s, i);
    sift_up(s, i);
}

/* One access of a bounded state (optimum.belady's inner loop). */
static inline void step_bounded(State *s, uint32_t b, pos_t next, int counted) {
    uint32_t slot = s->where[b];
    if (slot != NOT_RESIDENT) {
        s->block_hits += counted;
        s->prefix_hits += s->prefix;
        if (next == NEVER) {
            heap_remove(s, slot);
        } else { /* NOTE: the old key was this very access, so the new one is larger */
            s->key[slot] = next;
            sift_up(s, slot);
        }
        return;
    }
    s->prefix = 0;
    if (next == NEVER) return;
    if (s->size < (size_t)s->cap) {
        s->size++;
        heap_place(s, s->size - 1, next, b);
        sift_up(s, s->size - 1);
    } else if (s->key[0] > next) { /* else bypass: everything cached is needed sooner */
        s->where[s->blk[0]] = NOT_RESIDENT;
        heap_place(s, 0, next, b);
        sift_down(s, 0);
    }
}

/* One access of a state that never evicts. */
static inline void step_unlimited(State *s, uint32_t b, pos_t next, int counted) {
    if (s->where[b] != NOT_RESIDENT) {
        s->block_hits += counted;
        s->prefix_hits += s->prefix;
        if (next == NEVER) s->where[b] = NOT_RESIDENT;
    } else {
        s->prefix = 0;
        if (next != NEVER) s->where[b] = 0;
    }
}

/* A run of accesses of one request inside a window of pass 3. */
typedef struct {
    size_t start, end;
    int64_t input_length;
    unsigned char begins, ends, counted;
} Segment;

static inline int64_t hit_tokens(int64_t blocks, int64_t block_size, int64_t input_length) {
    /* min(blocks * block_size, input_length), without overflow */
    return blocks > input_length / block_size ? input_length : blocks * block_size;
}

static void run_segments(State *s, const Segment *segs, size_t n, const uint32_t *blk, const pos_t *next,
                         int64_t block_size) {
    for (size_t g = 0; g < n; g++) {
        const Segment *seg = &segs[g];
        if (seg->begins) {
            s->prefix = 1;
            s->prefix_hits = 0;
        }
        int counted = seg->counted;
        if (s->cap < 0)
            for (size_t i = seg->start; i < seg->end; i++) step_unlimited(s, blk[i], next[i], counted);
        else
            for (size_t i = seg->start; i < seg->end; i++) step_bounded(s, blk[i], next[i], counted);
        if (seg->ends && counted) s->hit_tokens += hit_tokens(s->prefix_hits, block_size, seg->input_length);
    }
}

/* ------------------------------------------------------------------ the sequence */

typedef struct {
    PyObject_HEAD
    int fd_blocks, fd_next, fd_requests; /* -1 once closed */
    IdMap ids;
    PyObject *others;   /* dict: an id outside [0, 2**192) -> its index (w0 with OTHER) */
    Key *scratch;       /* one request's converted ids */
    size_t scratch_cap;
    uint32_t *out;      /* pass 1: block numbers not yet written */
    size_t n_out;
    int64_t *rout;      /* pass 1: request records not yet written */
    size_t n_rout;
    int64_t accesses, requests;
    uint32_t blocks;
    size_t chunk;
    int sealed, busy;
} Sequence;

static void release(Sequence *s) {
    int *fds[] = {&s->fd_blocks, &s->fd_next, &s->fd_requests};
    for (int i = 0; i < 3; i++)
        if (*fds[i] >= 0) {
            close(*fds[i]);
            *fds[i] = -1;
        }
    idmap_free(&s->ids);
    Py_CLEAR(s->others);
    PyMem_RawFree(s->scratch);
    PyMem_RawFree(s->out);
    PyMem_RawFree(s->rout);
    s->scratch = NULL;
    s->out = NULL;
    s->rout = NULL;
    s->scratch_cap = s->n_out = s->n_rout = 0;
}

static PyObject *Sequence_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"directory", "chunk", NULL};
    PyObject *dir_obj;
    Py_ssize_t chunk = (Py_ssize_t)CHUNK;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|n:Sequence", kwlist, PyUnicode_FSConverter, &dir_obj, &chunk))
        return NULL;
    if (chunk < 1 || (size_t)chunk > ((size_t)1 << 30)) {
        Py_DECREF(dir_obj);
        return PyErr_Format(PyExc_ValueError, "chunk must be in [1, 2**30], got %zd", chunk);
    }
    Sequence *s = (Sequence *)type->tp_alloc(type, 0);
    if (!s) {
        Py_DECREF(dir_obj);
        return NULL;
    }
    s->fd_blocks = s->fd_next = s->fd_requests = -1;
    const char *dir = PyBytes_AS_STRING(dir_obj);
    s->others = PyDict_New();
    s->chunk = (size_t)chunk;
    s->out = PyMem_RawMalloc(s->chunk * sizeof(uint32_t));
    s->rout = PyMem_RawMalloc(s->chunk * 2 * sizeof(int64_t));
    size_t buckets = 8; /* the id map's first size: a small chunk (the tests') makes it grow early */
    while (buckets < s->chunk && buckets < ((size_t)1 << 16)) buckets *= 2;
    if (!s->others || !s->out || !s->rout || idmap_alloc(&s->ids, buckets) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto fail;
    }
    if ((s->fd_blocks = temp_file(dir)) < 0 || (s->fd_next = temp_file(dir)) < 0 ||
        (s->fd_requests = temp_file(dir)) < 0)
        goto fail;
    Py_DECREF(dir_obj);
    return (PyObject *)s;
fail:
    Py_DECREF(dir_obj);
    Py_DECREF(s);
    return NULL;
}

static void Sequence_dealloc(Sequence *s) {
    release(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* Whether the sequence can take ``what`` now; else a Python error. */
static int usable(Sequence *s, const char *what) {
    if (s->busy) {
        PyErr_Format(PyExc_RuntimeError, "%s: the sequence is in use by another call", what);
        return 0;
    }
    if (s->fd_blocks < 0) {
        PyErr_Format(PyExc_ValueError, "%s: the sequence is closed", what);
        return 0;
    }
    return 1;
}

/* An I/O error broke the sequence: close it and raise. */
static PyObject *broken(Sequence *s, int err) {
    release(s);
    errno = err;
    return PyErr_SetFromErrno(err == ENOMEM ? PyExc_MemoryError : PyExc_OSError);
}

/* ``obj``'s words into ``k`` (k->ctx: 0, WIDE or OTHER); -1 with a Python error when not an int. */
static int id_key(Sequence *s, PyObject *obj, Py_ssize_t i, Key *k) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "ids[%zd] must be an int, got %.100s", i, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    k->ctx = 0;
    if (!overflow && v >= 0) {
        k->w0 = (uint64_t)v;
        k->w1 = k->w2 = 0;
        return 0;
    }
    /* NOTE: int's own slots, not the object's: an int subclass must not run Python code
     * here (it could call this sequence back). */
    PyNumberMethods *num = PyLong_Type.tp_as_number;
    if (overflow > 0) { /* [2**63, ...): three words when it fits them */
        uint64_t w[3];
        PyObject *rest = obj;
        Py_INCREF(rest);
        for (int j = 0; j < 3; j++) {
            w[j] = PyLong_AsUnsignedLongLongMask(rest);
            PyObject *next = num->nb_rshift(rest, SIXTY_FOUR);
            Py_DECREF(rest);
            if (!next) return -1;
            rest = next;
        }
        int fits = !num->nb_bool(rest);
        Py_DECREF(rest);
        if (fits) {
            k->w0 = w[0];
            k->w1 = w[1];
            k->w2 = w[2];
            k->ctx = w[1] | w[2] ? WIDE : 0;
            return 0;
        }
    }
    /* negative or from 2**192 up: numbered by a dict, exact as the reference's is */
    PyObject *exact = num->nb_positive(obj);
    if (!exact) return -1;
    PyObject *index = PyDict_GetItemWithError(s->others, exact);
    if (index) {
        Py_INCREF(index);
    } else if (!PyErr_Occurred()) {
        index = PyLong_FromSsize_t(PyDict_GET_SIZE(s->others));
        if (index && PyDict_SetItem(s->others, exact, index) < 0) Py_CLEAR(index);
    }
    Py_DECREF(exact);
    if (!index) return -1;
    k->w0 = PyLong_AsUnsignedLongLong(index);
    k->w1 = k->w2 = 0;
    k->ctx = OTHER;
    Py_DECREF(index);
    return 0;
}

static int flush_out(Sequence *s) {
    int err = write_all(s->fd_blocks, s->out, s->n_out * sizeof(uint32_t));
    s->n_out = 0;
    return err;
}

static int flush_rout(Sequence *s) {
    int err = write_all(s->fd_requests, s->rout, s->n_rout * 2 * sizeof(int64_t));
    s->n_rout = 0;
    return err;
}

static PyObject *Sequence_add(Sequence *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "add(context, ids, input_length) takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    if (!usable(s, "add()")) return NULL;
    if (s->sealed) {
        PyErr_SetString(PyExc_RuntimeError, "add() after solve(): every request must come before the first solve()");
        return NULL;
    }
    long long ctx = PyLong_AsLongLong(args[0]);
    if (ctx == -1 && PyErr_Occurred()) return NULL;
    if (ctx < 0 || ctx > (long long)MAX_CONTEXT) {
        PyErr_Format(PyExc_ValueError, "context must be in [0, 2**30), got %lld", ctx);
        return NULL;
    }
    long long input_length = PyLong_AsLongLong(args[2]);
    if (input_length == -1 && PyErr_Occurred()) return NULL;
    if (input_length < 0) {
        PyErr_Format(PyExc_ValueError, "input_length must be >= 0, got %lld", input_length);
        return NULL;
    }
    PyObject *ids = PySequence_Fast(args[1], "ids must be a sequence of ints");
    if (!ids) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    PyObject **items = PySequence_Fast_ITEMS(ids);
    PyObject *result = NULL;
    s->busy = 1;
    if ((size_t)n > s->scratch_cap) {
        Key *grown = PyMem_RawRealloc(s->scratch, (size_t)n * sizeof(Key));
        if (!grown) {
            PyErr_NoMemory();
            goto done;
        }
        s->scratch = grown;
        s->scratch_cap = (size_t)n;
    }
    /* every id converted (and the map's room made) before any is numbered: a bad
     * request leaves the sequence as it was */
    int wide = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Key *k = &s->scratch[i];
        if (id_key(s, items[i], i, k) < 0) goto done;
        wide |= (k->ctx & WIDE) != 0;
        k->ctx |= (uint32_t)ctx;
        k->hash = key_hash(k->ctx, k->w0, k->w1, k->w2);
    }
    if ((uint64_t)n > (uint64_t)(MAX_BLOCKS - s->blocks) || n > MAX_ACCESSES - s->accesses) {
        PyErr_Format(PyExc_OverflowError, "more than %u distinct blocks or %u block accesses", (unsigned)MAX_BLOCKS,
                     (unsigned)MAX_ACCESSES);
        goto done;
    }
    if (idmap_reserve(&s->ids, (size_t)n, wide) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    /* NOTE: a request's lookups overlap their cache misses: the bucket of the id AHEAD on
     * is fetched, and the first node of the id AHEAD / 2 on, before this one is looked up */
    IdMap *m = &s->ids;
    Key *keys = s->scratch;
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) PREFETCH(&m->heads[keys[i].hash & m->mask]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) PREFETCH(&m->heads[keys[i + AHEAD].hash & m->mask]);
        if (i + AHEAD / 2 < n) {
            uint32_t j = m->heads[keys[i + AHEAD / 2].hash & m->mask];
            if (j) PREFETCH(&m->nodes[j - 1]);
        }
        int added = 0;
        s->out[s->n_out++] = idmap_number(m, &keys[i], &added);
        s->blocks += added;
        int err = s->n_out == s->chunk ? flush_out(s) : 0;
        if (err) {
            s->busy = 0;
            broken(s, err);
            goto done;
        }
    }
    s->rout[2 * s->n_rout] = n;
    s->rout[2 * s->n_rout + 1] = input_length;
    s->n_rout++;
    int err = s->n_rout == s->chunk ? flush_rout(s) : 0;
    if (err) {
        s->busy = 0;
        broken(s, err);
        goto done;
    }
    s->accesses += n;
    s->requests++;
    result = Py_NewRef(Py_None);
done:
    s->busy = 0;
    Py_DECREF(ids);
    return result;
}

/* Pass 2: each access's next use, from the blocks read backwards. Returns 0 or errno. */
static int next_uses(Sequence *s) {
    pos_t *last = big_calloc(s->blocks, sizeof(pos_t));
    size_t chunk = s->chunk;
    uint32_t *blk = PyMem_RawMalloc(chunk * sizeof(uint32_t));
    pos_t *next = PyMem_RawMalloc(chunk * sizeof(pos_t));
    int err = last && blk && next ? 0 : ENOMEM;
    if (!err) memset(last, 0xff, (size_t)s->blocks * sizeof(pos_t)); /* NEVER */
    for (int64_t end = s->accesses; end > 0 && !err;) {
        int64_t start = end > (int64_t)chunk ? end - (int64_t)chunk : 0;
        size_t len = (size_t)(end - start);
        err = pread_all(s->fd_blocks, blk, len * sizeof(uint32_t), start * (int64_t)sizeof(uint32_t));
        if (err) break;
        for (size_t i = len; i-- > 0;) {
            next[i] = last[blk[i]];
            last[blk[i]] = (pos_t)(start + (int64_t)i);
        }
        err = pwrite_all(s->fd_next, next, len * sizeof(pos_t), start * (int64_t)sizeof(pos_t));
        end = start;
    }
    PyMem_RawFree(last);
    PyMem_RawFree(blk);
    PyMem_RawFree(next);
    return err;
}

/* The request records, read forward in chunks. */
typedef struct {
    int fd;
    int64_t *buf;
    size_t chunk, n, i;
    int64_t offset; /* bytes read so far */
} Requests;

static int next_request(Requests *r, int64_t *blocks, int64_t *input_length) {
    if (r->i == r->n) {
        size_t want = r->chunk * 2 * sizeof(int64_t);
        ssize_t k;
        do k = pread(r->fd, r->buf, want, (off_t)r->offset);
        while (k < 0 && errno == EINTR);
        if (k < 0) return errno;
        if (k < (ssize_t)(2 * sizeof(int64_t)) || k % (2 * sizeof(int64_t))) return EIO;
        r->offset += k;
        r->n = (size_t)k / (2 * sizeof(int64_t));
        r->i = 0;
    }
    *blocks = r->buf[2 * r->i];
    *input_length = r->buf[2 * r->i + 1];
    r->i++;
    return 0;
}

/* Pass 3: every state fed the whole sequence, one window of segments at a time. */
static int belady(Sequence *s, State *states, size_t n_states, int64_t block_size, int64_t warmup) {
    size_t chunk = s->chunk;
    uint32_t *blk = PyMem_RawMalloc(chunk * sizeof(uint32_t));
    pos_t *next = PyMem_RawMalloc(chunk * sizeof(pos_t));
    Segment *segs = PyMem_RawMalloc(chunk * sizeof(Segment));
    Requests reqs = {s->fd_requests, PyMem_RawMalloc(chunk * 2 * sizeof(int64_t)), chunk, 0, 0, 0};
    int err = blk && next && segs && reqs.buf ? 0 : ENOMEM;
    int64_t r = -1, left = 0, input_length = 0;
    int begins = 0;
    for (int64_t pos = 0; pos < s->accesses && !err;) {
        size_t len = (size_t)(s->accesses - pos) < chunk ? (size_t)(s->accesses - pos) : chunk;
        err = pread_all(s->fd_blocks, blk, len * sizeof(uint32_t), pos * (int64_t)sizeof(uint32_t));
        if (!err) err = pread_all(s->fd_next, next, len * sizeof(pos_t), pos * (int64_t)sizeof(pos_t));
        for (size_t i = 0; i < len && !err;) {
            size_t n_segs = 0;
            while (i < len && n_segs < chunk && !err) {
                while (left == 0 && !err) { /* the next request with blocks */
                    err = next_request(&reqs, &left, &input_length);
                    r++;
                    begins = 1;
                }
                if (err) break;
                size_t take = (size_t)left < len - i ? (size_t)left : len - i;
                segs[n_segs++] = (Segment){i, i + take, input_length, (unsigned char)begins,
                                           (unsigned char)(take == (size_t)left), (unsigned char)(r >= warmup)};
                begins = 0;
                left -= (int64_t)take;
                i += take;
            }
            if (err) break;
            for (size_t k = 0; k < n_states; k++)
                if (states[k].cap != 0) run_segments(&states[k], segs, n_segs, blk, next, block_size);
        }
        pos += (int64_t)len;
    }
    PyMem_RawFree(blk);
    PyMem_RawFree(next);
    PyMem_RawFree(segs);
    PyMem_RawFree(reqs.buf);
    return err;
}

static void free_states(State *states, size_t n) {
    for (size_t k = 0; states && k < n; k++) {
        PyMem_RawFree(states[k].where);
        PyMem_RawFree(states[k].key);
        PyMem_RawFree(states[k].blk);
    }
    PyMem_RawFree(states);
}

/* The states for ``caps`` (-1: unlimited); ENOMEM or 0. */
static int make_states(Sequence *s, const int64_t *caps, size_t n, State **out) {
    State *states = PyMem_RawCalloc(n ? n : 1, sizeof(State));
    if (!states) return ENOMEM;
    *out = states;
    for (size_t k = 0; k < n; k++) {
        State *st = &states[k];
        if (caps[k] == 0) continue; /* admits nothing: no hits */
        st->cap = caps[k] < 0 || caps[k] >= (int64_t)s->blocks ? -1 : caps[k]; /* room for all never evicts */
        st->where = big_calloc(s->blocks, sizeof(uint32_t));
        if (!st->where) return ENOMEM;
        memset(st->where, 0xff, (size_t)s->blocks * sizeof(uint32_t)); /* NOT_RESIDENT */
        if (st->cap > 0) {
            st->key = PyMem_RawMalloc((size_t)st->cap * sizeof(pos_t));
            st->blk = PyMem_RawMalloc((size_t)st->cap * sizeof(uint32_t));
            if (!st->key || !st->blk) return ENOMEM;
        }
    }
    return 0;
}

/* The capacities as int64 (None: -1); NULL with a Python error when one is invalid. */
static int64_t *parse_capacities(PyObject *obj, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(obj, "capacities must be a sequence of ints (or None for unlimited)");
    if (!fast) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    int64_t *caps = PyMem_RawMalloc((*n ? (size_t)*n : 1) * sizeof(int64_t));
    if (!caps) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        int overflow = 0;
        long long v = -1;
        if (item != Py_None) {
            if (!PyLong_Check(item)) {
                PyErr_Format(PyExc_TypeError, "capacities[%zd] must be an int or None, got %.100s", i,
                             Py_TYPE(item)->tp_name);
                goto fail;
            }
            v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (v == -1 && PyErr_Occurred()) goto fail;
            if (overflow < 0 || (!overflow && v < 0)) {
                PyErr_Format(PyExc_ValueError, "capacities[%zd] must be >= 0 blocks (None: unlimited)", i);
                goto fail;
            }
            if (overflow > 0) v = -1; /* beyond any trace: unlimited */
        }
        caps[i] = v;
    }
    Py_DECREF(fast);
    return caps;
fail:
    Py_DECREF(fast);
    PyMem_RawFree(caps);
    return NULL;
}

static PyObject *Sequence_solve(Sequence *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacities", "block_size", "warmup", NULL};
    PyObject *caps_obj;
    long long block_size, warmup;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLL:solve", kwlist, &caps_obj, &block_size, &warmup)) return NULL;
    if (!usable(s, "solve()")) return NULL;
    if (block_size < 1) return PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %lld", block_size);
    if (warmup < 0) return PyErr_Format(PyExc_ValueError, "warmup must be >= 0 requests, got %lld", warmup);
    Py_ssize_t n;
    int64_t *caps = parse_capacities(caps_obj, &n);
    if (!caps) return NULL;
    int seal_err = 0, err = 0, seal = !s->sealed;
    if (seal) { /* pass 1 ends: the map is no longer needed */
        idmap_free(&s->ids);
        Py_CLEAR(s->others);
        PyMem_RawFree(s->scratch);
        s->scratch = NULL;
        s->scratch_cap = 0;
        s->sealed = 1;
    }
    State *states = NULL;
    s->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (seal) {
        seal_err = flush_out(s);
        if (!seal_err) seal_err = flush_rout(s);
        if (!seal_err) seal_err = next_uses(s);
    }
    if (!seal_err) err = make_states(s, caps, (size_t)n, &states);
    if (!seal_err && !err) err = belady(s, states, (size_t)n, block_size, warmup);
    Py_END_ALLOW_THREADS
    s->busy = 0;
    PyMem_RawFree(caps);
    PyObject *result = NULL;
    if (seal_err || err) { /* a sequence without its files is closed; one short of memory can retry */
        free_states(states, (size_t)n);
        return seal_err || err != ENOMEM ? broken(s, seal_err ? seal_err : err) : PyErr_NoMemory();
    }
    result = PyList_New(n);
    for (Py_ssize_t k = 0; result && k < n; k++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)states[k].hit_tokens, (long long)states[k].block_hits);
        if (!pair) Py_CLEAR(result);
        else PyList_SET_ITEM(result, k, pair);
    }
    free_states(states, (size_t)n);
    return result;
}

static PyObject *Sequence_close(Sequence *s, PyObject *unused) {
    if (s->busy) return PyErr_Format(PyExc_RuntimeError, "close(): the sequence is in use by another call");
    release(s);
    Py_RETURN_NONE;
}

static PyObject *Sequence_get_requests(Sequence *s, void *closure) { return PyLong_FromLongLong(s->requests); }
static PyObject *Sequence_get_accesses(Sequence *s, void *closure) { return PyLong_FromLongLong(s->accesses); }
static PyObject *Sequence_get_blocks(Sequence *s, void *closure) { return PyLong_FromUnsignedLong(s->blocks); }
static PyObject *Sequence_get_closed(Sequence *s, void *closure) { return PyBool_FromLong(s->fd_blocks < 0); }

static PyMethodDef Sequence_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Sequence_add, METH_FASTCALL,
     "add(context, ids, input_length): one request's blocks, in order (pass 1)"},
    {"solve", (PyCFunction)(void (*)(void))Sequence_solve, METH_VARARGS | METH_KEYWORDS,
     "solve(capacities, block_size, warmup) -> [(hit tokens, block hits)] per capacity (None: unlimited)"},
    {"close", (PyCFunction)Sequence_close, METH_NOARGS, "close(): free the memory and the temporary files"},
    {NULL},
};

static PyGetSetDef Sequence_getset[] = {
    {"requests", (getter)Sequence_get_requests, NULL, "requests added", NULL},
    {"accesses", (getter)Sequence_get_accesses, NULL, "block accesses added", NULL},
    {"blocks", (getter)Sequence_get_blocks, NULL, "distinct blocks added", NULL},
    {"closed", (getter)Sequence_get_closed, NULL, "whether close() (or an I/O error) freed it", NULL},
    {NULL},
};

static PyTypeObject SequenceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "prefixcache.sim.native._optimum.Sequence",
    .tp_basicsize = sizeof(Sequence),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sequence(directory, chunk=2**18): a trace's flat block sequence on temporary files in directory, "
              "read and written chunk accesses at a time, and its Belady optimum at any capacities.",
    .tp_new = Sequence_new,
    .tp_dealloc = (destructor)Sequence_dealloc,
    .tp_methods = Sequence_methods,
    .tp_getset = Sequence_getset,
};

static struct PyModuleDef optimum_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefixcache.sim.native._optimum",
    .m_doc = "The trace simulator's offline optimum, streaming (see _optimum.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__optimum(void) {
    if (PyType_Ready(&SequenceType) < 0) return NULL;
    if (!SIXTY_FOUR && !(SIXTY_FOUR = PyLong_FromLong(64))) return NULL;
    PyObject *m = PyModule_Create(&optimum_module);
    if (!m) return NULL;
    Py_INCREF(&SequenceType);
    if (PyModule_AddObject(m, "Sequence", (PyObject *)&SequenceType) < 0) {
        Py_DECREF(&SequenceType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
