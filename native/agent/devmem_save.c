/* The copy of the job's device memory after the runtime's Lock, and its reload after Restore
 * (see devmem.c). */
#include "devmem_int.h"

/* ------------------------------------------------------------------ save / reload */

/* n bytes from host memory at src to allocation a at offset off. 0, or -EIO with err set. */
static int copy_to_device(memcpy_fn_t memcpy_fn, const struct alloc *a, size_t off, const void *src, size_t n,
                          char *err, size_t errlen) {
    drvError_t c = memcpy_fn((DVdeviceptr)(a->ptr + off), n, (DVdeviceptr)(uintptr_t)src, n);
    if (c == 0) return 0;
    dm_seterr(err, errlen, "drvMemcpy host to device of %zu bytes at %#lx (device %d) failed with %d", n,
              (unsigned long)(a->ptr + off), a->dev, c);
    return -EIO;
}

/* The file form of the copies (npusnap_devmem_save_fd): a header, one record per copied
 * allocation, then their bytes in record order. Reload checks the records against the table
 * the restored process holds, so a file of another process or another dump is refused. */
#define DM_MAGIC NPUSNAP_DEVMEM_FILE_MAGIC
/* Copy steps: a save's small enough to stay in the CPU's cache between the copy off the device
 * and the write into the file (64 MiB ones did not); a reload's maps the file a step at a time. */
#define DM_SAVE_CHUNK ((size_t)4 << 20)
#define DM_LOAD_CHUNK ((size_t)16 << 20)
/* The header and the records are the contract's (native/contract/npusnap.toml, contract.h). */
#define dm_header npusnap_devmem_file_header
#define dm_record npusnap_devmem_file_record

static int write_full(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return w < 0 ? -errno : -EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_full(int fd, void *buf, size_t n, off_t off) {
    char *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n, off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        if (r == 0) return -ENODATA; /* the file is shorter than its records say */
        p += r;
        n -= (size_t)r;
        off += r;
    }
    return 0;
}

/* n bytes of fd at off to allocation a at a_off. Straight from a read-only mapping of the file
 * (its page cache): the copy to the device is then the only copy, where reading into a buffer
 * first copies every byte twice (docs/benchmarks.md, "Measurements behind design choices").
 * Through *bounce (allocated on first use) where the file cannot be mapped. The caller checked that the file holds
 * [off, off + n): a mapping past its end would fault (SIGBUS), so only truncating the image
 * under a running restore could make it. */
static int file_to_device(int fd, off_t off, size_t n, memcpy_fn_t memcpy_fn, const struct alloc *a, size_t a_off,
                          char **bounce, char *err, size_t errlen) {
    long pg = sysconf(_SC_PAGESIZE);
    off_t base = off - off % (pg > 0 ? pg : 4096);
    size_t delta = (size_t)(off - base);
    void *m = mmap(NULL, n + delta, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, base);
    if (m != MAP_FAILED) {
        int ret = copy_to_device(memcpy_fn, a, a_off, (const char *)m + delta, n, err, errlen);
        munmap(m, n + delta);
        return ret;
    }
    if (!*bounce && !(*bounce = malloc(DM_LOAD_CHUNK))) {
        dm_seterr(err, errlen, "no host memory for a %zu-byte copy buffer", DM_LOAD_CHUNK);
        return -ENOMEM;
    }
    int ret = read_full(fd, *bounce, n, off);
    if (ret != 0) {
        dm_seterr(err, errlen, "cannot read the device-memory file: %s", strerror(-ret));
        return ret;
    }
    return copy_to_device(memcpy_fn, a, a_off, *bounce, n, err, errlen);
}

/* The copies between the device and the image's file, spread over a few threads: each takes the
 * next chunk (an allocation's range <-> a range of the file) until none is left or one failed.
 * A copy and its page-cache write or mapping go at one core's pace, and nothing else of the job
 * runs meanwhile (it waits in the runtime's lock), so the other cores shorten both directions:
 *  - save: each thread copies its chunk off the device into its own buffer and writes it at its
 *    place in the file (pwrite); the CLI reserves the file's blocks first (image/streamhash.py).
 *    The file is then not written front to back, which is why npusnap's CLI hashes it only after
 *    the lock answered (pipelines/dump/devmemory.py);
 *  - reload: each thread copies its chunk from a mapping of the file to the device; the page-table
 *    work of the mappings goes in parallel even where the device copy itself is serialized.
 * What the threads gain is in docs/benchmarks.md ("Measurements behind design choices").
 * The driver's copy needs no context: each thread copies by address. */
