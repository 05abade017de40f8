/* The aclnn operators' side of write tracking (see writes.c). */
#include "writes_int.h"

/* ------------------------------------------------------------------ operator signatures */

enum { A_PTR, A_I8, A_U8, A_I16, A_U16, A_I32, A_U32, A_I64, A_U64, A_F32, A_F64 };
#define MAX_ARGS 48
#define NAME_MAX_LEN 128

struct op {
    char name[NAME_MAX_LEN]; /* aclnnXxx */
    int parsed;              /* its GetWorkspaceSize's signature was read from a header */
    int nargs;
    unsigned char type[MAX_ARGS];
    uint64_t out_tensor, out_list; /* bit i: parameter i is written (aclTensor*, aclTensorList*) */
    int opaque;                    /* a parameter reaches tensors this file cannot follow */
    void *real_gws, *real_launch;
    void *code_gws, *code_launch;
#ifdef NPUSNAP_HAVE_FFI
    ffi_cif cif;
    ffi_type *ft[MAX_ARGS];
#endif
    struct op *next;
};

static pthread_mutex_t g_omu = PTHREAD_MUTEX_INITIALIZER;
static struct op *g_ops; /* never freed: closures point at them */
static int g_sigs_read;
static size_t g_nsigs;

static struct op *op_find_locked(const char *name) {
    for (struct op *o = g_ops; o; o = o->next)
        if (!strcmp(o->name, name)) return o;
    return NULL;
}

static struct op *op_get_locked(const char *name) {
    struct op *o = op_find_locked(name);
    if (o || strlen(name) >= NAME_MAX_LEN) return o;
    o = calloc(1, sizeof *o);
    if (!o) return NULL;
    snprintf(o->name, sizeof o->name, "%s", name);
    o->next = g_ops;
    g_ops = o;
    return o;
}

