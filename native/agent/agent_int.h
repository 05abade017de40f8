/* Internal interface between the files of the native agent core (libnpusnap_agent.so).
 *
 * core.c   the library constructor, the agent thread, the control socket, fork handling,
 *          Python hooks with a deadline;
 * json.c   a small JSON reader and writer for the line protocol (no dependency);
 * proto.c  the line protocol: request validation and response encoding, the same rules as
 *          npusnap_cli/device/protocol.py (transcripts in tests/data/protocol/ check both);
 * client.c the client side of that protocol (request lines, response decoding) for the CRIU
 *          plugin, which compiles it with proto.c and json.c;
 * acl.c    the snapshot calls into the CANN runtime this process already loaded;
 * ops.c    the state logic: lock/backup/restore/unlock/rollback, lock ownership, the lease (with
 *          ops_report.c, ops_steps.c and ops_base.c: ops_int.h).
 *
 * Nothing here takes the Python GIL or runs Python, except the hook helper threads of core.c,
 * which the agent thread only ever waits for with a deadline.
 */
#ifndef NPUSNAP_AGENT_INT_H
#define NPUSNAP_AGENT_INT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define NPUSNAP_CONTRACT_CANN_NAMES /* ACL_ERROR_... by CANN's names: no CANN header is included */
#include "npusnap/contract.h" /* generated from native/contract/npusnap.toml */
#include "npusnap/timeutil.h" /* now_s, sleep_s, deadline_in */

#define AGENT_API __attribute__((visibility("default")))
#define MAX_LINE NPUSNAP_PROTOCOL_MAX_LINE
#define PROTOCOL_VERSION NPUSNAP_PROTOCOL_VERSION

/* ---- json.c ------------------------------------------------------------------------------ */
typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
    jtype t;
    int b;               /* J_BOOL */
    double num;          /* J_NUM */
    int is_int;          /* J_NUM written without fraction/exponent and fits in long long */
    long long i;         /* J_NUM when is_int */
    char *s;             /* J_STR (NUL-terminated; may contain NULs, see slen) */
    size_t slen;
    size_t n;            /* J_ARR / J_OBJ: number of items */
    struct jval *items;  /* J_ARR / J_OBJ values */
    char **keys;         /* J_OBJ keys */
} jval;

/* Parse a whole buffer; 0 on success, else -1 with a message in err. */
int json_parse(const char *buf, size_t len, jval *out, char *err, size_t errlen);
void json_free(jval *v);
const jval *json_get(const jval *obj, const char *key); /* last value of key, or NULL */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

void sb_init(sbuf *b);
void sb_free(sbuf *b);
void sb_raw(sbuf *b, const char *s);
void sb_rawn(sbuf *b, const char *s, size_t n);
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sb_str(sbuf *b, const char *s); /* a JSON string literal */
void sb_key(sbuf *b, const char *k); /* ,"k": (comma unless right after '{') */
void sb_num(sbuf *b, double v);      /* a JSON number like Python's repr (or null if not finite) */
void sb_json(sbuf *b, const jval *v); /* re-serialise a parsed value */

/* ---- proto.c ----------------------------------------------------------------------------- */
typedef struct request {
    long long id;
    char op[32];
    jval root; /* owns the args */
    const jval *args;
    int fd; /* a file descriptor sent with the line (SCM_RIGHTS), -1 if none; the core closes it
             * after the op: an op that keeps it dup()s it */
} request;

/* An error object being built: type, name, code, message, and extra members (raw JSON). */
typedef struct op_error {
    const char *type;
    char name[64];
    long long code;
    char message[1024];
    sbuf extra; /* ",\"k\":v..." members appended to the error object */
} op_error;

