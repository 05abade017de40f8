/* The public C interface of the npusnap agent (libnpusnap_agent.so), for programs that start
 * their own agent instead of running under `npusnap run` (which preloads the library and starts
 * it from the library constructor with NPUSNAP_AGENT=1). See docs/agent.md.
 */
#ifndef NPUSNAP_AGENT_H
#define NPUSNAP_AGENT_H

#ifdef __cplusplus
extern "C" {
#endif

/* Start the agent thread and its control socket (idempotent per process). Returns the socket
 * path, or NULL with the reason in npusnap_agent_last_error(). Never aborts the process. */
const char *npusnap_agent_start(void);
const char *npusnap_agent_last_error(void);
int npusnap_agent_running(void);
const char *npusnap_agent_socket_path(void);
/* Stop serving and remove the socket; the snapshot state is left as it is. */
void npusnap_agent_stop(void);

/* Where the agent writes its messages (never the program's stderr, unless NPUSNAP_AGENT_STDERR=1
 * asks for that too): NPUSNAP_AGENT_LOG, else <runtime dir>/<pid>.log; NULL if neither is known. */
const char *npusnap_agent_log_file(void);

#ifdef __cplusplus
}
#endif
#endif
