/* libacl_op_compiler.so of the simulated CANN tree (ge api/acl/acl_op_compiler/single_op/
 * op_compiler.cpp). torch_npu links it (BIND_NOW) and at initialisation sets compile options
 * (aclSetCompileopt; skipped on an Ascend950 SoC). The simulator compiles no single operators:
 * aclopCompileAndExecute is a deliberate failure (failures.toml), so that an operator op-plugin
 * sends down the aclop path raises in torch_npu instead of returning outputs nobody computed. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "errmsg.h"
#include "npusim.h"

typedef int32_t aclError;
#define ACL_API NPUSIM_API

/* aclCompileOpt (ge inc/external/acl/acl_op_compiler.h): ACL_PRECISION_MODE 0 .. ACL_OP_JIT_COMPILE 10
 * .. ACL_OP_DEBUG_OPTION 16. As op_compiler.cpp: the values set are kept; aclGetCompileoptSize is
 * 256 for JIT_COMPILE and the set value's length + 1 (0 when unset) for the others;
 * aclGetCompileopt answers JIT_COMPILE (the value set, else the default "disable", which
 * GetDefaultJitCompileValue gives an NpuArch outside its enabled list) and DEBUG_OPTION, and
 * ACL_ERROR_API_NOT_SUPPORT for the rest. torch_npu reads JIT_COMPILE at initialisation. */
#define COMPILE_OPTS 17
#define OPT_JIT_COMPILE 10
#define OPT_DEBUG_OPTION 16
#define COMPILE_OPT_SIZE 256
#define ACL_ERROR_API_NOT_SUPPORT 200001
static char g_opts[COMPILE_OPTS][COMPILE_OPT_SIZE];
static int g_set[COMPILE_OPTS];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static aclError bad(const char *func, int opt, aclError code) {
    npusim_report(code, "EE1001", func, "%s: option %d is not valid here", func, opt);
    return code;
}

ACL_API aclError aclSetCompileopt(int opt, const char *value) {
    if (opt < 0 || opt >= COMPILE_OPTS || !value || strlen(value) >= COMPILE_OPT_SIZE)
        return bad(__func__, opt, ACL_ERROR_INVALID_PARAM);
    pthread_mutex_lock(&g_mu);
    snprintf(g_opts[opt], sizeof g_opts[opt], "%s", value);
    g_set[opt] = 1;
    pthread_mutex_unlock(&g_mu);
    return ACL_SUCCESS;
}
ACL_API size_t aclGetCompileoptSize(int opt) {
    if (opt == OPT_JIT_COMPILE) return COMPILE_OPT_SIZE;
    if (opt < 0 || opt >= COMPILE_OPTS) return 0;
    pthread_mutex_lock(&g_mu);
    size_t n = g_set[opt] && g_opts[opt][0] ? strlen(g_opts[opt]) + 1 : 0;
    pthread_mutex_unlock(&g_mu);
    return n;
}
ACL_API aclError aclGetCompileopt(int opt, char *value, size_t length) {
    if (!value) return bad(__func__, opt, ACL_ERROR_INVALID_PARAM);
    if (opt != OPT_JIT_COMPILE && opt != OPT_DEBUG_OPTION) return bad(__func__, opt, ACL_ERROR_API_NOT_SUPPORT);
    pthread_mutex_lock(&g_mu);
    const char *v = g_set[opt] ? g_opts[opt] : opt == OPT_JIT_COMPILE ? "disable" : NULL;
    aclError rc = !v ? ACL_ERROR_API_NOT_SUPPORT : length < strlen(v) + 1 ? ACL_ERROR_INVALID_PARAM : ACL_SUCCESS;
    if (rc == ACL_SUCCESS) memcpy(value, v, strlen(v) + 1);
    pthread_mutex_unlock(&g_mu);
    return rc == ACL_SUCCESS ? rc : bad(__func__, opt, rc);
}

#define NPUSIM_FAILURES_ACL_OP_COMPILER
#include "failures.inc"
