/* Layers and losses of the nn family: activations and their gradients (Relu, ThresholdBackward,
 * Gelu, GeluV2 and their backwards), softmax and log-softmax with their backwards, LayerNorm and
 * RmsNorm with their backwards, NLLLoss, MseLoss, Embedding and its dense backward, Addmm and
 * Baddbmm. Prototypes: the call sites in op-plugin (the KernelNpuOpApi files of op_plugin/ops/opapi/ and
 * the exec lines of op_plugin/config/op_plugin_functions.yaml, whose argument order is the
 * prototype's) and CANN's aclnn API reference (aclnn_layer_norm.h, aclnn_nll_loss.h, ...). */
#include <math.h>
#include <string.h>

#include "op_nn_int.h"

HIDDEN struct ops_tensor nn_dim_last(struct ops_tensor v, int d) {
    int64_t s = v.shape[d], st = v.stride[d];
    for (int i = d; i < v.ndim - 1; i++) {
        v.shape[i] = v.shape[i + 1];
        v.stride[i] = v.stride[i + 1];
    }
    v.shape[v.ndim - 1] = s;
    v.stride[v.ndim - 1] = st;
    return v;
}

HIDDEN bool nn_same_shape(const aclTensor *a, const aclTensor *ref) { return t_same_shape(a, ref->dims, ref->ndim); }

#define EW1(name, fn, a, s, ns, out) \
    ew_op(name, fn, (const aclTensor *const[]){a}, 1, s, ns, out, workspaceSize, executor)
#define EW2(name, fn, a, b, s, ns, out) \
    ew_op(name, fn, (const aclTensor *const[]){a, b}, 2, s, ns, out, workspaceSize, executor)

/* An activation: self and out of one float dtype and one shape (aclnn_relu.h, aclnn_gelu.h:
 * "self and out must have the same dtype and shape"). */
static aclnnStatus act(const char *name, enum ops_ew_fn fn, const aclTensor *self, const aclTensor *out,
                       uint64_t *workspaceSize, aclOpExecutor **executor) {
    NN_CHECK(t_check(self, DTM_FLOATS));
    NN_CHECK(t_check(out, DTM_FLOATS));
    NN_REQUIRE(self->dtype == out->dtype && nn_same_shape(out, self));
    return EW1(name, fn, self, NULL, 0, out);
}

/* An activation's gradient: gradOutput and self broadcast to gradInput's shape, float dtypes. */
static aclnnStatus act_bwd(const char *name, enum ops_ew_fn fn, const aclTensor *g, const aclTensor *self,
                           const double *s, int ns, const aclTensor *out, uint64_t *workspaceSize,
                           aclOpExecutor **executor) {
    NN_CHECK(t_check(g, DTM_FLOATS));
    NN_CHECK(t_check(self, DTM_FLOATS));
    NN_CHECK(t_check(out, DTM_FLOATS));
    return EW2(name, fn, g, self, s, ns, out);
}

/* ---------------------------------------------------------------- activations */

/* relu(self) and relu_(self): the exec lines of relu and relu_ (aclnn_relu.h). */
API aclnnStatus aclnnReluGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                          aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return act("aclnnRelu", OPS_EWF_RELU, self, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnRelu)

API aclnnStatus aclnnInplaceReluGetWorkspaceSize(aclTensor *selfRef, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    return act("aclnnInplaceRelu", OPS_EWF_RELU, selfRef, selfRef, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceRelu)

/* threshold_backward(grad_output, self, threshold): aclnn_threshold_backward.h. */
API aclnnStatus aclnnThresholdBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                       const aclScalar *threshold, aclTensor *out,
                                                       uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!gradOutput || !self || !threshold || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {s_value(threshold)};
    return act_bwd("aclnnThresholdBackward", OPS_EWF_THRESHOLD_BWD, gradOutput, self, s, 1, out, workspaceSize,
                   executor);
}
OPS_LAUNCHER(aclnnThresholdBackward)

/* aclnnGelu(self, out): op-plugin's gelu_out calls it on the default path (not Ascend950, no
 * TORCH_NPU_USE_COMPATIBLE_IMPL) whatever `approximate` is (GeluOutKernelNpuOpApi.cpp). CANN's
 * reference gives the tanh formula for it; this library computes torch's default, the exact erf
 * form, because that is what torch.nn.functional.gelu asks for on this path and what the CPU
 * computes: an attention block trained here must follow the CPU step for step. GeluV2 honours the
 * approximation it is given. */
API aclnnStatus aclnnGeluGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                          aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return act("aclnnGelu", OPS_EWF_GELU, self, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnGelu)

