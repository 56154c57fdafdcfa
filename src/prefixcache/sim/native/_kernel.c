/* The replay kernel: PrefixCache's metadata path in C, for the trace simulator.
 *
 * What a replay of a capacity sweep does per request -- walk the block tree, pin the
 * deepest hit, touch the path in the policy, make room, store the missing blocks,
 * release -- is a few hundred nanoseconds of work per block that Python spends
 * microseconds on. This file does exactly what the ledger's ``access`` does for the
 * configurations it models (policies lru, fifo, s3fifo, sieve, lfuda, gittins; isolation shared,
 * namespace, partitioned; TTL; no publication or partial blocks), decision for
 * decision: the same victims in the same order, the same blocked-entry rules
 * (policies/base.py), the same quotas. tests/sim/test_kernel.py replays both engines
 * side by side and compares every answer and counter (the engines' ``LedgerCounters``)
 * after every request. Read cache/ledger.py, cache/lifecycle.py and policies/ first: each
 * function here names the Python it mirrors.
 *
 * Layout:
 *
 *     nodes[]            one slot per block or context root, recycled through a free list
 *       key              64-bit chained key: chain(parent key, id); the path's identity
 *       parent, id       what a hit verifies (a key is never trusted alone)
 *       prev/next        the node's place in its pool's policy queue
 *     index: Map         key -> node slot (open addressing, backward-shift deletion)
 *     pools[]            quota, usage and one policy instance each (queues + S3-FIFO ghost)
 *     ttl                with a TTL: the blocks by last access, oldest first (Ledger.ttl)
 *
 * All blocks of one tree have one size, ``unit`` tokens (the block size; 1 for a
 * pre-hashed trace, whose capacity counts native blocks), as without partial blocks.
 * The one exception is for sampled curves (curves.py): a request's first ``head``
 * blocks, when it names them, are charged ``head_unit`` each (each block records its
 * ``cost``), so that a miniature cache can weigh unsampled blocks at full scale.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { P_LRU, P_FIFO, P_S3FIFO, P_SIEVE, P_LFUDA, P_GITTINS, N_POLICIES };
static const char *POLICY_NAMES[N_POLICIES] = {"lru", "fifo", "s3fifo", "sieve", "lfuda", "gittins"};

#define NONE (-1)
#define FREQ_CAP 3            /* S3FIFOPolicy.FREQ_CAP */
#define MOVE_THRESHOLD 2      /* S3FIFOPolicy move_to_main_threshold */

#include "_simmap.h" /* mix64, chain, Map */

/* ------------------------------------------------------------------ nodes and queues */

typedef struct {
    uint64_t key, id;
    int32_t parent, nkids, pins, pool;
    int32_t prev, next;   /* queue links; next also links the free list */
    int32_t freq;         /* S3-FIFO and LFUDA frequency, SIEVE visited bit, Gittins reuses */
    int32_t queue;        /* S3-FIFO: 0 small, 1 main; Gittins: class */
    int64_t rank;         /* LFUDA: priority; Gittins: tick of the last access */
    int32_t group;        /* Gittins: its (class, tick) group, NONE when interior */
    int32_t interior;     /* Gittins: told it has children (out of the groups) */
    int32_t tprev, tnext; /* TTL order links */
    int32_t in_ttl;
    int32_t cost;         /* what it holds of its pool, in tokens: unit, or head_unit (curves.py) */
    double last_access;
} Node;

typedef struct {
    int32_t head, tail; /* oldest, newest */
    int64_t len;
} Queue;

typedef struct {
    uint64_t key;
    int64_t size; /* 0: left the ghost */
} GhostEntry;

/* S3-FIFO's ghost: keys in FIFO order, with the position of each in ``where``. */
typedef struct {
    GhostEntry *buf;
    int64_t start, end, cap; /* live window buf[start:end]; absolute position = base + offset */
    int64_t base;
    int64_t used;
    Map where; /* key -> absolute position */
} Ghost;

typedef struct {
    int64_t quota, used, blocks, evictions;
    int64_t capacity; /* the policy's: max(quota, 1) */
    Queue q[2];       /* lru/fifo/sieve: q[0]; s3fifo: q[0] small, q[1] main */
    int64_t qused[2];
    int64_t small_cap, main_cap, ghost_cap;
    int has_evicted;
    int32_t hand; /* SIEVE */
    Ghost ghost;
    /* LFUDA: one queue per priority present, found through ``buckets`` (priority -> slot) */
    Map buckets;
    Queue *bq;
    int32_t n_bq, cap_bq, free_bq; /* free slots chain through head */
    int64_t min_freq;              /* the lowest priority; 0: unknown */
    int64_t age;                   /* LFUDA's L: the priority of the last victim */
    struct Gittins *g;             /* Gittins' state (_kernel_gittins.h) */
} Pool;

typedef struct {
    PyObject_HEAD
    int policy;
    int partitioned;
    int64_t capacity, unit, head_unit, used;
    int64_t evictions, collisions, expired;
    int64_t blocks; /* resident blocks (roots excluded) */
    double ttl;     /* seconds; 0: none */
    double now;     /* the request's time */
    int32_t ttl_head, ttl_tail;
    Node *nodes;
    int32_t n_nodes, cap_nodes, free_head;
    Map index;
    Pool *pools;
    int32_t n_pools, cap_pools;
    int32_t *tenant_pool; /* tenant -> pool (partitioned), NONE until it stores */
    int32_t n_tenants;
    int32_t *path;
    Py_ssize_t cap_path;
} Tree;

static inline void q_push(Node *nodes, Queue *q, int32_t n) {
    nodes[n].prev = q->tail;
    nodes[n].next = NONE;
    if (q->tail != NONE)
        nodes[q->tail].next = n;
    else
        q->head = n;
    q->tail = n;
    q->len++;
}

static inline void q_unlink(Node *nodes, Queue *q, int32_t n) {
    int32_t p = nodes[n].prev, x = nodes[n].next;
    if (p != NONE)
        nodes[p].next = x;
    else
        q->head = x;
    if (x != NONE)
        nodes[x].prev = p;
    else
        q->tail = p;
    q->len--;
}

static inline void q_to_tail(Node *nodes, Queue *q, int32_t n) {
    if (q->tail == n) return;
    q_unlink(nodes, q, n);
    q_push(nodes, q, n);
}

/* ------------------------------------------------------------------ the ghost */

