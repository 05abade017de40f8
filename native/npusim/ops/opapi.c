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
 * once per process with aclrtBinaryLoadFromFile. fp32 only; enough operators to train an MLP. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops_abi.h"

#define API __attribute__((visibility("default")))

typedef int32_t aclnnStatus;
typedef int32_t aclError;
typedef void *aclrtStream;

#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_RUNTIME_ERROR 361001
#define ACLNN_ERR_INNER 561000

/* aclDataType and aclFormat values of acl_base.h that this library accepts or names. */
#define ACL_FLOAT 0
#define ACL_DT_UNDEFINED (-1)
#define ACL_FLOAT16 1
#define ACL_INT32 3
#define ACL_INT64 9
#define ACL_DOUBLE 11
#define ACL_FORMAT_ND 2

/* The runtime (libacl_rt.so): kernel binaries and launches (include/external/acl/acl_rt.h). */
extern aclError aclrtBinaryLoadFromFile(const char *binPath, void *options, void **binHandle);
extern aclError aclrtBinaryGetFunction(const void *binHandle, const char *kernelName, void **funcHandle);
extern aclError aclrtLaunchKernel(void *funcHandle, uint32_t numBlocks, const void *argsData, size_t argsSize,
                                  aclrtStream stream);

#define KERNEL_DIR "opp/built-in/op_impl/ai_core/tbe/kernel/npusim"
#define KERNEL_BIN "libnpusim_aclnn_kernels.so"
#define BLOCK_DIM 8u /* AI cores an operator spreads over */

typedef struct aclTensor {
    int32_t dtype, format;
    int32_t ndim, storage_ndim;
    int64_t dims[OPS_MAX_DIMS], strides[OPS_MAX_DIMS], storage[OPS_MAX_DIMS];
    int64_t offset;
    uint64_t data;
} aclTensor;

typedef struct aclScalar {
    double value;
    int32_t dtype;
} aclScalar;

typedef struct aclIntArray {
    uint64_t size;
    int64_t value[OPS_MAX_DIMS];
} aclIntArray;

enum kernel_id { K_ELEMENTWISE, K_MATMUL, K_REDUCE_SUM, K_MSE_LOSS, K_COUNT };
static const char *const KERNEL_NAMES[K_COUNT] = {"npusim_elementwise", "npusim_matmul", "npusim_reduce_sum",
                                                  "npusim_mse_loss"};

typedef struct aclOpExecutor {
    const char *op; /* the aclnn operator it was made for */
    int kernel;
    uint32_t block_dim;
    size_t args_size;
    union {
        struct ops_ew_args ew;
        struct ops_mm_args mm;
        struct ops_reduce_args red;
        struct ops_mse_args mse;
    } args;
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

API aclScalar *aclCreateScalar(void *value, int32_t dataType) {
    if (!value) return NULL;
    aclScalar *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->dtype = dataType;
    switch (dataType) {
    case ACL_FLOAT: s->value = *(const float *)value; break;
    case ACL_DOUBLE: s->value = *(const double *)value; break;
    case ACL_INT32: s->value = *(const int32_t *)value; break;
    case ACL_INT64: s->value = (double)*(const int64_t *)value; break;
    default: free(s); return NULL;
    }
    return s;
}

API aclnnStatus aclDestroyScalar(const aclScalar *scalar) {
    free((void *)scalar);
    return ACLNN_SUCCESS;
}

API aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    if (size > OPS_MAX_DIMS || (size && !value)) return NULL;
    aclIntArray *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->size = size;
    for (uint64_t i = 0; i < size; i++) a->value[i] = value[i];
    return a;
}

API aclnnStatus aclDestroyIntArray(const aclIntArray *array) {
    free((void *)array);
    return ACLNN_SUCCESS;
}

API aclnnStatus aclGetViewShape(const aclTensor *tensor, int64_t **viewDims, uint64_t *viewDimsNum) {
    if (!tensor || !viewDims || !viewDimsNum) return ACLNN_ERR_PARAM_NULLPTR;
    *viewDimsNum = (uint64_t)tensor->ndim;
    *viewDims = malloc(sizeof(int64_t) * (tensor->ndim ? (size_t)tensor->ndim : 1));
    if (!*viewDims) return ACLNN_ERR_INNER;
    memcpy(*viewDims, tensor->dims, sizeof(int64_t) * (size_t)tensor->ndim);
    return ACLNN_SUCCESS;
}

/* ---------------------------------------------------------------- checks and views */

static int64_t numel(const aclTensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->dims[d];
    return n;
}

