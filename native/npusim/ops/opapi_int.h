/* Shared by the operator library's files (opapi.c and op_*.c): the descriptor types of
 * aclnn/acl_meta.h as this library lays them out, and the builder of generic-family executors.
 *
 * An aclnn entry point of the generic family is two functions:
 *   aclnnXxxGetWorkspaceSize(args..., uint64_t *workspaceSize, aclOpExecutor **executor)
 *       checks its arguments as the real op_api checks them (161001 for a NULL, 161002 for a shape,
 *       dtype or format it does not support), then opens an executor with ex_open(), adds ints,
 *       scalars and tensors (inputs, then outputs) and returns ex_done();
 *   aclnnXxx(workspace, workspaceSize, executor, stream) = OPS_LAUNCHER(aclnnXxx).
 * Everything an executor holds is a value (no pointer into the caller's descriptors), because
 * torch_npu destroys the descriptors on its release thread while the launch may still be queued. */
#ifndef NPUSIM_OPAPI_INT_H
#define NPUSIM_OPAPI_INT_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ops_abi.h"

#define API __attribute__((visibility("default")))
#define HIDDEN __attribute__((visibility("hidden")))

typedef int32_t aclnnStatus;
typedef int32_t aclError;
typedef void *aclrtStream;

#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_RUNTIME_ERROR 361001
#define ACLNN_ERR_INNER 561000

/* aclFormat values of acl_base.h whose layout is plain strided memory (ND and its origin-format
 * aliases, which op-plugin passes for 3-D/4-D/5-D tensors); every other (private) format is
 * refused with 161002, as an op without a TransData path would. */
#define ACL_FORMAT_NCHW 0
#define ACL_FORMAT_NHWC 1
#define ACL_FORMAT_ND 2
#define ACL_FORMAT_NDHWC 27
#define ACL_FORMAT_NCDHW 30
#define ACL_FORMAT_NCL 47

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
    int64_t *value;
} aclIntArray;

typedef struct aclFloatArray {
    uint64_t size;
    float *value;
} aclFloatArray;

typedef struct aclBoolArray {
    uint64_t size;
    bool *value;
} aclBoolArray;

typedef struct aclTensorList {
    uint64_t size;
    aclTensor **tensors; /* owned: aclDestroyTensorList destroys them (op-plugin releases only the list) */
} aclTensorList;

typedef struct aclScalarList {
    uint64_t size;
    aclScalar **scalars; /* owned, likewise */
} aclScalarList;

typedef struct aclOpExecutor aclOpExecutor;

/* ---- checks */
HIDDEN int64_t t_numel(const aclTensor *t);
/* A tensor this library computes on: non-NULL, a dtype in the mask (DTM(dtype) bits; 0: any this
 * library knows), a strided format, data present when it has elements. */
#define DTM(dt) (1ull << (dt))
#define DTM_FLOATS (DTM(OPS_DT_FLOAT) | DTM(OPS_DT_FLOAT16) | DTM(OPS_DT_BF16))
#define DTM_INTS (DTM(OPS_DT_INT8) | DTM(OPS_DT_UINT8) | DTM(OPS_DT_INT16) | DTM(OPS_DT_INT32) | DTM(OPS_DT_INT64))
#define DTM_NUM (DTM_FLOATS | DTM_INTS | DTM(OPS_DT_DOUBLE))
#define DTM_ALL (DTM_NUM | DTM(OPS_DT_BOOL))
HIDDEN aclnnStatus t_check(const aclTensor *t, uint64_t dtypes);
HIDDEN bool t_same_shape(const aclTensor *t, const int64_t *shape, int nd);
/* numpy broadcast of a's and b's shapes into shape; returns the rank or -1. */
HIDDEN int t_broadcast(const int64_t *a, int na, const int64_t *b, int nb, int64_t *shape);
/* A dimension index in [0, nd) from a possibly negative one, or -1. */
HIDDEN int t_dim(int64_t d, int nd);

/* ---- views for the kernels */
HIDDEN struct ops_tensor t_view(const aclTensor *t);
/* t viewed in shape (rank nd): leading dimensions added, broadcast dimensions of stride 0. */
HIDDEN struct ops_tensor t_aligned(const aclTensor *t, const int64_t *shape, int nd);

/* ---- scalars */
HIDDEN double s_value(const aclScalar *s);

/* ---- executors */
/* Opens an executor for the generic kernel `op` on behalf of aclnn operator `name`; sets *ws = 0. */
HIDDEN aclOpExecutor *ex_open(const char *name, enum ops_op op, uint64_t *workspaceSize, aclOpExecutor **executor);
HIDDEN void ex_int(aclOpExecutor *e, int64_t v);
HIDDEN void ex_scalar(aclOpExecutor *e, double v);
HIDDEN void ex_tensor(aclOpExecutor *e, struct ops_tensor t);
/* Ask for a workspace of this many bytes (device memory the caller allocates and passes to phase
 * two; its address is handed to the kernel as the last int). */
HIDDEN void ex_workspace(aclOpExecutor *e, uint64_t bytes);
/* Ends phase one: ACLNN_SUCCESS with the caller's *workspaceSize and *executor set, or (out of
 * memory) an error and no executor. */
HIDDEN aclnnStatus ex_done(aclOpExecutor *e);
HIDDEN aclnnStatus ex_launch(const char *name, void *workspace, uint64_t workspaceSize, aclOpExecutor *e,
                             aclrtStream stream);

/* An element-wise operator: out = f(ins..., scalars) with inputs broadcast to out's shape (which
 * must be their broadcast shape). */
HIDDEN aclnnStatus ew_op(const char *name, enum ops_ew_fn fn, const aclTensor *const *ins, int nin, const double *s,
                         int ns, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor);

/* Defined by an operator family whose outputs get their shape when the kernel ran (weak: absent,
 * every tensor keeps its view shape): replaces dims/ndim for such an output. */
HIDDEN void op_result_shape(const aclTensor *t, int64_t *dims, int *ndim) __attribute__((weak));

#define OPS_LAUNCHER(name)                                                                                    \
    API aclnnStatus name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        return ex_launch(#name, workspace, workspaceSize, executor, stream);                                  \
    }

#endif