static int is_ident(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

static int has_word(const char *s, size_t n, const char *w) {
    size_t wl = strlen(w);
    for (size_t i = 0; i + wl <= n; i++)
        if (!memcmp(s + i, w, wl) && (i == 0 || !is_ident(s[i - 1])) && (i + wl == n || !is_ident(s[i + wl])))
            return 1;
    return 0;
}

/* One parameter "TYPE NAME" (no default values in C). Returns its class; *tensor / *list are set
 * when it is an aclTensor* / aclTensorList* the operator writes; *opaque when it reaches tensors
 * in a way that is not followed. */
static int param_class(const char *s, size_t n, int *tensor, int *list, int *opaque) {
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n')) n--;
    while (n && (*s == ' ' || *s == '\t' || *s == '\n')) s++, n--;
    size_t e = n;
    while (e && is_ident(s[e - 1])) e--; /* the parameter's name: s[e..n) */
    const char *pname = s + e;
    size_t plen = n - e;
    size_t stars = 0;
    for (size_t i = 0; i < e; i++) stars += s[i] == '*';
    int is_list = has_word(s, e, "aclTensorList");
    int is_tensor = has_word(s, e, "aclTensor");
    *tensor = *list = 0;
    if (stars) {
        if ((is_tensor || is_list) && stars > 1) *opaque = 1;
        else if (is_tensor || is_list) {
            /* const before the star: an input, unless its name says it is written: CANN names
             * an in-place operand ...Ref and declares it const (its documentation says
             * "input|output"), and some declare an output list const ("out", "...Out"). */
            const char *star = memchr(s, '*', e);
            int is_const = has_word(s, (size_t)(star - s), "const");
            int named = memmem(pname, plen, "Ref", 3) || memmem(pname, plen, "Out", 3) ||
                        (plen >= 3 && !memcmp(pname, "out", 3));
            if (!is_const || named) {
                if (is_list) *list = 1;
                else *tensor = 1;
            }
        }
        return A_PTR;
    }
    if (has_word(s, e, "double")) return A_F64;
    if (has_word(s, e, "float")) return A_F32;
    if (has_word(s, e, "int64_t") || has_word(s, e, "long")) return A_I64;
    if (has_word(s, e, "uint64_t") || has_word(s, e, "size_t")) return A_U64;
    if (has_word(s, e, "int32_t") || has_word(s, e, "int")) return A_I32;
    if (has_word(s, e, "uint32_t") || has_word(s, e, "unsigned")) return A_U32;
    if (has_word(s, e, "int16_t") || has_word(s, e, "short")) return A_I16;
    if (has_word(s, e, "uint16_t")) return A_U16;
    if (has_word(s, e, "int8_t") || has_word(s, e, "char")) return A_I8;
    if (has_word(s, e, "uint8_t") || has_word(s, e, "bool")) return A_U8;
    return A_I32; /* an enum (aclDataType, aclFormat, ...) */
}

/* The index of the first aclTensor* parameter in "[a, close)" (0 if none). */
static int first_tensor_arg(const char *a, const char *close) {
    for (int i = 0; a < close; i++) {
        const char *comma = memchr(a, ',', (size_t)(close - a));
        const char *end = comma ? comma : close;
        if (has_word(a, (size_t)(end - a), "aclTensor")) return i;
        if (!comma) break;
        a = end + 1;
    }
    return 0;
}

/* Every "aclnnXxxGetWorkspaceSize(...)" declaration of one header. */
static void parse_header(const char *buf, size_t len) {
    static const char suffix[] = "GetWorkspaceSize";
    for (const char *p = buf; (p = memmem(p, len - (size_t)(p - buf), suffix, sizeof suffix - 1)); p++) {
        const char *paren = p + sizeof suffix - 1;
        while (paren < buf + len && (*paren == ' ' || *paren == '\n')) paren++;
        if (paren >= buf + len || *paren != '(') continue;
        const char *start = p;
        while (start > buf && is_ident(start[-1])) start--;
        size_t nlen = (size_t)(p - start);
        if (nlen < 6 || nlen >= NAME_MAX_LEN || memcmp(start, "aclnn", 5) != 0) continue;
        const char *close = memchr(paren, ')', len - (size_t)(paren - buf));
        if (!close) return;
        /* Only plain parameter lists: a function pointer, an array or "..." is not followed
         * (the operator is then not wrapped, and its launch counts as writing everything). */
        const char *end = close + 1;
        while (end < buf + len && (*end == ' ' || *end == '\n' || *end == '\t')) end++;
        if (memchr(paren + 1, '(', (size_t)(close - paren - 1)) || memchr(paren + 1, '[', (size_t)(close - paren - 1)) ||
            memmem(paren + 1, (size_t)(close - paren - 1), "...", 3) || end >= buf + len || (*end != ';' && *end != '{'))
            continue;
        char name[NAME_MAX_LEN];
        memcpy(name, start, nlen);
        name[nlen] = 0;
        struct op tmp;
        memset(&tmp, 0, sizeof tmp);
        const char *a = paren + 1;
        int ok = 1;
        while (a < close && tmp.nargs < MAX_ARGS) {
            const char *comma = memchr(a, ',', (size_t)(close - a));
            const char *end = comma ? comma : close;
            int t = 0, l = 0;
            tmp.type[tmp.nargs] = (unsigned char)param_class(a, (size_t)(end - a), &t, &l, &tmp.opaque);
            if (t) tmp.out_tensor |= 1ull << tmp.nargs;
            if (l) tmp.out_list |= 1ull << tmp.nargs;
            tmp.nargs++;
            a = end + 1;
            if (!comma) break;
        }
        /* An in-place operator writes its first tensor whatever its declaration says. */
        if (!strncmp(name, "aclnnInplace", 12))
            for (int i = 0; i < tmp.nargs; i++)
                if (tmp.type[i] == A_PTR && has_word(paren, (size_t)(close - paren), "aclTensor")) {
                    tmp.out_tensor |= 1ull << first_tensor_arg(paren + 1, close);
                    break;
                }
        /* ..., uint64_t *workspaceSize, aclOpExecutor **executor */
        if (a < close || tmp.nargs < 2 || tmp.type[tmp.nargs - 1] != A_PTR || tmp.type[tmp.nargs - 2] != A_PTR) ok = 0;
        if (!ok) continue;
        pthread_mutex_lock(&g_omu);
        struct op *o = op_get_locked(name);
        if (o && !o->parsed) {
            o->parsed = 1;
            o->nargs = tmp.nargs;
            memcpy(o->type, tmp.type, sizeof tmp.type);
            o->out_tensor = tmp.out_tensor;
            o->out_list = tmp.out_list;
            o->opaque = tmp.opaque;
            g_nsigs++;
        }
        pthread_mutex_unlock(&g_omu);
        p = close;
    }
}

static void read_headers(const char *dir, int depth) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat st;
        if (stat(path, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            if (depth > 0) read_headers(path, depth - 1);
            continue;
        }
        size_t nl = strlen(de->d_name);
        if (!S_ISREG(st.st_mode) || nl < 3 || strcmp(de->d_name + nl - 2, ".h") != 0 || st.st_size > (4 << 20)) continue;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        char *buf = malloc((size_t)st.st_size + 1);
        ssize_t got = buf ? read(fd, buf, (size_t)st.st_size) : -1;
        close(fd);
        if (got > 0) parse_header(buf, (size_t)got);
        free(buf);
    }
    closedir(d);
}