/* A tensor this library computes on: fp32, ND-like format, non-negative strides, data present. */
static aclnnStatus check_tensor(const aclTensor *t) {
    if (!t) return ACLNN_ERR_PARAM_NULLPTR;
    if (t->dtype != ACL_FLOAT) return ACLNN_ERR_PARAM_INVALID;
    for (int d = 0; d < t->ndim; d++)
        if (t->strides[d] < 0) return ACLNN_ERR_PARAM_INVALID;
    if (numel(t) && !t->data) return ACLNN_ERR_PARAM_NULLPTR;
    return ACLNN_SUCCESS;
}

static struct ops_view view_of(const aclTensor *t) {
    struct ops_view v;
    memset(&v, 0, sizeof v);
    v.addr = t->data;
    v.offset = t->offset;
    v.ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) {
        v.shape[d] = t->dims[d];
        v.stride[d] = t->strides[d];
    }
    return v;
}

/* The broadcast shape of a and b (numpy rules, aligned at the last dimension), or -1. */
static int broadcast_shape(const aclTensor *a, const aclTensor *b, int64_t *shape) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int ia = a->ndim - nd + i, ib = b->ndim - nd + i;
        int64_t da = ia >= 0 ? a->dims[ia] : 1, db = ib >= 0 ? b->dims[ib] : 1;
        if (da != db && da != 1 && db != 1) return -1;
        shape[i] = da == 1 ? db : da;
    }
    return nd;
}

static int same_shape(const aclTensor *t, const int64_t *shape, int nd) {
    if (t->ndim != nd) return 0;
    for (int d = 0; d < nd; d++)
        if (t->dims[d] != shape[d]) return 0;
    return 1;
}

/* t viewed in the output's shape: leading dimensions added, broadcast dimensions of stride 0. */
static struct ops_view aligned(const aclTensor *t, const aclTensor *out) {
    struct ops_view v = view_of(out);
    v.addr = t->data;
    v.offset = t->offset;
    for (int i = 0; i < out->ndim; i++) {
        int it = t->ndim - out->ndim + i;
        v.stride[i] = (it >= 0 && t->dims[it] == out->dims[i]) ? t->strides[it] : 0;
    }
    return v;
}

static aclnnStatus new_executor(const char *op, int kernel, uint64_t *workspaceSize, aclOpExecutor **executor,
                                aclOpExecutor **out) {
    if (!workspaceSize || !executor) return ACLNN_ERR_PARAM_NULLPTR;
    aclOpExecutor *e = calloc(1, sizeof *e);
    if (!e) return ACLNN_ERR_INNER;
    e->op = op;
    e->kernel = kernel;
    e->block_dim = BLOCK_DIM;
    *workspaceSize = 0; /* these kernels need no scratch memory */
    *executor = e;
    *out = e;
    return ACLNN_SUCCESS;
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

/* Phase two of every operator: launch the executor's kernel on the stream, consume the executor. */
static aclnnStatus launch(const char *op, void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                          aclrtStream stream) {
    (void)workspace;
    if (!executor) return ACLNN_ERR_PARAM_NULLPTR;
    if (strcmp(executor->op, op) != 0) return ACLNN_ERR_PARAM_INVALID; /* an executor of another operator */
    (void)workspaceSize; /* every kernel here needs 0 bytes, so any size is enough */
    aclError rc = 0;
    void *f = kernel_func(executor->kernel, &rc);
    if (f) rc = aclrtLaunchKernel(f, executor->block_dim, &executor->args, executor->args_size, stream);
    free(executor);
    if (rc != 0) fprintf(stderr, "libopapi: %s: aclrtLaunchKernel failed with %d\n", op, rc);
    return rc == 0 ? ACLNN_SUCCESS : ACLNN_ERR_RUNTIME_ERROR;
}

#define LAUNCHER(name)                                                                                  \
    API aclnnStatus name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        return launch(#name, workspace, workspaceSize, executor, stream);                               \
    }

/* ---------------------------------------------------------------- element-wise operators */

static aclnnStatus ew_binary(const char *op, int ewop, float alpha, const aclTensor *a, const aclTensor *b,
                             const aclTensor *c, const aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    aclnnStatus st;
    if ((st = check_tensor(a)) || (b && (st = check_tensor(b))) || (c && (st = check_tensor(c))) ||
        (st = check_tensor(out)))
        return st;
    int64_t shape[OPS_MAX_DIMS];
    int nd = a->ndim;
    memcpy(shape, a->dims, sizeof shape);
    if (b) {
        nd = broadcast_shape(a, b, shape);
        if (nd < 0) return ACLNN_ERR_PARAM_INVALID;
    }
    if (c) {
        aclTensor tmp = *a;
        tmp.ndim = nd;
        memcpy(tmp.dims, shape, sizeof shape);
        nd = broadcast_shape(&tmp, c, shape);
        if (nd < 0) return ACLNN_ERR_PARAM_INVALID;
    }
    if (!same_shape(out, shape, nd)) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e;
    if ((st = new_executor(op, K_ELEMENTWISE, ws, ex, &e))) return st;
    e->args_size = sizeof e->args.ew;
    e->args.ew.op = ewop;
    e->args.ew.alpha = alpha;
    e->args.ew.nin = 1 + (b != NULL) + (c != NULL);
    e->args.ew.out = view_of(out);
    e->args.ew.in[0] = aligned(a, out);
    if (b) e->args.ew.in[1] = aligned(b, out);
    if (c) e->args.ew.in[2] = aligned(c, out);
    return ACLNN_SUCCESS;
}

static aclnnStatus scalar_value(const aclScalar *s, float *v) {
    if (!s) return ACLNN_ERR_PARAM_NULLPTR;
    *v = (float)s->value;
    return ACLNN_SUCCESS;
}

API aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                         aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    float al;
    aclnnStatus st = scalar_value(alpha, &al);
    if (st) return st;
    if (!other) return ACLNN_ERR_PARAM_NULLPTR;
    return ew_binary("aclnnAdd", OPS_EW_ADD, al, self, other, NULL, out, workspaceSize, executor);
}
LAUNCHER(aclnnAdd)