static int ghost_init(Ghost *g) {
    memset(g, 0, sizeof(*g));
    g->cap = 64;
    g->buf = PyMem_Malloc(g->cap * sizeof(GhostEntry));
    if (!g->buf) {
        PyErr_NoMemory();
        return -1;
    }
    return map_init(&g->where, 64);
}

static void ghost_free(Ghost *g) {
    PyMem_Free(g->buf);
    g->buf = NULL;
    map_free(&g->where);
}

static int ghost_add(Ghost *g, uint64_t key, int64_t size) {
    if (g->end == g->cap) {
        if (g->start * 2 >= g->cap) { /* mostly dead in front: slide down */
            memmove(g->buf, g->buf + g->start, (g->end - g->start) * sizeof(GhostEntry));
            g->base += g->start;
            g->end -= g->start;
            g->start = 0;
        } else {
            GhostEntry *bigger = PyMem_Realloc(g->buf, g->cap * 2 * sizeof(GhostEntry));
            if (!bigger) {
                PyErr_NoMemory();
                return -1;
            }
            g->buf = bigger;
            g->cap *= 2;
        }
    }
    g->buf[g->end].key = key;
    g->buf[g->end].size = size;
    if (map_put(&g->where, key, g->base + g->end) < 0) return -1;
    g->end++;
    g->used += size;
    return 0;
}

/* ``ghost.pop(key, None)``: the size it had, or 0 when absent. */
static int64_t ghost_pop(Ghost *g, uint64_t key) {
    int64_t pos = map_get(&g->where, key);
    if (pos == NONE) return 0;
    map_del(&g->where, key);
    GhostEntry *e = &g->buf[pos - g->base];
    int64_t size = e->size;
    e->size = 0;
    g->used -= size;
    return size;
}

/* ``_trim_ghost``: forget the oldest keys while the ghost holds more than its share. */
static void ghost_trim(Ghost *g, int64_t cap) {
    while (g->used > cap) {
        GhostEntry *e = &g->buf[g->start++];
        if (e->size) {
            map_del(&g->where, e->key);
            g->used -= e->size;
        }
    }
    if (g->start == g->end) { /* empty: restart at the front */
        g->base += g->start;
        g->start = g->end = 0;
    }
}

/* ------------------------------------------------------------------ pools */

static void gittins_resize(struct Gittins *g, int64_t capacity);
static struct Gittins *gittins_new(void);

static void pool_resize(Pool *p, int64_t capacity) { /* EvictionPolicy.resize, S3FIFOPolicy.resize */
    p->capacity = capacity;
    if (p->g) gittins_resize(p->g, capacity);
    p->small_cap = (int64_t)((double)capacity * 0.1);
    p->main_cap = capacity - p->small_cap;
    p->ghost_cap = (int64_t)((double)capacity * 0.9);
}

static int32_t new_pool(Tree *t, int64_t quota) {
    if (t->n_pools == t->cap_pools) {
        int32_t cap = t->cap_pools ? t->cap_pools * 2 : 4;
        Pool *bigger = PyMem_Realloc(t->pools, cap * sizeof(Pool));
        if (!bigger) {
            PyErr_NoMemory();
            return NONE;
        }
        t->pools = bigger;
        t->cap_pools = cap;
    }
    Pool *p = &t->pools[t->n_pools];
    memset(p, 0, sizeof(*p));
    p->q[0].head = p->q[0].tail = p->q[1].head = p->q[1].tail = NONE;
    p->hand = NONE;
    p->free_bq = NONE;
    p->quota = quota;
    if (t->policy == P_GITTINS && !(p->g = gittins_new())) return NONE;
    pool_resize(p, quota > 1 ? quota : 1);
    if (ghost_init(&p->ghost) < 0 || map_init(&p->buckets, 16) < 0) return NONE;
    return t->n_pools++;
}

/* ``Tenancy._rebalance`` without fixed quotas: every pool gets an equal share. */
static void rebalance(Tree *t) {
    int64_t share = t->capacity / t->n_pools;
    for (int32_t i = 0; i < t->n_pools; i++) {
        t->pools[i].quota = share;
        pool_resize(&t->pools[i], share > 1 ? share : 1);
    }
}

/* ``Tenancy.pool_for``: one pool, or (partitioned) the tenant's, made on first use. */
static int32_t pool_for(Tree *t, int32_t tenant) {
    if (!t->partitioned) return 0;
    int32_t pool = t->tenant_pool[tenant];
    if (pool == NONE) {
        pool = new_pool(t, 0);
        if (pool == NONE) return NONE;
        t->tenant_pool[tenant] = pool;
        rebalance(t);
    }
    return pool;
}

/* ------------------------------------------------------------------ policies */

static inline int evictable(const Node *n) { return n->pins == 0 && n->nkids == 0; } /* Ledger._evictable */

/* S3FIFOPolicy._to_main */
static inline void s3_to_main(Node *nodes, Pool *p, int32_t n, int64_t size) {
    q_push(nodes, &p->q[1], n);
    p->qused[1] += size;
    nodes[n].queue = 1;
    nodes[n].freq = 0;
}

static int lfu_place(Node *nodes, Pool *p, int32_t n, int64_t f, int64_t prio);
static int lfu_access(Node *nodes, Pool *p, int32_t n);
static int32_t lfu_victim(Tree *t, Pool *p);

#include "_kernel_gittins.h"

/* EvictionPolicy.insert */
static int policy_insert(Tree *t, Pool *p, int32_t n) {
    Node *nodes = t->nodes;
    int64_t size = nodes[n].cost;
    switch (t->policy) {
    case P_LRU:
    case P_FIFO:
        q_push(nodes, &p->q[0], n);
        return 0;
    case P_SIEVE:
        nodes[n].freq = 0;
        q_push(nodes, &p->q[0], n);
        if (p->hand == NONE) p->hand = n;
        return 0;
    case P_LFUDA:
        return lfu_place(nodes, p, n, 1, p->age + 1);
    case P_GITTINS:
        return gittins_insert(p->g, nodes, n, size);
    default: /* S3FIFOPolicy.insert */
        nodes[n].freq = 0;
        if (ghost_pop(&p->ghost, nodes[n].key))
            s3_to_main(nodes, p, n, size);
        else if (size > p->small_cap || (!p->has_evicted && p->qused[0] >= p->small_cap))
            s3_to_main(nodes, p, n, size);
        else {
            q_push(nodes, &p->q[0], n);
            p->qused[0] += size;
            nodes[n].queue = 0;
        }
        ghost_trim(&p->ghost, p->ghost_cap);
        return 0;
    }
}