#define DM_THREADS 4
struct xfer_chunk {
    const struct alloc *a;
    size_t a_off;
    off_t file_off;
    size_t n;
};
struct xfer {
    int fd;
    int save; /* device -> file; else file -> device */
    memcpy_fn_t memcpy_fn;
    struct xfer_chunk *chunks;
    size_t n, cap, next;
    int ret;
    char err[512];
    pthread_mutex_t mu;
};

/* Append a chunk; 0 or -ENOMEM. */
static int xfer_add(struct xfer *x, const struct alloc *a, size_t a_off, off_t file_off, size_t n) {
    if (x->n == x->cap) {
        size_t cap = x->cap ? 2 * x->cap : 64;
        struct xfer_chunk *c = realloc(x->chunks, cap * sizeof *c);
        if (!c) return -ENOMEM;
        x->chunks = c;
        x->cap = cap;
    }
    x->chunks[x->n++] = (struct xfer_chunk){a, a_off, file_off, n};
    return 0;
}

/* Queue allocation a in chunks of at most `chunk` bytes, its bytes at *file_off of the file
 * (advanced past them); 0 or -ENOMEM. */
static int xfer_add_alloc(struct xfer *x, const struct alloc *a, size_t chunk, off_t *file_off) {
    for (size_t off = 0; off < a->size; off += chunk) {
        size_t n = a->size - off < chunk ? a->size - off : chunk;
        if (xfer_add(x, a, off, *file_off, n) != 0) return -ENOMEM;
        *file_off += (off_t)n;
    }
    return 0;
}

/* One save chunk through buf (DM_SAVE_CHUNK bytes): 0, or -errno with err set. */
static int save_chunk(const struct xfer *x, const struct xfer_chunk *c, char *buf, char *err, size_t errlen) {
    const struct alloc *a = c->a;
    drvError_t rc = x->memcpy_fn((DVdeviceptr)(uintptr_t)buf, c->n, (DVdeviceptr)(a->ptr + c->a_off), c->n);
    if (rc != 0) {
        dm_seterr(err, errlen, "drvMemcpy device to host of %zu bytes at %#lx (device %d) failed with %d", c->n,
                  (unsigned long)(a->ptr + c->a_off), a->dev, rc);
        return -EIO;
    }
    int wr = dm_pwrite_full(x->fd, buf, c->n, c->file_off);
    if (wr != 0) dm_seterr(err, errlen, "cannot write the device-memory file: %s", strerror(-wr));
    return wr;
}

static void *xfer_main(void *arg) {
    struct xfer *x = arg;
    char *buf = NULL; /* save: the chunk's host copy; reload: a bounce buffer if mapping fails */
    char err[512] = "";
    if (x->save && !(buf = malloc(DM_SAVE_CHUNK))) {
        pthread_mutex_lock(&x->mu);
        if (x->ret == 0) {
            x->ret = -ENOMEM;
            snprintf(x->err, sizeof x->err, "no host memory for a %zu-byte copy buffer", DM_SAVE_CHUNK);
        }
        pthread_mutex_unlock(&x->mu);
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&x->mu);
        const struct xfer_chunk *c = x->ret == 0 && x->next < x->n ? &x->chunks[x->next++] : NULL;
        pthread_mutex_unlock(&x->mu);
        if (!c) break;
        int rc = x->save ? save_chunk(x, c, buf, err, sizeof err)
                         : file_to_device(x->fd, c->file_off, c->n, x->memcpy_fn, c->a, c->a_off, &buf, err,
                                          sizeof err);
        if (rc != 0) {
            pthread_mutex_lock(&x->mu);
            if (x->ret == 0) {
                x->ret = rc;
                snprintf(x->err, sizeof x->err, "%s", err);
            }
            pthread_mutex_unlock(&x->mu);
        }
    }
    free(buf);
    return NULL;
}

