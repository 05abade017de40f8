/* Shapes and indexing of the nn family: Tril, Triu (and in place), Arange, Cat, Stack, IndexSelect,
 * Gather, Index (advanced indexing), ArgMax, Topk. Prototypes: op-plugin's call sites (op_plugin/
 * ops/opapi/ and the exec lines of op_plugin/config/op_plugin_functions.yaml) and CANN's aclnn API
 * reference (aclnn_tril.h, aclnn_arange.h, aclnn_cat.h, aclnn_stack.h, aclnn_index_select.h,
 * aclnn_gather.h, aclnn_index.h, aclnn_argmax.h, aclnn_topk.h). */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "op_nn_int.h"

/* ---------------------------------------------------------------- Tril, Triu */

static aclnnStatus tri(const char *name, int upper, const aclTensor *self, int64_t diagonal, const aclTensor *out,
                       uint64_t *workspaceSize, aclOpExecutor **executor) {
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(out, DTM_ALL));
    NN_REQUIRE(self->ndim >= 2 && nn_same_shape(out, self) && out->dtype == self->dtype);
    NN_OPEN(e, name, OPS_OP_TRI);
    ex_int(e, diagonal);
    ex_int(e, upper);
    ex_tensor(e, t_view(self));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}

/* tril(self, diagonal) / tril_: exec aclnnTril and aclnnInplaceTril (op_plugin_functions.yaml). */
API aclnnStatus aclnnTrilGetWorkspaceSize(const aclTensor *self, int64_t diagonal, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return tri("aclnnTril", 0, self, diagonal, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnTril)

API aclnnStatus aclnnInplaceTrilGetWorkspaceSize(aclTensor *selfRef, int64_t diagonal, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    return tri("aclnnInplaceTril", 0, selfRef, diagonal, selfRef, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceTril)

API aclnnStatus aclnnTriuGetWorkspaceSize(const aclTensor *self, int64_t diagonal, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return tri("aclnnTriu", 1, self, diagonal, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnTriu)

API aclnnStatus aclnnInplaceTriuGetWorkspaceSize(aclTensor *selfRef, int64_t diagonal, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    return tri("aclnnInplaceTriu", 1, selfRef, diagonal, selfRef, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceTriu)

/* ---------------------------------------------------------------- Arange */

/* aclnnArange(start, end, step, out) (ArangeKernelNpuOpApi.cpp): out 1-D of
 * ceil((end - start) / step) elements, as torch sizes it (RangeFactories.cpp). */
API aclnnStatus aclnnArangeGetWorkspaceSize(const aclScalar *start, const aclScalar *end, const aclScalar *step,
                                            aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!start || !end || !step || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(out, DTM_NUM));
    double a = s_value(start), b = s_value(end), st = s_value(step);
    NN_REQUIRE(st != 0.0 && isfinite(a) && isfinite(b) && ((st > 0 && b >= a) || (st < 0 && b <= a)));
    NN_REQUIRE(out->ndim == 1 && (double)out->dims[0] == ceil((b - a) / st));
    NN_OPEN(e, "aclnnArange", OPS_OP_ARANGE);
    ex_scalar(e, a);
    ex_scalar(e, st);
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnArange)

/* ---------------------------------------------------------------- Cat, Stack */

/* aclnnCat(tensors, dim, out) (CatKernelNpuOpApi.cpp): every tensor has out's shape but along dim;
 * a 1-D empty tensor is skipped, as torch's legacy cat rule. One COPIES launch: each tensor into
 * its slice of out (out's view with a storage offset), cast to out's dtype. */
API aclnnStatus aclnnCatGetWorkspaceSize(const aclTensorList *tensors, int64_t dim, aclTensor *out,
                                         uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!tensors || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(out, DTM_ALL));
    int nd = out->ndim;
    int d = t_dim(dim, nd);
    NN_REQUIRE(d >= 0 && nd >= 1 && tensors->size >= 1);
    int64_t at = 0;
    for (uint64_t j = 0; j < tensors->size; j++) {
        const aclTensor *t = tensors->tensors[j];
        NN_CHECK(t_check(t, DTM_ALL));
        if (t->ndim == 1 && t->dims[0] == 0 && nd != 1) continue;
        NN_REQUIRE(t->ndim == nd);
        for (int i = 0; i < nd; i++) NN_REQUIRE(i == d || t->dims[i] == out->dims[i]);
        at += t->dims[d];
    }
    NN_REQUIRE(at == out->dims[d]);
    NN_OPEN(e, "aclnnCat", OPS_OP_COPIES);
    at = 0;
    for (uint64_t j = 0; j < tensors->size; j++) {
        const aclTensor *t = tensors->tensors[j];
        if (t->ndim == 1 && t->dims[0] == 0 && nd != 1) continue;
        struct ops_tensor dst = t_view(out);
        dst.offset += at * out->strides[d];
        dst.shape[d] = t->dims[d];
        ex_tensor(e, t_view(t));
        ex_tensor(e, dst);
        at += t->dims[d];
    }
    return ex_done(e);
}
OPS_LAUNCHER(aclnnCat)

/* aclnnStack(tensors, dim, out) (exec aclnnStack of stack): every tensor of one shape, out with a
 * new dimension of size n at dim; tensor j goes to out's select(dim, j). */
API aclnnStatus aclnnStackGetWorkspaceSize(const aclTensorList *tensors, int64_t dim, aclTensor *out,
                                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!tensors || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(out, DTM_ALL));
    NN_REQUIRE(tensors->size >= 1);
    const aclTensor *t0 = tensors->tensors[0];
    NN_CHECK(t_check(t0, DTM_ALL));
    int nd = t0->ndim;
    int d = t_dim(dim, nd + 1);
    NN_REQUIRE(d >= 0 && out->ndim == nd + 1 && out->dims[d] == (int64_t)tensors->size);
    for (int i = 0; i < nd; i++) NN_REQUIRE(out->dims[i < d ? i : i + 1] == t0->dims[i]);
    for (uint64_t j = 0; j < tensors->size; j++) {
        NN_CHECK(t_check(tensors->tensors[j], DTM_ALL));
        NN_REQUIRE(nn_same_shape(tensors->tensors[j], t0));
    }
    NN_OPEN(e, "aclnnStack", OPS_OP_COPIES);
    for (uint64_t j = 0; j < tensors->size; j++) {
        struct ops_tensor dst = t_view(out);
        dst.offset += (int64_t)j * out->strides[d];
        for (int i = d; i < nd; i++) { /* drop dim d */
            dst.shape[i] = dst.shape[i + 1];
            dst.stride[i] = dst.stride[i + 1];
        }
        dst.ndim = nd;
        ex_tensor(e, t_view(tensors->tensors[j]));
        ex_tensor(e, dst);
    }
    return ex_done(e);
}
OPS_LAUNCHER(aclnnStack)

/* ---------------------------------------------------------------- gathers by index */

/* aclnnIndexSelect(self, dim, index, out) (IndexSelectKernelNpuOpApi.cpp): out is self with dim's
 * size replaced by index's length; index 1-D or 0-D, int32 or int64. */
API aclnnStatus aclnnIndexSelectGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                                 aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !index || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(index, DTM_INDEX));
    NN_CHECK(t_check(out, DTM_ALL));
    NN_REQUIRE(index->ndim <= 1 && out->dtype == self->dtype);
    int nd = self->ndim;
    int d = t_dim(dim, nd);
    NN_REQUIRE(d >= 0);
    int64_t n = t_numel(index);
    if (nd == 0) {
        NN_REQUIRE(n == 1 && t_numel(out) == 1);
    } else {
        int64_t want[OPS_MAX_DIMS];
        memcpy(want, self->dims, sizeof want);
        want[d] = n;
        NN_REQUIRE(t_same_shape(out, want, nd));
    }
    struct ops_tensor o = t_view(out), idx = t_view(index);
    int ond = nd ? nd : 1;
    if (!nd) o.ndim = 1, o.shape[0] = 1, o.stride[0] = 0;
    idx.ndim = ond;
    for (int i = 0; i < ond; i++) {
        idx.shape[i] = o.shape[i];
        idx.stride[i] = i == d && index->ndim ? index->strides[0] : 0;
    }
    NN_OPEN(e, "aclnnIndexSelect", OPS_OP_INDEX);
    for (int i = 0; i < ond; i++) ex_int(e, i == d || !nd ? 0 : self->strides[i]);
    ex_int(e, nd ? self->strides[d] : 0);
    ex_int(e, nd ? self->dims[d] : 1);
    ex_tensor(e, o);
    ex_tensor(e, t_view(self));
    ex_tensor(e, idx);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnIndexSelect)

