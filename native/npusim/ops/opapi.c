/* libopapi.so of the simulated CANN tree: aclnn operators on the simulated NPU.
 *
 * Tensors, scalars and int arrays have the real prototypes of aclnn/acl_meta.h (aclCreateTensor:
 * view shape, strides, offset in elements, format, storage shape, device address). Operators have
 * the real two-phase shape: aclnnXxxGetWorkspaceSize checks its arguments (161001 for a NULL
 * tensor, 161002 for a shape, dtype or broadcast it does not support, as the real op_api checks
 * do), fills in the workspace size and a single-use aclOpExecutor; aclnnXxx(workspace,
 * workspaceSize, executor, stream) launches the kernel on the stream through the runtime's
 * aclrtLaunchKernel, so it is queued, ordered and gated by the snapshot lock like any launch, and
 * consumes the executor. The kernels live in a kernel binary under <tree>/opp (kernels.c), loaded
 * once per process with aclrtBinaryLoadFromFile. The operators themselves live in op_*.c. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops_abi.h"

#include "opapi_int.h"

/* The runtime (libacl_rt.so): kernel binaries and launches (include/external/acl/acl_rt.h). */
extern aclError aclrtBinaryLoadFromFile(const char *binPath, void *options, void **binHandle);
extern aclError aclrtBinaryGetFunction(const void *binHandle, const char *kernelName, void **funcHandle);
extern aclError aclrtLaunchKernel(void *funcHandle, uint32_t numBlocks, const void *argsData, size_t argsSize,
                                  aclrtStream stream);

#define KERNEL_DIR "opp/built-in/op_impl/ai_core/tbe/kernel/npusim"
#define KERNEL_BIN "libnpusim_aclnn_kernels.so"
#define BLOCK_DIM 8u /* AI cores an operator spreads over */

enum kernel_id { K_OP, K_COUNT };
static const char *const KERNEL_NAMES[K_COUNT] = {"npusim_op"};

typedef struct aclOpExecutor {
    const char *op; /* the aclnn operator it was made for */
    int kernel;
    uint32_t block_dim;
    /* the generic family's args, serialized at launch (ops_abi.h) */
    uint32_t gop;
    int oom;
    int64_t *ints;
    double *scalars;
    struct ops_tensor *tensors;
    uint32_t ni, ns, nt, capi, caps, capt;
    uint64_t workspace; /* bytes asked for */
    uint64_t *ws_out;   /* phase one's out-parameters, set by ex_done */
    aclOpExecutor **ex_out;
} aclOpExecutor;

/* ---------------------------------------------------------------- tensors, scalars, arrays */

API aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, int32_t dataType, const int64_t *stride,
                               int64_t offset, int32_t format, const int64_t *storageDims, uint64_t storageDimsNum,
                               void *tensorData) {
    if (viewDimsNum > OPS_MAX_DIMS || storageDimsNum > OPS_MAX_DIMS || offset < 0) return NULL;
    if ((viewDimsNum && !viewDims) || (storageDimsNum && !storageDims)) return NULL;
    aclTensor *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->dtype = dataType;
    t->format = format;
    t->ndim = (int32_t)viewDimsNum;
    t->storage_ndim = (int32_t)storageDimsNum;
    int64_t contiguous = 1;
    for (int d = (int)viewDimsNum - 1; d >= 0; d--) {
        if (viewDims[d] < 0) {
            free(t);
            return NULL;
        }
        t->dims[d] = viewDims[d];
        t->strides[d] = stride ? stride[d] : contiguous; /* NULL strides: contiguous, as torch_npu passes */
        contiguous *= viewDims[d] ? viewDims[d] : 1;
    }
    for (uint64_t d = 0; d < storageDimsNum; d++) t->storage[d] = storageDims[d];
    t->offset = offset;
    t->data = (uint64_t)(uintptr_t)tensorData;
    return t;
}

API aclnnStatus aclDestroyTensor(const aclTensor *tensor) {
    free((void *)tensor);
    return ACLNN_SUCCESS;
}

/* aclCreateScalar(value, dataType): value points at one element of dataType (op-plugin passes
 * double, int64, bool and complex scalars; complex ones are refused here, as no operator of this
 * library takes them). */
