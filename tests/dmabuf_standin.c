/*
 * A STAND-IN FOR A DMA-BUF-CAPABLE NIC, for tests only (LD_PRELOAD). Never ship or preload it
 * in production.
 *
 * Soft-RoCE (rxe) answers every ibv_reg_dmabuf_mr with EOPNOTSUPP, so ferroce's dma-buf path
 * cannot be exercised on it as is. Preloaded, this library makes rxe behave like a NIC that
 * registers dma-bufs:
 *   - the probe NCCL and ferroce make (fd -1) fails with EBADF, as on a capable driver;
 *   - ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access) maps [offset, offset + length)
 *     of the fd into this process and registers that CPU mapping with the real
 *     ibv_reg_mr_iova2 at `iova`, so the peer's RDMA writes to `iova` land in the fd's pages;
 *   - ibv_dereg_mr of such an MR deregisters it for real, then unmaps the mapping.
 * It keeps no fd: the mapping holds the memory, as a real NIC driver's dma-buf attachment
 * does. Every call is appended to the file named by FERROCE_STANDIN_LOG (one line each), so
 * the test can check exactly what ferroce passed.
 *
 * It also stands in for peer memory (nvidia-peermem): the test declares a "GPU allocation"
 * with ferroce_standin_gpu(dev, len, fd), where `dev` is an address range the CPU cannot touch
 * (a PROT_NONE reservation) and `fd` holds the pages. An ibv_reg_mr or ibv_reg_mr_iova2 of an
 * address inside such a range maps the matching pages of the fd here and registers that
 * mapping at the address asked for, as the peer-memory client resolves a GPU virtual address
 * for the NIC. Any other registration goes to the real verb unchanged.
 *
 * The real verbs are found in the already loaded libibverbs by version (RTLD_NEXT does not
 * see them when the plugin was opened RTLD_LOCAL).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct ibv_mr *(*reg_iova2_fn)(struct ibv_pd *, void *, size_t, uint64_t, unsigned);
typedef int (*dereg_fn)(struct ibv_mr *);
typedef struct ibv_mr *(*reg_fn)(struct ibv_pd *, void *, size_t, int);

#define MAX_MAPS 4096
static struct {
    struct ibv_mr *mr;
    void *map;
    size_t len;
} maps[MAX_MAPS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

#define MAX_GPU 64
static struct {
    uintptr_t dev;
    size_t len;
    int fd;
} gpu[MAX_GPU];

static void *real(const char *name, const char *version) {
    void *h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *f = h ? dlvsym(h, name, version) : NULL;
    if (h)
        dlclose(h);
    if (!f) {
        fprintf(stderr, "dmabuf stand-in: cannot find the real %s@%s\n", name, version);
        abort();
    }
    return f;
}

static void record(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void record(const char *fmt, ...) {
    const char *path = getenv("FERROCE_STANDIN_LOG");
    if (!path)
        return;
    FILE *f = fopen(path, "ae");
    if (!f)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

/* Maps [offset, offset + length) of fd and registers the mapping at iova; the MR and its
 * mapping are remembered for ibv_dereg_mr. `what` names the call in the log. */
static struct ibv_mr *map_and_register(const char *what, struct ibv_pd *pd, uint64_t offset,
                                       size_t length, uint64_t iova, int fd, int access) {
    long page = sysconf(_SC_PAGESIZE);
    uint64_t skew = offset % (uint64_t)page;
    size_t maplen = length + skew;
    void *map = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)(offset - skew));
    if (map == MAP_FAILED) {
        int e = errno;
        record("%s offset=%lu len=%zu iova=%#lx fd=%d access=%#x -> mmap errno %d", what,
               (unsigned long)offset, length, (unsigned long)iova, fd, access, e);
        errno = e;
        return NULL;
    }
    reg_iova2_fn reg = (reg_iova2_fn)real("ibv_reg_mr_iova2", "IBVERBS_1.8");
    struct ibv_mr *mr = reg(pd, (char *)map + skew, length, iova, (unsigned)access);
    int e = errno;
    if (!mr) {
        munmap(map, maplen);
        record("%s offset=%lu len=%zu iova=%#lx fd=%d access=%#x -> errno %d", what,
               (unsigned long)offset, length, (unsigned long)iova, fd, access, e);
        errno = e;
        return NULL;
    }
    pthread_mutex_lock(&lock);
    int slot = -1;
    for (int i = 0; i < MAX_MAPS && slot < 0; i++)
        if (!maps[i].mr)
            slot = i;
    if (slot >= 0) {
        maps[slot].mr = mr;
        maps[slot].map = map;
        maps[slot].len = maplen;
    }
    pthread_mutex_unlock(&lock);
    if (slot < 0) {
        fprintf(stderr, "dmabuf stand-in: more than %d live stand-in MRs\n", MAX_MAPS);
        abort();
    }
    record("%s offset=%lu len=%zu iova=%#lx fd=%d access=%#x -> mr %p", what,
           (unsigned long)offset, length, (unsigned long)iova, fd, access, (void *)mr);
    return mr;
}

struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
                                 uint64_t iova, int fd, int access) {
    if (fd < 0) {
        record("probe fd=%d", fd);
        errno = EBADF;
        return NULL;
    }
    return map_and_register("reg", pd, offset, length, iova, fd, access);
}

/* Declares [dev, dev + len) a GPU allocation whose pages are fd's from offset 0 (len 0
 * forgets it). Returns 0, or -1 when the table is full. */
int ferroce_standin_gpu(void *dev, size_t len, int fd) {
    int rc = -1;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_GPU; i++) {
        if (len == 0 && gpu[i].dev == (uintptr_t)dev) {
            gpu[i].len = 0;
            gpu[i].dev = 0;
            rc = 0;
        } else if (len > 0 && gpu[i].len == 0) {
            gpu[i].dev = (uintptr_t)dev;
            gpu[i].len = len;
            gpu[i].fd = fd;
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* The fd and offset behind [addr, addr + length) if it lies in a declared GPU allocation. */
static int gpu_lookup(const void *addr, size_t length, uint64_t *offset) {
    int fd = -1;
    uintptr_t a = (uintptr_t)addr;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_GPU; i++) {
        if (gpu[i].len && a >= gpu[i].dev && a + length <= gpu[i].dev + gpu[i].len) {
            *offset = a - gpu[i].dev;
            fd = gpu[i].fd;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return fd;
}

struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                                unsigned int access) {
    uint64_t offset = 0;
    int fd = gpu_lookup(addr, length, &offset);
    if (fd >= 0)
        return map_and_register("peer", pd, offset, length, iova, fd, (int)access);
    return ((reg_iova2_fn)real("ibv_reg_mr_iova2", "IBVERBS_1.8"))(pd, addr, length, iova,
                                                                   access);
}

#undef ibv_reg_mr
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
    uint64_t offset = 0;
    int fd = gpu_lookup(addr, length, &offset);
    if (fd >= 0)
        return map_and_register("peer", pd, offset, length, (uintptr_t)addr, fd, access);
    return ((reg_fn)real("ibv_reg_mr", "IBVERBS_1.1"))(pd, addr, length, access);
}

int ibv_dereg_mr(struct ibv_mr *mr) {
    void *map = NULL;
    size_t len = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPS; i++) {
        if (maps[i].mr == mr) {
            map = maps[i].map;
            len = maps[i].len;
            maps[i].mr = NULL;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    int rc = ((dereg_fn)real("ibv_dereg_mr", "IBVERBS_1.1"))(mr);
    if (map) {
        munmap(map, len);
        record("dereg mr %p -> %d", (void *)mr, rc);
    }
    return rc;
}