/* aclnnGather(self, dim, index, out) (GatherKernelNpuOpApi.cpp): out[i] = self[i with dim replaced
 * by index[i]]; out and index of one shape, index no larger than self outside dim. */
API aclnnStatus aclnnGatherGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                            aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !index || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(index, DTM_INDEX));
    NN_CHECK(t_check(out, DTM_ALL));
    int nd = self->ndim;
    int d = t_dim(dim, nd);
    int vec = nd <= 1 && index->ndim <= 1; /* torch lets a 0-d and a 1-d tensor pair up here */
    NN_REQUIRE(d >= 0 && out->dtype == self->dtype && nn_same_shape(out, index));
    NN_REQUIRE(index->ndim == nd || vec);
    for (int i = 0; i < nd && !vec; i++) NN_REQUIRE(i == d || index->dims[i] <= self->dims[i]);
    struct ops_tensor o = t_view(out), idx = t_view(index);
    if (vec) {
        o.ndim = idx.ndim = 1;
        o.shape[0] = idx.shape[0] = t_numel(index);
        o.stride[0] = out->ndim ? out->strides[0] : 0;
        idx.stride[0] = index->ndim ? index->strides[0] : 0;
        nd = 0; /* below: no base strides, the index alone decides */
    }
    NN_OPEN(e, "aclnnGather", OPS_OP_INDEX);
    for (int i = 0; i < o.ndim; i++) ex_int(e, i == d || !nd ? 0 : self->strides[i]);
    ex_int(e, self->ndim ? self->strides[d] : 0);
    ex_int(e, self->ndim ? self->dims[d] : 1);
    ex_tensor(e, o);
    ex_tensor(e, t_view(self));
    ex_tensor(e, idx);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnGather)

