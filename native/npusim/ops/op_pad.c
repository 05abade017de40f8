/* aclnnConstantPadNd (aclnn_constant_pad_nd.h; op-plugin ConstantPadNdKernelNpuOpApi.cpp:
 * EXEC_NPU_CMD(aclnnConstantPadNd, self, pad, value, result)): torch.nn.functional.pad in
 * "constant" mode, and what DDP's constructor pads its parameter check with. pad lists pairs
 * (before, after) from the last dimension backwards, as torch's; negative amounts crop. */
#include "opapi_int.h"

API aclnnStatus aclnnConstantPadNdGetWorkspaceSize(const aclTensor *self, const aclIntArray *pad, const aclScalar *value,
                                                   aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if (!self || !pad || !value || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if ((st = t_check(self, DTM_ALL)) || (st = t_check(out, DTM_ALL))) return st;
    int nd = self->ndim;
    if (pad->size % 2 || (int64_t)pad->size > 2 * (int64_t)nd || out->ndim != nd || out->dtype != self->dtype)
        return ACLNN_ERR_PARAM_INVALID;
    int64_t before[OPS_MAX_DIMS] = {0};
    for (int d = 0; d < nd; d++) {
        int64_t b = 0, a = 0;
        uint64_t k = 2 * (uint64_t)(nd - 1 - d); /* pad[k], pad[k+1] belong to dimension d */
        if (k + 1 < pad->size) {
            b = pad->value[k];
            a = pad->value[k + 1];
        }
        if (self->dims[d] + b + a != out->dims[d] || out->dims[d] < 0) return ACLNN_ERR_PARAM_INVALID;
        before[d] = b;
    }
    aclOpExecutor *e = ex_open("aclnnConstantPadNd", OPS_OP_PAD, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    for (int d = 0; d < nd; d++) ex_int(e, before[d]);
    ex_scalar(e, s_value(value));
    ex_tensor(e, t_view(self));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnConstantPadNd)
