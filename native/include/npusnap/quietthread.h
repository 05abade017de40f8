/* pthread_create for threads that must take none of the application's signals: the agent's own
 * threads and the simulated runtime's. Header only (static inline), like timeutil.h: each library
 * stays self-contained and exports none of it.
 *
 * Why: a signal sent to a process (kill(pid), a terminal's SIGINT, a timer's SIGALRM) goes to any
 * one of its threads that does not block it. A thread inherits the mask of the thread that
 * creates it, so a helper thread made before the application blocks a signal in its main thread
 * (to read it from a signalfd, or sigwait for it) would take that signal, run the application's
 * handler on a thread it does not know, or die of its default action. A thread that is never
 * meant to run application code blocks everything from its first instruction: the mask is set
 * around pthread_create, so there is no window in which the new thread could take one.
 * (Synchronous signals -- SIGSEGV, SIGBUS, SIGFPE from a fault on the thread itself -- are still
 * delivered: the kernel forces them whatever the mask.) */
#ifndef NPUSNAP_QUIETTHREAD_H
#define NPUSNAP_QUIETTHREAD_H

#include <pthread.h>
#include <signal.h>

static inline int npusnap_quiet_thread_create(pthread_t *thread, const pthread_attr_t *attr,
                                              void *(*start)(void *), void *arg) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(thread, attr, start, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

#endif