/* Advanced indexing as op-plugin passes it (IndexKernelNpuOpApi.cpp, IndexPutKernelNpuOpApi.cpp):
 * one entry per leading dim of self, an undefined index passed as an empty tensor (that dim kept
 * whole); bool masks were already turned into long indices (AdvanceIndex::npu_expand_tensors).
 * The defined indices broadcast to one shape B; as torch's rule, when they are adjacent B takes
 * their place in the result's shape, else B comes first and the kept dims follow. */
struct adv {
    int nidx, def[OPS_MAX_DIMS], nd;
    int64_t shape[OPS_MAX_DIMS], base[OPS_MAX_DIMS];
    struct ops_tensor idx[6]; /* each index aligned to the result's shape */
};

static aclnnStatus adv_index(const aclTensor *self, const aclTensorList *indices, struct adv *a) {
    int nd = self->ndim, L = (int)indices->size;
    NN_REQUIRE(L >= 1 && L <= nd);
    int64_t B[OPS_MAX_DIMS];
    int nb = 0;
    a->nidx = 0;
    for (int j = 0; j < L; j++) {
        const aclTensor *t = indices->tensors[j];
        if (!t) return ACLNN_ERR_PARAM_NULLPTR;
        if (t->ndim == 1 && t->dims[0] == 0) continue; /* undefined: the whole dim */
        NN_CHECK(t_check(t, DTM_INDEX));
        NN_REQUIRE(a->nidx < 6); /* the INDEX kernel's iterator holds out, self and 6 indices */
        int64_t tmp[OPS_MAX_DIMS];
        nb = t_broadcast(B, nb, t->dims, t->ndim, tmp);
        NN_REQUIRE(nb >= 0);
        memcpy(B, tmp, sizeof tmp);
        a->def[a->nidx++] = j;
    }
    NN_REQUIRE(a->nidx >= 1 && nd - a->nidx + nb <= OPS_MAX_DIMS);
    int adjacent = a->def[a->nidx - 1] - a->def[0] == a->nidx - 1;
    int bpos = adjacent ? a->def[0] : 0, k = 0;
    int is_idx[OPS_MAX_DIMS] = {0};
    for (int j = 0; j < a->nidx; j++) is_idx[a->def[j]] = 1;
    for (int i = 0; i < bpos; i++, k++) a->shape[k] = self->dims[i], a->base[k] = self->strides[i];
    for (int i = 0; i < nb; i++, k++) a->shape[k] = B[i], a->base[k] = 0;
    for (int i = bpos; i < nd; i++)
        if (!is_idx[i]) a->shape[k] = self->dims[i], a->base[k++] = self->strides[i];
    a->nd = k;
    for (int j = 0; j < a->nidx; j++) {
        /* index j aligned to B, placed at the result's dims [bpos, bpos + nb) */
        struct ops_tensor al = t_aligned(indices->tensors[a->def[j]], B, nb), v = al;
        v.ndim = k;
        for (int i = 0; i < k; i++) {
            v.shape[i] = a->shape[i];
            v.stride[i] = i >= bpos && i < bpos + nb ? al.stride[i - bpos] : 0;
        }
        a->idx[j] = v;
    }
    return ACLNN_SUCCESS;
}

static void adv_args(aclOpExecutor *e, const aclTensor *self, const struct adv *a, struct ops_tensor walked) {
    for (int i = 0; i < a->nd; i++) ex_int(e, a->base[i]);
    for (int j = 0; j < a->nidx; j++) {
        ex_int(e, self->strides[a->def[j]]);
        ex_int(e, self->dims[a->def[j]]);
    }
    ex_tensor(e, walked);
    ex_tensor(e, t_view(self));
    for (int j = 0; j < a->nidx; j++) ex_tensor(e, a->idx[j]);
}

/* aclnnIndex(self, indices, out): out = self[indices]. */
API aclnnStatus aclnnIndexGetWorkspaceSize(const aclTensor *self, const aclTensorList *indices, aclTensor *out,
                                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !indices || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(out, DTM_ALL));
    NN_REQUIRE(out->dtype == self->dtype);
    struct adv a;
    NN_CHECK(adv_index(self, indices, &a));
    NN_REQUIRE(t_same_shape(out, a.shape, a.nd));
    NN_OPEN(e, "aclnnIndex", OPS_OP_INDEX);
    adv_args(e, self, &a, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnIndex)

/* aclnnIndexPutImpl(selfRef, indices, values, accumulate, unsafe): selfRef[indices] = values (or
 * += with accumulate), values broadcast to the indexing result's shape; a repeated index takes the
 * last value (accumulate: every value, added in order). */
