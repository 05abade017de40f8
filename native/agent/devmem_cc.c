/* The concurrent copy of `dump --leave-running`, and the gate that holds the job's writers
 * (see devmem.c). */
#include "devmem_int.h"

/* --- the concurrent copy (dump --leave-running) -------------------------------------------
 *
 * At the cut (LOCKED, drained) the job's allocations are only planned: their pieces are copied
 * after Unlock by a thread of the agent while the job runs, and a call of the job that is about
 * to write a piece not yet copied copies it first (npusnap_devmem_before_write, called by every
 * wrapper writes.c counts as a writer, before the real call; a writer whose target is unknown
 * waits for the whole copy). So the image holds every piece as it was at the cut, and the job is
 * held only for the cut. Pieces: 0 copied or not needed, 1 to copy, 2 being copied. */
struct cc_range {
    uintptr_t ptr;
    size_t size;
    off_t file_off;
    unsigned char *state;
};
static struct {
    int planned;
    int active; /* the hooks copy first; read without the lock (atomically) on every call */
    int fd;
    memcpy_fn_t fn;
    struct cc_range *r;
    size_t n, cap, left, cursor_r, cursor_j;
    int err;
    char errmsg[256];
    uint64_t cow, background;
    int inside; /* threads in cc_piece_locked: the plan they read is not freed under them */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    int th_started;
    /* The last save was to plan, and all of it was copied at the cut (no allocation of the
     * job's own): the copy to wait for is complete, unlike a plan that was dropped. */
    int whole_at_cut;
} g_cc = {.fd = -1, .mu = PTHREAD_MUTEX_INITIALIZER};

/* The lock's hold on the job's writers (npusnap_devmem_hold_writers). */
__thread int t_entered; /* this thread's outermost writer went through the entry */
int g_entry_closed;     /* the lock's hold on writers (npusnap_devmem_hold_writers) */
int g_writers_inside;   /* the job's outermost writer calls past their entry */
pthread_mutex_t g_emu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_ecv; /* monotonic: cc_init */

static void ws_after_fork(void);

/* copy_wait's and the gate's deadlines are CLOCK_MONOTONIC, as everywhere. */
__attribute__((constructor)) static void cc_init(void) {
    monotonic_cond_init(&g_cc.cv);
    monotonic_cond_init(&g_ecv);
    pthread_atfork(NULL, NULL, ws_after_fork);
}

/* A save that was to plan: nothing planned means all of it was copied at the cut. */
void cc_note_whole_at_cut(int planning) {
    pthread_mutex_lock(&g_cc.mu);
    g_cc.whole_at_cut = planning && !g_cc.planned;
    pthread_mutex_unlock(&g_cc.mu);
}

static void cc_clear_locked(void) {
    g_cc.active = 0;
    while (g_cc.inside) pthread_cond_wait(&g_cc.cv, &g_cc.mu);
    for (size_t i = 0; i < g_cc.n; i++) free(g_cc.r[i].state);
    free(g_cc.r);
    g_cc.r = NULL;
    g_cc.n = g_cc.cap = g_cc.left = g_cc.cursor_r = g_cc.cursor_j = 0;
    g_cc.planned = 0;
    g_cc.whole_at_cut = 0;
    g_cc.err = 0;
    g_cc.errmsg[0] = 0;
    if (g_cc.fd >= 0) close(g_cc.fd);
    g_cc.fd = -1;
}

/* Holds g_mu (the save). */
int cc_plan_add(const struct alloc *a, off_t file_off, const unsigned char *unchanged) {
    size_t np = dm_pieces_of(a);
    pthread_mutex_lock(&g_cc.mu);
    int rc = dm_grow((void **)&g_cc.r, &g_cc.cap, g_cc.n, sizeof *g_cc.r);
    unsigned char *st = rc == 0 ? calloc(np ? np : 1, 1) : NULL;
    if (!st) rc = -ENOMEM;
    if (rc == 0) {
        size_t todo = 0;
        for (size_t j = 0; j < np; j++) todo += st[j] = g_check_all || !unchanged[j]; /* checked: all */
        g_cc.r[g_cc.n++] = (struct cc_range){a->ptr, a->size, file_off, st};
        g_cc.left += todo;
        g_cc.planned = 1;
    }
    pthread_mutex_unlock(&g_cc.mu);
    return rc;
}