static void read_signatures(void) {
    const char *home = getenv("ASCEND_HOME_PATH");
    const char *opp = getenv("ASCEND_OPP_PATH");
    char dir[4096];
    if (home && *home) {
        snprintf(dir, sizeof dir, "%s/include/aclnnop", home);
        read_headers(dir, 2);
    }
    if (opp && *opp) {
        snprintf(dir, sizeof dir, "%s/vendors", opp);
        DIR *d = opendir(dir);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (de->d_name[0] == '.') continue;
            char inc[4096];
            snprintf(inc, sizeof inc, "%s/%s/op_api/include", dir, de->d_name);
            read_headers(inc, 1);
        }
        if (d) closedir(d);
    }
    agent_log("[writes] %zu operator signatures read from the CANN install's headers", g_nsigs);
}

static pthread_once_t g_sigs_once = PTHREAD_ONCE_INIT;
static void sigs_once(void) {
    read_signatures();
    g_sigs_read = 1;
}

#ifdef NPUSNAP_HAVE_FFI
static ffi_type *ffi_of(int t) {
    switch (t) {
    case A_I8: return &ffi_type_sint8;
    case A_U8: return &ffi_type_uint8;
    case A_I16: return &ffi_type_sint16;
    case A_U16: return &ffi_type_uint16;
    case A_I32: return &ffi_type_sint32;
    case A_U32: return &ffi_type_uint32;
    case A_I64: return &ffi_type_sint64;
    case A_U64: return &ffi_type_uint64;
    case A_F32: return &ffi_type_float;
    case A_F64: return &ffi_type_double;
    default: return &ffi_type_pointer;
    }
}

static void add_extent(struct extent **e, size_t *n, size_t *cap, struct extent x, int *all) {
    if (x.n == UINT64_MAX) {
        *all = 1;
        return;
    }
    if (!x.n) return;
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 8;
        struct extent *ne = realloc(*e, c * sizeof *ne);
        if (!ne) {
            *all = 1;
            return;
        }
        *e = ne;
        *cap = c;
    }
    (*e)[(*n)++] = x;
}

