/* npusnap-plugin.json in the images directory: the locked tasks, their tokens and the sha256 of
 * every image file, written at the end of a dump and read back by the restore. */
#define _GNU_SOURCE
#include "plugin.h"

/* SHA-256: nettle's when CRIU has it loaded (CRIU links gnutls, which brings nettle and its
 * SHA-NI/assembly code, several times faster), else the plugin's own (sha256.c). The images are
 * hashed while the tasks are still frozen, so speed matters for --leave-running. */
typedef struct {
    void (*init)(void *);
    void (*update)(void *, size_t, const uint8_t *);
    void (*digest)(void *, size_t, uint8_t *);
} nettle_sha;

static const char *hasher_name(nettle_sha *n) {
    n->init = (void (*)(void *))dlsym(RTLD_DEFAULT, "nettle_sha256_init");
    n->update = (void (*)(void *, size_t, const uint8_t *))dlsym(RTLD_DEFAULT, "nettle_sha256_update");
    n->digest = (void (*)(void *, size_t, uint8_t *))dlsym(RTLD_DEFAULT, "nettle_sha256_digest");
    if (n->init && n->update && n->digest) return "nettle";
    memset(n, 0, sizeof *n);
    return "built-in";
}

/* sha256 of every regular file of the images directory, as a JSON array (files[]). */
static int hash_images(int dirfd, sbuf *out) {
    int dfd = dup(dirfd);
    if (dfd < 0) return -1;
    lseek(dfd, 0, SEEK_SET);
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return -1;
    }
    rewinddir(d);
    static char buf[1 << 20];
    int first = 1, rc = 0;
    nettle_sha nt;
    const char *impl = hasher_name(&nt);
    double t0 = now_s();
    long long total = 0;
    sb_raw(out, "[");
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        /* CRIU's logs and stats change after this point (restore writes its own) */
        if (de->d_name[0] == '.' || !strncmp(de->d_name, STATE_FILE, strlen(STATE_FILE)) ||
            (nl > 4 && !strcmp(de->d_name + nl - 4, ".log")) || !strncmp(de->d_name, "stats-", 6))
            continue;
        int fd = openat(dirfd, de->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        struct stat st;
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
            close(fd);
            continue;
        }
        sha256_ctx h;
        _Alignas(16) unsigned char nctx[512]; /* struct sha256_ctx of nettle: 112 bytes */
        if (nt.init) nt.init(nctx);
        else sha256_init(&h);
        ssize_t n;
        long long size = 0;
        while ((n = read(fd, buf, sizeof buf)) > 0) {
            if (nt.init) nt.update(nctx, (size_t)n, (const uint8_t *)buf);
            else sha256_update(&h, buf, (size_t)n);
            size += n;
        }
        close(fd);
        if (n < 0) {
            rc = -1;
            continue;
        }
        total += size;
        char hex[65];
        if (nt.init) {
            uint8_t d[32];
            nt.digest(nctx, 32, d);
            for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
        } else {
            sha256_hex(&h, hex);
        }
        sb_raw(out, first ? "{" : ",{");
        first = 0;
        sb_key(out, "path");
        sb_str(out, de->d_name);
        sb_key(out, "size");
        sb_printf(out, "%lld", size);
        sb_key(out, "sha256");
        sb_str(out, hex);
        sb_raw(out, "}");
    }
    sb_raw(out, "]");
    closedir(d);
    LOGI("sha256 (%s) of %lld bytes of images in %.3fs\n", impl, total, now_s() - t0);
    return rc;
}