API aclnnStatus aclnnInplaceAddGetWorkspaceSize(const aclTensor *selfRef, const aclTensor *other,
                                                const aclScalar *alpha, uint64_t *workspaceSize,
                                                aclOpExecutor **executor) {
    float al;
    aclnnStatus st = scalar_value(alpha, &al);
    if (st) return st;
    if (!other) return ACLNN_ERR_PARAM_NULLPTR;
    return ew_binary("aclnnInplaceAdd", OPS_EW_ADD, al, selfRef, other, NULL, selfRef, workspaceSize, executor);
}
LAUNCHER(aclnnInplaceAdd)

API aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                         uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!other) return ACLNN_ERR_PARAM_NULLPTR;
    return ew_binary("aclnnMul", OPS_EW_MUL, 0.0f, self, other, NULL, out, workspaceSize, executor);
}
LAUNCHER(aclnnMul)

API aclnnStatus aclnnMulsGetWorkspaceSize(const aclTensor *self, const aclScalar *other, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    float v;
    aclnnStatus st = scalar_value(other, &v);
    if (st) return st;
    return ew_binary("aclnnMuls", OPS_EW_MULS, v, self, NULL, NULL, out, workspaceSize, executor);
}
LAUNCHER(aclnnMuls)

API aclnnStatus aclnnInplaceMulsGetWorkspaceSize(const aclTensor *selfRef, const aclScalar *other,
                                                 uint64_t *workspaceSize, aclOpExecutor **executor) {
    float v;
    aclnnStatus st = scalar_value(other, &v);
    if (st) return st;
    return ew_binary("aclnnInplaceMuls", OPS_EW_MULS, v, selfRef, NULL, NULL, selfRef, workspaceSize, executor);
}
LAUNCHER(aclnnInplaceMuls)

API aclnnStatus aclnnReluGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                          aclOpExecutor **executor) {
    return ew_binary("aclnnRelu", OPS_EW_RELU, 0.0f, self, NULL, NULL, out, workspaceSize, executor);
}
LAUNCHER(aclnnRelu)

API aclnnStatus aclnnThresholdBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                       const aclScalar *threshold, aclTensor *out,
                                                       uint64_t *workspaceSize, aclOpExecutor **executor) {
    float th;
    aclnnStatus st = scalar_value(threshold, &th);
    if (st) return st;
    if (!self) return ACLNN_ERR_PARAM_NULLPTR;
    return ew_binary("aclnnThresholdBackward", OPS_EW_THRESHOLD_BWD, th, gradOutput, self, NULL, out,
                     workspaceSize, executor);
}
LAUNCHER(aclnnThresholdBackward)

/* reduction: 0 none, 1 mean, 2 sum (torch's Reduction enum, as aclnn takes it). */
API aclnnStatus aclnnMseLossBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                     const aclTensor *target, int64_t reduction,
                                                     aclTensor *gradInput, uint64_t *workspaceSize,
                                                     aclOpExecutor **executor) {
    if (!gradOutput || !self || !target || !gradInput) return ACLNN_ERR_PARAM_NULLPTR;
    if (reduction < 0 || reduction > 2) return ACLNN_ERR_PARAM_INVALID;
    int64_t n = numel(self);
    float scale = reduction == 1 ? (n ? 2.0f / (float)n : 0.0f) : 2.0f;
    return ew_binary("aclnnMseLossBackward", OPS_EW_MSE_BWD, scale, self, target, gradOutput, gradInput,
                     workspaceSize, executor);
}
LAUNCHER(aclnnMseLossBackward)

