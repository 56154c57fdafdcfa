/* GittinsPolicy (policies/gittins.py, policies/gittins_index.py) for the replay kernel.
 *
 * Included by _kernel.c after its types: it works on that file's Tree, Pool and Node.
 * Every decision is the Python policy's, order for order, and the index table is
 * computed with the same double operations in the same order (no reassociation, no
 * fused multiply-add: ISO C11 mode contracts nothing), so both engines rank every
 * block identically and break every tie the same way. Read the Python first; each
 * function names what it mirrors. The parameters are the policy's defaults.
 *
 *     per class c: groups in the OrderedDict's order (a new group goes to the back)
 *         group (c, tick): its entries in order, linked through Node.prev/next
 *     gmap: (tick, c) -> group slot
 *     ghost: evicted keys -> (tick, class, reuses), FIFO, expired from the front
 *
 * Node fields used: rank = tick of the last access, queue = class, freq = reuses so
 * far, group = its group (NONE when interior), interior = the ledger's set_leaf news
 * (the kernel knows every block's children, so it tells itself at the same moments).
 */

#define G_HORIZON 16.0
#define G_BINS 128
#define G_MAX_HITS 3
#define G_IRR 3
#define G_MEMORY 4.0
#define G_PRIOR 50.0
#define G_PROBE 2
#define G_CLASSES (1 + G_MAX_HITS * G_IRR)

typedef struct {
    int64_t tick;
    int32_t cls, head, tail, prev, next; /* prev/next: the class's order; next chains free slots */
    int64_t len;
} GGroup;

typedef struct {
    uint64_t key;
    int64_t tick;
    int32_t cls, reuses, live;
} GGhost;

typedef struct Gittins {
    int64_t clock, tick, next_table, quantum, ghost_cap;
    double decay;
    int has_index;
    int64_t open[G_CLASSES][G_BINS]; /* open trials by start tick % bins */
    double hits[G_CLASSES][G_BINS];  /* reuses by age (decayed) */
    double expired[G_CLASSES];       /* trials that reached the horizon (decayed) */
    double index[G_CLASSES][G_BINS];
    int32_t first[G_CLASSES], last[G_CLASSES];
    int64_t n_groups[G_CLASSES];
    GGroup *groups;
    int32_t cap_groups, used_groups, free_group;
    Map gmap;
    GGhost *ghost; /* live window ghost[gstart:gend], absolute position = gbase + offset */
    int64_t gstart, gend, gcap, gbase, glive;
    Map gwhere; /* key -> absolute position */
} Gittins;

static void gittins_resize(Gittins *g, int64_t capacity) { /* GittinsPolicy.resize */
    int64_t q = (int64_t)(G_HORIZON * (double)capacity / G_BINS);
    int64_t cap = (int64_t)(G_HORIZON * (double)capacity);
    g->quantum = q > 1 ? q : 1;
    g->ghost_cap = cap > 1 ? cap : 1;
    double decay = 1.0 - 1.0 / (2.0 * G_MEMORY * G_HORIZON);
    g->decay = decay > 0.5 ? decay : 0.5;
}

static int64_t gittins_table_every(void) { /* GittinsPolicy._table_every */
    int64_t every = (int64_t)(G_BINS / (2 * G_HORIZON));
    return every > 1 ? every : 1;
}

static Gittins *gittins_new(void) {
    Gittins *g = PyMem_Calloc(1, sizeof(Gittins));
    if (!g) {
        PyErr_NoMemory();
        return NULL;
    }
    for (int c = 0; c < G_CLASSES; c++) g->first[c] = g->last[c] = NONE;
    g->free_group = NONE;
    g->next_table = gittins_table_every();
    g->gcap = 64;
    g->ghost = PyMem_Malloc(g->gcap * sizeof(GGhost));
    if (!g->ghost || map_init(&g->gmap, 64) < 0 || map_init(&g->gwhere, 64) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return NULL; /* NOTE: freed with the pool (gittins_free) */
    }
    return g;
}

static void gittins_free(Gittins *g) {
    if (!g) return;
    PyMem_Free(g->groups);
    PyMem_Free(g->ghost);
    if (g->gmap.keys) map_free(&g->gmap);
    if (g->gwhere.keys) map_free(&g->gwhere);
    PyMem_Free(g);
}