/* aclnnGeluV2(self, approximate, out): approximate 0 none (erf), 1 tanh (aclnn_gelu_v2.h). */
API aclnnStatus aclnnGeluV2GetWorkspaceSize(const aclTensor *self, int64_t approximate, aclTensor *out,
                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (approximate != 0 && approximate != 1) return ACLNN_ERR_PARAM_INVALID;
    return act("aclnnGeluV2", approximate ? OPS_EWF_GELU_TANH : OPS_EWF_GELU, self, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnGeluV2)

API aclnnStatus aclnnGeluBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                  aclTensor *gradInput, uint64_t *workspaceSize,
                                                  aclOpExecutor **executor) {
    if (!gradOutput || !self || !gradInput) return ACLNN_ERR_PARAM_NULLPTR;
    return act_bwd("aclnnGeluBackward", OPS_EWF_GELU_BWD, gradOutput, self, NULL, 0, gradInput, workspaceSize,
                   executor);
}
OPS_LAUNCHER(aclnnGeluBackward)

/* aclnnGeluBackwardV2(gradOutput, self, approximate, gradInput): approximate "none" or "tanh". */
API aclnnStatus aclnnGeluBackwardV2GetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                    char *approximate, aclTensor *gradInput,
                                                    uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!gradOutput || !self || !approximate || !gradInput) return ACLNN_ERR_PARAM_NULLPTR;
    int tanh_mode = strcmp(approximate, "tanh") == 0;
    if (!tanh_mode && strcmp(approximate, "none") != 0) return ACLNN_ERR_PARAM_INVALID;
    return act_bwd("aclnnGeluBackwardV2", tanh_mode ? OPS_EWF_GELU_TANH_BWD : OPS_EWF_GELU_BWD, gradOutput, self,
                   NULL, 0, gradInput, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnGeluBackwardV2)

/* ---------------------------------------------------------------- MseLoss */

/* aclnnMseLoss(self, target, reduction, out): reduction 0 none, 1 mean, 2 sum (aclnn_mse_loss.h);
 * self and target broadcast. */
API aclnnStatus aclnnMseLossGetWorkspaceSize(const aclTensor *self, const aclTensor *target, int64_t reduction,
                                             aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !target || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_FLOATS));
    NN_CHECK(t_check(target, DTM_FLOATS));
    NN_CHECK(t_check(out, DTM_FLOATS));
    if (reduction < 0 || reduction > 2) return ACLNN_ERR_PARAM_INVALID;
    int64_t shape[OPS_MAX_DIMS];
    int nd = t_broadcast(self->dims, self->ndim, target->dims, target->ndim, shape);
    NN_REQUIRE(nd >= 0);
    if (reduction == 0) return EW2("aclnnMseLoss", OPS_EWF_SQDIFF, self, target, NULL, 0, out);
    NN_REQUIRE(t_numel(out) == 1);
    NN_OPEN(e, "aclnnMseLoss", OPS_OP_MSE);
    ex_int(e, reduction);
    ex_tensor(e, t_aligned(self, shape, nd));
    ex_tensor(e, t_aligned(target, shape, nd));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnMseLoss)

/* gradInput = norm * (self - target) * gradOutput, norm = 2 / numel for mean, else 2 (torch's
 * mse_loss_backward_out). */
API aclnnStatus aclnnMseLossBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                     const aclTensor *target, int64_t reduction,
                                                     aclTensor *gradInput, uint64_t *workspaceSize,
                                                     aclOpExecutor **executor) {
    if (!gradOutput || !self || !target || !gradInput) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(gradOutput, DTM_FLOATS));
    NN_CHECK(t_check(self, DTM_FLOATS));
    NN_CHECK(t_check(target, DTM_FLOATS));
    NN_CHECK(t_check(gradInput, DTM_FLOATS));
    if (reduction < 0 || reduction > 2) return ACLNN_ERR_PARAM_INVALID;
    int64_t n = t_numel(self);
    double s[1] = {reduction == 1 ? (n ? 2.0 / (double)n : NAN) : 2.0};
    return ew_op("aclnnMseLossBackward", OPS_EWF_MSE_BWD, (const aclTensor *const[]){self, target, gradOutput}, 3, s,
                 1, gradInput, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnMseLossBackward)

/* ---------------------------------------------------------------- softmax */

static aclnnStatus softmax(const char *name, int logm, const aclTensor *self, int64_t dim, const aclTensor *out,
                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_FLOATS));
    NN_CHECK(t_check(out, DTM_FLOATS));
    NN_REQUIRE(nn_same_shape(out, self));
    int d = t_dim(dim, self->ndim);
    NN_REQUIRE(d >= 0);
    struct ops_tensor x = t_view(self), y = t_view(out);
    if (self->ndim == 0) { /* a 0-d tensor is one row of one element */
        x.ndim = y.ndim = 1;
        x.shape[0] = y.shape[0] = 1;
        x.stride[0] = y.stride[0] = 0;
    } else {
        x = nn_dim_last(x, d);
        y = nn_dim_last(y, d);
    }
    NN_OPEN(e, name, OPS_OP_SOFTMAX);
    ex_int(e, logm);
    ex_tensor(e, x);
    ex_tensor(e, y);
    return ex_done(e);
}

