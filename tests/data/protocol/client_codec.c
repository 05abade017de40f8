/* A driver of the agent's C client codec (native/agent/client.c, with proto.c and json.c: what the
 * CRIU plugin speaks through), for tests/unit/test_client_codec.py. One command per stdin line,
 * one JSON answer per stdout line:
 *
 *   ["req", id, op, args]   -> {"line": "<request line>"} or {"refused": name, "message": text}
 *   ["resp", "<line>"]      -> {"ok": bool, "id": n, "type": t, "name": n, "message": m}
 *                              or {"malformed": reason}
 */
#include "agent_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
    static char in[MAX_LINE * 2 + 2];
    while (fgets(in, sizeof in, stdin)) {
        jval cmd;
        char perr[128];
        sbuf out;
        sb_init(&out);
        if (json_parse(in, strcspn(in, "\n"), &cmd, perr, sizeof perr) < 0 || cmd.t != J_ARR || cmd.n < 2 ||
            cmd.items[0].t != J_STR) {
            fprintf(stderr, "bad command: %s\n", in);
            return 2;
        }
        if (!strcmp(cmd.items[0].s, "req") && cmd.n == 4) {
            sbuf args, line;
            sb_init(&args);
            sb_init(&line);
            sb_json(&args, &cmd.items[3]);
            op_error e;
            err_init(&e);
            if (proto_request_line(&line, cmd.items[1].i, cmd.items[2].s, args.p, &e) == 0) {
                line.p[line.len - 1] = 0; /* the newline */
                sb_raw(&out, "{\"line\":");
                sb_str(&out, line.p);
            } else {
                sb_raw(&out, "{\"refused\":");
                sb_str(&out, e.name);
                sb_raw(&out, ",\"message\":");
                sb_str(&out, e.message);
            }
            sb_raw(&out, "}");
            err_free(&e);
            sb_free(&args);
            sb_free(&line);
        } else if (!strcmp(cmd.items[0].s, "resp") && cmd.items[1].t == J_STR) {
            proto_reply r;
            char err[256];
            if (proto_decode_response(cmd.items[1].s, cmd.items[1].slen, &r, err, sizeof err) == 0) {
                sb_printf(&out, "{\"ok\":%s,\"id\":%lld,\"type\":", r.ok ? "true" : "false", r.id);
                sb_str(&out, r.type);
                sb_raw(&out, ",\"name\":");
                sb_str(&out, r.name);
                sb_raw(&out, ",\"message\":");
                sb_str(&out, r.message);
                sb_raw(&out, "}");
                proto_reply_free(&r);
            } else {
                sb_raw(&out, "{\"malformed\":");
                sb_str(&out, err);
                sb_raw(&out, "}");
            }
        } else {
            fprintf(stderr, "bad command: %s\n", in);
            return 2;
        }
        printf("%s\n", out.p);
        fflush(stdout);
        sb_free(&out);
        json_free(&cmd);
    }
    return 0;
}