static __thread char *t_cc_buf;

/* Copy piece j of range r (its state already 2); 0 or -errno. */
static int cc_copy(const struct cc_range *r, size_t j) {
    if (!t_cc_buf && !(t_cc_buf = malloc(PIECE))) return -ENOMEM;
    size_t off = j * PIECE, n = r->size - off < PIECE ? r->size - off : PIECE;
    int saved = t_agent;
    t_agent = 1;
    drvError_t rc = g_cc.fn((DVdeviceptr)(uintptr_t)t_cc_buf, n, (DVdeviceptr)(r->ptr + off), n);
    t_agent = saved;
    if (rc != 0) return -EIO;
    return dm_pwrite_full(g_cc.fd, t_cc_buf, n, r->file_off + (off_t)off);
}

/* Take piece j of range i (held: g_cc.mu), copy it without the lock, mark it done. A piece
 * another thread is copying is waited for. */
static void cc_piece_locked(size_t i, size_t j, int cow) {
    struct cc_range *r = &g_cc.r[i];
    g_cc.inside++;
    while (r->state[j] == 2) pthread_cond_wait(&g_cc.cv, &g_cc.mu);
    if (r->state[j] != 1 || g_cc.err) {
        if (--g_cc.inside == 0) pthread_cond_broadcast(&g_cc.cv);
        return;
    }
    r->state[j] = 2;
    pthread_mutex_unlock(&g_cc.mu);
    int rc = cc_copy(r, j);
    pthread_mutex_lock(&g_cc.mu);
    g_cc.inside--;
    r->state[j] = 0;
    g_cc.left--;
    if (cow) g_cc.cow++;
    else g_cc.background++;
    if (rc != 0 && !g_cc.err) {
        g_cc.err = rc;
        snprintf(g_cc.errmsg, sizeof g_cc.errmsg, "copying %zu bytes at %#lx off the device failed (%s)", PIECE,
                 (unsigned long)(r->ptr + j * PIECE), strerror(-rc));
    }
    pthread_cond_broadcast(&g_cc.cv);
}

static void cc_cow_range(uintptr_t p, size_t n) {
    pthread_mutex_lock(&g_cc.mu);
    for (size_t i = 0; g_cc.active && i < g_cc.n; i++) {
        struct cc_range *r = &g_cc.r[i];
        if (p >= r->ptr + r->size || p + n <= r->ptr) continue;
        uintptr_t lo = p > r->ptr ? p : r->ptr, hi = p + n < r->ptr + r->size ? p + n : r->ptr + r->size;
        for (size_t j = (lo - r->ptr) / PIECE; g_cc.active && j <= (hi - 1 - r->ptr) / PIECE; j++)
            cc_piece_locked(i, j, 1);
    }
    pthread_mutex_unlock(&g_cc.mu);
}

static void cc_cow_all(void) {
    pthread_mutex_lock(&g_cc.mu);
    for (size_t i = 0; g_cc.active && i < g_cc.n && !g_cc.err; i++)
        for (size_t j = 0; g_cc.active && j < (g_cc.r[i].size + PIECE - 1) / PIECE; j++) cc_piece_locked(i, j, 1);
    while (g_cc.active && g_cc.left && !g_cc.err) pthread_cond_wait(&g_cc.cv, &g_cc.mu);
    pthread_mutex_unlock(&g_cc.mu);
}

/* Writers in flight. A call of the job takes its hook (below) and then enters the runtime, where
 * Lock may hold it at the gate: its hook ran before the copy was planned, and after Unlock it
 * writes. So every writer notes what it will write in a slot of its thread, open from before its
 * hook until its real call returned, and copy_start copies what the open slots name before
 * Unlock. The slot is noted before `active` is read, and copy_start sets `active` before it reads
 * the slots (both sequentially consistent): a writer either sees the copy or is seen by it. */