API aclScalar *aclCreateScalar(void *value, int32_t dataType) {
    if (!value) return NULL;
    aclScalar *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->dtype = dataType;
    switch (dataType) {
    case OPS_DT_FLOAT: s->value = *(const float *)value; break;
    case OPS_DT_DOUBLE: s->value = *(const double *)value; break;
    case OPS_DT_FLOAT16: s->value = (double)*(const _Float16 *)value; break;
    case OPS_DT_INT8: s->value = *(const int8_t *)value; break;
    case OPS_DT_UINT8: s->value = *(const uint8_t *)value; break;
    case OPS_DT_INT16: s->value = *(const int16_t *)value; break;
    case OPS_DT_INT32: s->value = *(const int32_t *)value; break;
    case OPS_DT_INT64: s->value = (double)*(const int64_t *)value; break;
    case OPS_DT_BOOL: s->value = *(const bool *)value; break;
    default: free(s); return NULL;
    }
    return s;
}

API aclnnStatus aclDestroyScalar(const aclScalar *scalar) {
    free((void *)scalar);
    return ACLNN_SUCCESS;
}

API aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    if (size && !value) return NULL;
    aclIntArray *a = calloc(1, sizeof *a);
    if (!a || !(a->value = malloc(sizeof(int64_t) * (size ? size : 1)))) {
        free(a);
        return NULL;
    }
    a->size = size;
    if (size) memcpy(a->value, value, sizeof(int64_t) * size);
    return a;
}

API aclnnStatus aclDestroyIntArray(const aclIntArray *array) {
    if (array) free(array->value);
    free((void *)array);
    return ACLNN_SUCCESS;
}

API aclFloatArray *aclCreateFloatArray(const float *value, uint64_t size) {
    if (size && !value) return NULL;
    aclFloatArray *a = calloc(1, sizeof *a);
    if (!a || !(a->value = malloc(sizeof(float) * (size ? size : 1)))) {
        free(a);
        return NULL;
    }
    a->size = size;
    if (size) memcpy(a->value, value, sizeof(float) * size);
    return a;
}

API aclnnStatus aclDestroyFloatArray(const aclFloatArray *array) {
    if (array) free(array->value);
    free((void *)array);
    return ACLNN_SUCCESS;
}

API aclBoolArray *aclCreateBoolArray(const bool *value, uint64_t size) {
    if (size && !value) return NULL;
    aclBoolArray *a = calloc(1, sizeof *a);
    if (!a || !(a->value = malloc(sizeof(bool) * (size ? size : 1)))) {
        free(a);
        return NULL;
    }
    a->size = size;
    if (size) memcpy(a->value, value, sizeof(bool) * size);
    return a;
}

API aclnnStatus aclDestroyBoolArray(const aclBoolArray *array) {
    if (array) free(array->value);
    free((void *)array);
    return ACLNN_SUCCESS;
}

/* The list takes the tensors: aclDestroyTensorList destroys them (op-plugin's Release of a tensor
 * list calls aclDestroyTensorList alone, op_api_common_base.h). */
API aclTensorList *aclCreateTensorList(const aclTensor *const *value, uint64_t size) {
    if (size && !value) return NULL;
    aclTensorList *l = calloc(1, sizeof *l);
    if (!l || !(l->tensors = calloc(size ? size : 1, sizeof *l->tensors))) {
        free(l);
        return NULL;
    }
    l->size = size;
    for (uint64_t i = 0; i < size; i++) l->tensors[i] = (aclTensor *)value[i];
    return l;
}

API aclnnStatus aclDestroyTensorList(const aclTensorList *list) {
    if (!list) return ACLNN_SUCCESS;
    for (uint64_t i = 0; i < list->size; i++) free(list->tensors[i]);
    free(list->tensors);
    free((void *)list);
    return ACLNN_SUCCESS;
}

