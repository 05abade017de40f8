/* npusim_plugin.so: the CRIU plugin for the simulated NPU's device handle, what Huawei's
 * npu_plugin.so is for /dev/davinci* (record the device handle at dump, reopen it at restore).
 *
 * The simulated runtime (native/npusim/runtime.c) keeps a connected unix stream socket to the
 * npusim daemon (npusnap_sim/daemon.py) for as long as it has a device open, across Lock and
 * Backup, as the real runtime keeps /dev/davinci_manager open. Stock CRIU cannot dump that socket
 * ("External socket is used"; with --ext-unix-sk "Ext stream not supported"), so a simulated NPU
 * process cannot be dumped without this plugin, exactly as a real one cannot without Huawei's.
 *
 * Dump:    DUMP_UNIX_SK(fd, id)  the socket's peer is an npusim daemon (a path-bound stream socket
 *                                whose owner, by SO_PEERCRED, runs npusnap_sim.daemon): write
 *                                npusim-dev-<id>.img (the daemon's socket path) into the images
 *                                directory, add the inventory entry once. Anything else: -ENOTSUP.
 *                                A socket with bytes in flight (a call frozen half-way) is refused.
 *          fini(DUMP, ret)       ret != 0 after this plugin took part: "[npusim-plugin fini-dump
 *                                err]" in CRIU's log, as Huawei's plugin marks a failed dump.
 * Restore: init(RESTORE)         only when the inventory says the image needs this plugin.
 *          RESTORE_UNIX_SK(id)   npusim-dev-<id>.img absent: -ENOTSUP. Else a NEW connection to the
 *                                recorded path, made by the restored task itself (in its mount and
 *                                pid namespaces), so the daemon sees the restored process as its
 *                                owner. The runtime's Restore then re-claims its devices over it.
 *                                A daemon that does not answer fails the restore loudly.
 *
 * npusnap's own plugin (npusnap_plugin.so) registers other hooks only; both answer -ENOTSUP for
 * what is not theirs, so CRIU's dispatcher reaches each. Log lines start with "npusim-plugin: ".
 */
#define _GNU_SOURCE
#include "criu_host.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define PLUGIN_NAME "npusim_plugin"
#define PREFIX "npusim-plugin: "
#define FINI_DUMP_ERR "[npusim-plugin fini-dump err]"
#define IMAGE_FORMAT "npusim-dev-%d.img"
#define DAEMON_MODULE "npusnap_sim.daemon"
#define LOG_ERR 1
#define LOG_INF 3

#define LOGI(...) print_on_level(LOG_INF, PREFIX __VA_ARGS__)
#define LOGE(...) print_on_level(LOG_ERR, PREFIX __VA_ARGS__)

static struct {
    int stage;
    int disabled;
    int inventory_added;
    int taken;  /* device sockets recorded by this dump */
    int failed; /* a hook of this dump failed */
} S;

/* The peer process of a connected unix socket runs the npusim daemon: its command line names the
 * daemon's module (`python -m npusnap_sim.daemon ...`, how `npusnap sim start` runs it). */
static int peer_is_daemon(int fd, pid_t *daemon_pid) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return 0;
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)cred.pid);
    int cf = open(path, O_RDONLY | O_CLOEXEC);
    if (cf < 0) return 0;
    ssize_t n = read(cf, buf, sizeof buf - 1);
    close(cf);
    if (n <= 0) return 0;
    buf[n] = '\0';
    for (ssize_t off = 0; off < n; off += (ssize_t)strlen(buf + off) + 1)
        if (!strcmp(buf + off, DAEMON_MODULE)) {
            *daemon_pid = cred.pid;
            return 1;
        }
    return 0;
}