API aclnnStatus aclnnIndexPutImplGetWorkspaceSize(aclTensor *selfRef, const aclTensorList *indices,
                                                  const aclTensor *values, bool accumulate, bool unsafe,
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {
    (void)unsafe;
    if (!selfRef || !indices || !values) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(selfRef, DTM_ALL));
    NN_CHECK(t_check(values, DTM_ALL));
    struct adv a;
    NN_CHECK(adv_index(selfRef, indices, &a));
    int64_t tmp[OPS_MAX_DIMS];
    NN_REQUIRE(t_broadcast(values->dims, values->ndim, a.shape, a.nd, tmp) == a.nd);
    for (int i = 0; i < a.nd; i++) NN_REQUIRE(tmp[i] == a.shape[i]);
    NN_OPEN(e, "aclnnIndexPutImpl", OPS_OP_INDEX_PUT);
    ex_int(e, accumulate);
    adv_args(e, selfRef, &a, t_aligned(values, a.shape, a.nd));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnIndexPutImpl)

/* ---------------------------------------------------------------- Scatter, ScatterAdd, IndexAdd */

/* out = self, then out[i with dim replaced by index[i]] op= value or src[i] for every i of index
 * (aclnn_scatter.h: reduce 0 none, 1 add, 2 multiply, as op-plugin's get_reduce maps them). */
static aclnnStatus scatter(const char *name, const aclTensor *self, int64_t dim, const aclTensor *index,
                           const aclTensor *src, double value, int64_t reduce, const aclTensor *out,
                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(index, DTM_INDEX));
    NN_CHECK(t_check(out, DTM_ALL));
    NN_REQUIRE(reduce >= 0 && reduce <= 2 && out->dtype == self->dtype && nn_same_shape(out, self));
    int nd = self->ndim, d = t_dim(dim, nd);
    NN_REQUIRE(d >= 0 && (index->ndim == nd || (nd == 0 && index->ndim <= 1)));
    for (int i = 0; i < index->ndim && nd; i++) NN_REQUIRE(i == d || index->dims[i] <= self->dims[i]);
    if (src) {
        NN_CHECK(t_check(src, DTM_ALL));
        NN_REQUIRE(src->ndim == index->ndim);
        for (int i = 0; i < index->ndim; i++) NN_REQUIRE(index->dims[i] <= src->dims[i]);
    }
    struct ops_tensor iv = t_view(index), sv = src ? t_view(src) : iv;
    if (index->ndim == 0) iv.ndim = sv.ndim = 1, iv.shape[0] = sv.shape[0] = 1, iv.stride[0] = sv.stride[0] = 0;
    for (int i = 0; i < iv.ndim; i++) sv.shape[i] = iv.shape[i];
    NN_OPEN(e, name, OPS_OP_SCATTER);
    ex_int(e, reduce);
    ex_int(e, src != NULL);
    ex_int(e, nd ? self->strides[d] : 0);
    ex_int(e, nd ? self->dims[d] : 1);
    for (int i = 0; i < iv.ndim; i++) ex_int(e, i == d || !nd ? 0 : out->strides[i]);
    ex_scalar(e, value);
    ex_tensor(e, t_view(self));
    ex_tensor(e, t_view(out));
    ex_tensor(e, iv);
    if (src) ex_tensor(e, sv);
    return ex_done(e);
}

/* ScatterKernelNpuOpApi.cpp: aclnnScatter(self, dim, index, src, reduce, out),
 * aclnnScatterValue(self, dim, index, value, reduce, out) and their in-place forms. */
API aclnnStatus aclnnScatterGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                             const aclTensor *src, int64_t reduce, aclTensor *out,
                                             uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !index || !src || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return scatter("aclnnScatter", self, dim, index, src, 1.0, reduce, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnScatter)

API aclnnStatus aclnnInplaceScatterGetWorkspaceSize(aclTensor *selfRef, int64_t dim, const aclTensor *index,
                                                    const aclTensor *src, int64_t reduce, uint64_t *workspaceSize,
                                                    aclOpExecutor **executor) {
    if (!selfRef || !index || !src) return ACLNN_ERR_PARAM_NULLPTR;
    return scatter("aclnnInplaceScatter", selfRef, dim, index, src, 1.0, reduce, selfRef, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceScatter)

API aclnnStatus aclnnScatterValueGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                                  const aclScalar *value, int64_t reduce, aclTensor *out,
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !index || !value || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return scatter("aclnnScatterValue", self, dim, index, NULL, s_value(value), reduce, out, workspaceSize,
                   executor);
}
OPS_LAUNCHER(aclnnScatterValue)

API aclnnStatus aclnnInplaceScatterValueGetWorkspaceSize(aclTensor *selfRef, int64_t dim, const aclTensor *index,
                                                         const aclScalar *value, int64_t reduce,
                                                         uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !index || !value) return ACLNN_ERR_PARAM_NULLPTR;
    return scatter("aclnnInplaceScatterValue", selfRef, dim, index, NULL, s_value(value), reduce, selfRef,
                   workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceScatterValue)

