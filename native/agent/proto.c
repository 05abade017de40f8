/* The agent's line protocol: request decoding and validation, response lines.
 *
 * The same rules as npusnap_cli/device/protocol.py (which the CLI uses to speak to this agent); the
 * transcripts under tests/data/protocol/ are replayed against this code to keep the two equal.
 * Only the operations of the contract's table exist (native/contract/npusnap.toml, compiled in
 * through npusnap/contract.h): the agent is an allow-list, never an evaluator.
 */
#include "agent_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct arg_spec {
    const char *name;
    int kind;
} arg_spec;

#define MAX_ARGS NPUSNAP_PROTOCOL_MAX_ARGS
typedef struct op_spec {
    const char *op;
    arg_spec args[MAX_ARGS];
} op_spec;

/* The contract's operations (npusnap_cli/device/protocol.py builds OP_ARGS from the same spec). */
static const op_spec OPS[] = {NPUSNAP_PROTOCOL_OPS_INIT};
#define N_OPS (sizeof OPS / sizeof OPS[0])

void err_init(op_error *e) {
    memset(e, 0, sizeof *e);
    e->type = NPUSNAP_ERRTYPE_INTERNAL;
    sb_init(&e->extra);
}

void err_set(op_error *e, const char *type, const char *name, long long code, const char *fmt, ...) {
    e->type = type;
    snprintf(e->name, sizeof e->name, "%s", name);
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

void err_free(op_error *e) { sb_free(&e->extra); }

static void py_repr(sbuf *b, const jval *v) {
    if (!v || v->t == J_NULL) {
        sb_raw(b, "None");
    } else if (v->t == J_BOOL) {
        sb_raw(b, v->b ? "True" : "False");
    } else if (v->t == J_STR) {
        sb_raw(b, "'");
        sb_rawn(b, v->s, strlen(v->s) > 64 ? 64 : strlen(v->s));
        sb_raw(b, "'");
    } else {
        sb_json(b, v);
    }
}

static const op_spec *find_op(const char *op) {
    for (size_t i = 0; i < N_OPS; i++) {
        if (strcmp(OPS[i].op, op) == 0) return &OPS[i];
    }
    return NULL;
}

/* Characters (code points) of a UTF-8 string, as Python's len() counts them. */
static size_t utf8_chars(const char *s) {
    size_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static int bad_args(op_error *e, const char *fmt, const char *a, const char *b) {
    err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, fmt, a, b);
    return -1;
}

static int validate(const char *op, const jval *args, op_error *e) {
    const op_spec *spec = find_op(op);
    if (!spec) {
        sbuf names;
        sb_init(&names);
        for (size_t i = 0; i < N_OPS; i++) {
            if (i) sb_raw(&names, ", ");
            sb_raw(&names, OPS[i].op);
        }
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_UNKNOWN_OP, 0, "unknown operation '%.64s' (allowed: %s)", op,
                names.p ? names.p : "");
        sb_free(&names);
        return -1;
    }
    for (size_t i = 0; i < args->n; i++) {
        const char *key = args->keys[i];
        const jval *v = &args->items[i];
        const arg_spec *a = NULL;
        for (int j = 0; j < MAX_ARGS && spec->args[j].name; j++) {
            if (strcmp(spec->args[j].name, key) == 0) a = &spec->args[j];
        }
        if (!a) return bad_args(e, "operation '%s' takes no argument '%.64s'", op, key);
        int ok = 0;
        switch (a->kind) {
        case NPUSNAP_ARG_LEASE: ok = v->t == J_NUM || v->t == J_NULL; break;
        case NPUSNAP_ARG_TOKEN: ok = v->t == J_STR || v->t == J_NULL; break;
        case NPUSNAP_ARG_BOOL: ok = v->t == J_BOOL; break;
        case NPUSNAP_ARG_DEVICE_MEMORY: ok = v->t == J_STR || v->t == J_NULL; break;
        case NPUSNAP_ARG_OWNER: ok = v->t == J_OBJ || v->t == J_NULL; break;
        case NPUSNAP_ARG_PATH: ok = v->t == J_STR; break;
        case NPUSNAP_ARG_HEX: ok = v->t == J_STR && strlen(v->s) <= 2 * NPUSNAP_PROTOCOL_HCCL_ROOT_BYTES &&
                                   strspn(v->s, "0123456789abcdef") == strlen(v->s); break;
        }
        if (!ok) return bad_args(e, "argument '%s' of '%s' has the wrong type", key, op);
    }
    /* Value checks after every type check, in the order of protocol.validate_args. */
    const jval *v = json_get(args, "lease_s");
    if (v && v->t == J_NUM && !(v->num > 0 && v->num <= NPUSNAP_PROTOCOL_MAX_LEASE_S)) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "lease_s must be > 0 and at most a week");
        return -1;
    }
    v = json_get(args, "drain_timeout_s");
    if (v && v->t == J_NUM && !(v->num > 0 && v->num <= 600)) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "drain_timeout_s must be > 0 and at most 600");
        return -1;
    }
    v = json_get(args, "token");
    if (v && v->t == J_STR && utf8_chars(v->s) > 2 * NPUSNAP_PROTOCOL_TOKEN_HEX_CHARS) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "token is too long");
        return -1;
    }
    v = json_get(args, "owner");
    if (v && v->t == J_OBJ) {
        const jval *cmd = json_get(v, "command");
        const jval *pid = json_get(v, "pid");
        int extra = 0;
        for (size_t k = 0; k < v->n; k++) {
            extra |= strcmp(v->keys[k], "command") != 0 && strcmp(v->keys[k], "pid") != 0;
        }
        if (extra || !cmd || cmd->t != J_STR || cmd->slen == 0 || utf8_chars(cmd->s) > NPUSNAP_PROTOCOL_MAX_OWNER_COMMAND || !pid ||
            pid->t != J_NUM || !pid->is_int || pid->i <= 0) {
            err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "owner must be {\"command\": str (1-64 chars), \"pid\": int > 0}");
            return -1;
        }
    }
    v = json_get(args, "device_memory_file");
    if (v && v->t == J_STR && (v->s[0] != '/' || v->slen >= NPUSNAP_PROTOCOL_MAX_PATH || strlen(v->s) != v->slen)) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "device_memory_file must be an absolute path");
        return -1;
    }
    v = json_get(args, "device_memory");
    if (v && v->t == J_STR && !npusnap_devmem_mode_valid(v->s)) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0,
                "device_memory must be one of " NPUSNAP_DEVMEM_MODES_TEXT " (got '%.32s')", v->s);
        return -1;
    }
    return 0;
}