#define WS_SLOTS 512
#define WS_RANGES 16
struct wslot {
    int owned, busy, all, depth;
    size_t n;
    uintptr_t p[WS_RANGES];
    size_t len[WS_RANGES];
};
static struct wslot g_ws[WS_SLOTS];
static int g_ws_unslotted; /* open writers of threads that found no free slot: count as writing all */
static __thread struct wslot *t_ws;
static __thread int t_ws_none, t_ws_none_depth;
static pthread_key_t g_ws_key;
static pthread_once_t g_ws_once = PTHREAD_ONCE_INIT;

/* The child has only the forking thread: the other threads' slots are free there. */
static void ws_after_fork(void) {
    for (int i = 0; i < WS_SLOTS; i++)
        if (&g_ws[i] != t_ws) g_ws[i].owned = g_ws[i].busy = g_ws[i].depth = 0;
    g_ws_unslotted = t_ws_none_depth > 0;
    /* A hold of the parent's is not the child's, and only this thread may be inside a writer. */
    g_entry_closed = 0;
    g_writers_inside = t_entered;
    pthread_mutex_init(&g_emu, NULL);
    monotonic_cond_init(&g_ecv);
}

static void ws_release(void *slot) {
    struct wslot *w = slot;
    __atomic_store_n(&w->busy, 0, __ATOMIC_SEQ_CST);
    w->depth = 0;
    __atomic_store_n(&w->owned, 0, __ATOMIC_RELEASE);
}
static void ws_key_init(void) { (void)pthread_key_create(&g_ws_key, ws_release); }