/* softmax / _softmax (half_to_float: a float16 self with a float32 out): exec aclnnSoftmax, self, dim, out. */
API aclnnStatus aclnnSoftmaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out,
                                             uint64_t *workspaceSize, aclOpExecutor **executor) {
    return softmax("aclnnSoftmax", 0, self, dim, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnSoftmax)

API aclnnStatus aclnnLogSoftmaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out,
                                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    return softmax("aclnnLogSoftmax", 1, self, dim, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnLogSoftmax)

static aclnnStatus softmax_bwd(const char *name, int logm, const aclTensor *g, const aclTensor *y, int64_t dim,
                               const aclTensor *gi, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!g || !y || !gi) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(g, DTM_FLOATS));
    NN_CHECK(t_check(y, DTM_FLOATS));
    NN_CHECK(t_check(gi, DTM_FLOATS));
    NN_REQUIRE(nn_same_shape(y, g) && nn_same_shape(gi, g));
    int d = t_dim(dim, g->ndim);
    NN_REQUIRE(d >= 0);
    struct ops_tensor v[3] = {t_view(g), t_view(y), t_view(gi)};
    for (int j = 0; j < 3; j++) {
        if (g->ndim == 0) {
            v[j].ndim = 1;
            v[j].shape[0] = 1;
            v[j].stride[0] = 0;
        } else {
            v[j] = nn_dim_last(v[j], d);
        }
    }
    NN_OPEN(e, name, OPS_OP_SOFTMAX_BWD);
    ex_int(e, logm);
    for (int j = 0; j < 3; j++) ex_tensor(e, v[j]);
    return ex_done(e);
}