/* ``int.bit_length() - 1`` of x >= 1 */
static inline int floor_log2(uint64_t x) { return 63 - __builtin_clzll(x); }

static inline int32_t gittins_class(int64_t reuses, int64_t last_age) { /* GittinsPolicy._class */
    if (reuses == 0) return 0;
    int64_t bucket = floor_log2((uint64_t)(last_age + 1)) / 2;
    if (bucket > G_IRR - 1) bucket = G_IRR - 1;
    int64_t hits = reuses < G_MAX_HITS ? reuses : G_MAX_HITS;
    return (int32_t)(1 + (hits - 1) * G_IRR + bucket);
}

static inline int64_t pymod(int64_t a, int64_t b) { return ((a % b) + b) % b; }

/* ------------------------------------------------------------------ the index */

static double g_slope(const double *xs, const double *ys, int a, int b) {
    double dx = xs[b] - xs[a];
    return dx > 0 ? (ys[b] - ys[a]) / dx : 0.0;
}

static double g_cross(const double *xs, const double *ys, int o, int a, int b) {
    return (xs[a] - xs[o]) * (ys[b] - ys[o]) - (ys[a] - ys[o]) * (xs[b] - xs[o]);
}

/* gittins_index (policies/gittins_index.py) */
static void gittins_index(const double *hits, const double *risk, double *index) {
    double xs[G_BINS + 1], ys[G_BINS + 1];
    int hull[G_BINS + 1];
    int n = G_BINS, hn = 0;
    xs[0] = ys[0] = 0.0;
    double surv = 1.0;
    for (int x = 0; x < n; x++) {
        double h = risk[x] > 0 ? hits[x] / risk[x] : 0.0;
        h = h < 0.0 ? 0.0 : (h > 1.0 ? 1.0 : h);
        xs[x + 1] = xs[x] + surv;
        ys[x + 1] = ys[x] + surv * h;
        surv *= 1.0 - h;
    }
    for (int a = n - 1; a >= 0; a--) {
        int p = a + 1;
        while (hn && xs[hull[hn - 1]] <= xs[p]) {
            if (ys[hull[hn - 1]] > ys[p]) {
                p = -1;
                break;
            }
            hn--;
        }
        if (p >= 0) {
            while (hn >= 2 && g_cross(xs, ys, p, hull[hn - 1], hull[hn - 2]) >= 0) hn--;
            hull[hn++] = p;
        }
        int lo = 0, hi = hn - 1;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (g_slope(xs, ys, a, hull[mid]) < g_slope(xs, ys, a, hull[mid + 1]))
                lo = mid + 1;
            else
                hi = mid;
        }
        if (hn) {
            double s = g_slope(xs, ys, a, hull[lo]);
            index[a] = 0.0 > s ? 0.0 : s; /* max(s, 0.0) */
        } else {
            index[a] = 0.0;
        }
    }
}

static void gittins_recompute(Gittins *g) { /* GittinsPolicy._recompute */
    double risks[G_CLASSES][G_BINS];
    double total_hits[G_BINS] = {0}, total_risk[G_BINS] = {0};
    int64_t tick = g->tick;
    for (int c = 0; c < G_CLASSES; c++) {
        double above = g->expired[c];
        int64_t open_above = 0;
        for (int x = G_BINS - 1; x >= 0; x--) {
            open_above += g->open[c][pymod(tick - x, G_BINS)];
            above += g->hits[c][x];
            risks[c][x] = above + (double)open_above;
            total_hits[x] += g->hits[c][x];
            total_risk[x] += risks[c][x];
        }
    }
    double base = total_risk[0] != 0.0 ? total_risk[0] : 1.0;
    double h[G_BINS], r[G_BINS];
    for (int c = 0; c < G_CLASSES; c++) {
        for (int x = 0; x < G_BINS; x++) {
            double w = G_PRIOR * total_risk[x] / base;
            double pooled = total_risk[x] > 0 ? total_hits[x] / total_risk[x] : 0.0;
            h[x] = g->hits[c][x] + w * pooled;
            r[x] = risks[c][x] + w;
        }
        gittins_index(h, r, g->index[c]);
    }
    g->has_index = 1;
    for (int c = 0; c < G_CLASSES; c++) {
        for (int x = 0; x < G_BINS; x++) g->hits[c][x] = g->hits[c][x] * g->decay;
        g->expired[c] *= g->decay;
    }
}