static int dump_unix_sk(int fd, int id) {
    if (S.disabled || S.stage != CR_PLUGIN_STAGE__DUMP) return -ENOTSUP;
    int type = 0;
    socklen_t tlen = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) != 0 || type != SOCK_STREAM) return -ENOTSUP;
    struct sockaddr_un peer;
    socklen_t plen = sizeof peer;
    memset(&peer, 0, sizeof peer);
    if (getpeername(fd, (struct sockaddr *)&peer, &plen) != 0 || peer.sun_family != AF_UNIX) return -ENOTSUP;
    if (plen <= offsetof(struct sockaddr_un, sun_path) || peer.sun_path[0] == '\0') return -ENOTSUP; /* unnamed/abstract */
    size_t pathlen = plen - offsetof(struct sockaddr_un, sun_path);
    if (pathlen >= sizeof peer.sun_path) pathlen = sizeof peer.sun_path - 1;
    peer.sun_path[pathlen] = '\0';
    pid_t dpid = 0;
    if (!peer_is_daemon(fd, &dpid)) return -ENOTSUP;

    /* A call frozen half-way leaves a request the daemon has not read, or a reply the runtime has
     * not: a new connection at restore cannot carry either. Lock+Backup never leave one. */
    int inq = 0, outq = 0;
    if (ioctl(fd, SIOCINQ, &inq) != 0 || ioctl(fd, SIOCOUTQ, &outq) != 0 || inq || outq) {
        S.failed = 1;
        LOGE("socket %d to the npusim daemon (%s) has %d byte(s) unread and %d unsent: a device call "
             "was frozen half-way; lock and back up the runtime first (npusnap dump does) " FINI_DUMP_ERR "\n",
             id, peer.sun_path, inq, outq);
        return -EBUSY;
    }

    int dir = criu_get_image_dir();
    char name[64];
    snprintf(name, sizeof name, IMAGE_FORMAT, id);
    int img = openat(dir, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FILE *f = img >= 0 ? fdopen(img, "w") : NULL;
    if (!f) {
        if (img >= 0) close(img);
        S.failed = 1;
        LOGE("cannot write %s: %s " FINI_DUMP_ERR "\n", name, strerror(errno));
        return -EIO;
    }
    fprintf(f, "{\"kind\": \"npusim-device-handle\", \"format\": 1, \"id\": %d, \"socket\": \"", id);
    for (const char *p = peer.sun_path; *p; p++) {
        if (*p == '"' || *p == '\\') fputc('\\', f);
        if ((unsigned char)*p < 0x20) fprintf(f, "\\u%04x", (unsigned char)*p);
        else fputc(*p, f);
    }
    fprintf(f, "\", \"daemon_pid\": %d}\n", (int)dpid);
    if (fclose(f) != 0) {
        S.failed = 1;
        LOGE("cannot write %s: %s " FINI_DUMP_ERR "\n", name, strerror(errno));
        return -EIO;
    }
    if (!S.inventory_added) {
        if (add_inventory_plugin(PLUGIN_NAME)) {
            S.failed = 1;
            LOGE("cannot add the inventory entry " FINI_DUMP_ERR "\n");
            return -EIO;
        }
        S.inventory_added = 1;
    }
    S.taken++;
    LOGI("socket %d: device connection to the npusim daemon (pid %d, %s) recorded in %s\n", id, (int)dpid,
         peer.sun_path, name);
    return 0;
}

/* The socket path recorded in npusim-dev-<id>.img: 1 found, 0 no such image, -1 unreadable. */
static int read_image(int id, char *sock, size_t len) {
    char name[64], buf[1024];
    snprintf(name, sizeof name, IMAGE_FORMAT, id);
    int fd = openat(criu_get_image_dir(), name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    const char *key = strstr(buf, "\"socket\": \"");
    if (!key) return -1;
    const char *p = key + strlen("\"socket\": \"");
    size_t o = 0;
    for (; *p && *p != '"' && o + 1 < len; p++) {
        if (*p == '\\' && p[1]) p++; /* the dump escapes only '"' and '\\' in practice */
        sock[o++] = *p;
    }
    sock[o] = '\0';
    return *p == '"' && o > 0 ? 1 : -1;
}

static int restore_unix_sk(int id) {
    if (S.disabled || S.stage != CR_PLUGIN_STAGE__RESTORE) return -ENOTSUP;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    int found = read_image(id, path, sizeof path);
    if (found == 0) return -ENOTSUP; /* not a socket this plugin dumped */
    if (found < 0) {
        LOGE("FAILED: npusim-dev-%d.img is unreadable or damaged\n", id);
        return -EIO;
    }
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        int e = errno;
        LOGE("FAILED: socket(): %s\n", strerror(e));
        return -e;
    }
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        close(fd);
        LOGE("FAILED: socket %d: cannot reconnect to the npusim daemon at %s (as pid %d): %s; start it "
             "(npusnap sim start) with the same socket path, visible to the restored process\n",
             id, path, (int)getpid(), strerror(e));
        return -e;
    }
    LOGI("socket %d: reconnected to the npusim daemon at %s (pid %d)\n", id, path, (int)getpid());
    return fd;
}

static int plugin_init(int stage) {
    memset(&S, 0, sizeof S);
    S.stage = stage;
    if (stage == CR_PLUGIN_STAGE__RESTORE && !check_and_remove_inventory_plugin(PLUGIN_NAME, strlen(PLUGIN_NAME)))
        S.disabled = 1; /* not an image this plugin took part in */
    if (stage == CR_PLUGIN_STAGE__PRE_DUMP) S.disabled = 1;
    return 0;
}

static void plugin_fini(int stage, int ret) {
    if (S.disabled || stage != CR_PLUGIN_STAGE__DUMP) return;
    if (ret != 0 && (S.taken || S.failed))
        LOGE("the dump failed (%d) after %d device connection(s) were recorded " FINI_DUMP_ERR "\n", ret, S.taken);
    else if (S.taken)
        LOGI("%d device connection(s) recorded\n", S.taken);
}

CR_PLUGIN_REGISTER(PLUGIN_NAME, plugin_init, plugin_fini)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__DUMP_UNIX_SK, dump_unix_sk)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESTORE_UNIX_SK, restore_unix_sk)