/* _softmax_backward_data: exec aclnnSoftmaxBackward, grad_output, output, dim, grad_input. */
API aclnnStatus aclnnSoftmaxBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *output, int64_t dim,
                                                     aclTensor *gradInput, uint64_t *workspaceSize,
                                                     aclOpExecutor **executor) {
    return softmax_bwd("aclnnSoftmaxBackward", 0, gradOutput, output, dim, gradInput, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnSoftmaxBackward)

/* _log_softmax_backward_data: exec aclnnLogSoftmaxBackward, grad_output, output, dim, out. */
API aclnnStatus aclnnLogSoftmaxBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *output,
                                                        int64_t dim, aclTensor *out, uint64_t *workspaceSize,
                                                        aclOpExecutor **executor) {
    return softmax_bwd("aclnnLogSoftmaxBackward", 1, gradOutput, output, dim, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnLogSoftmaxBackward)

/* ---------------------------------------------------------------- layer and RMS norms */

/* A per-row statistic (mean, rstd) in x's rank: its own strides on the outer dims, 0 on the kd
 * normalized ones. op-plugin gives it as x's shape with the normalized dims 1, or as [M] (M rows)
 * when x has no rows. */
static int stat_view(const aclTensor *stat, const aclTensor *x, int kd, struct ops_tensor *v) {
    int nd = x->ndim, no = nd - kd;
    *v = t_view(x);
    v->addr = stat->data;
    v->offset = stat->offset;
    v->dtype = stat->dtype;
    int64_t rows = 1;
    for (int d = 0; d < no; d++) rows *= x->dims[d];
    if (stat->ndim == nd) {
        for (int d = 0; d < nd; d++) {
            if (d < no && stat->dims[d] != x->dims[d]) return -1;
            if (d >= no && stat->dims[d] != 1) return -1;
            v->stride[d] = d < no ? stat->strides[d] : 0;
        }
        return 0;
    }
    if (t_numel(stat) != rows) return -1;
    if (rows == 0 || no == 0) {
        for (int d = 0; d < nd; d++) v->stride[d] = 0;
        return 0;
    }
    if (stat->ndim == no) { /* x's outer shape */
        for (int d = 0; d < no; d++) {
            if (stat->dims[d] != x->dims[d]) return -1;
            v->stride[d] = stat->strides[d];
        }
        for (int d = no; d < nd; d++) v->stride[d] = 0;
        return 0;
    }
    return -1;
}

/* A parameter of the normalized shape (weight, bias, gamma) in x's rank: stride 0 outside. */
static int param_view(const aclTensor *w, const aclTensor *x, int kd, struct ops_tensor *v) {
    int nd = x->ndim, no = nd - kd;
    if (w->ndim != kd) return -1;
    *v = t_view(x);
    v->addr = w->data;
    v->offset = w->offset;
    v->dtype = w->dtype;
    for (int d = 0; d < nd; d++) {
        if (d < no) {
            v->stride[d] = 0;
        } else {
            if (w->dims[d - no] != x->dims[d]) return -1;
            v->stride[d] = w->strides[d - no];
        }
    }
    return 0;
}

/* aclnnLayerNorm(input, normalizedShape, weight?, bias?, eps, out, meanOut?, rstdOut?): op-plugin's
 * native_layer_norm (LayerNormKernelNpuOpApi.cpp) on the default path; mean and rstd in float for
 * float16/bfloat16 inputs. */
API aclnnStatus aclnnLayerNormGetWorkspaceSize(const aclTensor *input, const aclIntArray *normalizedShape,
                                               const aclTensor *weightOptional, const aclTensor *biasOptional,
                                               double eps, aclTensor *out, aclTensor *meanOutOptional,
                                               aclTensor *rstdOutOptional, uint64_t *workspaceSize,
                                               aclOpExecutor **executor) {
    if (!input || !normalizedShape || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(input, DTM_FLOATS));
    NN_CHECK(t_check(out, DTM_FLOATS));
    int nd = input->ndim, kd = (int)normalizedShape->size;
    NN_REQUIRE(kd >= 1 && kd <= nd && nn_same_shape(out, input));
    for (int d = 0; d < kd; d++) NN_REQUIRE(normalizedShape->value[d] == input->dims[nd - kd + d]);
    struct ops_tensor v[6];
    int fl = 0, n = 0;
    v[n++] = t_view(input);
    if (weightOptional) {
        NN_CHECK(t_check(weightOptional, DTM_FLOATS));
        NN_REQUIRE(param_view(weightOptional, input, kd, &v[n++]) == 0);
        fl |= NORM_W;
    }
    if (biasOptional) {
        NN_CHECK(t_check(biasOptional, DTM_FLOATS));
        NN_REQUIRE(param_view(biasOptional, input, kd, &v[n++]) == 0);
        fl |= NORM_B;
    }
    v[n++] = t_view(out);
    if (meanOutOptional) {
        NN_CHECK(t_check(meanOutOptional, DTM_FLOATS));
        NN_REQUIRE(stat_view(meanOutOptional, input, kd, &v[n++]) == 0);
        fl |= NORM_MEAN;
    }
    if (rstdOutOptional) {
        NN_CHECK(t_check(rstdOutOptional, DTM_FLOATS));
        NN_REQUIRE(stat_view(rstdOutOptional, input, kd, &v[n++]) == 0);
        fl |= NORM_RSTD;
    }
    NN_OPEN(e, "aclnnLayerNorm", OPS_OP_NORM);
    ex_int(e, kd);
    ex_int(e, fl);
    ex_scalar(e, eps);
    for (int j = 0; j < n; j++) ex_tensor(e, v[j]);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnLayerNorm)

/* aclnnLayerNormBackward(gradOut, input, normalizedShape, mean, rstd, weight?, bias?, outputMask,
 * gradInputOut?, gradWeightOut?, gradBiasOut?): op-plugin's native_layer_norm_backward always
 * passes a weight (ones when the layer has none) and float32 gradWeight/gradBias; outputs the
 * mask leaves out come as NULL. */
API aclnnStatus aclnnLayerNormBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *input, const aclIntArray *normalizedShape, const aclTensor *mean,
    const aclTensor *rstd, const aclTensor *weightOptional, const aclTensor *biasOptional,
    const aclBoolArray *outputMask, aclTensor *gradInputOut, aclTensor *gradWeightOut, aclTensor *gradBiasOut,
    uint64_t *workspaceSize, aclOpExecutor **executor) {
    (void)biasOptional;
    if (!gradOut || !input || !normalizedShape || !mean || !rstd || !outputMask) return ACLNN_ERR_PARAM_NULLPTR;
    if (!weightOptional) return ACLNN_ERR_PARAM_NULLPTR; /* op-plugin always passes one */
    NN_CHECK(t_check(gradOut, DTM_FLOATS));
    NN_CHECK(t_check(input, DTM_FLOATS));
    NN_CHECK(t_check(mean, DTM_FLOATS));
    NN_CHECK(t_check(rstd, DTM_FLOATS));
    NN_CHECK(t_check(weightOptional, DTM_FLOATS));
    NN_REQUIRE(outputMask->size == 3);
    int nd = input->ndim, kd = (int)normalizedShape->size;
    NN_REQUIRE(kd >= 1 && kd <= nd && nn_same_shape(gradOut, input));
    for (int d = 0; d < kd; d++) NN_REQUIRE(normalizedShape->value[d] == input->dims[nd - kd + d]);
    struct ops_tensor v[8];
    int n = 0, fl = 0;
    v[n++] = t_view(gradOut);
    v[n++] = t_view(input);
    NN_REQUIRE(stat_view(mean, input, kd, &v[n++]) == 0);
    NN_REQUIRE(stat_view(rstd, input, kd, &v[n++]) == 0);
    NN_REQUIRE(param_view(weightOptional, input, kd, &v[n++]) == 0);
    const aclTensor *outs[3] = {gradInputOut, gradWeightOut, gradBiasOut};
    for (int j = 0; j < 3; j++) {
        if (!outputMask->value[j]) continue;
        if (!outs[j]) return ACLNN_ERR_PARAM_NULLPTR;
        NN_CHECK(t_check(outs[j], DTM_FLOATS));
        if (j == 0) {
            NN_REQUIRE(nn_same_shape(outs[0], input));
            v[n++] = t_view(outs[0]);
        } else {
            NN_REQUIRE(param_view(outs[j], input, kd, &v[n++]) == 0);
        }
        fl |= j == 0 ? NORM_GX : j == 1 ? NORM_GW : NORM_GB;
    }
    NN_OPEN(e, "aclnnLayerNormBackward", OPS_OP_NORM_BWD);
    ex_int(e, kd);
    ex_int(e, fl);
    for (int j = 0; j < n; j++) ex_tensor(e, v[j]);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnLayerNormBackward)