/* aclnnScatterAdd(self, dim, index, src, out) (ScatterAddKernelNpuOpApi.cpp). */
API aclnnStatus aclnnScatterAddGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                                const aclTensor *src, aclTensor *out, uint64_t *workspaceSize,
                                                aclOpExecutor **executor) {
    if (!self || !index || !src || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return scatter("aclnnScatterAdd", self, dim, index, src, 1.0, 1, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnScatterAdd)

/* aclnnIndexAdd(self, dim, index, source, alpha, out) (IndexAddKernelNpuOpApi.cpp): out = self,
 * then out.select(dim, index[i]) += alpha * source.select(dim, i), i in order. A SCATTER walk over
 * source's shape with the index read along dim. */
API aclnnStatus aclnnIndexAddGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                              const aclTensor *source, const aclScalar *alpha, aclTensor *out,
                                              uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !index || !source || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(index, DTM_INDEX));
    NN_CHECK(t_check(source, DTM_ALL));
    NN_CHECK(t_check(out, DTM_ALL));
    NN_REQUIRE(out->dtype == self->dtype && nn_same_shape(out, self) && index->ndim <= 1);
    int nd = self->ndim, d = t_dim(dim, nd);
    NN_REQUIRE(d >= 0 && nd >= 1 && source->ndim == nd && source->dims[d] == t_numel(index));
    for (int i = 0; i < nd; i++) NN_REQUIRE(i == d || source->dims[i] == self->dims[i]);
    struct ops_tensor iv = t_view(source);
    iv.addr = index->data, iv.offset = index->offset, iv.dtype = index->dtype;
    for (int i = 0; i < nd; i++) iv.stride[i] = i == d && index->ndim ? index->strides[0] : 0;
    NN_OPEN(e, "aclnnIndexAdd", OPS_OP_SCATTER);
    ex_int(e, 1);
    ex_int(e, 1);
    ex_int(e, self->strides[d]);
    ex_int(e, self->dims[d]);
    for (int i = 0; i < nd; i++) ex_int(e, i == d ? 0 : out->strides[i]);
    ex_scalar(e, s_value(alpha));
    ex_tensor(e, t_view(self));
    ex_tensor(e, t_view(out));
    ex_tensor(e, iv);
    ex_tensor(e, t_view(source));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnIndexAdd)

/* ---------------------------------------------------------------- ArgMax, Topk */

/* aclnnArgMax(self, dim, keepdim, out) (ArgmaxKernelNpuOpApi.cpp: without a dim op-plugin passes
 * self flattened and dim 0); out int64 (or int32). */
API aclnnStatus aclnnArgMaxGetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepdim, aclTensor *out,
                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_NUM));
    NN_CHECK(t_check(out, DTM_INDEX));
    int nd = self->ndim;
    int d = t_dim(dim, nd);
    NN_REQUIRE(d >= 0);
    struct ops_tensor x = t_view(self), o = t_view(out);
    if (nd == 0) {
        NN_REQUIRE(t_numel(out) == 1);
        x.ndim = o.ndim = 1;
        x.shape[0] = o.shape[0] = 1;
        x.stride[0] = o.stride[0] = 0;
    } else {
        NN_REQUIRE(self->dims[d] > 0);
        int64_t want[OPS_MAX_DIMS];
        int nw = 0;
        for (int i = 0; i < nd; i++)
            if (i != d) want[nw++] = self->dims[i];
            else if (keepdim) want[nw++] = 1;
        NN_REQUIRE(t_same_shape(out, want, nw));
        /* out in self's rank, size 1 along d */
        o = t_view(self);
        o.addr = out->data, o.offset = out->offset, o.dtype = out->dtype;
        for (int i = 0, j = 0; i < nd; i++) {
            if (i == d) {
                o.shape[i] = 1, o.stride[i] = 0;
                if (keepdim) j++;
            } else {
                o.stride[i] = out->strides[j++];
            }
        }
        x = nn_dim_last(x, d);
        o = nn_dim_last(o, d);
    }
    NN_OPEN(e, "aclnnArgMax", OPS_OP_ARGMAX);
    ex_tensor(e, x);
    ex_tensor(e, o);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnArgMax)

/* aclnnTopk(self, k, dim, largest, sorted, valuesOut, indicesOut) (TopKKernelNpuOpApi.cpp): values
 * and indices shaped as self with k along dim. Always returned sorted (a stable order: ties by
 * index), which is one of the orders sorted=false allows. */
API aclnnStatus aclnnTopkGetWorkspaceSize(const aclTensor *self, int64_t k, int64_t dim, bool largest, bool sorted,
                                          aclTensor *valuesOut, aclTensor *indicesOut, uint64_t *workspaceSize,
                                          aclOpExecutor **executor) {
    if (!self || !valuesOut || !indicesOut) return ACLNN_ERR_PARAM_NULLPTR;
    (void)sorted;
    NN_CHECK(t_check(self, DTM_NUM));
    NN_CHECK(t_check(valuesOut, DTM_NUM));
    NN_CHECK(t_check(indicesOut, DTM_INDEX));
    int nd = self->ndim;
    int d = t_dim(dim, nd);
    NN_REQUIRE(d >= 0 && valuesOut->dtype == self->dtype);
    int64_t n = nd ? self->dims[d] : 1;
    NN_REQUIRE(k >= 0 && k <= n);
    int64_t want[OPS_MAX_DIMS];
    memcpy(want, self->dims, sizeof want);
    if (nd) want[d] = k;
    NN_REQUIRE(t_same_shape(valuesOut, want, nd) && t_same_shape(indicesOut, want, nd));
    struct ops_tensor v[3] = {t_view(self), t_view(valuesOut), t_view(indicesOut)};
    for (int j = 0; j < 3; j++) {
        if (!nd) {
            v[j].ndim = 1;
            v[j].shape[0] = j ? k : 1;
            v[j].stride[0] = 0;
        } else {
            v[j] = nn_dim_last(v[j], d);
        }
    }
    NN_OPEN(e, "aclnnTopk", OPS_OP_TOPK);
    ex_int(e, k);
    ex_int(e, largest);
    ex_int(e, 1);
    for (int j = 0; j < 3; j++) ex_tensor(e, v[j]);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnTopk)

