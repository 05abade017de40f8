/* The agent's operations that report or re-link and change no lock state: hello, status and
 * the HCCL communicator rebuild (hccl_root, hccl_rebuild). They run on the agent thread, as
 * every operation does (ops.c). */
#include "ops_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void python_or_null(sbuf *b) { python_info_json(b); }

int op_hello(const request *r, const agent_endpoint *ep, sbuf *res, op_error *e) {
    (void)r;
    (void)e;
    acl_rt *a = runtime();
    sb_key(res, "agent_version");
    sb_str(res, NPUSNAP_VERSION);
    sb_key(res, "agent");
    sb_str(res, "native");
    sb_key(res, "protocol_version");
    sb_printf(res, "%d", PROTOCOL_VERSION);
    sb_key(res, "pid");
    sb_printf(res, "%d", (int)getpid());
    long long ticks = read_start_ticks();
    sb_key(res, "start_time_ticks");
    sb_printf(res, "%lld", ticks);
    sb_key(res, "log");
    if (agent_log_path()) sb_str(res, agent_log_path());
    else sb_raw(res, "null");
    double bt = boot_time();
    sb_key(res, "started_at");
    if (bt >= 0 && ticks >= 0) sb_num(res, bt + (double)ticks / (double)sysconf(_SC_CLK_TCK));
    else sb_raw(res, "null");
    sb_key(res, "restored");
    sb_raw(res, restored ? "true" : "false");
    sb_key(res, "socket");
    sb_str(res, ep->socket);
    sb_key(res, "python");
    python_or_null(res);
    sb_key(res, "acl");
    sb_raw(res, "{");
    sb_key(res, "loaded");
    sb_raw(res, a ? "true" : "false");
    sb_key(res, "library");
    sb_str(res, a ? a->path : NULL);
    sb_key(res, "cann_version");
    sb_str(res, a && a->version[0] ? a->version : NULL);
    /* The runtime maps the program's device ids through this list, read once at its init and
     * kept in process memory (runtime.cc GetVisibleDevices): a restore must reach the same driver
     * ids, which a restore onto other devices (--device-map) cannot promise. */
    sb_key(res, "visible_devices");
    sb_str(res, getenv("ASCEND_RT_VISIBLE_DEVICES"));
    /* The devices: those the interposed aclrtSetDevice saw, else what the runtime can tell. */
    int32_t ids[MAX_CB_DEVICES];
    int n = 0;
    const char *source = NULL;
    npusnap_devmem_info info;
    memset(&info, 0, sizeof info);
    if (npusnap_devmem_get_info) npusnap_devmem_get_info(&info);
    if (info.interposed && npusnap_devmem_devices) n = npusnap_devmem_devices(ids, MAX_CB_DEVICES);
    if (n > 0) {
        source = "aclrtSetDevice (interposed)";
    } else {
        pthread_mutex_lock(&cb.mu);
        n = cb.n_known;
        memcpy(ids, cb.known, sizeof ids[0] * (size_t)n);
        pthread_mutex_unlock(&cb.mu);
        source = n ? "LOCK_PRE callback" : NULL;
    }
    if (n > MAX_CB_DEVICES) n = MAX_CB_DEVICES;
    sb_key(res, "devices");
    ids_json(res, ids, n < 0 ? 0 : n);
    sb_key(res, "devices_source");
    sb_str(res, source);
    sb_key(res, "callback_devices");
    pthread_mutex_lock(&cb.mu);
    ids_json(res, cb.known, cb.n_known);
    pthread_mutex_unlock(&cb.mu);
    sb_raw(res, "}");
    sb_key(res, "hooks");
    hooks_names_json(res);
    sb_key(res, "owner");
    owner_json(res);
    sb_key(res, "device_memory");
    devmem_json(res);
    return 0;
}

/* "hccl": the communicators the agent stands behind (npusnap/hcclvirt.h). */
static void hccl_json(sbuf *res) {
    struct npusnap_hccl_comm_info comms[64];
    size_t n = npusnap_hccl_comms(comms, 64);
    if (n > 64) n = 64;
    sb_key(res, "hccl");
    sb_raw(res, "[");
    for (size_t i = 0; i < n; i++) {
        sb_raw(res, i ? ",{" : "{");
        sb_printf(res, "\"key\":\"%s\",\"rank\":%u,\"nranks\":%u,\"state\":\"%s\",\"collectives\":%llu", comms[i].key,
                  comms[i].rank, comms[i].nranks, comms[i].state, (unsigned long long)comms[i].collectives);
        sb_raw(res, "}");
    }
    sb_raw(res, "]");
}

int op_hccl_root(const request *r, sbuf *res, op_error *e) {
    const jval *key = json_get(r->args, "key");
    if (!key || key->t != J_STR) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "hccl_root needs a key");
        return -1;
    }
    char root[2 * NPUSNAP_HCCL_ROOT_BYTES + 1], err[256] = "";
    int rc = npusnap_hccl_new_root(key->s, root, err, sizeof err);
    if (rc != 0) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_HCCL_FAILED, rc, "%s", err);
        return -1;
    }
    sb_key(res, "root");
    sb_str(res, root);
    return 0;
}

int op_hccl_rebuild(const request *r, sbuf *res, op_error *e) {
    const jval *key = json_get(r->args, "key"), *root = json_get(r->args, "root");
    if (!key || key->t != J_STR || !root || root->t != J_STR) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "hccl_rebuild needs a key and a root");
        return -1;
    }
    double start = now_s();
    char err[256] = "";
    int rc = npusnap_hccl_rebuild(key->s, root->s, err, sizeof err);
    if (rc != 0) {
        ops_event("HCCL communicator %s NOT rebuilt: %s", key->s, err);
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_HCCL_FAILED, rc, "%s", err);
        return -1;
    }
    ops_event("HCCL communicator %s rebuilt", key->s);
    elapsed_member(res, start);
    return 0;
}

int op_status(const request *r, sbuf *res, op_error *e) {
    (void)r;
    (void)e;
    state_members(res);
    sb_key(res, "pid");
    sb_printf(res, "%d", (int)getpid());
    sb_key(res, "acl_loaded");
    sb_raw(res, runtime() ? "true" : "false");
    sb_key(res, "restored");
    sb_raw(res, restored ? "true" : "false");
    sb_key(res, "restore_pending");
    sb_raw(res, restore_pending ? "true" : "false");
    sb_key(res, "device_memory");
    devmem_json(res);
    hccl_json(res);
    sb_key(res, "events");
    sb_raw(res, "[");
    int first = n_events > 10 ? n_events - 10 : 0;
    for (int i = first; i < n_events; i++) {
        if (i > first) sb_raw(res, ",");
        sb_str(res, events[i]);
    }
    sb_raw(res, "]");
    return 0;
}