int proto_decode(const char *line, size_t len, request *r, op_error *e, long long *id_out) {
    memset(r, 0, sizeof *r);
    *id_out = 0;
    if (len > MAX_LINE) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_LINE_TOO_LONG, 0, "line of %zu bytes exceeds %d", len, MAX_LINE);
        return -1;
    }
    char perr[128];
    if (json_parse(line, len, &r->root, perr, sizeof perr) < 0) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_JSON, 0, "not a JSON line: %s", perr);
        return -1;
    }
    const jval *root = &r->root;
    if (root->t != J_OBJ) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_MESSAGE, 0, "a message must be a JSON object");
        goto fail;
    }
    const jval *idv = json_get(root, "id");
    if (idv && idv->t == J_NUM && idv->is_int) *id_out = idv->i;
    const jval *v = json_get(root, "v");
    if (!v || v->t != J_NUM || v->num != PROTOCOL_VERSION) {
        sbuf rb;
        sb_init(&rb);
        py_repr(&rb, v);
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_VERSION_MISMATCH, 0,
                "protocol version %s is not supported (speaks %d)", rb.p ? rb.p : "None", PROTOCOL_VERSION);
        sb_free(&rb);
        goto fail;
    }
    if (!idv || idv->t != J_NUM || !idv->is_int) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_MESSAGE, 0, "message id must be an integer");
        goto fail;
    }
    const jval *op = json_get(root, "op");
    if (!op || op->t != J_STR) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_MESSAGE, 0, "request has no op");
        goto fail;
    }
    static const jval empty = {.t = J_OBJ};
    const jval *args = json_get(root, "args");
    if (!args) args = &empty;
    if (args->t != J_OBJ) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "args must be a JSON object");
        goto fail;
    }
    if (validate(op->s, args, e) < 0) goto fail;
    r->id = idv->i;
    snprintf(r->op, sizeof r->op, "%s", op->s);
    r->args = args;
    return 0;
fail:
    json_free(&r->root);
    return -1;
}

void proto_request_free(request *r) { json_free(&r->root); }

static void finish_line(sbuf *out, size_t start, long long id) {
    if (out->oom || out->len - start + 1 > MAX_LINE) {
        size_t len = out->len - start;
        out->len = start;
        out->oom = 0;
        if (out->p) out->p[start] = 0;
        sb_printf(out,
                  "{\"error\":{\"code\":0,\"message\":\"message of %zu bytes exceeds %d\","
                  "\"name\":\"" NPUSNAP_ERR_LINE_TOO_LONG "\",\"type\":\"" NPUSNAP_ERRTYPE_INTERNAL
                  "\"},\"id\":%lld,\"ok\":false,\"v\":%d}",
                  len, MAX_LINE, id, PROTOCOL_VERSION);
    }
    sb_raw(out, "\n");
}

void proto_result_line(sbuf *out, long long id, const char *result_members) {
    size_t start = out->len;
    sb_printf(out, "{\"id\":%lld,\"ok\":true,\"result\":{%s},\"v\":%d}", id, result_members ? result_members : "",
              PROTOCOL_VERSION);
    finish_line(out, start, id);
}

void proto_error_line(sbuf *out, long long id, const op_error *e) {
    size_t start = out->len;
    sb_raw(out, "{\"error\":{");
    sb_printf(out, "\"code\":%lld,\"message\":", e->code);
    sb_str(out, e->message);
    sb_raw(out, ",\"name\":");
    sb_str(out, e->name);
    sb_raw(out, ",\"type\":");
    sb_str(out, e->type);
    if (e->extra.p) sb_raw(out, e->extra.p);
    sb_printf(out, "},\"id\":%lld,\"ok\":false,\"v\":%d}", id, PROTOCOL_VERSION);
    finish_line(out, start, id);
}
