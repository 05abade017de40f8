/* The generic operator family: one row per kernel of the kernel binary (k_*.c), shared by the
 * operator library (which launches them, op_*.c) and the kernel binary (which runs them).
 *
 * OPS_KERNELS: X(ID, kernel function). The kernel function has the signature
 *     int fn(const struct kctx *k)          (kern.h)
 * OPS_EW: the element-wise maps run by the EW kernel, X(ID, function), the function being
 *     double fn(const double *x, const double *s)   (x: the inputs' elements, s: the scalars)
 * Adding an operator: a row here (an EW row, or a kernel row) and its function, and the aclnn
 * entry points in an op_*.c file that build its args. */
#ifndef NPUSIM_OPS_LIST_H
#define NPUSIM_OPS_LIST_H

/* One list per family file, so that families grow apart: ops_list_nn.h (k_nn_*.c: layers and
 * losses, shapes and indexing), ops_list_math.h (k_math_*.c: element-wise math, comparisons,
 * the foreach family, random numbers). */
#include "ops_list_math.h"
#include "ops_list_nn.h"

#define OPS_KERNELS(X)                                                                            \
    X(EW, k_ew)             /* ints[0] = enum ops_ew_fn; inputs aligned to the output, out last */ \
    X(MATMUL, k_matmul)     /* a [..,M,K], b [..,K,N], out [..,M,N]; batch dims aligned to out's */ \
    X(REDUCE, k_reduce)     /* ints[0] = enum ops_reduce_kind, ints[1..nd] = reduced flags;      \
                               in, out (in in's rank, size 1 on reduced dims); s[0] = p (norms) */ \
    X(PAD, k_pad)           /* ints[d] = elements added before dim d (negative: cropped); s[0] = the \
                               fill value; in, out (same rank) */                                 \
    OPS_KERNELS_MATH(X)                                                                           \
    OPS_KERNELS_NN(X)

#define OPS_EW(X)          \
    X(COPY, ew_copy)       \
    X(ADD, ew_add)         \
    X(SUB, ew_sub)         \
    X(MUL, ew_mul)         \
    X(DIV, ew_div)         \
    X(ADDS, ew_adds)       \
    X(RADDS, ew_radds)     \
    X(SUBS, ew_subs)       \
    X(MULS, ew_muls)       \
    X(DIVS, ew_divs)       \
    X(FILL, ew_fill)       \
    OPS_EW_MATH(X)         \
    OPS_EW_NN(X)

enum ops_ew_fn {
#define OPS_EW_ENUM(id, fn) OPS_EWF_##id,
    OPS_EW(OPS_EW_ENUM)
#undef OPS_EW_ENUM
        OPS_EWF_COUNT
};

enum ops_reduce_kind { OPS_RED_SUM, OPS_RED_MEAN, OPS_RED_MAX, OPS_RED_MIN, OPS_RED_PROD, OPS_RED_NORM };

#endif
