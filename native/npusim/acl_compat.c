/* The names only the compat libascendcl.so carries: the old single-operator descriptors of
 * acl_base.h and acl_op.h. Since CANN 9.1 libascendcl.so is the acl-compat package (runtime
 * cmake/third_party/acl_compat.cmake, acl-compat_9.1.0), holding the whole old ACL surface; the
 * descriptors themselves are GE's (ge api/acl/acl_model/types/tensor_desc_internal.cpp,
 * api/acl/acl_op_executor/types/op_attr.cpp). torch_npu links them (BIND_NOW) and uses them only on
 * the aclop path, which ends in aclopCompileAndExecute, a deliberate failure (failures.toml).
 *
 * They are real host objects: a descriptor keeps what was set on it and answers it back; an
 * attribute set keeps its count of attributes. Built into libascendcl.so only. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "errmsg.h"
#include "npusim.h"

typedef int32_t aclError;
#define ACL_API NPUSIM_API
#define MAX_DIMS 64 /* ACL_MAX_DIM_CNT (acl_base.h) is 128; torch_npu passes at most 8 */

typedef struct {
    int dtype;
    int format;
    int placement;
    int ndims;
    int64_t dims[MAX_DIMS];
    char name[128];
} aclTensorDesc;

typedef struct {
    unsigned count; /* how many attributes were set */
} aclopAttr;

static aclError invalid(const char *func, const char *what) {
    npusim_report(ACL_ERROR_INVALID_PARAM, "EE1001", func, "%s: %s", func, what);
    return ACL_ERROR_INVALID_PARAM;
}

ACL_API aclTensorDesc *aclCreateTensorDesc(int dataType, int numDims, const int64_t *dims, int format) {
    if (numDims < 0 || numDims > MAX_DIMS || (numDims > 0 && !dims)) {
        invalid(__func__, "numDims out of range or dims NULL");
        return NULL;
    }
    aclTensorDesc *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->dtype = dataType;
    d->format = format;
    d->ndims = numDims;
    if (numDims > 0) memcpy(d->dims, dims, (size_t)numDims * sizeof *dims);
    return d;
}
ACL_API void aclDestroyTensorDesc(const aclTensorDesc *desc) { free((void *)desc); }
/* NULL answers ACL_DT_UNDEFINED / ACL_FORMAT_UNDEFINED (-1), as tensor_desc_internal.cpp. */
ACL_API int aclGetTensorDescType(const aclTensorDesc *desc) { return desc ? desc->dtype : -1; }
ACL_API int aclGetTensorDescFormat(const aclTensorDesc *desc) { return desc ? desc->format : -1; }
ACL_API size_t aclGetTensorDescNumDims(const aclTensorDesc *desc) { return desc ? (size_t)desc->ndims : 0; }
ACL_API aclError aclGetTensorDescDimV2(const aclTensorDesc *desc, size_t index, int64_t *dimSize) {
    if (!desc || !dimSize || index >= (size_t)desc->ndims) return invalid(__func__, "no such dimension");
    *dimSize = desc->dims[index];
    return ACL_SUCCESS;
}
ACL_API void aclSetTensorDescName(aclTensorDesc *desc, const char *name) {
    if (desc) snprintf(desc->name, sizeof desc->name, "%s", name ? name : "");
}
ACL_API aclError aclSetTensorFormat(aclTensorDesc *desc, int format) {
    if (!desc) return invalid(__func__, "desc is NULL");
    desc->format = format;
    return ACL_SUCCESS;
}
ACL_API aclError aclSetTensorShape(aclTensorDesc *desc, int numDims, const int64_t *dims) {
    if (!desc || numDims < 0 || numDims > MAX_DIMS || (numDims > 0 && !dims))
        return invalid(__func__, "desc NULL, numDims out of range or dims NULL");
    desc->ndims = numDims;
    if (numDims > 0) memcpy(desc->dims, dims, (size_t)numDims * sizeof *dims);
    return ACL_SUCCESS;
}
/* aclMemType: ACL_MEMTYPE_DEVICE 0, ACL_MEMTYPE_HOST 1, ACL_MEMTYPE_HOST_COMPILE_INDEPENDENT 2. */
ACL_API aclError aclSetTensorPlaceMent(aclTensorDesc *desc, int memType) {
    if (!desc || memType < 0 || memType > 2) return invalid(__func__, "desc NULL or memType unknown");
    desc->placement = memType;
    return ACL_SUCCESS;
}

ACL_API aclopAttr *aclopCreateAttr(void) { return calloc(1, sizeof(aclopAttr)); }
ACL_API void aclopDestroyAttr(const aclopAttr *attr) { free((void *)attr); }

/* Each setter checks its arguments as op_attr.cpp does (attr and name non-NULL, list values
 * non-NULL when the count is positive) and counts the attribute. */
static aclError set_attr(const char *func, aclopAttr *attr, const char *name, int n, const void *values) {
    if (!attr || !name || n < 0 || (n > 0 && !values)) return invalid(func, "attr or attrName NULL, or bad list");
    attr->count++;
    return ACL_SUCCESS;
}
ACL_API aclError aclopSetAttrBool(aclopAttr *attr, const char *attrName, uint8_t attrValue) {
    return set_attr(__func__, attr, attrName, 0, &attrValue);
}
ACL_API aclError aclopSetAttrInt(aclopAttr *attr, const char *attrName, int64_t attrValue) {
    return set_attr(__func__, attr, attrName, 0, &attrValue);
}
ACL_API aclError aclopSetAttrFloat(aclopAttr *attr, const char *attrName, float attrValue) {
    return set_attr(__func__, attr, attrName, 0, &attrValue);
}
ACL_API aclError aclopSetAttrString(aclopAttr *attr, const char *attrName, const char *attrValue) {
    if (!attrValue) return invalid(__func__, "attrValue is NULL");
    return set_attr(__func__, attr, attrName, 0, attrValue);
}
ACL_API aclError aclopSetAttrDataType(aclopAttr *attr, const char *attrName, int attrValue) {
    return set_attr(__func__, attr, attrName, 0, &attrValue);
}
ACL_API aclError aclopSetAttrListBool(aclopAttr *attr, const char *attrName, int numValues, const uint8_t *values) {
    return set_attr(__func__, attr, attrName, numValues, values);
}
ACL_API aclError aclopSetAttrListInt(aclopAttr *attr, const char *attrName, int numValues, const int64_t *values) {
    return set_attr(__func__, attr, attrName, numValues, values);
}
ACL_API aclError aclopSetAttrListFloat(aclopAttr *attr, const char *attrName, int numValues, const float *values) {
    return set_attr(__func__, attr, attrName, numValues, values);
}
ACL_API aclError aclopSetAttrListListInt(aclopAttr *attr, const char *attrName, int numLists, const int *numValues,
                                         const int64_t *const values[]) {
    if (numLists > 0 && !numValues) return invalid(__func__, "numValues is NULL");
    return set_attr(__func__, attr, attrName, numLists, values);
}

#define NPUSIM_FAILURES_ASCENDCL
#include "failures.inc"