/* Run the chunks on this thread and up to DM_THREADS - 1 more (fewer on fewer cores; none if
 * they cannot be created). 0, or the first failed chunk's error (err set). */
static int xfer_run(struct xfer *x, char *err, size_t errlen) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    size_t extra = cores > 1 ? (size_t)(cores < DM_THREADS ? cores : DM_THREADS) - 1 : 0;
    if (extra > x->n) extra = x->n ? x->n - 1 : 0;
    pthread_t th[DM_THREADS];
    size_t started = 0;
    pthread_mutex_init(&x->mu, NULL);
    for (size_t i = 0; i < extra; i++)
        if (npusnap_quiet_thread_create(&th[started], NULL, xfer_main, x) == 0) started++;
    xfer_main(x);
    for (size_t i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&x->mu);
    if (x->ret != 0) dm_seterr(err, errlen, "%s", x->err);
    return x->ret;
}

/* --- draining the device before the copy ------------------------------------------------- */

struct sync_job {
    aclError (*fn)(void);
    aclError rc;
    int done;
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    void *ctx;
};

/* One waiter at a time (the agent thread); its deadline is CLOCK_MONOTONIC, as everywhere. */
static pthread_mutex_t sync_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sync_cv;
__attribute__((constructor)) static void sync_cv_init(void) { monotonic_cond_init(&sync_cv); }

static void *sync_thread(void *arg) {
    struct sync_job *j = arg;
    aclError (*sc)(void *) = (aclError(*)(void *))dm_real(F_SET_CTX);
    t_agent = 1;
    if (sc && j->ctx) sc(j->ctx);
    aclError rc = j->fn();
    pthread_mutex_lock(j->mu);
    j->rc = rc;
    j->done = 1;
    pthread_cond_broadcast(j->cv);
    int free_it = j->done == 2;
    pthread_mutex_unlock(j->mu);
    if (free_it) free(j);
    return NULL;
}

/* Synchronize one device (its context selected on this thread), bounded by timeout_ms:
 * aclrtSynchronizeDeviceWithTimeout where the runtime has it; else aclrtSynchronizeDevice on a
 * thread of its own that is waited for until the deadline (a hung stream then leaves that thread
 * behind, parked in the runtime, and the save fails). 0, or -ETIMEDOUT / -EIO with err set. */
static int sync_device(int32_t dev, void *ctx, int timeout_ms, char *err, size_t errlen) {
    aclError (*sc)(void *) = (aclError(*)(void *))dm_real(F_SET_CTX);
    aclError (*swt)(int32_t) = (aclError(*)(int32_t))dm_real(F_SYNC_DEVICE_TIMEOUT);
    if (swt) {
        if (sc) sc(ctx);
        aclError rc = swt(timeout_ms > 0 ? timeout_ms : 1);
        if (rc == ACL_SUCCESS) return 0;
        dm_seterr(err, errlen,
                  "device %d did not finish its queued work within %d ms (aclrtSynchronizeDeviceWithTimeout: %d): a "
                  "kernel or a collective is still running",
                  dev, timeout_ms, rc);
        return -ETIMEDOUT;
    }
    aclError (*sync)(void) = (aclError(*)(void))dm_real(F_SYNC_DEVICE);
    if (!sync) {
        dm_seterr(err, errlen, "the runtime exports no aclrtSynchronizeDevice: cannot drain device %d", dev);
        return -ENOSYS;
    }
    struct sync_job *j = calloc(1, sizeof *j);
    if (!j) return -ENOMEM;
    *j = (struct sync_job){sync, 0, 0, &sync_mu, &sync_cv, ctx};
    pthread_t th;
    int cr = npusnap_quiet_thread_create(&th, NULL, sync_thread, j);
    if (cr != 0) {
        free(j);
        dm_seterr(err, errlen, "cannot start a thread to synchronize device %d", dev);
        return -cr;
    }
    pthread_detach(th);
    struct timespec dl = deadline_in(timeout_ms / 1000.0);
    pthread_mutex_lock(&sync_mu);
    int w = 0;
    while (!j->done && w != ETIMEDOUT) w = pthread_cond_timedwait(&sync_cv, &sync_mu, &dl);
    int ret = 0;
    if (!j->done) {
        j->done = 2; /* the thread frees it when (if) the runtime ever returns */
        dm_seterr(err, errlen,
                  "device %d did not finish its queued work within %d ms (aclrtSynchronizeDevice still waiting): a "
                  "kernel or a collective is still running",
                  dev, timeout_ms);
        ret = -ETIMEDOUT;
    } else {
        if (j->rc != ACL_SUCCESS) {
            dm_seterr(err, errlen, "aclrtSynchronizeDevice (device %d) failed with %d", dev, j->rc);
            ret = -EIO;
        }
        free(j);
    }
    pthread_mutex_unlock(&sync_mu);
    return ret;
}