/* aclnnRmsNorm(x, gamma, epsilon, yOut, rstdOut): y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2)
 * + eps) over gamma's (trailing) dims; rstd float32 shaped as x with those dims 1 (op-plugin's
 * npu_rms_norm, RmsNormKernelOpApi.cpp; aclnn_rms_norm.h). */
API aclnnStatus aclnnRmsNormGetWorkspaceSize(const aclTensor *x, const aclTensor *gamma, double epsilon,
                                             const aclTensor *yOut, const aclTensor *rstdOut,
                                             uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!x || !gamma || !yOut || !rstdOut) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(x, DTM_FLOATS));
    NN_CHECK(t_check(gamma, DTM_FLOATS));
    NN_CHECK(t_check(yOut, DTM_FLOATS));
    NN_CHECK(t_check(rstdOut, DTM_FLOATS));
    int kd = gamma->ndim;
    NN_REQUIRE(kd >= 1 && kd <= x->ndim && nn_same_shape(yOut, x));
    struct ops_tensor v[4];
    v[0] = t_view(x);
    NN_REQUIRE(param_view(gamma, x, kd, &v[1]) == 0);
    v[2] = t_view(yOut);
    NN_REQUIRE(stat_view(rstdOut, x, kd, &v[3]) == 0);
    NN_OPEN(e, "aclnnRmsNorm", OPS_OP_NORM);
    ex_int(e, kd);
    ex_int(e, NORM_W | NORM_RSTD | NORM_RMS);
    ex_scalar(e, epsilon);
    for (int j = 0; j < 4; j++) ex_tensor(e, v[j]);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnRmsNorm)

/* aclnnRmsNormGrad(dy, x, rstd, gamma, dxOut, dgammaOut): dgamma float32 (npu_rms_norm_backward,
 * RmsNormBackwardKernelOpApi.cpp). */
API aclnnStatus aclnnRmsNormGradGetWorkspaceSize(const aclTensor *dy, const aclTensor *x, const aclTensor *rstd,
                                                 const aclTensor *gamma, const aclTensor *dxOut,
                                                 const aclTensor *dgammaOut, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!dy || !x || !rstd || !gamma || !dxOut || !dgammaOut) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(dy, DTM_FLOATS));
    NN_CHECK(t_check(x, DTM_FLOATS));
    NN_CHECK(t_check(rstd, DTM_FLOATS));
    NN_CHECK(t_check(gamma, DTM_FLOATS));
    NN_CHECK(t_check(dxOut, DTM_FLOATS));
    NN_CHECK(t_check(dgammaOut, DTM_FLOATS));
    int kd = gamma->ndim;
    NN_REQUIRE(kd >= 1 && kd <= x->ndim && nn_same_shape(dy, x) && nn_same_shape(dxOut, x));
    struct ops_tensor v[6];
    v[0] = t_view(dy);
    v[1] = t_view(x);
    NN_REQUIRE(stat_view(rstd, x, kd, &v[2]) == 0);
    NN_REQUIRE(param_view(gamma, x, kd, &v[3]) == 0);
    v[4] = t_view(dxOut);
    NN_REQUIRE(param_view(dgammaOut, x, kd, &v[5]) == 0);
    NN_OPEN(e, "aclnnRmsNormGrad", OPS_OP_NORM_BWD);
    ex_int(e, kd);
    ex_int(e, NORM_RMS | NORM_GX | NORM_GW);
    for (int j = 0; j < 6; j++) ex_tensor(e, v[j]);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnRmsNormGrad)

/* ---------------------------------------------------------------- NLLLoss */

/* self [N, C] or [C] (2d: [N, C, H, W]), target [N] or [] ([N, H, W]), weight [C] (op-plugin passes
 * ones when there is none). The kernel sees x with the class dim last and target's dims first. */
