/* Monotonic time in seconds, sleeps and absolute deadlines: the one copy that the agent, the CRIU
 * plugin and the simulator include. CLOCK_MONOTONIC throughout, so that setting the wall clock
 * (NTP, an operator) neither fires nor stretches a deadline. Header only (static inline): each
 * library stays self-contained and exports none of it. */
#ifndef NPUSNAP_TIMEUTIL_H
#define NPUSNAP_TIMEUTIL_H

#include <errno.h>
#include <pthread.h>
#include <time.h>

/* CLOCK_MONOTONIC, in seconds. */
static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sleep `s` seconds (not at all when s <= 0); a signal does not cut the sleep short. */
static inline void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* CLOCK_MONOTONIC `s` seconds from now, as the absolute time that pthread_cond_timedwait takes on a
 * condition variable created with pthread_condattr_setclock(CLOCK_MONOTONIC). */
static inline struct timespec deadline_in(double s) {
    double t = now_s() + s;
    struct timespec ts = {(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
    return ts;
}

/* Initialise `c` so that its timed waits take deadline_in()'s CLOCK_MONOTONIC deadlines. */
static inline void monotonic_cond_init(pthread_cond_t *c) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(c, &ca);
    pthread_condattr_destroy(&ca);
}

#endif