/* ------------------------------------------------------------------ trials */

static void gittins_advance(Gittins *g, int64_t size) { /* GittinsPolicy._advance */
    g->clock += size;
    int64_t tick = g->clock / g->quantum;
    while (g->tick < tick) {
        g->tick++;
        int64_t slot = g->tick % G_BINS;
        for (int c = 0; c < G_CLASSES; c++) {
            if (g->open[c][slot]) {
                g->expired[c] += (double)g->open[c][slot];
                g->open[c][slot] = 0;
            }
        }
        if (g->tick >= g->next_table) {
            g->next_table = g->tick + gittins_table_every();
            gittins_recompute(g);
        }
    }
}

/* GittinsPolicy._reuse: a trial (start, c) ends with a reuse now; the next one's class. */
static int32_t gittins_reuse(Gittins *g, int64_t start, int32_t c, int64_t reuses) {
    int64_t age = g->tick - start;
    if (age < G_BINS) {
        g->hits[c][age] += 1.0;
        g->open[c][start % G_BINS] -= 1;
    }
    return gittins_class(reuses + 1, age);
}

static inline uint64_t gkey(int64_t tick, int32_t c) { return ((uint64_t)tick * G_CLASSES + (uint64_t)c) + 1; }

/* GittinsPolicy._link: to the back of group (start, c), made at the class's back. */
static int gittins_link(Gittins *g, Node *nodes, int32_t n) {
    int64_t start = nodes[n].rank;
    int32_t c = nodes[n].queue;
    int64_t slot = map_get(&g->gmap, gkey(start, c));
    if (slot == NONE) {
        if (g->free_group != NONE) {
            slot = g->free_group;
            g->free_group = g->groups[slot].next;
        } else {
            if (g->used_groups == g->cap_groups) {
                int32_t cap = g->cap_groups ? g->cap_groups * 2 : 64;
                GGroup *bigger = PyMem_Realloc(g->groups, (size_t)cap * sizeof(GGroup));
                if (!bigger) {
                    PyErr_NoMemory();
                    return -1;
                }
                g->groups = bigger;
                g->cap_groups = cap;
            }
            slot = g->used_groups++;
        }
        if (map_put(&g->gmap, gkey(start, c), slot) < 0) return -1;
        GGroup *grp = &g->groups[slot];
        grp->tick = start;
        grp->cls = c;
        grp->head = grp->tail = NONE;
        grp->len = 0;
        grp->next = NONE;
        grp->prev = g->last[c];
        if (g->last[c] != NONE)
            g->groups[g->last[c]].next = (int32_t)slot;
        else
            g->first[c] = (int32_t)slot;
        g->last[c] = (int32_t)slot;
        g->n_groups[c]++;
    }
    GGroup *grp = &g->groups[slot];
    nodes[n].prev = grp->tail;
    nodes[n].next = NONE;
    if (grp->tail != NONE)
        nodes[grp->tail].next = n;
    else
        grp->head = n;
    grp->tail = n;
    grp->len++;
    nodes[n].group = (int32_t)slot;
    return 0;
}

/* GittinsPolicy._unlink: out of its group; an emptied group leaves its class. */
static void gittins_unlink(Gittins *g, Node *nodes, int32_t n) {
    if (nodes[n].interior) return;
    int32_t slot = nodes[n].group;
    GGroup *grp = &g->groups[slot];
    int32_t p = nodes[n].prev, x = nodes[n].next;
    if (p != NONE)
        nodes[p].next = x;
    else
        grp->head = x;
    if (x != NONE)
        nodes[x].prev = p;
    else
        grp->tail = p;
    nodes[n].group = NONE;
    if (--grp->len) return;
    int32_t c = grp->cls;
    map_del(&g->gmap, gkey(grp->tick, c));
    if (grp->prev != NONE)
        g->groups[grp->prev].next = grp->next;
    else
        g->first[c] = grp->next;
    if (grp->next != NONE)
        g->groups[grp->next].prev = grp->prev;
    else
        g->last[c] = grp->prev;
    g->n_groups[c]--;
    grp->next = g->free_group;
    g->free_group = slot;
}