API aclScalarList *aclCreateScalarList(const aclScalar *const *value, uint64_t size) {
    if (size && !value) return NULL;
    aclScalarList *l = calloc(1, sizeof *l);
    if (!l || !(l->scalars = calloc(size ? size : 1, sizeof *l->scalars))) {
        free(l);
        return NULL;
    }
    l->size = size;
    for (uint64_t i = 0; i < size; i++) l->scalars[i] = (aclScalar *)value[i];
    return l;
}

API aclnnStatus aclDestroyScalarList(const aclScalarList *list) {
    if (!list) return ACLNN_SUCCESS;
    for (uint64_t i = 0; i < list->size; i++) free(list->scalars[i]);
    free(list->scalars);
    free((void *)list);
    return ACLNN_SUCCESS;
}

/* The view shape; for the output of an operator whose shape is known only once it ran (aclnnNonzero,
 * which op-plugin runs with EXEC_NPU_CMD_SYNC and then asks here), the shape it computed. */
API aclnnStatus aclGetViewShape(const aclTensor *tensor, int64_t **viewDims, uint64_t *viewDimsNum) {
    if (!tensor || !viewDims || !viewDimsNum) return ACLNN_ERR_PARAM_NULLPTR;
    int64_t dims[OPS_MAX_DIMS];
    int nd = tensor->ndim;
    memcpy(dims, tensor->dims, sizeof dims);
    if (op_result_shape) op_result_shape(tensor, dims, &nd);
    *viewDimsNum = (uint64_t)nd;
    *viewDims = malloc(sizeof(int64_t) * (nd ? (size_t)nd : 1));
    if (!*viewDims) return ACLNN_ERR_INNER;
    memcpy(*viewDims, dims, sizeof(int64_t) * (size_t)nd);
    return ACLNN_SUCCESS;
}

/* ---------------------------------------------------------------- checks and views */

static int64_t numel(const aclTensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->dims[d];
    return n;
}

static int same_shape(const aclTensor *t, const int64_t *shape, int nd) {
    if (t->ndim != nd) return 0;
    for (int d = 0; d < nd; d++)
        if (t->dims[d] != shape[d]) return 0;
    return 1;
}

/* ---------------------------------------------------------------- kernel binary and launch */

static pthread_mutex_t g_bin_mu = PTHREAD_MUTEX_INITIALIZER;
static void *g_bin;
static void *g_funcs[K_COUNT];

/* The kernel binary of the CANN tree this library belongs to: <tree>/lib64/libopapi.so ->
 * <tree>/opp/..., as the real op_api finds its binaries under the opp directory of its install. */
static int kernel_path(char *buf, size_t len) {
    const char *opp = getenv("ASCEND_OPP_PATH");
    if (opp && *opp) return snprintf(buf, len, "%s/%s/%s", opp, KERNEL_DIR + 4, KERNEL_BIN) < (int)len ? 0 : -1;
    Dl_info info;
    if (!dladdr((void *)kernel_path, &info) || !info.dli_fname) return -1;
    char self[PATH_MAX];
    if (!realpath(info.dli_fname, self)) return -1;
    char *slash = strrchr(self, '/');
    if (!slash) return -1;
    *slash = '\0'; /* <tree>/lib64 */
    slash = strrchr(self, '/');
    if (!slash) return -1;
    *slash = '\0'; /* <tree> */
    return snprintf(buf, len, "%s/%s/%s", self, KERNEL_DIR, KERNEL_BIN) < (int)len ? 0 : -1;
}

static void *kernel_func(int kernel, aclError *rc) {
    pthread_mutex_lock(&g_bin_mu);
    *rc = 0;
    if (!g_bin) {
        char path[PATH_MAX];
        if (kernel_path(path, sizeof path) != 0) *rc = ACLNN_ERR_INNER;
        else *rc = aclrtBinaryLoadFromFile(path, NULL, &g_bin);
        if (*rc != 0) {
            fprintf(stderr, "libopapi: cannot load the kernel binary %s: error %d\n", path, *rc);
            g_bin = NULL;
        }
    }
    if (g_bin && !g_funcs[kernel]) *rc = aclrtBinaryGetFunction(g_bin, KERNEL_NAMES[kernel], &g_funcs[kernel]);
    void *f = g_funcs[kernel];
    pthread_mutex_unlock(&g_bin_mu);
    return f;
}