/* aclnnSort(self, stable, dim, descending, valuesOut, indicesOut) (SortKernelNpuOpApi.cpp): a TOPK
 * of every element, which is stable (ties keep their order, NaN last ascending and first
 * descending, as torch's sort). */
API aclnnStatus aclnnSortGetWorkspaceSize(const aclTensor *self, bool stable, int64_t dim, bool descending,
                                          aclTensor *valuesOut, aclTensor *indicesOut, uint64_t *workspaceSize,
                                          aclOpExecutor **executor) {
    (void)stable;
    if (!self || !valuesOut || !indicesOut) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_NUM));
    NN_CHECK(t_check(valuesOut, DTM_NUM));
    NN_CHECK(t_check(indicesOut, DTM_INDEX));
    int nd = self->ndim, d = t_dim(dim, nd);
    NN_REQUIRE(d >= 0 && valuesOut->dtype == self->dtype && nn_same_shape(valuesOut, self) &&
               nn_same_shape(indicesOut, self));
    struct ops_tensor v[3] = {t_view(self), t_view(valuesOut), t_view(indicesOut)};
    for (int j = 0; j < 3; j++) {
        if (!nd) v[j].ndim = 1, v[j].shape[0] = 1, v[j].stride[0] = 0;
        else v[j] = nn_dim_last(v[j], d);
    }
    NN_OPEN(e, "aclnnSort", OPS_OP_TOPK);
    ex_int(e, nd ? self->dims[d] : 1);
    ex_int(e, descending);
    ex_int(e, 1);
    for (int j = 0; j < 3; j++) ex_tensor(e, v[j]);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnSort)

/* A dim of a view split in two: (n, r) with strides (r * t, t), for an output dim of n * r. */
static void split_dim(struct ops_tensor *v, int d, int64_t n, int64_t r) {
    int64_t t = v->stride[d];
    for (int i = v->ndim; i > d + 1; i--) v->shape[i] = v->shape[i - 1], v->stride[i] = v->stride[i - 1];
    v->shape[d] = n, v->stride[d] = r * t;
    v->shape[d + 1] = r, v->stride[d + 1] = t;
    v->ndim++;
}

/* aclnnRepeat(self, repeats, out) (exec aclnnRepeat of repeat): out is self tiled repeats[i] times
 * along each dim (repeats may add leading dims). One COPIES launch of a broadcast view of self into
 * out viewed with every repeated dim split in (repeat, size). */
API aclnnStatus aclnnRepeatGetWorkspaceSize(const aclTensor *self, const aclIntArray *repeats, aclTensor *out,
                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !repeats || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(out, DTM_ALL));
    int nr = (int)repeats->size, nd = self->ndim;
    NN_REQUIRE(nr >= nd && nr == out->ndim && out->dtype == self->dtype);
    struct ops_tensor src = t_view(out), dst = t_view(out);
    src.addr = self->data, src.offset = self->offset, src.dtype = self->dtype;
    int k = 0;
    for (int i = 0; i < nr; i++) {
        int64_t r = repeats->value[i], s = i < nr - nd ? 1 : self->dims[i - (nr - nd)];
        int64_t st = i < nr - nd ? 0 : self->strides[i - (nr - nd)];
        NN_REQUIRE(r >= 0 && out->dims[i] == r * s);
        if (r != 1 && s != 1) {
            NN_REQUIRE(dst.ndim < OPS_MAX_DIMS);
            split_dim(&dst, k, r, s);
            src.ndim = dst.ndim;
            for (int j = src.ndim - 1; j > k + 1; j--) src.shape[j] = src.shape[j - 1], src.stride[j] = src.stride[j - 1];
            src.shape[k] = r, src.stride[k] = 0;
            src.shape[k + 1] = s, src.stride[k + 1] = st;
            k += 2;
        } else {
            src.shape[k] = r * s, src.stride[k] = r == 1 ? st : 0;
            k++;
        }
    }
    NN_OPEN(e, "aclnnRepeat", OPS_OP_COPIES);
    ex_tensor(e, src);
    ex_tensor(e, dst);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnRepeat)

/* aclnnRepeatInterleaveIntWithDim(self, repeats, dim, outputSize, out) and aclnnRepeatInterleaveInt
 * (self flattened) (RepeatInterLeaveKernelNpuOpApi.cpp): every element repeats times in a row. */
