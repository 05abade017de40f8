/* The agent's device record, read from a stopped process (see npusnap_cli/host/agentrecord.py,
 * which reads it the same way, and native/agent/devmem.c, which writes it).
 *
 * A stopped process runs no agent code, so the plugin cannot ask it to lock; resuming it would be
 * seen by its parent. Its agent keeps an exported variable (the contract's agent_record) counting
 * the device-opening calls the process made since it began or was forked; a record naming
 * another pid is its parent's, held by a copy that made no such call since. The plugin finds the
 * variable as a debugger would -- the library's load address in /proc/PID/maps plus the symbol's
 * value in the library's own dynamic symbol table -- and reads it through /proc/PID/mem. With
 * /proc showing no device mapping and no device file, "never opened a device" means the process
 * holds no device state: CRIU dumps it as any other process. */
#include "agentrecord.h"

#include <dirent.h>
#include <elf.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "npusnap/contract.h"

#define STR_(x) #x
#define STR(x) STR_(x)

static const char *const MAPPING_PREFIXES[] = {NPUSNAP_DEVICE_MAPPING_PREFIXES};
static const char *const FILE_PREFIXES[] = {NPUSNAP_DEVICE_FILE_PREFIXES};

static int has_prefix(const char *s, const char *const *prefixes, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strncmp(s, prefixes[i], strlen(prefixes[i]))) return 1;
    return 0;
}

/* The agent library's mapping at file offset 0 (start, end, path); 0 if there is none. A device
 * mapping seen on the way sets *device. */
static int scan_maps(int pid, unsigned long *start, unsigned long *end, char *path, size_t len, int *device) {
    char file[64], line[4096];
    snprintf(file, sizeof file, "/proc/%d/maps", pid);
    FILE *f = fopen(file, "re");
    if (!f) return -1;
    int found = 0;
    const char *lib = "/" NPUSNAP_AGENT_LIBRARY;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi, off;
        int name_at = 0;
        if (sscanf(line, "%lx-%lx %*s %lx %*s %*s %n", &lo, &hi, &off, &name_at) < 3 || !name_at) continue;
        char *name = line + name_at;
        name[strcspn(name, "\n")] = 0;
        if (has_prefix(name, MAPPING_PREFIXES, sizeof MAPPING_PREFIXES / sizeof *MAPPING_PREFIXES)) *device = 1;
        size_t l = strlen(name), ll = strlen(lib);
        if (!found && off == 0 && l > ll && !strcmp(name + l - ll, lib)) {
            *start = lo;
            *end = hi;
            snprintf(path, len, "%s", name);
            found = 1;
        }
    }
    fclose(f);
    return found;
}

static int device_file_open(int pid) {
    char dir[64], target[4096];
    snprintf(dir, sizeof dir, "/proc/%d/fd", pid);
    DIR *d = opendir(dir);
    if (!d) return -1;
    int hit = 0;
    struct dirent *e;
    while (!hit && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        ssize_t n = readlinkat(dirfd(d), e->d_name, target, sizeof target - 1);
        if (n < 0) continue;
        target[n] = 0;
        hit = has_prefix(target, FILE_PREFIXES, sizeof FILE_PREFIXES / sizeof *FILE_PREFIXES);
    }
    closedir(d);
    return hit;
}

/* The record's offset from the mapping's start: its symbol's value less the first PT_LOAD's
 * page-aligned address; -1 when the file is not a 64-bit ELF with the symbol. */
static long record_offset(const char *file) {
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size < sizeof(Elf64_Ehdr)) {
        close(fd);
        return -1;
    }
    size_t size = (size_t)st.st_size;
    const unsigned char *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return -1;
    long result = -1;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)m;
    if (memcmp(eh->e_ident, ELFMAG, SELFMAG) || eh->e_ident[EI_CLASS] != ELFCLASS64) goto out;
    if (eh->e_shoff + (uint64_t)eh->e_shnum * sizeof(Elf64_Shdr) > size) goto out;
    if (eh->e_phoff + (uint64_t)eh->e_phnum * sizeof(Elf64_Phdr) > size) goto out;
    const Elf64_Phdr *ph = (const Elf64_Phdr *)(m + eh->e_phoff);
    uint64_t first_load = UINT64_MAX;
    for (int i = 0; i < eh->e_phnum; i++)
        if (ph[i].p_type == PT_LOAD && ph[i].p_vaddr < first_load) first_load = ph[i].p_vaddr;
    if (first_load == UINT64_MAX) goto out;
    const Elf64_Shdr *sh = (const Elf64_Shdr *)(m + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_DYNSYM || sh[i].sh_link >= eh->e_shnum) continue;
        const Elf64_Shdr *strs = &sh[sh[i].sh_link];
        if (sh[i].sh_offset + sh[i].sh_size > size || strs->sh_offset + strs->sh_size > size) goto out;
        const Elf64_Sym *sym = (const Elf64_Sym *)(m + sh[i].sh_offset);
        size_t n = sh[i].sh_size / sizeof(Elf64_Sym);
        const char *names = (const char *)(m + strs->sh_offset);
        for (size_t k = 0; k < n; k++) {
            if (sym[k].st_name >= strs->sh_size || sym[k].st_shndx == SHN_UNDEF) continue;
            const char *name = names + sym[k].st_name;
            if (strnlen(name, strs->sh_size - sym[k].st_name) == strs->sh_size - sym[k].st_name) continue;
            if (strcmp(name, STR(NPUSNAP_AGENT_RECORD_SYMBOL)) || sym[k].st_size < sizeof(struct npusnap_agent_record))
                continue;
            long page = sysconf(_SC_PAGESIZE);
            result = (long)(sym[k].st_value - (first_load & ~(uint64_t)(page - 1)));
            goto out;
        }
    }
out:
    munmap((void *)m, size);
    return result;
}

int npusnap_never_opened_a_device(int pid, int nspid) {
    unsigned long start = 0, end = 0;
    char path[4096], file[4200];
    int device = 0;
    if (scan_maps(pid, &start, &end, path, sizeof path, &device) != 1 || device) return 0;
    if (device_file_open(pid) != 0) return 0;
    snprintf(file, sizeof file, "/proc/%d/map_files/%lx-%lx", pid, start, end);
    long off = record_offset(file);
    if (off < 0) {
        snprintf(file, sizeof file, "/proc/%d/root%s", pid, path);
        off = record_offset(file);
    }
    if (off < 0) return 0;
    char mem[64];
    snprintf(mem, sizeof mem, "/proc/%d/mem", pid);
    int fd = open(mem, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    struct npusnap_agent_record rec;
    ssize_t n = pread(fd, &rec, sizeof rec, (off_t)(start + (unsigned long)off));
    close(fd);
    if (n != (ssize_t)sizeof rec || strncmp(rec.magic, NPUSNAP_AGENT_RECORD_MAGIC, sizeof rec.magic)) return 0;
    if (!rec.tracking) return 0; /* not preloaded: its wrappers saw nothing of the process's calls */
    /* another pid's record: a copy that made no device-opening call since it was made */
    return rec.pid != nspid || rec.opened == 0;
}