static aclnnStatus nll_views(const aclTensor *self, const aclTensor *target, const aclTensor *weight, int two_d,
                             struct ops_tensor *x, struct ops_tensor *t, struct ops_tensor *w) {
    NN_CHECK(t_check(self, DTM_FLOATS));
    NN_CHECK(t_check(target, DTM_INDEX | DTM(OPS_DT_UINT8)));
    NN_CHECK(t_check(weight, DTM_FLOATS));
    int cd = two_d || self->ndim == 2 ? 1 : 0;
    NN_REQUIRE(two_d ? self->ndim == 4 : (self->ndim == 1 || self->ndim == 2));
    int64_t C = self->dims[cd];
    NN_REQUIRE(weight->ndim == 1 && weight->dims[0] == C);
    *x = nn_dim_last(t_view(self), cd);
    *t = t_view(target);
    *w = t_view(weight);
    if (self->ndim == 1) { /* one sample: target [] or [1] */
        NN_REQUIRE(target->ndim == 0 || (target->ndim == 1 && target->dims[0] == 1));
        x->ndim = 2;
        x->shape[1] = C, x->stride[1] = self->strides[0];
        x->shape[0] = 1, x->stride[0] = 0;
        t->ndim = 1;
        t->shape[0] = 1, t->stride[0] = target->ndim ? target->strides[0] : 0;
    } else {
        NN_REQUIRE(target->ndim == self->ndim - 1);
        for (int d = 0; d < target->ndim; d++) NN_REQUIRE(target->dims[d] == x->shape[d]);
    }
    return ACLNN_SUCCESS;
}

static aclnnStatus nll(const char *name, int two_d, const aclTensor *self, const aclTensor *target,
                       const aclTensor *weight, int64_t reduction, int64_t ignoreIndex, const aclTensor *out,
                       const aclTensor *totalWeightOut, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !target || !weight || !out || !totalWeightOut) return ACLNN_ERR_PARAM_NULLPTR;
    if (reduction < 0 || reduction > 2) return ACLNN_ERR_PARAM_INVALID;
    struct ops_tensor x, t, w;
    NN_CHECK(nll_views(self, target, weight, two_d, &x, &t, &w));
    NN_CHECK(t_check(out, DTM_FLOATS));
    NN_CHECK(t_check(totalWeightOut, DTM_FLOATS));
    NN_REQUIRE(t_numel(totalWeightOut) == 1);
    struct ops_tensor o = t_view(out);
    if (reduction == 0 && self->ndim > 1) {
        NN_REQUIRE(nn_same_shape(out, target));
    } else if (reduction == 0) {
        NN_REQUIRE(t_numel(out) == 1);
        o.ndim = 1, o.shape[0] = 1, o.stride[0] = 0;
    } else {
        NN_REQUIRE(t_numel(out) == 1);
        o.ndim = 0;
    }
    NN_OPEN(e, name, OPS_OP_NLL);
    ex_int(e, reduction);
    ex_int(e, ignoreIndex);
    ex_tensor(e, x);
    ex_tensor(e, t);
    ex_tensor(e, w);
    ex_tensor(e, o);
    ex_tensor(e, t_view(totalWeightOut));
    return ex_done(e);
}

/* aclnnNLLLoss(self, target, weight, reduction, ignoreIndex, out, totalWeightOut): op-plugin's
 * nll_loss_forward (NLLLossKernelNpuOpApi.cpp); out [N] for reduction none on a batch, else []. */
API aclnnStatus aclnnNLLLossGetWorkspaceSize(const aclTensor *self, const aclTensor *target, const aclTensor *weight,
                                             int64_t reduction, int64_t ignoreIndex, aclTensor *out,
                                             aclTensor *totalWeightOut, uint64_t *workspaceSize,
                                             aclOpExecutor **executor) {
    return nll("aclnnNLLLoss", 0, self, target, weight, reduction, ignoreIndex, out, totalWeightOut, workspaceSize,
               executor);
}
OPS_LAUNCHER(aclnnNLLLoss)

/* aclnnNLLLoss2d: the same for self [N, C, H, W] and target [N, H, W] (NLLLoss2dKernelNpuOpApi.cpp;
 * cross_entropy of [N, C, d] logits reaches it through nll_loss_nd). */
API aclnnStatus aclnnNLLLoss2dGetWorkspaceSize(const aclTensor *self, const aclTensor *target, const aclTensor *weight,
                                               int64_t reduction, int64_t ignoreIndex, aclTensor *out,
                                               aclTensor *totalWeightOut, uint64_t *workspaceSize,
                                               aclOpExecutor **executor) {
    return nll("aclnnNLLLoss2d", 1, self, target, weight, reduction, ignoreIndex, out, totalWeightOut,
               workspaceSize, executor);
}
OPS_LAUNCHER(aclnnNLLLoss2d)