/* EvictionPolicy.access: 0, or -1 on error */
static inline int policy_access(Tree *t, Pool *p, int32_t n) {
    Node *node = &t->nodes[n];
    switch (t->policy) {
    case P_LRU:
        q_to_tail(t->nodes, &p->q[0], n);
        break;
    case P_FIFO:
        break;
    case P_SIEVE:
        node->freq = 1;
        break;
    case P_LFUDA:
        return lfu_access(t->nodes, p, n);
    case P_GITTINS:
        return gittins_access(p->g, t->nodes, n, node->cost);
    default:
        if (node->freq < FREQ_CAP) node->freq++;
    }
    return 0;
}

/* FIFOPolicy.victim (LRU's too): one pass at most, blocked entries to the tail. */
static int32_t fifo_victim(Tree *t, Pool *p) {
    Node *nodes = t->nodes;
    Queue *q = &p->q[0];
    for (int64_t i = q->len; i > 0; i--) {
        int32_t n = q->head;
        if (evictable(&nodes[n])) {
            q_unlink(nodes, q, n);
            return n;
        }
        q_to_tail(nodes, q, n);
    }
    return NONE;
}

/* SievePolicy's removal: out of the queue, the hand moving on (wrapping) if it was there. */
static void sieve_unlink(Node *nodes, Pool *p, int32_t n) {
    int32_t next = nodes[n].next;
    q_unlink(nodes, &p->q[0], n);
    if (p->hand == n) p->hand = next != NONE ? next : p->q[0].head;
}

/* SievePolicy.victim: the queue in one list, the hand on the first entry "ahead". */
static int32_t sieve_victim(Tree *t, Pool *p) {
    Node *nodes = t->nodes;
    Queue *q = &p->q[0];
    int64_t run = 0;
    while (run < q->len) {
        int32_t n = p->hand;
        int32_t next = nodes[n].next;
        if (nodes[n].freq) {
            nodes[n].freq = 0;
            run = 0;
        } else if (evictable(&nodes[n])) {
            sieve_unlink(nodes, p, n);
            return n;
        } else {
            run++;
        }
        p->hand = next != NONE ? next : q->head; /* past the newest: wrap */
    }
    return NONE;
}

/* S3FIFOPolicy._evict_small */
static int32_t s3_evict_small(Tree *t, Pool *p) {
    Node *nodes = t->nodes;
    Queue *small = &p->q[0];
    while (small->len) {
        int32_t n = small->head;
        int64_t size = nodes[n].cost;
        q_unlink(nodes, small, n);
        p->qused[0] -= size;
        if (nodes[n].freq < MOVE_THRESHOLD && evictable(&nodes[n])) {
            if (size <= p->ghost_cap && ghost_add(&p->ghost, nodes[n].key, size) < 0) return -2;
            return n;
        }
        s3_to_main(nodes, p, n, size);
    }
    return NONE;
}

/* S3FIFOPolicy._evict_main */
static int32_t s3_evict_main(Tree *t, Pool *p) {
    Node *nodes = t->nodes;
    Queue *main = &p->q[1];
    int64_t run = 0;
    while (run < main->len) {
        int32_t n = main->head;
        if (nodes[n].freq) {
            nodes[n].freq--;
            run = 0;
        } else if (evictable(&nodes[n])) {
            q_unlink(nodes, main, n);
            p->qused[1] -= nodes[n].cost;
            return n;
        } else {
            run++;
        }
        q_to_tail(nodes, main, n);
    }
    return NONE;
}

/* S3FIFOPolicy.victim */
static int32_t s3_victim(Tree *t, Pool *p) {
    p->has_evicted = 1;
    int32_t n;
    if (p->q[0].len && p->qused[1] <= p->main_cap) {
        n = s3_evict_small(t, p);
        if (n != NONE) return n;
    }
    n = s3_evict_main(t, p);
    if (n != NONE || !p->q[0].len) return n;
    n = s3_evict_small(t, p);
    if (n != NONE) return n;
    return s3_evict_main(t, p);
}

/* EvictionPolicy.victim: a node slot, NONE when nothing may leave, -2 on error. */
static int32_t policy_victim(Tree *t, Pool *p) {
    switch (t->policy) {
    case P_LRU:
    case P_FIFO:
        return fifo_victim(t, p);
    case P_SIEVE:
        return sieve_victim(t, p);
    case P_LFUDA:
        return lfu_victim(t, p);
    case P_GITTINS:
        return gittins_victim(p->g, t->nodes);
    default:
        return s3_victim(t, p);
    }
}

/* ------------------------------------------------------------------ LFUDA (LFUDAPolicy) */

/* The queue of priority ``f`` (made empty when absent, or NULL on error). */
static Queue *lfu_bucket(Pool *p, int64_t f, int create) {
    int64_t slot = map_get(&p->buckets, (uint64_t)f);
    if (slot != NONE) return &p->bq[slot];
    if (!create) return NULL;
    if (p->free_bq != NONE) {
        slot = p->free_bq;
        p->free_bq = p->bq[slot].head;
    } else {
        if (p->n_bq == p->cap_bq) {
            int32_t cap = p->cap_bq ? p->cap_bq * 2 : 8;
            Queue *bigger = PyMem_Realloc(p->bq, (size_t)cap * sizeof(Queue));
            if (!bigger) {
                PyErr_NoMemory();
                return NULL;
            }
            p->bq = bigger;
            p->cap_bq = cap;
        }
        slot = p->n_bq++;
    }
    if (map_put(&p->buckets, (uint64_t)f, slot) < 0) return NULL;
    p->bq[slot].head = p->bq[slot].tail = NONE;
    p->bq[slot].len = 0;
    return &p->bq[slot];
}

static void lfu_drop_bucket(Pool *p, int64_t f) {
    int64_t slot = map_get(&p->buckets, (uint64_t)f);
    map_del(&p->buckets, (uint64_t)f);
    p->bq[slot].head = p->free_bq;
    p->free_bq = (int32_t)slot;
}

/* LFUDAPolicy._unbucket: take ``n`` out of its bucket. */
static void lfu_forget(Node *nodes, Pool *p, int32_t n) {
    int64_t f = nodes[n].rank;
    Queue *q = lfu_bucket(p, f, 0);
    q_unlink(nodes, q, n);
    if (!q->len) {
        lfu_drop_bucket(p, f);
        if (p->min_freq == f) p->min_freq = 0;
    }
}

