/* The chained block keys and the hash map that the compiled simulator parts share
 * (_kernel.c, _curves.c; _optimum.c takes the mixer): one definition, so that all hash
 * alike.
 *
 *     chain(parent key, id)   a block's 64-bit key (never 0: 0 marks an empty slot)
 *     Map                     u64 -> i64, open addressing with linear probing, at most
 *                             half full, deletion by backward shift (no tombstones)
 *
 * Everything here is ``static inline``: a file that includes it and uses part of it
 * gets no warning for the rest. Allocation failures set Python's MemoryError.
 */
#ifndef PREFIXCACHE_SIMMAP_H
#define PREFIXCACHE_SIMMAP_H

#include <Python.h>
#include <stdint.h>

static inline uint64_t mix64(uint64_t x) { /* splitmix64's finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static inline uint64_t chain(uint64_t parent_key, uint64_t id) {
    uint64_t k = mix64(parent_key ^ mix64(id + 0x9e3779b97f4a7c15ULL));
    return k ? k : 1; /* 0 marks an empty map slot */
}

typedef struct {
    uint64_t *keys; /* 0: empty */
    int64_t *vals;
    size_t mask, count;
} Map;

/* A map of ``cap`` slots (a power of two); -1 with MemoryError, the map then empty. */
static inline int map_init(Map *m, size_t cap) {
    m->keys = PyMem_Calloc(cap, sizeof(uint64_t));
    m->vals = PyMem_Malloc(cap * sizeof(int64_t));
    m->mask = cap - 1;
    m->count = 0;
    if (!m->keys || !m->vals) {
        PyMem_Free(m->keys);
        PyMem_Free(m->vals);
        m->keys = NULL;
        m->vals = NULL;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static inline void map_free(Map *m) {
    PyMem_Free(m->keys);
    PyMem_Free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
}

/* The value slot of ``k``, or NULL when absent. */
static inline int64_t *map_find(const Map *m, uint64_t k) {
    size_t i = (size_t)k & m->mask;
    for (;;) {
        uint64_t s = m->keys[i];
        if (s == k) return &m->vals[i];
        if (s == 0) return NULL;
        i = (i + 1) & m->mask;
    }
}

/* The value of ``k``, or -1 when absent (the maps here hold values >= 0). */
static inline int64_t map_get(const Map *m, uint64_t k) {
    const int64_t *v = map_find(m, k);
    return v ? *v : -1;
}

static inline int map_grow(Map *m);

/* The value slot of ``k``, made (set to ``fresh``) when absent; NULL on error. */
static inline int64_t *map_slot(Map *m, uint64_t k, int64_t fresh) {
    if ((m->count + 1) * 2 > m->mask + 1 && map_grow(m) < 0) return NULL;
    size_t i = (size_t)k & m->mask;
    for (;;) {
        uint64_t s = m->keys[i];
        if (s == k) return &m->vals[i];
        if (s == 0) {
            m->keys[i] = k;
            m->vals[i] = fresh;
            m->count++;
            return &m->vals[i];
        }
        i = (i + 1) & m->mask;
    }
}

/* Insert or overwrite; -1 on error. */
static inline int map_put(Map *m, uint64_t k, int64_t v) {
    int64_t *slot = map_slot(m, k, v);
    if (!slot) return -1;
    *slot = v;
    return 0;
}

/* Twice the slots, every entry moved; on error the map is as it was. */
static inline int map_grow(Map *m) {
    Map old = *m;
    if (map_init(m, (old.mask + 1) * 2) < 0) {
        *m = old;
        return -1;
    }
    for (size_t i = 0; i <= old.mask; i++)
        if (old.keys[i]) *map_slot(m, old.keys[i], 0) = old.vals[i];
    map_free(&old);
    return 0;
}

/* Delete ``k`` if present, with backward shift: probe chains stay short under churn. */
static inline void map_del(Map *m, uint64_t k) {
    size_t i = (size_t)k & m->mask;
    for (;;) {
        uint64_t s = m->keys[i];
        if (s == 0) return;
        if (s == k) break;
        i = (i + 1) & m->mask;
    }
    size_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        uint64_t s = m->keys[j];
        if (s == 0) break;
        size_t home = (size_t)s & m->mask;
        /* move s back into the hole at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
            m->keys[i] = s;
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->keys[i] = 0;
    m->count--;
}

#endif
