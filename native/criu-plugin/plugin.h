/* The CRIU plugin's shared internals: names and codes, the log macros, the task table, and what
 * each file offers the others (npusnap_plugin.c: the hooks, and the overview at its top). */
#ifndef NPUSNAP_PLUGIN_H
#define NPUSNAP_PLUGIN_H

#include "agent_int.h"
#include "npusnap/timeutil.h"
#include "agentrecord.h"
#include "sha256.h"

#include "criu_host.h"
#include <dirent.h>
#include <dlfcn.h>
#include <linux/openat2.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Names, formats, exit codes and protocol constants: npusnap/contract.h (native/contract/npusnap.toml,
 * the same spec npusnap_cli/contract.py is generated from). */
#define PLUGIN_NAME NPUSNAP_PLUGIN_NAME
#define PREFIX "npusnap-plugin: "
#define STATE_FILE NPUSNAP_PLUGIN_STATE_FILE
#define STATE_FORMAT NPUSNAP_PLUGIN_STATE_FORMAT
#define LOG_ERR 1
#define LOG_WRN 2
#define LOG_INF 3

/* npusnap's exit codes (the contract's, docs/exit-codes.md): a failure is logged with the code
 * `npusnap dump/restore` would have exited with. */
#define EX_TARGET NPUSNAP_EXIT_TARGET
#define EX_AGENT NPUSNAP_EXIT_AGENT
#define EX_DEVICE NPUSNAP_EXIT_DEVICE
#define EX_IMAGE NPUSNAP_EXIT_IMAGE
#define EX_STATE_UNKNOWN NPUSNAP_EXIT_STATE_UNKNOWN

#define LOGI(...) print_on_level(LOG_INF, PREFIX __VA_ARGS__)
#define LOGW(...) print_on_level(LOG_WRN, PREFIX __VA_ARGS__)
#define FAIL(code, fmt, ...) \
    print_on_level(LOG_ERR, PREFIX "FAILED, npusnap %s: " fmt "\n", exit_meaning(code), ##__VA_ARGS__)

#define MAX_TASKS 1024
#define TOKEN_LEN NPUSNAP_PROTOCOL_TOKEN_HEX_CHARS

typedef struct task {
    int pid;   /* host pid (CRIU's view) */
    int nspid; /* pid in its own namespace: the agent's socket is named after it */
    char sock[256]; /* the socket path inside the task's mount namespace */
    char token[TOKEN_LEN + 1];
    int restored; /* restore: RESUME_DEVICES_LATE saw it */
    int newpid;   /* restore: host pid of the restored task */
    int pidfd;    /* dump's rollback helper: this very task, not a later one with its pid */
} task;

struct plugin_state {
    int stage;
    int disabled;
    int inventory_added;
    int ntasks;
    task tasks[MAX_TASKS];
    /* Processes left to CRIU at PAUSE_DEVICES because they never opened a device, though
     * their agent could not be asked; CHECKPOINT_DEVICES checks again once they are frozen. */
    int nidle;
    int idle[MAX_TASKS][2]; /* pid, ns pid */
    double lease_s;
    int require_agent;
    char device_memory[16]; /* "" (the agent's default) or one of the contract's device-memory modes */
    char log_path[256];
    int criu_pid;
    double job_barrier_s; /* how long a job barrier may wait for the other members */
};
extern struct plugin_state P;

/* The job coordinator of this dump (see the top of the file); fd -1 until joined. */
struct job_state {
    int checked;   /* the root's environment was read */
    int member;    /* NPUSNAP_JOB_MEMBER; -1: not a job member */
    char addr[256];
    int fd;
    int locked;    /* passed the "locked" barrier */
    int aborted;   /* an abort was sent or received: no later barrier */
    char buf[4096];
    size_t len;
};
extern struct job_state J;

/* ---- one connection to an agent (plugin_agent.c) ---------------------------------------- */
typedef struct conn {
    int fd;
    int pid;
    long long next_id;
    char buf[MAX_LINE + 2];
    size_t len;
} conn;

/* A decoded answer (client.c): ok, body (result or error), and the error's type, name and message. */
typedef proto_reply reply;

static inline void reply_free(reply *r) { proto_reply_free(r); }

int agent_connect(conn *c, int pid, const char *sock, char *err, size_t errlen);
int agent_request(conn *c, const char *op, const char *args, double timeout_s, reply *r, char *err,
                  size_t errlen);
void token_args(sbuf *b, const char *token, double lease_s);
void agent_close(conn *c);
int error_exit_code(const reply *r);
int find_and_connect(int pid, int nspid, char *sock, size_t socklen, conn *c, char *err, size_t errlen);

/* ---- the job coordinator (plugin_job.c) */
void job_read_env(int pid);
int job_connect(char *err, size_t errlen);
int job_sync(const char *phase, char *err, size_t errlen);
void job_abort(const char *reason);

/* ---- the detached rollback helper (plugin_rollback.c) */
void spawn_rollback_helper(void);

/* ---- the state file in the images directory (plugin_state.c) */
void iso_now(char *buf, size_t len);
int write_state_file(void);
int load_state_file(void);

/* ---- configuration, exit codes, /proc and the agents' sockets (plugin_util.c) */
const char *exit_meaning(int code);
const char *config_path(void);
void load_config(void);
int ns_pid(int pid);
int status_field(int pid, const char *field);
char proc_state(int pid);
int maps_cann(int pid, char *lib, size_t liblen);
int agent_sockets(int pid, int nspid, char out[][256], int max);

#endif