/* After Lock: every device that holds tracked memory drains its queues (bounded), then the job's
 * driver copies still in flight end (bounded), then the devices drain once more (a launch that was
 * past the runtime's entry check when Lock came may have queued work after the first drain).
 * 0, or -errno with err set. */
static double g_drain_s;
static int quiesce_timed(int timeout_ms, char *err, size_t errlen);
static int quiesce(int timeout_ms, char *err, size_t errlen) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int rc = quiesce_timed(timeout_ms, err, errlen);
    clock_gettime(CLOCK_MONOTONIC, &b);
    g_drain_s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    return rc;
}

API double npusnap_devmem_last_drain_s(void) { return g_drain_s; }

static int quiesce_timed(int timeout_ms, char *err, size_t errlen) {
    int32_t devs[64];
    void *ctxs[64];
    int nd = 0;
    pthread_mutex_lock(&g_mu);
    /* Every device holding tracked memory (it must have a known context), and every other device
     * the job opened (so that Backup's own synchronize, which has no timeout, finds them idle). */
    for (size_t i = 0; i < g_n; i++) {
        int32_t d = g_allocs[i].dev;
        if (g_allocs[i].excluded || d < 0 || d >= MAX_DEVS) continue;
        int seen = 0;
        for (int k = 0; k < nd; k++) seen |= devs[k] == d;
        if (!seen && nd < 64) {
            devs[nd] = d;
            ctxs[nd++] = g_dev_ctx[d];
        }
    }
    for (int32_t d = 0; d < MAX_DEVS && nd < 64; d++) {
        int seen = 0;
        for (int k = 0; k < nd; k++) seen |= devs[k] == d;
        if (!seen && g_devs[d] && g_dev_ctx[d]) {
            devs[nd] = d;
            ctxs[nd++] = g_dev_ctx[d];
        }
    }
    pthread_mutex_unlock(&g_mu);
    for (int k = 0; k < nd; k++)
        if (!ctxs[k]) {
            dm_seterr(err, errlen,
                      "device %d holds tracked memory but npusnap saw no context of it (no aclrtSetDevice or "
                      "aclrtSetCurrentContext of the job): cannot drain its queued work",
                      devs[k]);
            return -ENODEV;
        }
    double t0 = now_s();
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < nd; k++) {
            int rc = sync_device(devs[k], ctxs[k], timeout_ms, err, errlen);
            if (rc != 0) return rc;
        }
        if (pass) break;
        struct timespec dl = deadline_in(t0 + timeout_ms / 1000.0 - now_s());
        pthread_mutex_lock(&g_mu);
        int w = 0;
        while (g_copies_inflight > 0 && w != ETIMEDOUT) w = pthread_cond_timedwait(&g_cv, &g_mu, &dl);
        int left = g_copies_inflight;
        pthread_mutex_unlock(&g_mu);
        if (left > 0) {
            dm_seterr(err, errlen, "%d device copy(ies) of the job were still running after %d ms", left, timeout_ms);
            return -ETIMEDOUT;
        }
    }
    return 0;
}

/* Copy every tracked allocation into fd: the header, one record per allocation, then their bytes
 * in record order, written by xfer_run. Holds g_mu. */
API void npusnap_devmem_copy_cancel(void);
static int g_plan_next; /* the next save plans the job's allocations for a concurrent copy */