static struct wslot *ws_claim(void) {
    pthread_once(&g_ws_once, ws_key_init);
    for (int i = 0; i < WS_SLOTS; i++) {
        int zero = 0;
        if (__atomic_compare_exchange_n(&g_ws[i].owned, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            (void)pthread_setspecific(g_ws_key, &g_ws[i]);
            return &g_ws[i];
        }
    }
    return NULL;
}

/* The lock's hold on the job's writers. A call past the runtime's entry check when Lock comes
 * runs to its end (shared CANN notes, "Lock"): a copy or a launch that had passed it would write
 * device memory, or queue work, after the drain, while the memory is being copied, and the image
 * would hold the old bytes for a host that saw the call return. So before Lock the agent closes
 * the entry of every writer (this thread's outermost write_open), waits until none is inside, and
 * opens it again once Lock returned: a writer that came meanwhile goes on into the runtime and
 * waits at its gate, never past it. Dekker-style: a writer counts itself in, then reads `closed`;
 * the hold sets `closed`, then reads the count (both sequentially consistent). */

static void entry_leave(void) {
    if (__atomic_sub_fetch(&g_writers_inside, 1, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_load_n(&g_entry_closed, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&g_emu);
        pthread_cond_broadcast(&g_ecv);
        pthread_mutex_unlock(&g_emu);
    }
}

static void entry_enter(void) {
    for (;;) {
        __atomic_add_fetch(&g_writers_inside, 1, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&g_entry_closed, __ATOMIC_SEQ_CST)) return;
        entry_leave();
        pthread_mutex_lock(&g_emu);
        while (__atomic_load_n(&g_entry_closed, __ATOMIC_SEQ_CST)) pthread_cond_wait(&g_ecv, &g_emu);
        pthread_mutex_unlock(&g_emu);
    }
}

API int npusnap_devmem_hold_writers(int timeout_ms) {
    __atomic_store_n(&g_entry_closed, 1, __ATOMIC_SEQ_CST);
    struct timespec dl = deadline_in(timeout_ms / 1000.0);
    pthread_mutex_lock(&g_emu);
    int w = 0;
    while (__atomic_load_n(&g_writers_inside, __ATOMIC_SEQ_CST) > 0 && w != ETIMEDOUT)
        w = pthread_cond_timedwait(&g_ecv, &g_emu, &dl);
    int left = __atomic_load_n(&g_writers_inside, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&g_emu);
    return left;
}

API void npusnap_devmem_release_writers(void) {
    pthread_mutex_lock(&g_emu);
    __atomic_store_n(&g_entry_closed, 0, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&g_ecv);
    pthread_mutex_unlock(&g_emu);
}

/* A writer opens its slot. ``gated``: a call of the runtime's API, above its entry check, which
 * the lock's hold keeps out; the driver's functions the runtime calls below that check (a copy,
 * a free, an unmap of a call already past it) are not held there, which would only delay them
 * into the copy. */
void dm_write_open(int gated) {
    if (t_agent) return;
    if (!t_ws && !t_ws_none && !(t_ws = ws_claim())) t_ws_none = 1;
    if (gated && (t_ws ? t_ws->depth : t_ws_none_depth) == 0) {
        entry_enter();
        t_entered = 1;
    }
    if (t_ws) {
        if (t_ws->depth++ == 0) {
            __atomic_store_n(&t_ws->n, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&t_ws->all, 0, __ATOMIC_RELAXED);
        }
    } else if (t_ws_none_depth++ == 0) {
        __atomic_fetch_add(&g_ws_unslotted, 1, __ATOMIC_SEQ_CST);
    }
}

void npusnap_devmem_write_open(void) { dm_write_open(1); }

void npusnap_devmem_write_close(void) {
    if (t_agent) return;
    if (t_ws) {
        if (t_ws->depth > 0 && --t_ws->depth == 0) __atomic_store_n(&t_ws->busy, 0, __ATOMIC_SEQ_CST);
    } else if (t_ws_none && t_ws_none_depth > 0 && --t_ws_none_depth == 0) {
        __atomic_fetch_sub(&g_ws_unslotted, 1, __ATOMIC_SEQ_CST);
    }
    if (t_entered && (t_ws ? t_ws->depth : t_ws_none_depth) == 0) {
        t_entered = 0;
        entry_leave();
    }
}

static void ws_note(uintptr_t p, size_t n, int all) {
    struct wslot *w = t_ws;
    if (!w || !w->depth) return;
    size_t k = __atomic_load_n(&w->n, __ATOMIC_RELAXED);
    if (all || k >= WS_RANGES) {
        __atomic_store_n(&w->all, 1, __ATOMIC_RELEASE);
    } else {
        w->p[k] = p;
        w->len[k] = n;
        __atomic_store_n(&w->n, k + 1, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&w->busy, 1, __ATOMIC_SEQ_CST);
}

/* copy_start, `active` set: what the writers in flight will write, copied now. */
static void cc_cow_open_writers(void) {
    int all = __atomic_load_n(&g_ws_unslotted, __ATOMIC_SEQ_CST) > 0;
    for (int i = 0; i < WS_SLOTS && !all; i++) {
        struct wslot *w = &g_ws[i];
        if (!__atomic_load_n(&w->busy, __ATOMIC_SEQ_CST)) continue;
        if (__atomic_load_n(&w->all, __ATOMIC_ACQUIRE)) {
            all = 1;
            break;
        }
        size_t n = __atomic_load_n(&w->n, __ATOMIC_ACQUIRE);
        for (size_t k = 0; k < n && k < WS_RANGES; k++) cc_cow_range(w->p[k], w->len[k]);
    }
    if (all) cc_cow_all();
}

/* Before a call of the job writes [p, p + n): copy the pieces there that are not copied yet. */
void npusnap_devmem_before_write(uintptr_t p, size_t n) {
    if (!n || t_agent) return;
    ws_note(p, n, 0);
    if (!__atomic_load_n(&g_cc.active, __ATOMIC_SEQ_CST)) return;
    cc_cow_range(p, n);
}

/* Before a call whose writes are not known: the whole copy first (this thread helps). */
void npusnap_devmem_before_write_all(void) {
    if (t_agent) return;
    ws_note(0, 0, 1);
    if (!__atomic_load_n(&g_cc.active, __ATOMIC_SEQ_CST)) return;
    cc_cow_all();
}

static void *cc_main(void *arg) {
    (void)arg;
    t_agent = 1;
    pthread_mutex_lock(&g_cc.mu);
    while (g_cc.left && !g_cc.err && g_cc.cursor_r < g_cc.n) {
        struct cc_range *r = &g_cc.r[g_cc.cursor_r];
        size_t np = (r->size + PIECE - 1) / PIECE;
        if (g_cc.cursor_j >= np) {
            g_cc.cursor_r++;
            g_cc.cursor_j = 0;
            continue;
        }
        cc_piece_locked(g_cc.cursor_r, g_cc.cursor_j++, 0);
    }
    while (g_cc.left && !g_cc.err) pthread_cond_wait(&g_cc.cv, &g_cc.mu); /* pieces others copy */
    g_cc.active = 0; /* done: the hooks are inert again */
    pthread_cond_broadcast(&g_cc.cv);
    pthread_mutex_unlock(&g_cc.mu);
    return NULL;
}

/* Stop the copy (held: g_cc.mu, released on return): the hooks inert, the copier joined, the
 * plan dropped. */
static void cc_end_locked(void) {
    g_cc.active = 0;
    pthread_cond_broadcast(&g_cc.cv);
    int th = g_cc.th_started;
    g_cc.th_started = 0;
    pthread_mutex_unlock(&g_cc.mu);
    if (th) pthread_join(g_cc.th, NULL);
    pthread_mutex_lock(&g_cc.mu);
    cc_clear_locked();
    g_cc.cow = g_cc.background = 0;
    pthread_mutex_unlock(&g_cc.mu);
}

/* After the cut, before Unlock: start copying the planned pieces into fd (kept: a dup). */
API int npusnap_devmem_copy_start(int fd, char *err, size_t errlen) {
    pthread_mutex_lock(&g_cc.mu);
    if (!g_cc.planned) {
        pthread_mutex_unlock(&g_cc.mu);
        return 0;
    }
    g_cc.fn = (memcpy_fn_t)dm_real(F_DRV_MEMCPY);
    g_cc.fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (g_cc.fd < 0 || !g_cc.fn) {
        dm_seterr(err, errlen, "cannot start the concurrent copy: %s", g_cc.fn ? strerror(errno) : "no drvMemcpy");
        cc_clear_locked();
        pthread_mutex_unlock(&g_cc.mu);
        return -EIO;
    }
    __atomic_store_n(&g_cc.active, 1, __ATOMIC_SEQ_CST);
    g_cc.th_started = npusnap_quiet_thread_create(&g_cc.th, NULL, cc_main, NULL) == 0;
    pthread_mutex_unlock(&g_cc.mu);
    if (!g_cc.th_started) cc_main(NULL); /* no thread: copy now, the job still locked */
    else cc_cow_open_writers();           /* still locked: what the gated calls will write */
    return 0;
}

/* Wait (at most timeout_ms) for the concurrent copy; 0 once it is complete (the plan is then
 * dropped), -ETIMEDOUT while it runs, -errno if it failed. What it did goes to *stats. */
API int npusnap_devmem_copy_wait(int timeout_ms, uint64_t stats[3], char *err, size_t errlen) {
    struct timespec dl = deadline_in(timeout_ms / 1000.0);
    pthread_mutex_lock(&g_cc.mu);
    if (!g_cc.planned && g_cc.whole_at_cut) {
        g_cc.whole_at_cut = 0;
        pthread_mutex_unlock(&g_cc.mu);
        if (stats) stats[0] = stats[1] = stats[2] = 0;
        return 0;
    }
    if (!g_cc.planned) {
        pthread_mutex_unlock(&g_cc.mu);
        dm_seterr(err, errlen, "no concurrent copy was planned");
        return -ENOENT;
    }
    while (g_cc.active && !g_cc.err)
        if (pthread_cond_timedwait(&g_cc.cv, &g_cc.mu, &dl) == ETIMEDOUT) break;
    int rc = g_cc.err ? g_cc.err : g_cc.active ? -ETIMEDOUT : 0;
    if (stats) {
        stats[0] = g_cc.left;
        stats[1] = g_cc.cow;
        stats[2] = g_cc.background;
    }
    if (rc == -ETIMEDOUT) {
        dm_seterr(err, errlen, "%zu pieces are still to copy", g_cc.left);
        pthread_mutex_unlock(&g_cc.mu);
        return rc;
    }
    if (rc != 0) dm_seterr(err, errlen, "%s", g_cc.errmsg);
    cc_end_locked();
    return rc;
}

/* Drop a planned or running copy (a rollback, a restored process, a dump that gave up). */
API void npusnap_devmem_copy_cancel(void) {
    pthread_mutex_lock(&g_cc.mu);
    if (!g_cc.err) g_cc.err = -ECANCELED;
    cc_end_locked();
}

/* The next file save plans the job's allocations instead of copying them. */
