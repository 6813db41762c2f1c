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

#define MAX_MAPS 4096
static struct {
    struct ibv_mr *mr;
    void *map;
    size_t len;
} maps[MAX_MAPS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

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

struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
                                 uint64_t iova, int fd, int access) {
    if (fd < 0) {
        record("probe fd=%d", fd);
        errno = EBADF;
        return NULL;
    }
    long page = sysconf(_SC_PAGESIZE);
    uint64_t skew = offset % (uint64_t)page;
    size_t maplen = length + skew;
    void *map = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)(offset - skew));
    if (map == MAP_FAILED) {
        int e = errno;
        record("reg offset=%lu len=%zu iova=%#lx fd=%d access=%#x -> mmap errno %d",
               (unsigned long)offset, length, (unsigned long)iova, fd, access, e);
        errno = e;
        return NULL;
    }
    reg_iova2_fn reg = (reg_iova2_fn)real("ibv_reg_mr_iova2", "IBVERBS_1.8");
    struct ibv_mr *mr = reg(pd, (char *)map + skew, length, iova, (unsigned)access);
    int e = errno;
    if (!mr) {
        munmap(map, maplen);
        record("reg offset=%lu len=%zu iova=%#lx fd=%d access=%#x -> errno %d",
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
        fprintf(stderr, "dmabuf stand-in: more than %d live dma-buf MRs\n", MAX_MAPS);
        abort();
    }
    record("reg offset=%lu len=%zu iova=%#lx fd=%d access=%#x -> mr %p", (unsigned long)offset,
           length, (unsigned long)iova, fd, access, (void *)mr);
    return mr;
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
