/* Helpers shared by the nn family's operator files (op_nn_*.c). */
#ifndef NPUSIM_OP_NN_INT_H
#define NPUSIM_OP_NN_INT_H
#include "opapi_int.h"

/* v with dimension d moved last (a permutation of shape and strides: the same memory). */
HIDDEN struct ops_tensor nn_dim_last(struct ops_tensor v, int d);
/* Opens an executor or answers why not (161001 for NULL out-parameters, else 561000). */
#define NN_OPEN(e, name, op)                                                                  \
    aclOpExecutor *e = ex_open(name, op, workspaceSize, executor);                            \
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR

#define NN_CHECK(expr)                       \
    do {                                     \
        aclnnStatus st_ = (expr);            \
        if (st_) return st_;                 \
    } while (0)

#define NN_REQUIRE(cond)                                \
    do {                                                \
        if (!(cond)) return ACLNN_ERR_PARAM_INVALID;    \
    } while (0)

/* Tensors of the same shape as ref (same rank and sizes). */
HIDDEN bool nn_same_shape(const aclTensor *a, const aclTensor *ref);
/* Index dtypes: int32, int64 (and for masks, bool). */
#define DTM_INDEX (DTM(OPS_DT_INT32) | DTM(OPS_DT_INT64))

#endif
