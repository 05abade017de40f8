/* The nn family's rows of ops_list.h (which says what a row is).
 *
 * Row kernels see the dimension they work along last: the operator library moves it there (a
 * permutation of shape and strides, free for a strided view), so a kernel walks the outer
 * dimensions with an iterator and each row with its last stride. */
#ifndef NPUSIM_OPS_LIST_NN_H
#define NPUSIM_OPS_LIST_NN_H

/* SOFTMAX: i0 = 0 softmax, 1 log-softmax; x, y.
 * SOFTMAX_BWD: i0 as SOFTMAX; grad, y (the forward's output), gradInput.
 * NORM: i0 = k (the trailing dims normalized), i1 = NORM_* flags, s0 = eps;
 *       x, [weight], [bias], y, [mean], [rstd], all in x's rank (weight and bias stride 0 on the
 *       outer dims, mean and rstd stride 0 on the normalized ones).
 * NORM_BWD: i0 = k, i1 = NORM_* flags; grad, x, [mean], rstd, weight, [gx], [gw], [gb], as NORM.
 * NLL: i0 = reduction (0 none, 1 mean, 2 sum), i1 = ignore_index; x [N, C], target [N], weight [C],
 *      out, total_weight (x as [1, C] and target as [1] for an unbatched input).
 * NLL_BWD: as NLL; gradOutput, x, target, weight, total_weight, gradInput.
 * INDEX: out = self[base + sum_j wrap(index_j) * stride_j]: ints: for each index j its dimension's
 *        stride and size; out, self (aligned to out, stride 0 where an index decides), index_j
 *        (aligned to out): IndexSelect, Gather, Index, Embedding.
 * INDEX_PUT: i0 = accumulate, then INDEX's ints; values (aligned to the walk's shape), self, index_j:
 *        self[base + sum_j wrap(index_j) * stride_j] = (or +=) values, in the walk's order.
 * SCATTER: i0 = 0 assign, 1 add, 2 multiply; i1 = 1 if src is a tensor (else s0 is the value);
 *        i2 = the dim's stride in out, i3 = its size, then out's base strides aligned to the walk's
 *        shape; s0 = value or alpha (src's factor); self, out, index (aligned), [src (aligned)]:
 *        out = self, then out[base + wrap(index) * stride] op= src in the walk's order (Scatter,
 *        ScatterValue, ScatterAdd, IndexAdd).
 * EMBEDDING_BWD: i0 = padding_idx (-1 none), i1 = scale_grad_by_freq; grad [n, D], indices [n],
 *        out [numWeights, D] (grad and indices flattened to n rows by the operator library).
 * TRI: i0 = diagonal, i1 = 1 upper (triu), 0 lower (tril); x, out (the last two dims).
 * ARANGE: s0 = start, s1 = step; out (1-D).
 * COPIES: pairs (src, dst) of views of the same shape: Cat and Stack.
 * ARGMAX: x, out (out [.., 1] on the row dim).
 * TOPK: i0 = k, i1 = largest, i2 = sorted; x, values, indices.
 * ADDMM: s0 = beta, s1 = alpha; a [.., M, K], b [.., K, N], c aligned to out, out [.., M, N].
 * MSE: i0 = reduction (1 mean, 2 sum); a, b (aligned to a), out (one element).
 * NONZERO: i0 = 1 for [ndim, count] (NonzeroV2), 0 for [count, ndim]; i1 = the workspace (the
 *     count goes there as an int64); self, out (its buffer, written contiguous for the count found).
 * MASKED_SELECT: i0 = the workspace (the count, int64); self and mask aligned to their broadcast
 *     shape, out (1-D, written contiguous for the count found).
 * MASKED_SCATTER: selfRef, mask (aligned to selfRef), source: selfRef's elements where mask is set
 *     take source's elements one after another (both in row-major order).
 * FA: attention, every tensor as a [B, N, S, D] view (the layout undone by the operator library):
 *     i0 = sparse mode, i1 = preTokens, i2 = nextTokens, i3 = 1 if a mask is given; s0 = scale;
 *     q [B, N1, S0, D], k [B, N2, S1, D], v [B, N2, S1, D2], [mask aligned to [B, N1, S0, S1]],
 *     softmaxMax [B, N1, S0, 8], softmaxSum [B, N1, S0, 8], out [B, N1, S0, D2].
 * FA_BWD: as FA; q, k, v, dy, [mask], dq, dk, dv. */
#define OPS_KERNELS_NN(X)                 \
    X(SOFTMAX, k_softmax)                 \
    X(SOFTMAX_BWD, k_softmax_bwd)         \
    X(NORM, k_norm)                       \
    X(NORM_BWD, k_norm_bwd)               \
    X(NLL, k_nll)                         \
    X(NLL_BWD, k_nll_bwd)                 \
    X(INDEX, k_index)                     \
    X(INDEX_PUT, k_index_put)             \
    X(SCATTER, k_scatter)                 \
    X(EMBEDDING_BWD, k_embedding_bwd)     \
    X(TRI, k_tri)                         \
    X(ARANGE, k_arange)                   \
    X(COPIES, k_copies)                   \
    X(ARGMAX, k_argmax)                   \
    X(TOPK, k_topk)                       \
    X(ADDMM, k_addmm)                     \
    X(MSE, k_mse)                         \
    X(NONZERO, k_nonzero)                 \
    X(MASKED_SELECT, k_masked_select)     \
    X(MASKED_SCATTER, k_masked_scatter)   \
    X(FA, k_fa)                           \
    X(FA_BWD, k_fa_bwd)

/* NORM and NORM_BWD flags. */
#define NORM_W 1    /* weight present (NORM_BWD: always) */
#define NORM_B 2    /* bias present */
#define NORM_MEAN 4 /* mean output (NORM) / input (NORM_BWD) present */
#define NORM_RSTD 8 /* rstd output present */
#define NORM_RMS 16 /* RMS norm: no mean subtracted, no bias */
#define NORM_GX 32  /* NORM_BWD outputs present */
#define NORM_GW 64
#define NORM_GB 128

/* x[] are the inputs in order, s[] the scalars (k_nn_ew.c defines each function). */
#define OPS_EW_NN(X)                                                                              \
    X(RELU, ew_relu)                                                                              \
    X(THRESHOLD_BWD, ew_threshold_bwd) /* x0 grad, x1 self: x1 <= s0 ? 0 : x0 */                  \
    X(GELU, ew_gelu)                   /* x * Phi(x), with erf */                                  \
    X(GELU_TANH, ew_gelu_tanh)         /* the tanh approximation */                                \
    X(GELU_BWD, ew_gelu_bwd)           /* x0 grad, x1 self */                                      \
    X(GELU_TANH_BWD, ew_gelu_tanh_bwd) /* x0 grad, x1 self */                                      \
    X(SQDIFF, ew_sqdiff)               /* (x0 - x1)^2 */                                           \
    X(MSE_BWD, ew_mse_bwd)             /* s0 (x0 - x1) x2: x0 self, x1 target, x2 grad */

#define OPS_EW_NN_DECL(id, fn) __attribute__((visibility("hidden"))) double fn(const double *x, const double *s);
OPS_EW_NN(OPS_EW_NN_DECL)
#undef OPS_EW_NN_DECL

#endif