static aclnnStatus nll_bwd(const char *name, int two_d, const aclTensor *gradOutput, const aclTensor *self,
                           const aclTensor *target, const aclTensor *weight, int64_t reduction, int64_t ignoreIndex,
                           const aclTensor *totalWeight, const aclTensor *out, uint64_t *workspaceSize,
                           aclOpExecutor **executor) {
    if (!gradOutput || !self || !target || !weight || !totalWeight || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (reduction < 0 || reduction > 2) return ACLNN_ERR_PARAM_INVALID;
    struct ops_tensor x, t, w;
    NN_CHECK(nll_views(self, target, weight, two_d, &x, &t, &w));
    NN_CHECK(t_check(gradOutput, DTM_FLOATS));
    NN_CHECK(t_check(totalWeight, DTM_FLOATS));
    NN_CHECK(t_check(out, DTM_FLOATS));
    NN_REQUIRE(nn_same_shape(out, self) && t_numel(totalWeight) == 1);
    struct ops_tensor go = t_view(gradOutput), gi = nn_dim_last(t_view(out), two_d || self->ndim == 2 ? 1 : 0);
    if (reduction == 0 && self->ndim > 1) {
        NN_REQUIRE(nn_same_shape(gradOutput, target));
    } else {
        NN_REQUIRE(t_numel(gradOutput) == 1);
        go.ndim = t.ndim;
        for (int d = 0; d < go.ndim; d++) go.shape[d] = t.shape[d], go.stride[d] = 0;
    }
    if (self->ndim == 1) {
        gi.ndim = 2;
        gi.shape[1] = gi.shape[0], gi.stride[1] = gi.stride[0];
        gi.shape[0] = 1, gi.stride[0] = 0;
    }
    NN_OPEN(e, name, OPS_OP_NLL_BWD);
    ex_int(e, reduction);
    ex_int(e, ignoreIndex);
    ex_tensor(e, go);
    ex_tensor(e, x);
    ex_tensor(e, t);
    ex_tensor(e, w);
    ex_tensor(e, t_view(totalWeight));
    ex_tensor(e, gi);
    return ex_done(e);
}

/* aclnnNLLLossBackward(gradOutput, self, target, weight, reduction, ignoreIndex, totalWeight, out)
 * (NLLLossBackwardKernelNpuOpApi.cpp). */
API aclnnStatus aclnnNLLLossBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                     const aclTensor *target, const aclTensor *weight,
                                                     int64_t reduction, int64_t ignoreIndex,
                                                     const aclTensor *totalWeight, aclTensor *out,
                                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    return nll_bwd("aclnnNLLLossBackward", 0, gradOutput, self, target, weight, reduction, ignoreIndex, totalWeight,
                   out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnNLLLossBackward)

/* aclnnNLLLoss2dBackward: the same argument order (NLLLoss2dBackwardKernelNpuOpApi.cpp). */
API aclnnStatus aclnnNLLLoss2dBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                       const aclTensor *target, const aclTensor *weight,
                                                       int64_t reduction, int64_t ignoreIndex,
                                                       const aclTensor *totalWeight, aclTensor *out,
                                                       uint64_t *workspaceSize, aclOpExecutor **executor) {
    return nll_bwd("aclnnNLLLoss2dBackward", 1, gradOutput, self, target, weight, reduction, ignoreIndex,
                   totalWeight, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnNLLLoss2dBackward)

/* ---------------------------------------------------------------- Embedding */

/* aclnnEmbedding(weight, indices, out): out = weight[indices] (EmbeddingKernelNpuOpApi.cpp), out
 * shaped indices.shape + [D]. An INDEX launch: the row index picks weight's dim 0. */
API aclnnStatus aclnnEmbeddingGetWorkspaceSize(const aclTensor *weight, const aclTensor *indices, aclTensor *out,
                                               uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!weight || !indices || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(weight, DTM_NUM));
    NN_CHECK(t_check(indices, DTM_INDEX));
    NN_CHECK(t_check(out, DTM_NUM));
    NN_REQUIRE(weight->ndim == 2 && indices->ndim + 1 <= OPS_MAX_DIMS && out->dtype == weight->dtype);
    int r = indices->ndim;
    int64_t want[OPS_MAX_DIMS];
    for (int d = 0; d < r; d++) want[d] = indices->dims[d];
    want[r] = weight->dims[1];
    NN_REQUIRE(t_same_shape(out, want, r + 1));
    struct ops_tensor idx = t_view(indices);
    idx.ndim = r + 1;
    idx.shape[r] = weight->dims[1];
    idx.stride[r] = 0;
    NN_OPEN(e, "aclnnEmbedding", OPS_OP_INDEX);
    for (int d = 0; d < r; d++) ex_int(e, 0);
    ex_int(e, weight->strides[1]);
    ex_int(e, weight->strides[0]);
    ex_int(e, weight->dims[0]);
    ex_tensor(e, t_view(out));
    ex_tensor(e, t_view(weight));
    ex_tensor(e, idx);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnEmbedding)

/* aclnnEmbeddingDenseBackward(grad, sortIndices, numWeights, paddingIdx, scaleGradByFreq, out): the
 * exec line of embedding_dense_backward passes (grad_output, indices, num_weights, padding_idx,
 * scale_grad_by_freq, out), indices as they are (not sorted) and padding_idx -1 for none. */