static void ex_free(aclOpExecutor *e) {
    if (!e) return;
    free(e->ints);
    free(e->scalars);
    free(e->tensors);
    free(e);
}

/* ---------------------------------------------------------------- the generic family (opapi_int.h) */

HIDDEN int64_t t_numel(const aclTensor *t) { return numel(t); }

HIDDEN aclnnStatus t_check(const aclTensor *t, uint64_t dtypes) {
    if (!t) return ACLNN_ERR_PARAM_NULLPTR;
    if (t->dtype < 0 || t->dtype >= 64 || !(DTM(t->dtype) & (dtypes ? dtypes : DTM_ALL))) return ACLNN_ERR_PARAM_INVALID;
    switch (t->format) {
    case ACL_FORMAT_NCHW: case ACL_FORMAT_NHWC: case ACL_FORMAT_ND: case ACL_FORMAT_NDHWC: case ACL_FORMAT_NCDHW:
    case ACL_FORMAT_NCL: break;
    default: return ACLNN_ERR_PARAM_INVALID;
    }
    if (numel(t) && !t->data) return ACLNN_ERR_PARAM_NULLPTR;
    return ACLNN_SUCCESS;
}

HIDDEN bool t_same_shape(const aclTensor *t, const int64_t *shape, int nd) { return same_shape(t, shape, nd) != 0; }

HIDDEN int t_broadcast(const int64_t *a, int na, const int64_t *b, int nb, int64_t *shape) {
    int nd = na > nb ? na : nb;
    if (nd > OPS_MAX_DIMS) return -1;
    for (int i = 0; i < nd; i++) {
        int ia = na - nd + i, ib = nb - nd + i;
        int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
        if (da != db && da != 1 && db != 1) return -1;
        shape[i] = da == 1 ? db : da;
    }
    return nd;
}

HIDDEN int t_dim(int64_t d, int nd) {
    int64_t r = d < 0 ? d + (nd ? nd : 1) : d;
    return r >= 0 && r < (nd ? nd : 1) ? (int)r : -1;
}

HIDDEN struct ops_tensor t_view(const aclTensor *t) {
    struct ops_tensor v;
    memset(&v, 0, sizeof v);
    v.addr = t->data;
    v.offset = t->offset;
    v.ndim = t->ndim;
    v.dtype = t->dtype;
    for (int d = 0; d < t->ndim; d++) {
        v.shape[d] = t->dims[d];
        v.stride[d] = t->strides[d];
    }
    return v;
}

HIDDEN struct ops_tensor t_aligned(const aclTensor *t, const int64_t *shape, int nd) {
    struct ops_tensor v = t_view(t);
    v.ndim = nd;
    for (int i = 0; i < nd; i++) {
        int it = t->ndim - nd + i;
        v.shape[i] = shape[i];
        v.stride[i] = (it >= 0 && t->dims[it] == shape[i] && shape[i] != 1) ? t->strides[it] : 0;
    }
    return v;
}

HIDDEN double s_value(const aclScalar *s) { return s ? s->value : 0.0; }

HIDDEN aclOpExecutor *ex_open(const char *name, enum ops_op op, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!workspaceSize || !executor) return NULL;
    aclOpExecutor *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->op = name;
    e->kernel = K_OP;
    e->block_dim = BLOCK_DIM;
    e->gop = (uint32_t)op;
    e->ws_out = workspaceSize;
    e->ex_out = executor;
    *workspaceSize = 0;
    *executor = NULL;
    return e;
}

#define EX_PUSH(arr, n, cap, v)                                                   \
    do {                                                                          \
        if (e->oom) return;                                                       \
        if (e->n == e->cap) {                                                     \
            uint32_t nc = e->cap ? e->cap * 2 : 8;                                \
            void *np = realloc(e->arr, sizeof *e->arr * nc);                      \
            if (!np) {                                                            \
                e->oom = 1;                                                       \
                return;                                                           \
            }                                                                     \
            e->arr = np;                                                          \
            e->cap = nc;                                                          \
        }                                                                         \
        e->arr[e->n++] = (v);                                                     \
    } while (0)