/* LFUDAPolicy._place: frequency ``f``, priority ``prio``, at the tail of its bucket. */
static int lfu_place(Node *nodes, Pool *p, int32_t n, int64_t f, int64_t prio) {
    if (f > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an LFUDA frequency passed 2**31");
        return -1;
    }
    nodes[n].freq = (int32_t)f;
    nodes[n].rank = prio;
    Queue *q = lfu_bucket(p, prio, 1);
    if (!q) return -1;
    q_push(nodes, q, n);
    if (p->min_freq && prio < p->min_freq) p->min_freq = prio;
    return 0;
}

/* LFUDAPolicy.access: frequency + 1, priority L + frequency, to its bucket's tail. */
static int lfu_access(Node *nodes, Pool *p, int32_t n) {
    int64_t f = (int64_t)nodes[n].freq + 1;
    lfu_forget(nodes, p, n);
    return lfu_place(nodes, p, n, f, p->age + f);
}

/* LFUDAPolicy._first_evictable: its priority becomes L. */
static int32_t lfu_first_evictable(Tree *t, Pool *p, int64_t f) {
    Node *nodes = t->nodes;
    Queue *q = lfu_bucket(p, f, 0);
    for (int64_t i = q->len; i > 0; i--) {
        int32_t n = q->head;
        if (evictable(&nodes[n])) {
            lfu_forget(nodes, p, n);
            p->age = f;
            return n;
        }
        q_to_tail(nodes, q, n);
    }
    return NONE;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* LFUDAPolicy.victim */
static int32_t lfu_victim(Tree *t, Pool *p) {
    Map *b = &p->buckets;
    if (!b->count) return NONE;
    if (!p->min_freq) {
        for (size_t i = 0; i <= b->mask; i++)
            if (b->keys[i] && (!p->min_freq || (int64_t)b->keys[i] < p->min_freq)) p->min_freq = (int64_t)b->keys[i];
    }
    int32_t n = lfu_first_evictable(t, p, p->min_freq);
    if (n != NONE) return n;
    /* the slow path: the lowest bucket is blocked throughout, try the others in order */
    size_t count = b->count, k = 0;
    uint64_t *freqs = PyMem_Malloc(count * sizeof(uint64_t));
    if (!freqs) {
        PyErr_NoMemory();
        return -2;
    }
    for (size_t i = 0; i <= b->mask; i++)
        if (b->keys[i]) freqs[k++] = b->keys[i];
    qsort(freqs, count, sizeof(uint64_t), cmp_u64);
    for (size_t i = 0; i < count && n == NONE; i++)
        if ((int64_t)freqs[i] != p->min_freq) n = lfu_first_evictable(t, p, (int64_t)freqs[i]);
    PyMem_Free(freqs);
    return n;
}

/* EvictionPolicy.remove: ``n`` leaves for a reason of the cache's own (no ghost). */
static void policy_remove(Tree *t, Pool *p, int32_t n) {
    Node *nodes = t->nodes;
    switch (t->policy) {
    case P_LRU:
    case P_FIFO:
        q_unlink(nodes, &p->q[0], n);
        break;
    case P_SIEVE:
        sieve_unlink(nodes, p, n);
        break;
    case P_LFUDA:
        lfu_forget(nodes, p, n);
        break;
    case P_GITTINS:
        gittins_remove(p->g, nodes, n);
        break;
    default: {
        int32_t which = nodes[n].queue;
        q_unlink(nodes, &p->q[which], n);
        p->qused[which] -= nodes[n].cost;
    }
    }
}

/* ------------------------------------------------------------------ TTL order */

static void ttl_unlink(Tree *t, int32_t n) {
    Node *nodes = t->nodes;
    if (!nodes[n].in_ttl) return;
    int32_t p = nodes[n].tprev, x = nodes[n].tnext;
    if (p != NONE)
        nodes[p].tnext = x;
    else
        t->ttl_head = x;
    if (x != NONE)
        nodes[x].tprev = p;
    else
        t->ttl_tail = p;
    nodes[n].in_ttl = 0;
}

/* ``ttl[key] = block; ttl.move_to_end(key)`` with ``last_access = now`` */
static void ttl_touch(Tree *t, int32_t n) {
    Node *nodes = t->nodes;
    nodes[n].last_access = t->now;
    if (nodes[n].in_ttl && t->ttl_tail == n) return;
    ttl_unlink(t, n);
    nodes[n].tprev = t->ttl_tail;
    nodes[n].tnext = NONE;
    if (t->ttl_tail != NONE)
        nodes[t->ttl_tail].tnext = n;
    else
        t->ttl_head = n;
    t->ttl_tail = n;
    nodes[n].in_ttl = 1;
}

/* ------------------------------------------------------------------ the tree */

static int32_t new_node(Tree *t) {
    if (t->free_head != NONE) {
        int32_t n = t->free_head;
        t->free_head = t->nodes[n].next;
        return n;
    }
    if (t->n_nodes == t->cap_nodes) {
        if (t->cap_nodes >= INT32_MAX / 2) {
            PyErr_SetString(PyExc_MemoryError, "the replay kernel holds at most 2**30 blocks");
            return NONE;
        }
        int32_t cap = t->cap_nodes ? t->cap_nodes * 2 : 1024;
        Node *bigger = PyMem_Realloc(t->nodes, (size_t)cap * sizeof(Node));
        if (!bigger) {
            PyErr_NoMemory();
            return NONE;
        }
        t->nodes = bigger;
        t->cap_nodes = cap;
    }
    return t->n_nodes++;
}

/* The child of ``parent`` with block id ``id``: its slot, NONE when absent; a key that
 * names another (parent, id) is a counted collision and a miss (invariant 3). */
static inline int32_t find_child(Tree *t, int32_t parent, uint64_t id, int *collided) {
    uint64_t key = chain(t->nodes[parent].key, id);
    int64_t n = map_get(&t->index, key);
    if (n == NONE) return NONE;
    if (t->nodes[n].parent != parent || t->nodes[n].id != id) {
        *collided = 1;
        return NONE;
    }
    return (int32_t)n;
}

/* Lifecycle._leaf_news: a block lost its last child (``leaf``) or gained its first; only
 * Gittins listens (a root is no block: nothing to tell). 0, or -1 on error. */
static int set_leaf(Tree *t, int32_t n, int leaf) {
    Node *node = &t->nodes[n];
    if (t->policy != P_GITTINS || node->pool == NONE) return 0;
    return gittins_set_leaf(t->pools[node->pool].g, t->nodes, n, leaf);
}

/* Ledger.remove (cache/lifecycle.py): an eviction (the policy already let go) or, ``expired``, a TTL
 * reclaim (the policy forgets it here). */
static int remove_block(Tree *t, int32_t n, int expired) {
    Node *node = &t->nodes[n];
    Pool *p = &t->pools[node->pool];
    if (expired) {
        policy_remove(t, p, n);
        t->expired++;
    } else {
        p->evictions++;
        t->evictions++;
    }
    ttl_unlink(t, n);
    map_del(&t->index, node->key);
    if (!--t->nodes[node->parent].nkids && set_leaf(t, node->parent, 1) < 0) return -1;
    p->used -= node->cost;
    p->blocks--;
    t->used -= node->cost;
    t->blocks--;
    node->pool = NONE;
    node->next = t->free_head;
    t->free_head = n;
    return 0;
}

static int evict(Tree *t, int32_t n) { return remove_block(t, n, 0); }

/* Ledger.reclaim_one (TTL part): free the oldest expired block that may leave. */
static int reclaim_one(Tree *t) {
    double horizon = t->now - t->ttl;
    for (int32_t n = t->ttl_head; n != NONE; n = t->nodes[n].tnext) {
        Node *node = &t->nodes[n];
        if (node->last_access >= horizon) break;
        if (evictable(node)) return remove_block(t, n, 1) < 0 ? -1 : 1;
    }
    return 0;
}

/* Ledger._evict_from: 1 if anything was evicted, 0 if nothing could be, -1 on error. */
static int evict_from(Tree *t, int32_t pool, int64_t tokens) {
    int64_t freed = 0;
    while (freed < tokens) {
        int32_t v = policy_victim(t, &t->pools[pool]);
        if (v == -2) return -1;
        if (v == NONE) return freed > 0;
        freed += t->nodes[v].cost;
        if (evict(t, v) < 0) return -1;
    }
    return 1;
}

/* Ledger._over_quota_victim */
static int32_t over_quota_victim(Tree *t, int32_t pool) {
    int any = 0;
    for (int32_t i = 0; i < t->n_pools; i++) {
        Pool *p = &t->pools[i];
        if (p->used - p->quota > 0) {
            any = 1;
            int32_t v = policy_victim(t, p);
            if (v != NONE) return v;
        }
    }
    return any ? NONE : policy_victim(t, &t->pools[pool]);
}

/* Ledger._make_room: how many tokens fit (``need`` when all do); -1 on error. */
static int64_t make_room(Tree *t, int32_t pool, int64_t need) {
    Pool *p = &t->pools[pool];
    if (need > p->quota) need = p->quota;
    if (need > t->capacity) need = t->capacity;
    for (;;) {
        p = &t->pools[pool];
        int64_t free = p->quota - p->used;
        if (t->capacity - t->used < free) free = t->capacity - t->used;
        if (free >= need) return need;
        if (t->ttl_head != NONE) {
            int r = reclaim_one(t);
            if (r < 0) return -1;
            if (r) continue;
        }
        if (p->used + need > p->quota || !t->partitioned) {
            int r = evict_from(t, pool, need - free);
            if (r < 0) return -1;
            if (!r) return free > 0 ? free : 0;
            continue;
        }
        int32_t v = over_quota_victim(t, pool);
        if (v == -2) return -1;
        if (v == NONE) return free > 0 ? free : 0;
        if (evict(t, v) < 0) return -1;
    }
}

/* ------------------------------------------------------------------ Python type */

/* A block id as 64 bits: itself when it fits, else a digest of all its bits (2**-64 odds
 * that it names the same as another id; the trace format allows ids of any size).
 * 0 with an exception set when it is not an int >= 0. */
static int block_id(PyObject *obj, Py_ssize_t i, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block id %zd must be an int, got %.100s", i, Py_TYPE(obj)->tp_name);
        return 0;
    }
    uint64_t v = PyLong_AsUnsignedLongLong(obj);
    if (!(v == (uint64_t)-1 && PyErr_Occurred())) {
        *out = v;
        return 1;
    }
    PyErr_Clear();
    /* NOTE: int's own slots, not the object's: an int subclass must not run Python code
     * here (it could change the tree or the id list under this call). */
    PyNumberMethods *num = PyLong_Type.tp_as_number;
    PyObject *zero = PyLong_FromLong(0);
    PyObject *negative = zero ? PyLong_Type.tp_richcompare(obj, zero, Py_LT) : NULL;
    Py_XDECREF(zero);
    if (!negative) return 0;
    int is_negative = negative == Py_True;
    Py_DECREF(negative);
    if (is_negative) {
        PyErr_Format(PyExc_ValueError, "block id %zd must be >= 0 (a %.100s)", i, Py_TYPE(obj)->tp_name);
        return 0;
    }
    PyObject *shift = PyLong_FromLong(64), *rest = obj;
    uint64_t h = 0x243f6a8885a308d3ULL;
    Py_INCREF(rest);
    while (shift && rest && num->nb_bool(rest)) {
        h = mix64(h ^ mix64(PyLong_AsUnsignedLongLongMask(rest)));
        PyObject *next = num->nb_rshift(rest, shift);
        Py_DECREF(rest);
        rest = next;
    }
    Py_XDECREF(shift);
    if (!rest) return 0;
    Py_DECREF(rest);
    if (PyErr_Occurred()) return 0;
    *out = h;
    return 1;
}