API aclnnStatus aclnnMseLossGetWorkspaceSize(const aclTensor *self, const aclTensor *target, int64_t reduction,
                                             aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = check_tensor(self)) || (st = check_tensor(target)) || (st = check_tensor(out))) return st;
    if (reduction < 0 || reduction > 2) return ACLNN_ERR_PARAM_INVALID;
    int64_t shape[OPS_MAX_DIMS];
    int nd = broadcast_shape(self, target, shape);
    if (nd < 0 || !same_shape(self, shape, nd)) return ACLNN_ERR_PARAM_INVALID;
    if (reduction == 0)
        return ew_binary("aclnnMseLoss", OPS_EW_SQDIFF, 0.0f, self, target, NULL, out, workspaceSize, executor);
    if (numel(out) != 1) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e;
    if ((st = new_executor("aclnnMseLoss", K_MSE_LOSS, workspaceSize, executor, &e))) return st;
    e->block_dim = BLOCK_DIM;
    e->args_size = sizeof e->args.mse;
    e->args.mse.a = view_of(self);
    e->args.mse.b = aligned(target, self);
    e->args.mse.out = view_of(out);
    e->args.mse.reduction = (int32_t)reduction;
    return ACLNN_SUCCESS;
}
LAUNCHER(aclnnMseLoss)

/* ---------------------------------------------------------------- matmul, reduce */

static aclnnStatus mm(const char *op, const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = check_tensor(self)) || (st = check_tensor(mat2)) || (st = check_tensor(out))) return st;
    if (self->ndim != 2 || mat2->ndim != 2 || out->ndim != 2) return ACLNN_ERR_PARAM_INVALID;
    if (self->dims[1] != mat2->dims[0] || out->dims[0] != self->dims[0] || out->dims[1] != mat2->dims[1])
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e;
    if ((st = new_executor(op, K_MATMUL, workspaceSize, executor, &e))) return st;
    e->args_size = sizeof e->args.mm;
    e->args.mm.a = view_of(self);
    e->args.mm.b = view_of(mat2);
    e->args.mm.out = view_of(out);
    return ACLNN_SUCCESS;
}

/* cubeMathType (0 KEEP_DTYPE, 1 ALLOW_FP32_DOWN_PRECISION, 2 USE_FP16, 3 USE_HF32): fp32 either way. */
API aclnnStatus aclnnMatmulGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                            int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (cubeMathType < 0 || cubeMathType > 3) return ACLNN_ERR_PARAM_INVALID;
    return mm("aclnnMatmul", self, mat2, out, workspaceSize, executor);
}
LAUNCHER(aclnnMatmul)

API aclnnStatus aclnnMmGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                        int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (cubeMathType < 0 || cubeMathType > 3) return ACLNN_ERR_PARAM_INVALID;
    return mm("aclnnMm", self, mat2, out, workspaceSize, executor);
}
LAUNCHER(aclnnMm)

API aclnnStatus aclnnReduceSumGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim,
                                               int32_t dtype, aclTensor *out, uint64_t *workspaceSize,
                                               aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = check_tensor(self)) || (st = check_tensor(out))) return st;
    if (!dim) return ACLNN_ERR_PARAM_NULLPTR;
    if (dtype != ACL_FLOAT) return ACLNN_ERR_PARAM_INVALID;
    uint8_t red[OPS_MAX_DIMS] = {0};
    for (uint64_t i = 0; i < dim->size; i++) {
        int64_t d = dim->value[i] < 0 ? dim->value[i] + self->ndim : dim->value[i];
        if (d < 0 || d >= self->ndim || red[d]) return ACLNN_ERR_PARAM_INVALID; /* out of range or repeated */
        red[d] = 1;
    }
    int64_t want[OPS_MAX_DIMS];
    int nw = 0;
    for (int d = 0; d < self->ndim; d++)
        if (!red[d]) want[nw++] = self->dims[d];
        else if (keepDim) want[nw++] = 1;
    if (!same_shape(out, want, nw)) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e;
    if ((st = new_executor("aclnnReduceSum", K_REDUCE_SUM, workspaceSize, executor, &e))) return st;
    e->args_size = sizeof e->args.red;
    e->args.red.in = view_of(self);
    /* out in self's rank: reduced dimensions of size 1 (their stride does not matter). */
    struct ops_view o = view_of(self);
    o.addr = out->data;
    o.offset = out->offset;
    for (int d = 0, k = 0; d < self->ndim; d++) {
        if (red[d]) {
            o.shape[d] = 1;
            o.stride[d] = 0;
            if (keepDim) k++;
        } else {
            o.shape[d] = out->dims[k];
            o.stride[d] = out->strides[k];
            k++;
        }
        e->args.red.reduce[d] = red[d];
    }
    e->args.red.out = o;
    return ACLNN_SUCCESS;
}
LAUNCHER(aclnnReduceSum)