HIDDEN void ex_int(aclOpExecutor *e, int64_t v) { EX_PUSH(ints, ni, capi, v); }
HIDDEN void ex_scalar(aclOpExecutor *e, double v) { EX_PUSH(scalars, ns, caps, v); }
HIDDEN void ex_tensor(aclOpExecutor *e, struct ops_tensor t) { EX_PUSH(tensors, nt, capt, t); }
HIDDEN void ex_workspace(aclOpExecutor *e, uint64_t bytes) { e->workspace = bytes; }

HIDDEN aclnnStatus ex_done(aclOpExecutor *e) {
    if (!e) return ACLNN_ERR_INNER;
    if (e->oom) {
        ex_free(e);
        return ACLNN_ERR_INNER;
    }
    *e->ws_out = e->workspace;
    *e->ex_out = e;
    return ACLNN_SUCCESS;
}

HIDDEN aclnnStatus ex_launch(const char *name, void *workspace, uint64_t workspaceSize, aclOpExecutor *e,
                             aclrtStream stream) {
    if (!e) return ACLNN_ERR_PARAM_NULLPTR;
    if (strcmp(e->op, name) != 0) return ACLNN_ERR_PARAM_INVALID; /* an executor of another operator */
    if (e->workspace && (!workspace || workspaceSize < e->workspace)) {
        ex_free(e);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (e->workspace) ex_int(e, (int64_t)(uintptr_t)workspace);
    size_t size = sizeof(struct ops_args) + e->ni * sizeof(int64_t) + e->ns * sizeof(double) +
                  e->nt * sizeof(struct ops_tensor);
    char *buf = e->oom ? NULL : malloc(size);
    aclError rc = ACLNN_ERR_INNER;
    if (buf) {
        struct ops_args *a = (struct ops_args *)buf;
        *a = (struct ops_args){e->gop, e->nt, e->ns, e->ni};
        memcpy((void *)OPS_ARGS_INTS(a), e->ints, e->ni * sizeof(int64_t));
        memcpy((void *)OPS_ARGS_SCALARS(a), e->scalars, e->ns * sizeof(double));
        memcpy((void *)OPS_ARGS_TENSORS(a), e->tensors, e->nt * sizeof(struct ops_tensor));
        void *f = kernel_func(K_OP, &rc);
        if (f) rc = aclrtLaunchKernel(f, e->block_dim, buf, size, stream);
        free(buf);
    }
    ex_free(e);
    if (rc != 0) fprintf(stderr, "libopapi: %s: aclrtLaunchKernel failed with %d\n", name, rc);
    return rc == 0 ? ACLNN_SUCCESS : ACLNN_ERR_RUNTIME_ERROR;
}

/* nnopbase's destructor of an executor that phase two never consumed (acl_meta.h). */
API aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) {
    ex_free(executor);
    return ACLNN_SUCCESS;
}

HIDDEN aclnnStatus ew_op(const char *name, enum ops_ew_fn fn, const aclTensor *const *ins, int nin, const double *s,
                         int ns, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if (nin + 1 > 8) return ACLNN_ERR_INNER;
    if ((st = t_check(out, DTM_ALL))) return st;
    /* the inputs broadcast with the output (a copy broadcasts its source into selfRef) */
    int64_t shape[OPS_MAX_DIMS];
    int nd = out->ndim;
    memcpy(shape, out->dims, sizeof shape);
    for (int j = 0; j < nin; j++) {
        if ((st = t_check(ins[j], DTM_ALL))) return st;
        int64_t tmp[OPS_MAX_DIMS];
        nd = t_broadcast(shape, nd, ins[j]->dims, ins[j]->ndim, tmp);
        if (nd < 0) return ACLNN_ERR_PARAM_INVALID;
        memcpy(shape, tmp, sizeof tmp);
    }
    if (!t_same_shape(out, shape, nd)) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = ex_open(name, OPS_OP_EW, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, fn);
    for (int j = 0; j < ns; j++) ex_scalar(e, s[j]);
    for (int j = 0; j < nin; j++) ex_tensor(e, t_aligned(ins[j], shape, nd));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