API aclnnStatus aclnnEmbeddingDenseBackwardGetWorkspaceSize(const aclTensor *grad, const aclTensor *sortIndices,
                                                            uint64_t numWeights, uint64_t paddingIdx,
                                                            bool scaleGradByFreq, aclTensor *out,
                                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!grad || !sortIndices || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(grad, DTM_FLOATS));
    NN_CHECK(t_check(sortIndices, DTM_INDEX));
    NN_CHECK(t_check(out, DTM_FLOATS));
    int r = sortIndices->ndim;
    NN_REQUIRE(out->ndim == 2 && out->dims[0] == (int64_t)numWeights && grad->ndim >= 1 &&
               grad->dims[grad->ndim - 1] == out->dims[1]);
    /* grad is indices.shape + [D]; a flattened [n, D] grad with a multi-dim indices is accepted too */
    struct ops_tensor g = t_view(grad), idx = t_view(sortIndices);
    if (grad->ndim != r + 1) {
        NN_REQUIRE(grad->ndim == 2 && grad->dims[0] == t_numel(sortIndices));
        /* view indices as 1-D: only possible when they are contiguous among themselves */
        int64_t st = 1;
        for (int d = r - 1; d >= 0; d--) {
            NN_REQUIRE(sortIndices->dims[d] == 1 || sortIndices->strides[d] == st);
            st *= sortIndices->dims[d];
        }
        idx.ndim = 1;
        idx.shape[0] = t_numel(sortIndices);
        idx.stride[0] = 1;
    } else {
        for (int d = 0; d < r; d++) NN_REQUIRE(grad->dims[d] == sortIndices->dims[d]);
    }
    NN_OPEN(e, "aclnnEmbeddingDenseBackward", OPS_OP_EMBEDDING_BWD);
    ex_int(e, (int64_t)paddingIdx);
    ex_int(e, scaleGradByFreq);
    ex_tensor(e, g);
    ex_tensor(e, idx);
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnEmbeddingDenseBackward)

/* ---------------------------------------------------------------- Addmm, Baddbmm */

/* out = beta * self + alpha * (mat1 @ mat2), self broadcast to out; batched when mat1 and mat2 are
 * 3-D (aclnn_addmm.h, aclnn_baddbmm.h; op-plugin's AddmmKernelNpuOpApi.cpp, BaddbmmKernelNpuOpApi.cpp).
 * cubeMathType is accepted and ignored, as Matmul's (op_linalg.c). */
static aclnnStatus addmm(const char *name, int batched, const aclTensor *self, const aclTensor *m1,
                         const aclTensor *m2, const aclScalar *beta, const aclScalar *alpha, const aclTensor *out,
                         int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !m1 || !m2 || !beta || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    NN_CHECK(t_check(self, DTM_FLOATS));
    NN_CHECK(t_check(m1, DTM_FLOATS));
    NN_CHECK(t_check(m2, DTM_FLOATS));
    NN_CHECK(t_check(out, DTM_FLOATS));
    if (cubeMathType < 0 || cubeMathType > 3) return ACLNN_ERR_PARAM_INVALID;
    int nd = batched ? 3 : 2;
    NN_REQUIRE(m1->ndim == nd && m2->ndim == nd && out->ndim == nd);
    NN_REQUIRE(m1->dims[nd - 1] == m2->dims[nd - 2]);
    if (batched) NN_REQUIRE(m1->dims[0] == m2->dims[0]);
    int64_t want[3];
    if (batched) want[0] = m1->dims[0];
    want[nd - 2] = m1->dims[nd - 2];
    want[nd - 1] = m2->dims[nd - 1];
    NN_REQUIRE(t_same_shape(out, want, nd));
    int64_t tmp[OPS_MAX_DIMS];
    NN_REQUIRE(t_broadcast(self->dims, self->ndim, want, nd, tmp) == nd && t_same_shape(out, tmp, nd));
    NN_OPEN(e, name, OPS_OP_ADDMM);
    ex_scalar(e, s_value(beta));
    ex_scalar(e, s_value(alpha));
    ex_tensor(e, t_view(m1));
    ex_tensor(e, t_view(m2));
    ex_tensor(e, t_aligned(self, want, nd));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}

API aclnnStatus aclnnAddmmGetWorkspaceSize(const aclTensor *self, const aclTensor *mat1, const aclTensor *mat2,
                                           const aclScalar *beta, const aclScalar *alpha, aclTensor *out,
                                           int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    return addmm("aclnnAddmm", 0, self, mat1, mat2, beta, alpha, out, cubeMathType, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnAddmm)

API aclnnStatus aclnnBaddbmmGetWorkspaceSize(const aclTensor *self, const aclTensor *batch1, const aclTensor *batch2,
                                             const aclScalar *beta, const aclScalar *alpha, aclTensor *out,
                                             int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    return addmm("aclnnBaddbmm", 1, self, batch1, batch2, beta, alpha, out, cubeMathType, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnBaddbmm)