static int Tree_init(Tree *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"policy", "capacity", "unit", "partitioned", "ttl", "head_unit", NULL};
    const char *policy;
    long long capacity, unit, head_unit = 0;
    int partitioned = 0;
    PyObject *ttl = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sLL|pOL", kwlist, &policy, &capacity, &unit, &partitioned, &ttl,
                                     &head_unit))
        return -1;
    if (ttl != Py_None) {
        t->ttl = PyFloat_AsDouble(ttl);
        if (t->ttl == -1.0 && PyErr_Occurred()) return -1;
        if (!(t->ttl > 0.0) || t->ttl > 1e300) {
            PyErr_Format(PyExc_ValueError, "ttl must be a positive number of seconds or None, got %R", ttl);
            return -1;
        }
    }
    t->ttl_head = t->ttl_tail = NONE;
    if (t->nodes) {
        PyErr_SetString(PyExc_RuntimeError, "a Tree is initialized once");
        return -1;
    }
    t->policy = -1;
    for (int i = 0; i < N_POLICIES; i++)
        if (!strcmp(policy, POLICY_NAMES[i])) t->policy = i;
    if (t->policy < 0) {
        PyErr_Format(PyExc_ValueError, "unknown policy '%s' for the replay kernel; valid: lru, fifo, s3fifo, sieve, lfuda, gittins",
                     policy);
        return -1;
    }
    if (capacity < 0) {
        PyErr_Format(PyExc_ValueError, "capacity must be >= 0, got %lld", capacity);
        return -1;
    }
    if (unit < 1 || unit > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "unit (tokens per block) must be in [1, 2**31), got %lld", unit);
        return -1;
    }
    if (head_unit < 0 || head_unit > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "head_unit must be in [0, 2**31) (0: unit), got %lld", head_unit);
        return -1;
    }
    t->capacity = capacity;
    t->unit = unit;
    t->head_unit = head_unit ? head_unit : unit;
    t->partitioned = partitioned;
    t->free_head = NONE;
    if (map_init(&t->index, 1024) < 0) return -1;
    if (!t->partitioned && new_pool(t, capacity) == NONE) return -1;
    t->cap_nodes = 1024;
    t->nodes = PyMem_Malloc((size_t)t->cap_nodes * sizeof(Node));
    t->cap_path = 256;
    t->path = PyMem_Malloc(t->cap_path * sizeof(int32_t));
    if (!t->nodes || !t->path) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Tree_dealloc(Tree *t) {
    for (int32_t i = 0; i < t->n_pools; i++) {
        ghost_free(&t->pools[i].ghost);
        map_free(&t->pools[i].buckets);
        PyMem_Free(t->pools[i].bq);
        gittins_free(t->pools[i].g);
    }
    PyMem_Free(t->pools);
    PyMem_Free(t->nodes);
    PyMem_Free(t->path);
    PyMem_Free(t->tenant_pool);
    if (t->index.keys) map_free(&t->index);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int ready(Tree *t) {
    if (!t->nodes) {
        PyErr_SetString(PyExc_RuntimeError, "Tree.__init__ was not called");
        return 0;
    }
    return 1;
}

/* root(key) -> slot: a context root (model and namespace), under which blocks hang. */
static PyObject *Tree_root(Tree *t, PyObject *arg) {
    if (!ready(t)) return NULL;
    uint64_t key = PyLong_AsUnsignedLongLongMask(arg);
    if (key == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    int32_t n = new_node(t);
    if (n == NONE) return NULL;
    Node *node = &t->nodes[n];
    memset(node, 0, sizeof(*node));
    node->key = chain(key, (uint64_t)n); /* distinct for every root, whatever keys it is given */
    node->parent = NONE;
    node->pool = NONE;
    node->prev = node->next = NONE;
    return PyLong_FromLong(n);
}

/* Tree_access's checks of its root and tenant: 1, or 0 with an exception set. */
static int check_root(Tree *t, int root, int tenant) {
    if (root < 0 || root >= t->n_nodes || t->nodes[root].parent != NONE || t->nodes[root].pool != NONE) {
        PyErr_Format(PyExc_IndexError, "%d is not a root of this tree (Tree.root gives them)", root);
        return 0;
    }
    if (tenant < 0) {
        PyErr_Format(PyExc_ValueError, "tenant must be >= 0, got %d", tenant);
        return 0;
    }
    return 1;
}

/* The ids of ``ids_obj`` (a list or tuple), their first ``limit`` (-1: all), as 64 bits in
 * a new buffer (``*n`` of them); NULL with an exception set. A bad id is an error before
 * anything changed. */
static uint64_t *convert_ids(PyObject *ids_obj, Py_ssize_t limit, Py_ssize_t *n) {
    PyObject *ids = PySequence_Fast(ids_obj, "ids must be a list or tuple of block ids (ints >= 0)");
    if (!ids) return NULL;
    Py_ssize_t n_ids = PySequence_Fast_GET_SIZE(ids);
    if (limit >= 0 && limit < n_ids) n_ids = limit;
    PyObject **items = PySequence_Fast_ITEMS(ids);
    uint64_t *id_of = PyMem_Malloc((n_ids ? n_ids : 1) * sizeof(uint64_t));
    if (!id_of) PyErr_NoMemory();
    for (Py_ssize_t i = 0; id_of && i < n_ids; i++)
        if (!block_id(items[i], i, &id_of[i])) {
            PyMem_Free(id_of);
            id_of = NULL;
        }
    Py_DECREF(ids);
    *n = n_ids;
    return id_of;
}

/* Memory, not work, bounds a walk down a large tree: each step's map slot and node are
 * a cache miss, one after another, since a step knows its node only from the one
 * before. But every key of the path is known before any lookup (the chain of the ids
 * from the root's key, as ``find_child`` and the insert compute them), so the map slots
 * of the path are fetched together, 32 at a time, then the nodes they name. Only loads
 * (build with -DNO_PREFETCH to compare): no decision changes. */
static void prefetch_path(Tree *t, int32_t root, const uint64_t *id_of, Py_ssize_t n_ids) {
#ifndef NO_PREFETCH
    const Map *m = &t->index;
    uint64_t key = t->nodes[root].key;
    size_t slots[32];
    for (Py_ssize_t start = 0; start < n_ids; start += 32) {
        Py_ssize_t n = n_ids - start < 32 ? n_ids - start : 32;
        for (Py_ssize_t i = 0; i < n; i++) {
            key = chain(key, id_of[start + i]);
            slots[i] = (size_t)key & m->mask;
            __builtin_prefetch(&m->keys[slots[i]]);
            __builtin_prefetch(&m->vals[slots[i]]);
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (m->keys[slots[i]]) __builtin_prefetch(&t->nodes[m->vals[slots[i]]]);
    }
#endif
}

/* Ledger.access of a prompt of ``n_ids`` blocks (checked root and tenant, ``match_blocks``
 * in [0, n_ids]): the hit in blocks, or -1 with an exception set. */
static Py_ssize_t tree_access(Tree *t, int32_t root, int tenant, const uint64_t *id_of, Py_ssize_t n_ids,
                              Py_ssize_t match_blocks, double now, Py_ssize_t head) {
    if (t->partitioned && tenant >= t->n_tenants) {
        int32_t n = tenant + 1 > t->n_tenants * 2 ? tenant + 1 : t->n_tenants * 2;
        int32_t *bigger = PyMem_Realloc(t->tenant_pool, (size_t)n * sizeof(int32_t));
        if (!bigger) {
            PyErr_NoMemory();
            return -1;
        }
        for (int32_t i = t->n_tenants; i < n; i++) bigger[i] = NONE;
        t->tenant_pool = bigger;
        t->n_tenants = n;
    }
    if (n_ids > t->cap_path) {
        int32_t *bigger = PyMem_Realloc(t->path, (size_t)n_ids * sizeof(int32_t));
        if (!bigger) {
            PyErr_NoMemory();
            return -1;
        }
        t->path = bigger;
        t->cap_path = n_ids;
    }
    Py_ssize_t result = -1;
    int32_t *path = t->path;
    prefetch_path(t, root, id_of, n_ids);

    /* match: the deepest cached block, verified step by step (Ledger.find) */
    Py_ssize_t depth = 0;
    int collided = 0;
    int32_t cur = root;
    while (depth < n_ids) {
        int32_t child = find_child(t, cur, id_of[depth], &collided);
        if (child == NONE) break;
        path[depth++] = cur = child;
    }
    t->collisions += collided;
    Py_ssize_t alive = depth;
    if (t->ttl) { /* Ledger.alive: what was last used before the horizon is not matched */
        t->now = now;
        double horizon = now - t->ttl;
        for (alive = 0; alive < depth && t->nodes[path[alive]].last_access >= horizon; alive++) {
        }
    }
    Py_ssize_t hit = alive < match_blocks ? alive : match_blocks;
    int32_t pinned = hit ? path[hit - 1] : NONE;
    if (pinned != NONE) { /* Ledger._touch: deepest first, then pin */
        Pool *p = &t->pools[t->nodes[pinned].pool];
        t->nodes[pinned].pins++;
        for (Py_ssize_t i = hit - 1; i >= 0; i--)
            if (policy_access(t, p, path[i]) < 0) goto unpin;
        if (t->ttl)
            for (Py_ssize_t i = hit - 1; i >= 0; i--) ttl_touch(t, path[i]);
    }

    /* insert what the path lacks under its deepest block (Ledger.extend, plan_chain) */
    if (depth < n_ids) {
        int32_t parent = depth ? path[depth - 1] : root, top = parent;
        int32_t pool = pool_for(t, tenant);
        if (pool == NONE) goto unpin;
        t->nodes[parent].pins++;
        int64_t need = 0;
        for (Py_ssize_t i = depth; i < n_ids; i++) need += i < head ? t->head_unit : t->unit;
        int64_t room = make_room(t, pool, need);
        t->nodes[parent].pins--;
        if (room < 0) goto unpin;
        Py_ssize_t first = depth;
        int64_t stored = 0;
        for (Py_ssize_t i = depth; i < n_ids && (i < head ? t->head_unit : t->unit) <= room; i++) {
            uint64_t key = chain(t->nodes[parent].key, id_of[i]);
            if (map_get(&t->index, key) != NONE) { /* the walk stopped here: another path's key */
                t->collisions++;
                break;
            }
            int32_t n = new_node(t);
            if (n == NONE || map_put(&t->index, key, n) < 0) goto unpin;
            Node *node = &t->nodes[n];
            node->key = key;
            node->id = id_of[i];
            node->parent = parent;
            node->nkids = node->pins = node->freq = node->queue = node->in_ttl = 0;
            node->last_access = 0.0;
            node->pool = pool;
            node->cost = (int32_t)(i < head ? t->head_unit : t->unit);
            t->nodes[parent].nkids++;
            path[depth++] = parent = n;
            room -= node->cost;
            stored += node->cost;
        }
        Pool *p = &t->pools[pool];
        const Map *ghost = t->policy == P_S3FIFO ? &p->ghost.where : t->policy == P_GITTINS ? &p->g->gwhere : NULL;
        for (Py_ssize_t i = first; ghost && i < depth; i++) /* each insert asks the ghost: its misses together */
            __builtin_prefetch(&ghost->keys[(size_t)t->nodes[path[i]].key & ghost->mask]);
        p->used += stored;
        p->blocks += depth - first;
        t->used += stored;
        t->blocks += depth - first;
        for (Py_ssize_t i = depth - 1; i >= first; i--) /* Ledger._link: deepest first */
            if (policy_insert(t, p, path[i]) < 0) goto unpin;
        /* Lifecycle._new_children: the chain's parent has its first child (its own blocks
         * told the policy at insert) */
        if (depth > first && t->nodes[top].nkids == 1 && set_leaf(t, top, 0) < 0) goto unpin;
    }
    if (t->ttl && n_ids) /* Ledger._refresh_ttl: the stored path counts as just used */
        for (Py_ssize_t i = depth - 1; i >= 0; i--) ttl_touch(t, path[i]);
    result = hit;
unpin:
    if (pinned != NONE) t->nodes[pinned].pins--;
    return result;
}

/* access(root, tenant, ids, match_blocks=-1, now=0.0, head=0) -> hit blocks.
 *
 * ``Ledger.access`` (``PrefixCache.access``) of a prompt of ``len(ids)`` blocks at time ``now``; with
 * ``match_blocks`` >= 0, the match covers only the first ``match_blocks`` of them and the
 * insert all of them (a prompt and its answer: ``match(prompt)``, ``insert(prompt +
 * output)``, release). A new block among the first ``head`` of ``ids`` costs ``head_unit``.
 */
static PyObject *Tree_access(Tree *t, PyObject *args) {
    int root, tenant;
    PyObject *ids_obj;
    Py_ssize_t match_blocks = -1, head = 0, n_ids;
    double now = 0.0;
    if (!ready(t) || !PyArg_ParseTuple(args, "iiO|ndn", &root, &tenant, &ids_obj, &match_blocks, &now, &head))
        return NULL;
    if (!check_root(t, root, tenant)) return NULL;
    if (match_blocks < -1) {
        PyErr_Format(PyExc_ValueError, "match_blocks must be >= 0, or -1 for all, got %zd", match_blocks);
        return NULL;
    }
    if (head < 0) {
        PyErr_Format(PyExc_ValueError, "head must be >= 0, got %zd", head);
        return NULL;
    }
    uint64_t *id_of = convert_ids(ids_obj, -1, &n_ids);
    if (!id_of) return NULL;
    if (match_blocks == -1 || match_blocks > n_ids) match_blocks = n_ids;
    Py_ssize_t hit = tree_access(t, root, tenant, id_of, n_ids, match_blocks, now, head);
    PyMem_Free(id_of);
    return hit < 0 ? NULL : PyLong_FromSsize_t(hit);
}

static PyTypeObject TreeType;

/* access_all(trees, roots, ids, now, head, limit=-1) -> [hit blocks of each tree].
 *
 * ``trees[i].access(roots[i], 0, ids[:limit], -1, now, head)`` for every i, the ids
 * converted once (curves.py's miniatures: one request on every capacity in one call).
 */
static PyObject *access_all(PyObject *module, PyObject *args) {
    PyObject *trees_obj, *roots_obj, *ids_obj;
    double now;
    Py_ssize_t head, limit = -1, n_ids;
    if (!PyArg_ParseTuple(args, "OOOdn|n", &trees_obj, &roots_obj, &ids_obj, &now, &head, &limit)) return NULL;
    if (head < 0) {
        PyErr_Format(PyExc_ValueError, "head must be >= 0, got %zd", head);
        return NULL;
    }
    PyObject *trees = PySequence_Fast(trees_obj, "trees must be a list or tuple of Tree");
    if (!trees) return NULL;
    PyObject *roots = PySequence_Fast(roots_obj, "roots must be a list or tuple of root slots");
    PyObject *out = NULL;
    uint64_t *id_of = NULL;
    if (!roots) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(trees);
    if (PySequence_Fast_GET_SIZE(roots) != n) {
        PyErr_Format(PyExc_ValueError, "%zd trees but %zd roots", n, PySequence_Fast_GET_SIZE(roots));
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *tree = PySequence_Fast_GET_ITEM(trees, i);
        if (!PyObject_TypeCheck(tree, &TreeType)) {
            PyErr_Format(PyExc_TypeError, "trees[%zd] is a %.100s, not a Tree", i, Py_TYPE(tree)->tp_name);
            goto done;
        }
        long root = PyLong_AsLong(PySequence_Fast_GET_ITEM(roots, i));
        if (root == -1 && PyErr_Occurred()) goto done;
        if (!ready((Tree *)tree) || !check_root((Tree *)tree, root < INT32_MAX ? (int)root : -1, 0)) goto done;
    }
    id_of = convert_ids(ids_obj, limit, &n_ids);
    if (!id_of || !(out = PyList_New(n))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Tree *t = (Tree *)PySequence_Fast_GET_ITEM(trees, i);
        int32_t root = (int32_t)PyLong_AsLong(PySequence_Fast_GET_ITEM(roots, i));
        Py_ssize_t hit = tree_access(t, root, 0, id_of, n_ids, n_ids, now, head);
        PyObject *value = hit < 0 ? NULL : PyLong_FromSsize_t(hit);
        if (!value) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, value);
    }
done:
    PyMem_Free(id_of);
    Py_XDECREF(roots);
    Py_DECREF(trees);
    return out;
}

static Py_ssize_t Tree_len(Tree *t) { return (Py_ssize_t)t->blocks; }

static PyObject *Tree_get_evictions(Tree *t, void *closure) { return PyLong_FromLongLong(t->evictions); }
static PyObject *Tree_get_used(Tree *t, void *closure) { return PyLong_FromLongLong(t->used); }
static PyObject *Tree_get_collisions(Tree *t, void *closure) { return PyLong_FromLongLong(t->collisions); }
static PyObject *Tree_get_expired(Tree *t, void *closure) { return PyLong_FromLongLong(t->expired); }
static PyObject *Tree_get_capacity(Tree *t, void *closure) { return PyLong_FromLongLong(t->capacity); }

static PyObject *Tree_pools(Tree *t, PyObject *unused) {
    PyObject *out = PyList_New(t->n_pools);
    if (!out) return NULL;
    for (int32_t i = 0; i < t->n_pools; i++) {
        Pool *p = &t->pools[i];
        PyObject *row = Py_BuildValue("{s:L,s:L,s:L,s:L}", "quota", (long long)p->quota, "used", (long long)p->used,
                                      "blocks", (long long)p->blocks, "evictions", (long long)p->evictions);
        if (!row) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, row);
    }
    return out;
}

static PyMethodDef Tree_methods[] = {
    {"root", (PyCFunction)Tree_root, METH_O, "root(key) -> slot of a new context root"},
    {"access", (PyCFunction)Tree_access, METH_VARARGS,
     "access(root, tenant, ids, match_blocks=-1, now=0.0, head=0) -> hit blocks: match, insert, release"},
    {"pools", (PyCFunction)Tree_pools, METH_NOARGS, "pools() -> [{quota, used, blocks, evictions}] in creation order"},
    {NULL},
};

static PyGetSetDef Tree_getset[] = {
    {"evictions", (getter)Tree_get_evictions, NULL, "blocks evicted so far", NULL},
    {"used", (getter)Tree_get_used, NULL, "tokens held", NULL},
    {"collisions", (getter)Tree_get_collisions, NULL, "keys that named another path", NULL},
    {"expired", (getter)Tree_get_expired, NULL, "blocks reclaimed by the TTL", NULL},
    {"capacity", (getter)Tree_get_capacity, NULL, "capacity in tokens", NULL},
    {NULL},
};

static PySequenceMethods Tree_as_sequence = {.sq_length = (lenfunc)Tree_len};

static PyTypeObject TreeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "prefixcache.sim.native._kernel.Tree",
    .tp_basicsize = sizeof(Tree),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Tree(policy, capacity, unit, partitioned=False, ttl=None, head_unit=0): PrefixCache's metadata path for "
              "replays.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tree_init,
    .tp_dealloc = (destructor)Tree_dealloc,
    .tp_methods = Tree_methods,
    .tp_getset = Tree_getset,
    .tp_as_sequence = &Tree_as_sequence,
};