/* GittinsPolicy._start: a trial of class c starts now. */
static int gittins_start(Gittins *g, Node *nodes, int32_t n, int64_t reuses, int32_t c) {
    nodes[n].rank = g->tick;
    nodes[n].queue = c;
    nodes[n].freq = (int32_t)(reuses < INT32_MAX ? reuses : INT32_MAX);
    g->open[c][g->tick % G_BINS]++;
    return nodes[n].interior ? 0 : gittins_link(g, nodes, n);
}

/* ------------------------------------------------------------------ the ghost */

static int gittins_ghost_add(Gittins *g, uint64_t key, int64_t tick, int32_t c, int32_t reuses) {
    if (g->gend == g->gcap) {
        if (g->gstart * 2 >= g->gcap) { /* mostly dead in front: slide down */
            memmove(g->ghost, g->ghost + g->gstart, (g->gend - g->gstart) * sizeof(GGhost));
            g->gbase += g->gstart;
            g->gend -= g->gstart;
            g->gstart = 0;
        } else {
            GGhost *bigger = PyMem_Realloc(g->ghost, g->gcap * 2 * sizeof(GGhost));
            if (!bigger) {
                PyErr_NoMemory();
                return -1;
            }
            g->ghost = bigger;
            g->gcap *= 2;
        }
    }
    GGhost *e = &g->ghost[g->gend];
    e->key = key;
    e->tick = tick;
    e->cls = c;
    e->reuses = reuses;
    e->live = 1;
    if (map_put(&g->gwhere, key, g->gbase + g->gend) < 0) return -1;
    g->gend++;
    g->glive++;
    return 0;
}

/* ``ghost.pop(key, None)``: the entry, or NULL. */
static GGhost *gittins_ghost_pop(Gittins *g, uint64_t key) {
    int64_t pos = map_get(&g->gwhere, key);
    if (pos == NONE) return NULL;
    map_del(&g->gwhere, key);
    GGhost *e = &g->ghost[pos - g->gbase];
    e->live = 0;
    g->glive--;
    return e;
}

/* The end of GittinsPolicy._evict: the oldest ghosts leave while their trial is over or
 * there are more than ``ghost_cap``. */
static void gittins_ghost_trim(Gittins *g) {
    if (g->gstart + 4 < g->gend) /* a later trim's map slot, fetched ahead */
        __builtin_prefetch(&g->gwhere.keys[(size_t)g->ghost[g->gstart + 4].key & g->gwhere.mask]);
    while (g->glive) {
        GGhost *e = &g->ghost[g->gstart];
        if (e->live) {
            if (g->tick - e->tick < G_BINS && g->glive <= g->ghost_cap) break;
            map_del(&g->gwhere, e->key);
            e->live = 0;
            g->glive--;
        }
        g->gstart++;
    }
    if (!g->glive) { /* empty: restart at the front */
        g->gbase += g->gend;
        g->gstart = g->gend = 0;
    }
}

/* ------------------------------------------------------------------ the interface */

/* GittinsPolicy.insert; ``interior``: the ledger's set_leaf(k, False) that follows it
 * for every block of a new chain but its deepest (the same end state). */
static int gittins_insert(Gittins *g, Node *nodes, int32_t n, int64_t size) {
    int64_t reuses = 0;
    int32_t c = 0;
    nodes[n].interior = nodes[n].nkids > 0;
    nodes[n].group = NONE;
    GGhost *ghost = gittins_ghost_pop(g, nodes[n].key);
    if (ghost && g->tick - ghost->tick < G_BINS) {
        c = gittins_reuse(g, ghost->tick, ghost->cls, ghost->reuses);
        reuses = (int64_t)ghost->reuses + 1;
    }
    if (gittins_start(g, nodes, n, reuses, c) < 0) return -1;
    gittins_advance(g, size);
    return 0;
}

static int gittins_access(Gittins *g, Node *nodes, int32_t n, int64_t size) { /* GittinsPolicy.access */
    gittins_unlink(g, nodes, n);
    int64_t reuses = nodes[n].freq;
    int32_t c = gittins_reuse(g, nodes[n].rank, nodes[n].queue, reuses);
    if (gittins_start(g, nodes, n, reuses + 1, c) < 0) return -1;
    gittins_advance(g, size);
    return 0;
}

