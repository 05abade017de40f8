/* The client side of the agent's line protocol in C: request lines and response decoding.
 *
 * The CRIU plugin (native/criu-plugin/npusnap_plugin.c) speaks to agents through this file, which
 * it compiles together with proto.c and json.c -- the agent's own codec -- so that a request it
 * sends is one the agent's decoder accepts (proto_request_line runs it through proto_decode) and
 * the op names, argument kinds, error names and limits are the contract's (npusnap/contract.h).
 * It is in the agent library too (every .c of this directory), where nothing calls it yet.
 * The rules for a response are those of npusnap_cli/device/protocol.py's decode_response.
 */
#include "agent_int.h"

#include <stdio.h>
#include <string.h>

int proto_request_line(sbuf *out, long long id, const char *op, const char *args_json, op_error *e) {
    size_t start = out->len;
    sb_printf(out, "{\"v\":%d,\"id\":%lld,\"op\":", PROTOCOL_VERSION, id);
    sb_str(out, op);
    sb_raw(out, ",\"args\":");
    sb_raw(out, args_json && *args_json ? args_json : "{}");
    sb_raw(out, "}");
    if (out->oom) {
        err_set(e, NPUSNAP_ERRTYPE_INTERNAL, NPUSNAP_ERR_OUT_OF_MEMORY, 0, "out of memory building a %.32s request",
                op);
        return -1;
    }
    /* The agent's own decoder: an op or argument it would refuse is refused here, before sending. */
    request r;
    long long rid;
    if (proto_decode(out->p + start, out->len - start, &r, e, &rid) < 0) {
        out->len = start;
        if (out->p) out->p[start] = 0;
        return -1;
    }
    proto_request_free(&r);
    sb_raw(out, "\n");
    return 0;
}

static void copy_str(char *dst, size_t len, const jval *v) { snprintf(dst, len, "%s", v && v->t == J_STR ? v->s : ""); }

int proto_decode_response(const char *line, size_t len, proto_reply *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    char perr[128];
    if (len > MAX_LINE) {
        snprintf(err, errlen, "%s: line of %zu bytes exceeds %d", NPUSNAP_ERR_LINE_TOO_LONG, len, MAX_LINE);
        return -1;
    }
    if (json_parse(line, len, &r->v, perr, sizeof perr) < 0) {
        snprintf(err, errlen, "%s: not a JSON line: %s", NPUSNAP_ERR_BAD_JSON, perr);
        return -1;
    }
    const jval *root = &r->v;
    const char *why = NULL;
    const jval *ver = root->t == J_OBJ ? json_get(root, "v") : NULL;
    const jval *id = root->t == J_OBJ ? json_get(root, "id") : NULL;
    const jval *ok = root->t == J_OBJ ? json_get(root, "ok") : NULL;
    if (root->t != J_OBJ) {
        why = NPUSNAP_ERR_BAD_MESSAGE ": a message must be a JSON object";
    } else if (!ver || ver->t != J_NUM || ver->num != PROTOCOL_VERSION) {
        why = NPUSNAP_ERR_VERSION_MISMATCH ": another protocol version";
    } else if (!id || id->t != J_NUM || !id->is_int) {
        why = NPUSNAP_ERR_BAD_MESSAGE ": message id must be an integer";
    } else if (!ok || ok->t != J_BOOL) {
        why = NPUSNAP_ERR_BAD_MESSAGE ": response has no ok flag";
    } else {
        r->ok = ok->b;
        r->id = id->i;
        r->body = json_get(root, r->ok ? "result" : "error");
        if (!r->body || r->body->t != J_OBJ) {
            why = NPUSNAP_ERR_BAD_MESSAGE ": response has no result/error object";
        } else if (!r->ok) {
            const jval *type = json_get(r->body, "type"), *name = json_get(r->body, "name");
            const jval *message = json_get(r->body, "message");
            if (!type || type->t != J_STR || !name || name->t != J_STR || !message || message->t != J_STR) {
                why = NPUSNAP_ERR_BAD_MESSAGE ": error object lacks type, name or message";
            } else {
                copy_str(r->type, sizeof r->type, type);
                copy_str(r->name, sizeof r->name, name);
                copy_str(r->message, sizeof r->message, message);
            }
        }
    }
    if (why) {
        snprintf(err, errlen, "%s", why);
        proto_reply_free(r);
        return -1;
    }
    return 0;
}

void proto_reply_free(proto_reply *r) {
    json_free(&r->v);
    r->body = NULL;
}