static int save_file_locked(int fd, memcpy_fn_t memcpy_fn, uint64_t *written, char *err, size_t errlen) {
    struct dm_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, DM_MAGIC, sizeof DM_MAGIC);
    for (size_t i = 0; i < g_n; i++)
        if (!g_allocs[i].excluded) {
            h.count++;
            h.bytes += g_allocs[i].size;
        }
    int wr = write_full(fd, &h, sizeof h);
    for (size_t i = 0; i < g_n && wr == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        struct dm_record r = {(uint64_t)a->ptr, (uint64_t)a->size, a->dev, a->kind};
        wr = write_full(fd, &r, sizeof r);
    }
    if (wr != 0) {
        dm_seterr(err, errlen, "cannot write the device-memory file: %s", strerror(-wr));
        return wr;
    }
    int ret = 0;
    struct xfer x = {.fd = fd, .save = 1, .memcpy_fn = memcpy_fn};
    off_t data_off = (off_t)(sizeof h + h.count * sizeof(struct dm_record));
    /* Since an earlier save of this process's history: the pieces not written since are left
     * out (a hole in the file), and the CLI takes them from that save's image. */
    uint32_t since = 0;
    for (int i = 0; g_since_id && i < g_nlineage; i++)
        if (g_lineage[i].id == g_since_id) since = g_lineage[i].epoch;
    size_t npieces = 0;
    for (size_t i = 0; i < g_n; i++)
        if (!g_allocs[i].excluded) npieces += dm_pieces_of(&g_allocs[i]);
    unsigned char *unchanged = calloc(npieces ? npieces : 1, 1);
    if (!unchanged) {
        dm_seterr(err, errlen, "no host memory for the table of pieces");
        return -ENOMEM;
    }
    size_t k = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        const struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        if (g_plan_next && a->app) {
            /* Copied after Unlock while the job runs (cc_*): what the job writes first is
             * copied first. The runtime's own allocations, whose writes are not known, now. */
            for (size_t j = 0, np = dm_pieces_of(a); j < np; j++, k++) unchanged[k] = since && dm_piece_gen(a, j) <= since;
            if (cc_plan_add(a, data_off, unchanged + k - dm_pieces_of(a)) != 0) {
                dm_seterr(err, errlen, "no host memory for the plan of the concurrent copy");
                ret = -ENOMEM;
            }
            if (g_plan_next == 1) {
                data_off += (off_t)a->size;
                continue;
            }
            k -= dm_pieces_of(a); /* 2: the full copy as well, a reference for the concurrent one */
        }
        for (size_t j = 0, np = dm_pieces_of(a); j < np && ret == 0; j++, k++) {
            size_t off = j * PIECE, n = a->size - off < PIECE ? a->size - off : PIECE;
            unchanged[k] = since && dm_piece_gen(a, j) <= since;
            if (!unchanged[k] || g_check_all) {
                struct xfer_chunk *last = x.n ? &x.chunks[x.n - 1] : NULL;
                if (last && last->a == a && last->a_off + last->n == off && last->n + n <= DM_SAVE_CHUNK)
                    last->n += n; /* the next piece of the same run */
                else if (xfer_add(&x, a, off, data_off + (off_t)off, n) != 0)
                    ret = -ENOMEM;
            }
        }
        data_off += (off_t)a->size;
        if (ret != 0) dm_seterr(err, errlen, "no host memory for the list of device-memory copies");
    }
    if (ret == 0 && x.n) ret = xfer_run(&x, err, errlen);
    free(x.chunks);
    if (ret != 0) {
        free(unchanged);
        return ret;
    }
    /* The file may end in a hole: its size must still say where its data ends. */
    if (ftruncate(fd, data_off) != 0) {
        ret = -errno;
        dm_seterr(err, errlen, "cannot size the device-memory file: %s", strerror(-ret));
        free(unchanged);
        return ret;
    }
    *written = (uint64_t)data_off;
    for (size_t i = 0; i < g_n; i++)
        if (!g_allocs[i].excluded) g_allocs[i].in_file = 1;
    free(g_unchanged);
    g_unchanged = unchanged;
    g_npieces = npieces;
    g_since_used = since != 0;
    /* This save ends the epoch: it joins the history, and writes from now on are the next's. */
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, GRND_NONBLOCK) != (ssize_t)sizeof id || !id)
        id = ((uint64_t)time(NULL) << 24) ^ ((uint64_t)getpid() << 8) ^ g_epoch ^ 0x9e3779b97f4a7c15ull;
    if (g_nlineage == LINEAGE) memmove(g_lineage, g_lineage + 1, (LINEAGE - 1) * sizeof g_lineage[0]);
    else g_nlineage++;
    g_lineage[g_nlineage - 1].id = id;
    g_lineage[g_nlineage - 1].epoch = g_epoch;
    g_save_id = id;
    g_save_epoch = g_epoch;
    g_epoch++;
    return 0;
}