static int gittins_set_leaf(Gittins *g, Node *nodes, int32_t n, int leaf) { /* GittinsPolicy.set_leaf */
    if (leaf) {
        if (nodes[n].interior) {
            nodes[n].interior = 0;
            return gittins_link(g, nodes, n);
        }
    } else if (!nodes[n].interior) {
        gittins_unlink(g, nodes, n);
        nodes[n].interior = 1;
    }
    return 0;
}

static void gittins_remove(Gittins *g, Node *nodes, int32_t n) { /* GittinsPolicy.remove */
    gittins_unlink(g, nodes, n);
    nodes[n].interior = 0;
    int64_t start = nodes[n].rank;
    if (g->tick - start < G_BINS) g->open[nodes[n].queue][start % G_BINS] -= 1;
}

static inline double gittins_rank(const Gittins *g, int32_t c, int64_t start) { /* GittinsPolicy._rank */
    int64_t age = g->tick - start;
    if (!g->has_index) return -(double)age;
    return age < G_BINS ? g->index[c][age] : 0.0;
}

/* _first: the first evictable of ``probe`` entries of a group, the blocked ones to its back. */
static int32_t gittins_first(GGroup *grp, Node *nodes) {
    int64_t tries = grp->len < G_PROBE ? grp->len : G_PROBE;
    for (int64_t i = 0; i < tries; i++) {
        int32_t n = grp->head;
        if (evictable(&nodes[n])) return n;
        if (grp->tail == n) continue;
        int32_t x = nodes[n].next; /* move_to_end */
        nodes[x].prev = NONE;
        grp->head = x;
        nodes[n].prev = grp->tail;
        nodes[n].next = NONE;
        nodes[grp->tail].next = n;
        grp->tail = n;
    }
    return NONE;
}

/* GittinsPolicy._scan: every entry, when no end of any class had an evictable one. */
static int32_t gittins_scan(Gittins *g, Node *nodes) {
    int32_t best = NONE;
    double best_rank = 0.0;
    int64_t best_start = 0;
    for (int c = 0; c < G_CLASSES; c++) {
        for (int32_t s = g->first[c]; s != NONE; s = g->groups[s].next) {
            GGroup *grp = &g->groups[s];
            double rank = gittins_rank(g, c, grp->tick);
            if (best != NONE && (rank > best_rank || (rank == best_rank && grp->tick >= best_start))) continue;
            for (int32_t n = grp->head; n != NONE; n = nodes[n].next) {
                if (evictable(&nodes[n])) {
                    best = n;
                    best_rank = rank;
                    best_start = grp->tick;
                    break;
                }
            }
        }
    }
    return best;
}

/* GittinsPolicy.victim (and _evict): NONE when nothing may leave, -2 on error. */
static int32_t gittins_victim(Gittins *g, Node *nodes) {
    int32_t best = NONE;
    double best_rank = 0.0;
    int64_t best_start = 0;
    for (int c = 0; c < G_CLASSES; c++) {
        if (!g->n_groups[c]) continue;
        int ends = g->n_groups[c] > 1 ? 2 : 1;
        for (int e = 0; e < ends; e++) {
            int32_t s = e == 0 ? g->first[c] : g->last[c];
            for (int i = 0; s != NONE && i < G_PROBE; i++) {
                GGroup *grp = &g->groups[s];
                int32_t n = gittins_first(grp, nodes);
                if (n != NONE) {
                    double rank = gittins_rank(g, c, grp->tick);
                    if (best == NONE || rank < best_rank || (rank == best_rank && grp->tick < best_start)) {
                        best = n;
                        best_rank = rank;
                        best_start = grp->tick;
                    }
                    break;
                }
                s = e == 0 ? grp->next : grp->prev;
            }
        }
    }
    if (best == NONE) best = gittins_scan(g, nodes);
    if (best == NONE) return NONE;
    __builtin_prefetch(&g->gwhere.keys[(size_t)nodes[best].key & g->gwhere.mask]); /* for ghost_add */
    gittins_unlink(g, nodes, best);
    nodes[best].interior = 0;
    int64_t start = nodes[best].rank;
    if (g->tick - start < G_BINS &&
        gittins_ghost_add(g, nodes[best].key, start, nodes[best].queue, nodes[best].freq) < 0)
        return -2;
    gittins_ghost_trim(g);
    return best;
}