static PyMethodDef kernel_functions[] = {
    {"access_all", access_all, METH_VARARGS,
     "access_all(trees, roots, ids, now, head, limit=-1) -> [hit blocks]: one request on every tree"},
    {NULL},
};

static struct PyModuleDef kernel_module = {
    PyModuleDef_HEAD_INIT,
    .m_methods = kernel_functions,
    .m_name = "prefixcache.sim.native._kernel",
    .m_doc = "The trace simulator's compiled replay kernel (see _kernel.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__kernel(void) {
    if (PyType_Ready(&TreeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&kernel_module);
    if (!m) return NULL;
    PyObject *names = PyTuple_New(N_POLICIES);
    if (!names) goto fail;
    for (int i = 0; i < N_POLICIES; i++) {
        PyObject *s = PyUnicode_FromString(POLICY_NAMES[i]);
        if (!s) {
            Py_DECREF(names);
            goto fail;
        }
        PyTuple_SET_ITEM(names, i, s);
    }
    if (PyModule_AddObject(m, "POLICIES", names) < 0) {
        Py_DECREF(names);
        goto fail;
    }
    Py_INCREF(&TreeType);
    if (PyModule_AddObject(m, "Tree", (PyObject *)&TreeType) < 0) {
        Py_DECREF(&TreeType);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