void err_init(op_error *e);
void err_set(op_error *e, const char *type, const char *name, long long code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void err_free(op_error *e);

/* 0: request decoded; -1: protocol error in e and *id_out the id to answer (0 if unknown). */
int proto_decode(const char *line, size_t len, request *r, op_error *e, long long *id_out);
void proto_request_free(request *r);
/* Whole response lines (with the newline). result_members: the members of the result object
 * without braces ("\"a\":1,\"b\":2"). */
void proto_result_line(sbuf *out, long long id, const char *result_members);
void proto_error_line(sbuf *out, long long id, const op_error *e);

/* ---- client.c (the CRIU plugin's side of the protocol) ------------------------------------ */
typedef struct proto_reply {
    int ok;
    long long id;
    jval v;            /* the whole response */
    const jval *body;  /* result or error object */
    char type[32];     /* error.type, error.name and error.message when !ok */
    char name[64];
    char message[512];
} proto_reply;

/* One request line (with the newline) appended to out: args_json is the args object's text ("{}"
 * or NULL for none). The line goes through proto_decode first: 0, or -1 with e filled as the agent
 * would have answered (nothing appended). */
int proto_request_line(sbuf *out, long long id, const char *op, const char *args_json, op_error *e);
/* Decode one response line (without its newline): 0, or -1 with the reason (error name first) in err. */
int proto_decode_response(const char *line, size_t len, proto_reply *r, char *err, size_t errlen);
void proto_reply_free(proto_reply *r);

/* ---- acl.c ------------------------------------------------------------------------------- */
enum {
    ST_RUNNING = NPUSNAP_STATE_RUNNING,
    ST_LOCKED = NPUSNAP_STATE_LOCKED,
    ST_BACKED_UP = NPUSNAP_STATE_BACKED_UP,
    ST_UNKNOWN = -1 /* this runtime cannot tell */
};

typedef struct acl_rt {
    void *lib;      /* handle on the already-loaded libacl_rt.so / libascendcl.so */
    void *runtime;  /* handle on the already-loaded libruntime.so (GetState), or NULL */
    char path[512];
    char version[128];
} acl_rt;

/* Find the runtime this process already loaded (never loads one). 0 found, -1 not loaded. */
int acl_find(acl_rt *rt);
/* Snapshot call by name ("Lock", "Backup", "Restore", "Unlock"); the ACL return code. */
int acl_call(acl_rt *rt, const char *what);
/* The same with an args struct whose flags are `flags` (Backup/Restore of the driver-backed flow:
 * 0 required device memory, 1 also optional), or NULL args (the legacy flow) when flags < 0. */
int acl_call_flags(acl_rt *rt, const char *what, int flags);
/* Whether this CANN is new enough to try the driver-backed flow (Backup then answers 207000
 * where the driver lacks the feature). The simulator's 9.2.0 stands in for those builds. */
#define DRIVER_FLOW_MIN_MAJOR NPUSNAP_DRIVER_FLOW_MIN_MAJOR
#define DRIVER_FLOW_MIN_MINOR NPUSNAP_DRIVER_FLOW_MIN_MINOR
#define DRIVER_FLOW_FLAGS NPUSNAP_DRIVER_FLOW_FLAGS /* required and optional device memory */
int acl_may_have_driver_flow(const acl_rt *rt);
/* aclrtSnapShotCallBack; registered with aclrtSnapShotCallbackRegister (CANN 9.0+). */
typedef uint32_t (*acl_callback)(int32_t device_id, void *args);
enum { STAGE_LOCK_PRE = NPUSNAP_STAGE_LOCK_PRE };
int acl_register_callback(acl_rt *rt, int stage, acl_callback cb);
/* The state, or ST_UNKNOWN when this runtime cannot tell; *code gets a GetState failure. */
int acl_state(acl_rt *rt, int *code);
const char *acl_error_name(int code);
const char *state_name(int st);

/* ---- ops.c ------------------------------------------------------------------------------- */
/* The agent's listening socket, as core.c has it: its path (NULL: none) and inode (a CRIU restore
 * makes a new socket, another inode; 0: none). */
typedef struct agent_endpoint {
    const char *socket;
    unsigned long long ino;
} agent_endpoint;
/* Handle one decoded request; append the response line to out. Called on the agent thread. */
void ops_handle(const request *r, int peer_pid, const agent_endpoint *ep, sbuf *out);
void ops_tick(const agent_endpoint *ep); /* lease and CRIU-restore detection; on the agent thread */
void ops_init(void);           /* once per process (and again in a forked child) */
void ops_event(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- log.c ------------------------------------------------------------------------------- */
void agent_log(const char *fmt, ...) __attribute__((format(printf, 1, 2))); /* into the log file */
void agent_log_setup(void);       /* names the log file (at start, and in a forked child) */
const char *agent_log_path(void); /* that file, or NULL */
/* fd moved to a high number (>= agent_fd_floor()), close-on-exec; the original is closed. -1 stays
 * -1; where nothing is free up there, fd itself (made close-on-exec). */
int agent_fd_high(int fd);
int agent_fd_floor(void);
/* The directory of the agent's socket and log (npusnap_cli/paths.py's rules). 0, or -1: too long. */
int agent_runtime_dir(char *out, size_t outlen);
int agent_socket_pid(void); /* the pid the socket is named after: ours as the host's /proc sees it */

/* ---- devmem.c ---------------------------------------------------------------------------- */
/* 1 when the agent was preloaded: the job's device calls pass its wrappers. */
int npusnap_devmem_preloaded(void);
/* fn runs after each device-opening call of the job that succeeded. */
void npusnap_devmem_on_device_open(void (*fn)(void));

/* ---- hooks.c ----------------------------------------------------------------------------- */
void hooks_init(void);       /* once, before the agent starts */
void hooks_after_fork(void); /* in a forked child */
/* Run the Python hooks of a stage with a deadline. 0: ran (names appended to ran_json, a JSON
 * array); -1: failed (e filled: HOOK_FAILED or HOOK_TIMEOUT). No hooks for the stage: 0, "[]". */
int hooks_run(const char *stage, sbuf *ran_json, op_error *e);
void hooks_names_json(sbuf *out); /* {"pre_lock": [...], ...} */
void python_info_json(sbuf *out); /* the Python face's info object, or null */

#endif