/* GetWorkspaceSize: call it, then record what the executor it made will write. */
static void gws_handler(ffi_cif *cif, void *ret, void **args, void *ud) {
    struct op *o = ud;
    ffi_call(cif, FFI_FN(o->real_gws), ret, args);
    if ((aclnnStatus)*(ffi_sarg *)ret != 0) return;
    void **exec_pp = *(void ***)args[o->nargs - 1];
    if (!exec_pp || !*exec_pp) return;
    struct extent *e = NULL;
    size_t n = 0, cap = 0;
    int all = o->opaque;
    for (int i = 0; i < o->nargs && !all; i++) {
        if (o->out_tensor >> i & 1) {
            const void *t = *(void **)args[i];
            struct extent x;
            if (!t) continue; /* an optional output not asked for */
            if (!w_tensor_get(t, &x)) x.n = UINT64_MAX; /* made behind the agent's back */
            add_extent(&e, &n, &cap, x, &all);
        } else if (o->out_list >> i & 1) {
            const void *l = *(void **)args[i];
            if (!l) continue;
            int found = 0;
            pthread_mutex_lock(&g_tmu);
            for (struct lnode *ln = g_lists[w_hash_ptr(l, L_BUCKETS)]; ln; ln = ln->next)
                if (ln->key == l) {
                    found = 1;
                    for (size_t k = 0; k < ln->n && !all; k++) add_extent(&e, &n, &cap, ln->e[k], &all);
                    break;
                }
            pthread_mutex_unlock(&g_tmu);
            if (!found) all = 1;
        }
    }
    if (all) {
        free(e);
        e = NULL;
        n = 0;
    }
    w_exec_put(*exec_pp, o, all, e, n);
}

/* The operator's launch: call it, then stamp what its executor writes. */
static ffi_cif g_launch_cif;
static ffi_type *g_launch_types[4];

static void launch_handler(ffi_cif *cif, void *ret, void **args, void *ud) {
    struct op *o = ud;
    struct taken t = w_take(*(void **)args[2], o);
    /* A concurrent copy takes what the kernels will write first. */
    npusnap_devmem_write_open();
    if (t.all) npusnap_devmem_before_write_all();
    for (size_t i = 0; i < t.n; i++) npusnap_devmem_before_write(t.e[i].p, (size_t)t.e[i].n);
    npusnap_devmem_before_write((uintptr_t)*(void **)args[0], (size_t)*(uint64_t *)args[1]);
    w_stamp_ranges(&t, NULL); /* and again after the call: w_stamp_ranges says why */
    npusnap_devmem_mark((uintptr_t)*(void **)args[0], (size_t)*(uint64_t *)args[1]);
    t_in_op++;
    ffi_call(cif, FFI_FN(o->real_launch), ret, args);
    t_in_op--;
    npusnap_devmem_write_close();
    w_stamp(&t, o->name);
    /* Its workspace (the caller's device memory) is the kernels' scratch: written too. */
    npusnap_devmem_mark((uintptr_t)*(void **)args[0], (size_t)*(uint64_t *)args[1]);
}

static pthread_once_t g_launch_once = PTHREAD_ONCE_INIT;
static int g_launch_ok;
static void launch_cif_init(void) {
    g_launch_types[0] = &ffi_type_pointer;
    g_launch_types[1] = &ffi_type_uint64;
    g_launch_types[2] = &ffi_type_pointer;
    g_launch_types[3] = &ffi_type_pointer;
    g_launch_ok = ffi_prep_cif(&g_launch_cif, FFI_DEFAULT_ABI, 4, &ffi_type_sint32, g_launch_types) == FFI_OK;
}

static void *make_closure(ffi_cif *cif, void (*fn)(ffi_cif *, void *, void **, void *), void *ud) {
    void *code = NULL;
    ffi_closure *cl = ffi_closure_alloc(sizeof(ffi_closure), &code);
    if (!cl) return NULL;
    if (ffi_prep_closure_loc(cl, cif, fn, ud, code) != FFI_OK) {
        ffi_closure_free(cl);
        return NULL;
    }
    return code;
}
#endif