void iso_now(char *buf, size_t len) {
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

int write_state_file(void) {
    int dirfd = criu_get_image_dir();
    sbuf s;
    sb_init(&s);
    char when[32], host[256] = "";
    iso_now(when, sizeof when);
    gethostname(host, sizeof host - 1);
    sb_raw(&s, "{");
    sb_key(&s, "format");
    sb_printf(&s, "%d", STATE_FORMAT);
    sb_key(&s, "kind");
    sb_str(&s, NPUSNAP_PLUGIN_STATE_KIND);
    sb_key(&s, "plugin");
    sb_str(&s, PLUGIN_NAME);
    sb_key(&s, "created");
    sb_str(&s, when);
    sb_key(&s, "hostname");
    sb_str(&s, host);
    sb_key(&s, "criu_pid");
    sb_printf(&s, "%d", (int)getpid());
    sb_key(&s, "lease_s");
    sb_num(&s, P.lease_s);
    if (J.member >= 0) {
        sb_key(&s, "job");
        sb_raw(&s, "{");
        sb_key(&s, "member");
        sb_printf(&s, "%d", J.member);
        sb_key(&s, "coordinator");
        sb_str(&s, J.addr);
        sb_raw(&s, "}");
    }
    sb_key(&s, "processes");
    sb_raw(&s, "[");
    for (int i = 0; i < P.ntasks; i++) {
        task *t = &P.tasks[i];
        sb_raw(&s, i ? ",{" : "{");
        sb_key(&s, "pid");
        sb_printf(&s, "%d", t->pid);
        sb_key(&s, "ns_pid");
        sb_printf(&s, "%d", t->nspid);
        sb_key(&s, "agent_socket");
        sb_str(&s, t->sock);
        sb_key(&s, "lock_token");
        sb_str(&s, t->token);
        sb_raw(&s, "}");
    }
    sb_raw(&s, "]");
    sb_key(&s, "files");
    int hrc = hash_images(dirfd, &s);
    sb_raw(&s, "}\n");
    if (s.oom || hrc < 0) {
        sb_free(&s);
        FAIL(EX_IMAGE, "cannot checksum the image files");
        return -1;
    }
    int fd = openat(dirfd, STATE_FILE ".tmp", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    int ok = fd >= 0 && write(fd, s.p, s.len) == (ssize_t)s.len && fsync(fd) == 0;
    if (fd >= 0) close(fd);
    ok = ok && renameat(dirfd, STATE_FILE ".tmp", dirfd, STATE_FILE) == 0;
    sb_free(&s);
    if (!ok) {
        FAIL(EX_IMAGE, "cannot write %s in the images directory: %s", STATE_FILE, strerror(errno));
        return -1;
    }
    LOGI("wrote %s (%d NPU processes, tokens and image checksums)\n", STATE_FILE, P.ntasks);
    return 0;
}

/* ---- restore: the state file read back ---------------------------------------------------- */
int load_state_file(void) {
    int dirfd = criu_get_image_dir();
    int fd = openat(dirfd, STATE_FILE, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        FAIL(EX_IMAGE, "the image needs %s but has no %s: %s (was it copied without it?)", PLUGIN_NAME, STATE_FILE,
             strerror(errno));
        return -1;
    }
    sbuf s;
    sb_init(&s);
    char buf[8192];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) sb_rawn(&s, buf, (size_t)n);
    close(fd);
    jval v;
    char err[128];
    if (s.oom || json_parse(s.p ? s.p : "", s.len, &v, err, sizeof err) < 0 || v.t != J_OBJ) {
        FAIL(EX_IMAGE, "%s is not valid JSON: %s", STATE_FILE, err);
        sb_free(&s);
        return -1;
    }
    sb_free(&s);
    const jval *fmt = json_get(&v, "format");
    const jval *procs = json_get(&v, "processes");
    const jval *lease = json_get(&v, "lease_s");
    if (!fmt || fmt->t != J_NUM || (int)fmt->num != STATE_FORMAT || !procs || procs->t != J_ARR) {
        FAIL(EX_IMAGE, "%s has an unknown format (this plugin reads format %d)", STATE_FILE, STATE_FORMAT);
        json_free(&v);
        return -1;
    }
    if (lease && lease->t == J_NUM) P.lease_s = lease->num;
    /* A job member's checkpoint: its restore joins the same coordinator (the "restored" barrier). */
    const jval *job = json_get(&v, "job");
    const jval *member = job && job->t == J_OBJ ? json_get(job, "member") : NULL;
    const jval *coord = job && job->t == J_OBJ ? json_get(job, "coordinator") : NULL;
    if (member && member->t == J_NUM && coord && coord->t == J_STR) {
        J.member = (int)member->num;
        snprintf(J.addr, sizeof J.addr, "%s", coord->s);
    }
    P.ntasks = 0;
    for (size_t i = 0; i < procs->n && P.ntasks < MAX_TASKS; i++) {
        const jval *p = &procs->items[i];
        const jval *pid = json_get(p, "pid"), *nspid = json_get(p, "ns_pid"), *sock = json_get(p, "agent_socket"),
                   *tok = json_get(p, "lock_token");
        if (!pid || pid->t != J_NUM || !nspid || nspid->t != J_NUM || !sock || sock->t != J_STR || !tok ||
            tok->t != J_STR) {
            FAIL(EX_IMAGE, "%s: processes[%zu] lacks pid/ns_pid/agent_socket/lock_token", STATE_FILE, i);
            json_free(&v);
            return -1;
        }
        task *t = &P.tasks[P.ntasks++];
        memset(t, 0, sizeof *t);
        t->pid = (int)pid->num;
        t->nspid = (int)nspid->num;
        snprintf(t->sock, sizeof t->sock, "%s", sock->s);
        snprintf(t->token, sizeof t->token, "%s", tok->s);
    }
    json_free(&v);
    LOGI("%s: %d NPU process(es) to restore\n", STATE_FILE, P.ntasks);
    return 0;
}