/* Copy every tracked allocation to host memory, one malloc'd copy each (npusnap_devmem_save, for
 * a process without a device-memory file). Holds g_mu. */
static int save_in_process_locked(memcpy_fn_t memcpy_fn, char *err, size_t errlen) {
    int ret = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        free(a->copy);
        a->copy = malloc(a->size ? a->size : 1);
        if (!a->copy) {
            dm_seterr(err, errlen, "no host memory for a copy of %zu bytes of device memory", a->size);
            return -ENOMEM;
        }
        drvError_t c = memcpy_fn((DVdeviceptr)(uintptr_t)a->copy, a->size, (DVdeviceptr)a->ptr, a->size);
        if (c != 0) {
            dm_seterr(err, errlen, "drvMemcpy device to host of %zu bytes at %#lx (device %d) failed with %d", a->size,
                      (unsigned long)a->ptr, a->dev, c);
            ret = -EIO;
        }
    }
    return ret;
}


/* Called by the agent after the runtime's Lock: drain (bounded), then copy with the driver. */
static int save_to(int fd, int timeout_ms, uint64_t *written, char *err, size_t errlen) {
    if (timeout_ms < 0) timeout_ms = 0;
    npusnap_devmem_copy_cancel(); /* a concurrent copy of an earlier dump that gave up, if any */
    t_agent = 1;
    int ret = quiesce(timeout_ms, err, errlen);
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)dm_real(F_DRV_MEMCPY);
    pthread_mutex_lock(&g_mu);
    if (ret == 0 && g_n && !memcpy_fn) {
        dm_seterr(err, errlen,
                  "the driver's drvMemcpy (libascend_hal.so) is not available in this process: cannot copy device "
                  "memory while the runtime is locked");
        ret = -ENOSYS;
    } else if (ret == 0) {
        ret = fd >= 0 ? save_file_locked(fd, memcpy_fn, written, err, errlen)
                      : save_in_process_locked(memcpy_fn, err, errlen);
    }
    if (ret != 0) dm_free_copies_locked();
    else g_saved = 1;
    cc_note_whole_at_cut(ret == 0 && g_plan_next && fd >= 0);
    g_plan_next = 0;
    pthread_mutex_unlock(&g_mu);
    if (ret != 0) npusnap_devmem_copy_cancel(); /* a plan half made */
    t_agent = 0;
    return ret;
}

API int npusnap_devmem_drain(int timeout_ms, char *err, size_t errlen) {
    if (timeout_ms < 0) timeout_ms = 0;
    t_agent = 1;
    int rc = quiesce(timeout_ms, err, errlen);
    t_agent = 0;
    return rc;
}

API int npusnap_devmem_save(int timeout_ms, char *err, size_t errlen) {
    uint64_t unused = 0;
    return save_to(-1, timeout_ms, &unused, err, errlen);
}

API void npusnap_devmem_plan_next(int on) {
    pthread_mutex_lock(&g_mu);
    g_plan_next = on;
    pthread_mutex_unlock(&g_mu);
}

API int npusnap_devmem_save_fd(int fd, int timeout_ms, uint64_t *written, char *err, size_t errlen) {
    uint64_t n = 0;
    if (fd < 0) {
        dm_seterr(err, errlen, "no file to write the device memory into");
        return -EBADF;
    }
    int rc = save_to(fd, timeout_ms, &n, err, errlen);
    if (written) *written = n;
    return rc;
}

