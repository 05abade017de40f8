/* The agent's wrappers of the driver's allocation calls, of the runtime's device and context
 * calls, and dlsym() (see devmem.c). */
#include "devmem_int.h"

/* ------------------------------------------------------------------ the driver wrappers */

#define REAL(idx, type)                      \
    __typeof__(type) fn = (type)dm_real(idx); \
    if (!fn) return dm_missing(idx)

API drvError_t halMemAlloc(void **pp, unsigned long long size, unsigned long long flag) {
    REAL(F_HAL_ALLOC, drvError_t(*)(void **, unsigned long long, unsigned long long));
    drvError_t rc = fn(pp, size, flag);
    if (rc == 0 && pp && *pp) {
        pthread_mutex_lock(&g_mu);
        dm_note_oom(dm_add((uintptr_t)*pp, (size_t)size, dm_user_dev((int32_t)(flag & HAL_FLAG_DEVID_MASK)), K_ALLOC));
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* Before memory goes away: a concurrent copy takes what it still needs of it first. */
static void before_release(uintptr_t p) {
    size_t n = 0;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = dm_find(p);
    if (a) n = a->size;
    pthread_mutex_unlock(&g_mu);
    npusnap_devmem_before_write(p, n);
}

API drvError_t halMemFree(void *pp) {
    REAL(F_HAL_FREE, drvError_t(*)(void *));
    dm_write_open(0); /* below the runtime's entry check */
    before_release((uintptr_t)pp);
    drvError_t rc = fn(pp);
    npusnap_devmem_write_close();
    if (rc == 0) dm_untrack((uintptr_t)pp);
    return rc;
}

API drvError_t halMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr, uint64_t flag) {
    REAL(F_HAL_RESERVE, drvError_t(*)(void **, size_t, size_t, void *, uint64_t));
    drvError_t rc = fn(ptr, size, alignment, addr, flag);
    if (rc == 0 && ptr && *ptr) {
        dm_record_opened();
        pthread_mutex_lock(&g_mu);
        int g = dm_grow((void **)&g_reserved, &g_res_cap, g_nres, sizeof *g_reserved);
        if (g == 0) g_reserved[g_nres++] = (struct range){(uintptr_t)*ptr, size};
        dm_note_oom(g);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemAddressFree(void *ptr) {
    REAL(F_HAL_ADDR_FREE, drvError_t(*)(void *));
    drvError_t rc = fn(ptr);
    if (rc == 0) {
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_nres; i++)
            if (g_reserved[i].start == (uintptr_t)ptr) {
                g_reserved[i] = g_reserved[--g_nres];
                break;
            }
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemCreate(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop, uint64_t flag) {
    REAL(F_HAL_CREATE, drvError_t(*)(drv_mem_handle_t **, size_t, const struct drv_mem_prop *, uint64_t));
    drvError_t rc = fn(handle, size, prop, flag);
    if (rc == 0 && handle && *handle) {
        dm_record_opened();
        pthread_mutex_lock(&g_mu);
        int g = dm_grow((void **)&g_handles, &g_h_cap, g_nh, sizeof *g_handles);
        if (g == 0) g_handles[g_nh++] = (struct handle){*handle, size, prop ? dm_user_dev((int32_t)prop->devid) : -1};
        dm_note_oom(g);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemRelease(drv_mem_handle_t *handle) {
    REAL(F_HAL_RELEASE, drvError_t(*)(drv_mem_handle_t *));
    drvError_t rc = fn(handle);
    if (rc == 0) {
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_nh; i++)
            if (g_handles[i].h == handle) {
                g_handles[i] = g_handles[--g_nh];
                break;
            }
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* A mapped VMM range is saved and reloaded by its virtual address, like an allocation: its bytes
 * are those of the physical chunk at `offset`. */
API drvError_t halMemMap(void *ptr, size_t size, size_t offset, drv_mem_handle_t *handle, uint64_t flag) {
    REAL(F_HAL_MAP, drvError_t(*)(void *, size_t, size_t, drv_mem_handle_t *, uint64_t));
    drvError_t rc = fn(ptr, size, offset, handle, flag);
    if (rc == 0 && ptr) {
        pthread_mutex_lock(&g_mu);
        int32_t dev = -1;
        for (size_t i = 0; i < g_nh; i++)
            if (g_handles[i].h == handle) dev = g_handles[i].dev;
        dm_note_oom(dm_add((uintptr_t)ptr, size, dev, K_VMM));
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemUnmap(void *ptr) {
    REAL(F_HAL_UNMAP, drvError_t(*)(void *));
    dm_write_open(0); /* below the runtime's entry check */
    before_release((uintptr_t)ptr);
    drvError_t rc = fn(ptr);
    npusnap_devmem_write_close();
    if (rc == 0) dm_untrack((uintptr_t)ptr);
    return rc;
}

/* The job's driver copies are counted (a synchronous copy past the runtime's entry check when
 * Lock came still runs: save waits for it); npusnap's own copies (t_agent) are not. */
API drvError_t drvMemcpy(DVdeviceptr dst, size_t destMax, DVdeviceptr src, size_t n) {
    REAL(F_DRV_MEMCPY, drvError_t(*)(DVdeviceptr, size_t, DVdeviceptr, size_t));
    if (t_agent) return fn(dst, destMax, src, n);
    dm_write_open(0); /* below the runtime's entry check */
    npusnap_devmem_before_write((uintptr_t)dst, n);
    npusnap_devmem_mark((uintptr_t)dst, n); /* and after it: writes.c, stamp_ranges */
    pthread_mutex_lock(&g_mu);
    g_copies_inflight++;
    pthread_mutex_unlock(&g_mu);
    drvError_t rc = fn(dst, destMax, src, n);
    npusnap_devmem_write_close();
    pthread_mutex_lock(&g_mu);
    if (--g_copies_inflight == 0) pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    npusnap_devmem_mark((uintptr_t)dst, n); /* the job's own driver copy writes its destination */
    return rc;
}

/* ------------------------------------------------------------------ the context wrappers */

/* Every wrapper of this file, in the enum's order: what dlsym() hands out for a wrapped name. */
static void *const g_wrappers[N_WRAPPED] = {
    (void *)halMemAlloc,    (void *)halMemFree,      (void *)halMemAddressReserve, (void *)halMemAddressFree,
    (void *)halMemCreate,   (void *)halMemRelease,   (void *)halMemMap,            (void *)halMemUnmap,
    (void *)drvMemcpy,      (void *)aclrtSetDevice,  (void *)aclrtResetDevice,     (void *)aclrtResetDeviceForce,
    (void *)aclFinalize,
    (void *)aclrtCreateContext, (void *)aclrtSetCurrentContext, (void *)aclrtDestroyContext,
};

static int dm_is_wrapper(void *p) {
    for (int i = 0; i < N_WRAPPED; i++)
        if (g_wrappers[i] == p) return 1;
    return 0;
}

API aclError aclrtSetDevice(int32_t deviceId) {
    REAL(F_SET_DEVICE, aclError(*)(int32_t));
    pthread_mutex_lock(&g_life);
    aclError rc = fn(deviceId);
    if (rc == ACL_SUCCESS) dm_remember_ctx(deviceId, 1);
    pthread_mutex_unlock(&g_life);
    if (rc == ACL_SUCCESS) {
        dm_record_opened();
        dm_device_opened();
    }
    return rc;
}

API aclError aclrtCreateContext(void **ctx, int32_t deviceId) {
    REAL(F_CREATE_CTX, aclError(*)(void **, int32_t));
    pthread_mutex_lock(&g_life);
    aclError rc = fn(ctx, deviceId);
    if (rc == ACL_SUCCESS) dm_remember_ctx(deviceId, 0);
    pthread_mutex_unlock(&g_life);
    if (rc == ACL_SUCCESS) {
        dm_record_opened();
        dm_device_opened();
    }
    return rc;
}

API aclError aclrtSetCurrentContext(void *ctx) {
    REAL(F_SET_CTX, aclError(*)(void *));
    aclError rc = fn(ctx);
    if (rc == ACL_SUCCESS && !t_agent) {
        dm_record_opened();
        int32_t dev;
        dm_current_place(&dev);
        if (dev >= 0 && dev < MAX_DEVS) {
            pthread_mutex_lock(&g_mu);
            if (!g_devs[dev]) g_devs[dev] = 1;
            if (!g_dev_ctx[dev]) g_dev_ctx[dev] = ctx;
            pthread_mutex_unlock(&g_mu);
        }
        dm_device_opened();
    }
    return rc;
}

/* A destroyed context must not be selected to drain its device: forget it (the device keeps its
 * primary context, which the next aclrtSetDevice / aclrtSetCurrentContext records again). */
API aclError aclrtDestroyContext(void *ctx) {
    REAL(F_DESTROY_CTX, aclError(*)(void *));
    aclError rc = fn(ctx);
    if (rc == ACL_SUCCESS && ctx) {
        pthread_mutex_lock(&g_mu);
        for (int d = 0; d < MAX_DEVS; d++)
            if (g_dev_ctx[d] == ctx) g_dev_ctx[d] = NULL;
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* The device released (count 0, or a forced reset): the runtime frees its memory through halMemFree
 * (untracked there); a range it released otherwise must not be copied from a device that is gone.
 * g_mu held. */
static void forget_device_locked(int32_t dev) {
    for (size_t i = 0; i < g_n;) {
        if (g_allocs[i].dev == dev && g_allocs[i].kind != K_REGISTERED) dm_drop_at(i);
        else i++;
    }
    g_devs[dev] = 0;
    g_dev_ctx[dev] = NULL;
}

static aclError reset_device(int32_t deviceId, int func) {
    aclError (*fn)(int32_t) = (aclError(*)(int32_t))dm_real(func);
    if (!fn) return dm_missing(func);
    pthread_mutex_lock(&g_life);
    aclError rc = fn(deviceId);
    if (rc == ACL_SUCCESS && deviceId >= 0 && deviceId < MAX_DEVS) {
        pthread_mutex_lock(&g_mu);
        /* another aclrtSetDevice still holds the device: CANN keeps it, and its memory */
        if (func == F_RESET_DEVICE && g_devs[deviceId] > 1) g_devs[deviceId]--;
        else forget_device_locked(deviceId);
        pthread_mutex_unlock(&g_mu);
    }
    pthread_mutex_unlock(&g_life);
    return rc;
}

API aclError aclrtResetDevice(int32_t deviceId) { return reset_device(deviceId, F_RESET_DEVICE); }

/* Releases the device whatever its count (CANN's aclrtResetDeviceForce). */
API aclError aclrtResetDeviceForce(int32_t deviceId) { return reset_device(deviceId, F_RESET_DEVICE_FORCE); }

/* The aclFinalize the caller itself would reach: its own lookup scope's (a library dlopen'ed
 * RTLD_LOCAL, as Python loads torch_npu, reaches its libascendcl.so there, which the global scope
 * and RTLD_NEXT do not see), else dm_real(). aclInit's state belongs to the ACL front-end that
 * served it, so finalizing another front-end would fail with ACL_ERROR_UNINITIALIZE. */
static aclError (*caller_finalize(void *ret))(void) {
    Dl_info info;
    dlsym_fn ds = npusnap_real_dlsym();
    if (ds && ret && dladdr(ret, &info) && info.dli_fname) {
        void *h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (h) {
            void *p = ds(h, "aclFinalize");
            dlclose(h); /* NOLOAD handle: only drops the reference it took */
            if (p && !dm_is_wrapper(p)) return (aclError(*)(void))p;
        }
    }
    return (aclError(*)(void))dm_real(F_FINALIZE);
}

API aclError aclFinalize(void) {
    aclError (*fn)(void) = caller_finalize(__builtin_return_address(0));
    if (!fn) return dm_missing(F_FINALIZE);
    aclError rc = fn();
    if (rc == ACL_SUCCESS) {
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_n;) {
            if (g_allocs[i].kind != K_REGISTERED) dm_drop_at(i);
            else i++;
        }
        g_nres = g_nh = 0;
        memset(g_devs, 0, sizeof g_devs);
        memset(g_dev_ctx, 0, sizeof g_dev_ctx);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* dlsym(): hand out the wrapper for a wrapped name, remembering the real function. Every other
 * lookup -- and every RTLD_NEXT lookup, whose meaning depends on the caller -- goes to the real
 * dlsym as a tail call, so that glibc still sees the original caller's return address. */
API void *dlsym(void *handle, const char *name) {
    dlsym_fn ds = npusnap_real_dlsym();
    if (handle != RTLD_NEXT && ((name[0] == 'a' && name[1] == 'c' && name[2] == 'l') || (name[0] == 'r' && name[1] == 't'))) {
        /* What writes device memory, and what tells where (writes.c). */
        void *p = ds(handle, name);
        void *w = npusnap_writes_wrapper_for(handle, name, p, ds);
        if (w) return w;
        if (name[0] == 'r' || (name[3] == 'n' && name[4] == 'n')) return p;
    }
    if (handle != RTLD_NEXT && name[0] == 'H' && name[1] == 'c' && name[2] == 'c' && name[3] == 'l') {
        /* HCCL's names that take a communicator: the agent's wrapper (hccl.c). */
        void *p = ds(handle, name);
        void *w = npusnap_hccl_wrapper_for(name, p);
        return w ? w : p;
    }
    if (handle != RTLD_NEXT && ((name[0] == 'h' && name[1] == 'a' && name[2] == 'l') ||
                                (name[0] == 'd' && name[1] == 'r' && name[2] == 'v') ||
                                (name[0] == 'a' && name[1] == 'c' && name[2] == 'l'))) {
        for (int i = 0; i < N_WRAPPED; i++)
            if (!strcmp(name, NAMES[i])) {
                void *p = ds(handle, name);
                if (!p || p == g_wrappers[i]) return p;
                if (i == F_FINALIZE) {
                    /* aclInit's state belongs to the ACL front-end that served it (libacl_rt and
                     * libascendcl each keep their own): the wrapper may stand only for the
                     * aclFinalize a direct call would reach, never pin another library's. A
                     * lookup in another front-end gets its own function, untracked. */
                    return p == dm_real(i) ? g_wrappers[i] : p;
                }
                if (!g_real[i]) g_real[i] = p;
                return g_wrappers[i];
            }
    }
    return ds(handle, name);
}