/* Names that write device memory but are neither wrapped (writes.c) nor an aclnn operator:
 * looking one up gives the tracking up (the process's later saves are full). */
static int writer_like(const char *n) {
    static const char *const prefixes[] = {"aclrtMemcpy", "aclrtMemset", "aclrtLaunch", "aclrtCmo", "aclrtReduce",
                                           "aclrtValueWrite", "rtKernelLaunch", "rtLaunch", "rtMemcpy", "rtMemset",
                                           "rtsLaunch", "rtsMemcpy", "aclopExecute", "aclopCompileAndExecute",
                                           "aclmdlExecute", "aclmdlRIExecute", "aclSetInputTensorAddr",
                                           "aclSetOutputTensorAddr", "aclSetDynamicInputTensorAddr",
                                           "aclSetDynamicOutputTensorAddr", "aclSetTensorAddr", "aclInitTensor"};
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
        if (!strncmp(n, prefixes[i], strlen(prefixes[i]))) return 1;
    return 0;
}

/* dlsym(handle, name) found p: the wrapper to hand out instead, or NULL (p as it is). */
void *npusnap_writes_wrapper_for(void *handle, const char *name, void *p, dlsym_fn ds) {
    if (!p) return NULL;
    for (int i = 0; i < W_N; i++)
        if (!strcmp(name, WNAMES[i])) {
            if (p == g_wwrappers[i]) return p;
            if (!g_wreal[i]) g_wreal[i] = p;
            return g_wwrappers[i];
        }
    if (strncmp(name, "aclnn", 5) != 0) {
        if (writer_like(name)) npusnap_devmem_untracked(name);
        return NULL;
    }
#ifdef NPUSNAP_HAVE_FFI
    size_t nl = strlen(name);
    static const char suffix[] = "GetWorkspaceSize";
    size_t sl = sizeof suffix - 1;
    int gws = nl > sl && !strcmp(name + nl - sl, suffix);
    char base[NAME_MAX_LEN];
    if (nl >= sizeof base) return NULL;
    memcpy(base, name, gws ? nl - sl : nl);
    base[gws ? nl - sl : nl] = 0;
    pthread_once(&g_sigs_once, sigs_once);
    void *code = NULL;
    int launch = 0;
    pthread_mutex_lock(&g_omu);
    struct op *o = op_find_locked(base);
    if (gws) {
        if (o && o->parsed) {
            if (!o->code_gws) {
                o->real_gws = p;
                for (int i = 0; i < o->nargs; i++) o->ft[i] = ffi_of(o->type[i]);
                if (ffi_prep_cif(&o->cif, FFI_DEFAULT_ABI, (unsigned)o->nargs, &ffi_type_sint32, o->ft) == FFI_OK)
                    o->code_gws = make_closure(&o->cif, gws_handler, o);
            }
            if (o->real_gws == p) code = o->code_gws;
        }
    } else {
        /* A launch: only an operator with two halves (its GetWorkspaceSize exists). */
        char partner[NAME_MAX_LEN + sizeof suffix];
        snprintf(partner, sizeof partner, "%s%s", name, suffix);
        launch = (o && o->parsed) || (ds && handle && ds(handle, partner));
        if (launch) {
            if (!o) o = op_get_locked(base);
            pthread_once(&g_launch_once, launch_cif_init);
            if (o && g_launch_ok && !o->code_launch) {
                o->real_launch = p;
                o->code_launch = make_closure(&g_launch_cif, launch_handler, o);
            }
            if (o && o->real_launch == p) code = o->code_launch;
        }
    }
    pthread_mutex_unlock(&g_omu);
    if (!code && launch) npusnap_devmem_untracked(name); /* a launch whose writes cannot be stamped */
    return code;
#else
    (void)handle;
    (void)ds;
    npusnap_devmem_untracked("aclnn operators (built without libffi)");
    return NULL;
#endif
}