API int npusnap_devmem_reload_fd(int fd, char *err, size_t errlen) {
    pthread_mutex_lock(&g_mu);
    if (!g_saved) {
        pthread_mutex_unlock(&g_mu);
        dm_seterr(err, errlen, "no saved device memory to reload");
        return -ENOENT;
    }
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)dm_real(F_DRV_MEMCPY);
    struct dm_header h;
    int ret = read_full(fd, &h, sizeof h, 0);
    uint64_t want = 0;
    for (size_t i = 0; i < g_n; i++) want += g_allocs[i].in_file;
    if (ret != 0) {
        dm_seterr(err, errlen, "cannot read the device-memory file's header: %s", strerror(-ret));
    } else if (memcmp(h.magic, DM_MAGIC, sizeof DM_MAGIC) != 0) {
        dm_seterr(err, errlen, "the device-memory file is not one (bad magic)");
        ret = -EINVAL;
    } else if (h.count != want) {
        dm_seterr(err, errlen, "the device-memory file holds %llu allocations, this process saved %llu into it",
                  (unsigned long long)h.count, (unsigned long long)want);
        ret = -EINVAL;
    } else if (!memcpy_fn && want) {
        dm_seterr(err, errlen, "the driver's drvMemcpy is not available in this process");
        ret = -ENOSYS;
    }
    off_t rec_off = sizeof h;
    off_t data_off = (off_t)(sizeof h + h.count * sizeof(struct dm_record));
    struct stat st;
    if (ret == 0 && fstat(fd, &st) != 0) {
        ret = -errno;
        dm_seterr(err, errlen, "cannot stat the device-memory file: %s", strerror(-ret));
    } else if (ret == 0 && (uint64_t)st.st_size < (uint64_t)data_off + h.bytes) {
        /* Checked before anything is mapped: see file_to_device. */
        dm_seterr(err, errlen, "the device-memory file has %lld bytes, its records need %llu", (long long)st.st_size,
                  (unsigned long long)((uint64_t)data_off + h.bytes));
        ret = -ENODATA;
    }
    struct xfer x = {.fd = fd, .memcpy_fn = memcpy_fn};
    uint64_t mapped_total = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (!a->in_file) continue;
        struct dm_record r;
        ret = read_full(fd, &r, sizeof r, rec_off);
        rec_off += sizeof r;
        if (ret != 0) {
            dm_seterr(err, errlen, "cannot read the device-memory file's records: %s", strerror(-ret));
            break;
        }
        if (r.ptr != (uint64_t)a->ptr || r.size != (uint64_t)a->size || r.dev != a->dev) {
            dm_seterr(err, errlen,
                      "the device-memory file does not match this process: it has %llu bytes at %#llx on device %d "
                      "where the process has %zu bytes at %#lx on device %d",
                      (unsigned long long)r.size, (unsigned long long)r.ptr, r.dev, a->size, (unsigned long)a->ptr,
                      a->dev);
            ret = -EINVAL;
            break;
        }
        mapped_total += a->size;
        if (mapped_total > h.bytes) {
            dm_seterr(err, errlen, "the device-memory file's records add up to more than its header's %llu bytes",
                      (unsigned long long)h.bytes);
            ret = -EINVAL;
            break;
        }
        if (xfer_add_alloc(&x, a, DM_LOAD_CHUNK, &data_off) != 0) {
            dm_seterr(err, errlen, "no host memory for the reload's list of copies");
            ret = -ENOMEM;
        }
    }
    t_agent = 1;
    if (ret == 0 && x.n) ret = xfer_run(&x, err, errlen);
    t_agent = 0;
    free(x.chunks);
    pthread_mutex_unlock(&g_mu);
    return ret;
}

API int npusnap_devmem_reload(char *err, size_t errlen) {
    pthread_mutex_lock(&g_mu);
    if (!g_saved) {
        pthread_mutex_unlock(&g_mu);
        dm_seterr(err, errlen, "no saved device memory to reload");
        return -ENOENT;
    }
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)dm_real(F_DRV_MEMCPY);
    int ret = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++)
        if (g_allocs[i].in_file) {
            dm_seterr(err, errlen, "the device memory was saved into a file of the image: reloading needs that file");
            ret = -ENOENT;
        }
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded || !a->copy) continue;
        if (!memcpy_fn) {
            dm_seterr(err, errlen, "the driver's drvMemcpy is not available in this process");
            ret = -ENOSYS;
            break;
        }
        t_agent = 1;
        ret = copy_to_device(memcpy_fn, a, 0, a->copy, a->size, err, errlen);
        t_agent = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return ret;
}

