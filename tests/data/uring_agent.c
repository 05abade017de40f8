/* A stand-in for a launcher that holds an io_uring (torchrun's elastic agent with PyTorch's
 * libuv TCPStore): it opens a ring with the io_uring_setup system call, keeps a thread named
 * "store-loop" waiting in io_uring_enter on it, runs argv[1..] as its child (the worker rank)
 * and exits with the child's status. Prints "ring FD" on stdout once the ring is open.
 * URING_THREAD_NAME names the thread otherwise (PyTorch's libuv store thread: pt_tcpstore_uv),
 * URING_COMM the process (torchrun's agent: pt_elastic). */
#define _GNU_SOURCE
#include <linux/io_uring.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int ring = -1;

static void *store_loop(void *arg) {
    (void)arg;
    for (;;) syscall(__NR_io_uring_enter, ring, 0, 1, IORING_ENTER_GETEVENTS, NULL, 0);
    return NULL;
}

int main(int argc, char **argv) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    ring = (int)syscall(__NR_io_uring_setup, 4, &p);
    if (ring < 0) {
        perror("io_uring_setup");
        return 2;
    }
    pthread_t t;
    if (pthread_create(&t, NULL, store_loop, NULL) != 0) return 2;
    const char *name = getenv("URING_THREAD_NAME");
    pthread_setname_np(t, name && *name ? name : "store-loop");
    const char *comm = getenv("URING_COMM");
    if (comm && *comm) prctl(PR_SET_NAME, comm, 0, 0, 0);
    printf("ring %d\n", ring);
    fflush(stdout);
    if (argc < 2) {
        for (;;) pause();
    }
    pid_t child = fork();
    if (child == 0) {
        close(ring);
        execvp(argv[1], argv + 1);
        _exit(127);
    }
    int status = 0;
    while (waitpid(child, &status, 0) < 0) {
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