static aclnnStatus repeat_interleave(const char *name, const aclTensor *self, int64_t repeats, int withdim,
                                     int64_t dim, const aclTensor *out, uint64_t *workspaceSize,
                                     aclOpExecutor **executor) {
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(out, DTM_ALL));
    NN_REQUIRE(repeats >= 0 && out->dtype == self->dtype);
    struct ops_tensor src = t_view(self), dst = t_view(out);
    int nd = self->ndim;
    if (withdim && nd) {
        int d = t_dim(dim, nd);
        NN_REQUIRE(d >= 0 && out->ndim == nd && nd < OPS_MAX_DIMS);
        for (int i = 0; i < nd; i++) NN_REQUIRE(out->dims[i] == (i == d ? self->dims[i] * repeats : self->dims[i]));
        split_dim(&dst, d, self->dims[d], repeats);
        split_dim(&src, d, self->dims[d], 1);
        src.stride[d] = self->strides[d], src.shape[d + 1] = repeats, src.stride[d + 1] = 0;
    } else {
        /* out 1-D of numel * repeats, split into self's dims and the repeat */
        NN_REQUIRE(out->ndim == 1 && out->dims[0] == t_numel(self) * repeats && nd < OPS_MAX_DIMS);
        int64_t t = out->strides[0];
        dst.ndim = nd + 1;
        dst.shape[nd] = repeats, dst.stride[nd] = t;
        int64_t acc = repeats * t;
        for (int i = nd - 1; i >= 0; i--) {
            dst.shape[i] = self->dims[i], dst.stride[i] = acc;
            acc *= self->dims[i];
        }
        src.ndim = nd + 1;
        src.shape[nd] = repeats, src.stride[nd] = 0;
    }
    NN_OPEN(e, name, OPS_OP_COPIES);
    ex_tensor(e, src);
    ex_tensor(e, dst);
    return ex_done(e);
}

API aclnnStatus aclnnRepeatInterleaveIntWithDimGetWorkspaceSize(const aclTensor *self, int64_t repeats, int64_t dim,
                                                                int64_t outputSize, aclTensor *out,
                                                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    (void)outputSize;
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return repeat_interleave("aclnnRepeatInterleaveIntWithDim", self, repeats, 1, dim, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnRepeatInterleaveIntWithDim)

API aclnnStatus aclnnRepeatInterleaveIntGetWorkspaceSize(const aclTensor *self, int64_t repeats, int64_t outputSize,
                                                         aclTensor *out, uint64_t *workspaceSize,
                                                         aclOpExecutor **executor) {
    (void)outputSize;
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return repeat_interleave("aclnnRepeatInterleaveInt", self, repeats, 0, 0, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnRepeatInterleaveInt)

/* ---------------------------------------------------------------- Nonzero */

/* aclnnNonzero(self, out) and aclnnNonzeroV2(self, out): op-plugin gives out its largest shape
 * ([numel, ndim], V2 [ndim, numel]: NonzeroKernelNpuOpApi.cpp, AdvancedIndex.cpp for boolean
 * indices), runs the op with EXEC_NPU_CMD_SYNC and then reads the real shape with aclGetViewShape
 * and resizes out. The kernel leaves the count in an 8-byte workspace; each executor's out and
 * (at launch) workspace are remembered here until aclGetViewShape asks for that out, after the
 * stream was synchronized. */

extern int aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind);
#define ACL_MEMCPY_DEVICE_TO_HOST 2

struct synced {
    const void *ex, *out;
    uint64_t ws;
    int ndim, tr; /* nonzero's ndim and layout; ndim -1: a 1-D result (masked select) */
};
static pthread_mutex_t g_sync_mu = PTHREAD_MUTEX_INITIALIZER;
static struct synced g_sync[64]; /* the latest ones; an older entry is overwritten */
static unsigned g_sync_next;

HIDDEN void op_result_shape(const aclTensor *t, int64_t *dims, int *ndim) {
    pthread_mutex_lock(&g_sync_mu);
    struct synced *hit = NULL;
    for (unsigned j = 0; j < 64; j++)
        if (g_sync[j].out == t && g_sync[j].ws) hit = &g_sync[j];
    struct synced s = hit ? *hit : (struct synced){0};
    if (hit) memset(hit, 0, sizeof *hit);
    pthread_mutex_unlock(&g_sync_mu);
    int64_t cnt = 0;
    if (!hit || aclrtMemcpy(&cnt, sizeof cnt, (const void *)(uintptr_t)s.ws, sizeof cnt, ACL_MEMCPY_DEVICE_TO_HOST))
        return;
    if (s.ndim < 0) {
        *ndim = 1;
        dims[0] = cnt;
        return;
    }
    *ndim = 2;
    dims[0] = s.tr ? s.ndim : cnt;
    dims[1] = s.tr ? cnt : s.ndim;
}

static void sync_remember(aclOpExecutor *ex, const aclTensor *out, int ndim, int tr) {
    pthread_mutex_lock(&g_sync_mu);
    g_sync[g_sync_next++ % 64] = (struct synced){ex, out, 0, ndim, tr};
    pthread_mutex_unlock(&g_sync_mu);
}

static aclnnStatus nonzero(const char *name, int tr, const aclTensor *self, const aclTensor *out,
                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(out, DTM(OPS_DT_INT64) | DTM(OPS_DT_INT32)));
    int nd = self->ndim;
    int64_t n = t_numel(self);
    int64_t want[2] = {tr ? nd : n, tr ? n : nd};
    NN_REQUIRE(t_same_shape(out, want, 2));
    /* written as a contiguous array from out's first element */
    NN_REQUIRE(out->strides[1] == 1 || out->dims[1] <= 1);
    NN_REQUIRE(out->strides[0] == out->dims[1] || out->dims[0] <= 1);
    NN_OPEN(e, name, OPS_OP_NONZERO);
    ex_int(e, tr);
    ex_workspace(e, sizeof(int64_t));
    ex_tensor(e, t_view(self));
    ex_tensor(e, t_view(out));
    aclnnStatus st = ex_done(e);
    if (st == ACLNN_SUCCESS) sync_remember(*executor, out, nd, tr);
    return st;
}

static aclnnStatus nonzero_launch(const char *name, void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                  aclrtStream stream) {
    pthread_mutex_lock(&g_sync_mu);
    for (unsigned j = 0; j < 64; j++)
        if (executor && g_sync[j].ex == executor && !g_sync[j].ws) g_sync[j].ws = (uint64_t)(uintptr_t)workspace;
    pthread_mutex_unlock(&g_sync_mu);
    return ex_launch(name, workspace, workspaceSize, executor, stream);
}

API aclnnStatus aclnnNonzeroGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                             aclOpExecutor **executor) {
    return nonzero("aclnnNonzero", 0, self, out, workspaceSize, executor);
}

API aclnnStatus aclnnNonzero(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return nonzero_launch("aclnnNonzero", workspace, workspaceSize, executor, stream);
}

API aclnnStatus aclnnNonzeroV2GetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                               aclOpExecutor **executor) {
    return nonzero("aclnnNonzeroV2", 1, self, out, workspaceSize, executor);
}

API aclnnStatus aclnnNonzeroV2(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return nonzero_launch("aclnnNonzeroV2", workspace, workspaceSize, executor, stream);
}

/* aclnnMaskedSelect(self, mask, out) (MaskedSelectKernelNpuOpApi.cpp): out 1-D of the broadcast
 * numel, resized after the sync to the count selected, as Nonzero's. */
API aclnnStatus aclnnMaskedSelectGetWorkspaceSize(const aclTensor *self, const aclTensor *mask, aclTensor *out,
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !mask || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_ALL));
    NN_CHECK(t_check(mask, DTM(OPS_DT_BOOL) | DTM(OPS_DT_UINT8)));
    NN_CHECK(t_check(out, DTM_ALL));
    int64_t shape[OPS_MAX_DIMS];
    int nd = t_broadcast(self->dims, self->ndim, mask->dims, mask->ndim, shape);
    NN_REQUIRE(nd >= 0 && out->dtype == self->dtype && out->ndim == 1);
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= shape[d];
    NN_REQUIRE(out->dims[0] == n);
    struct ops_tensor x = t_aligned(self, shape, nd), m = t_aligned(mask, shape, nd);
    if (nd == 0) x.ndim = m.ndim = 1, x.shape[0] = m.shape[0] = 1, x.stride[0] = m.stride[0] = 0;
    NN_OPEN(e, "aclnnMaskedSelect", OPS_OP_MASKED_SELECT);
    ex_workspace(e, sizeof(int64_t));
    ex_tensor(e, x);
    ex_tensor(e, m);
    ex_tensor(e, t_view(out));
    aclnnStatus st = ex_done(e);
    if (st == ACLNN_SUCCESS) sync_remember(*executor, out, -1, 0);
    return st;
}

API aclnnStatus aclnnMaskedSelect(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                  aclrtStream stream) {
    return nonzero_launch("aclnnMaskedSelect", workspace, workspaceSize, executor, stream);
}

/* aclnnInplaceMaskedScatter(selfRef, mask, source) (MaskedScatterKernelNpuOpApi.cpp): masked_scatter_,
 * also masked_select's gradient. */
API aclnnStatus aclnnInplaceMaskedScatterGetWorkspaceSize(aclTensor *selfRef, const aclTensor *mask,
                                                          const aclTensor *source, uint64_t *workspaceSize,
                                                          aclOpExecutor **executor) {
    if (!selfRef || !mask || !source) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(selfRef, DTM_ALL));
    NN_CHECK(t_check(mask, DTM(OPS_DT_BOOL) | DTM(OPS_DT_UINT8)));
    NN_CHECK(t_check(source, DTM_ALL));
    int64_t tmp[OPS_MAX_DIMS];
    NN_REQUIRE(t_broadcast(mask->dims, mask->ndim, selfRef->dims, selfRef->ndim, tmp) == selfRef->ndim &&
               t_same_shape(selfRef, tmp, selfRef->ndim));
    struct ops_tensor x = t_view(selfRef), m = t_aligned(mask, selfRef->dims, selfRef->ndim), s = t_view(source);
    if (!x.ndim) x.ndim = m.ndim = 1, x.shape[0] = m.shape[0] = 1, x.stride[0] = m.stride[0] = 0;
    NN_OPEN(e, "aclnnInplaceMaskedScatter", OPS_OP_MASKED_SCATTER);
    ex_tensor(e, x);
    ex_tensor(e, m);
    ex_tensor(e, s);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnInplaceMaskedScatter)
