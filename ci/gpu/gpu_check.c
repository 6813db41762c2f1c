/*
 * GPU-side checks for ferroce, run by ci/gpu-check.sh on a machine with an NVIDIA GPU and
 * no RDMA NIC. Needs no CUDA or NCCL headers: the few types and prototypes are declared here
 * and every entry point is resolved with dlsym, so it builds with a bare C compiler.
 *
 *   gpu_check dmabuf        export real GPU memory as dma-buf the way NCCL's core does
 *                           before it calls a plugin's regMrDmaBuf, and check the fd
 *   gpu_check nccl LIBNCCL  load ferroce under the real NCCL (one rank) and let NCCL fall back
 *
 * Prints one PASS or FAIL line per check. Exit: 0 all passed, 1 a check failed,
 * 2 something needed is absent (a "SKIP-REASON:" line says what).
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

enum {
	CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
	CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
};

typedef int ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef void *ncclComm_t;

static int failures;

static void check(int ok, const char *fmt, ...)
{
	va_list ap;
	printf("%s ", ok ? "PASS" : "FAIL");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	putchar('\n');
	failures += !ok;
}

/* A check that already failed outranks a missing prerequisite found later. */
static void skip(const char *fmt, ...)
{
	va_list ap;
	printf("SKIP-REASON: ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	putchar('\n');
	exit(failures ? 1 : 2);
}

static struct {
	void *lib;
	CUresult (*init)(unsigned);
	CUresult (*driverGetVersion)(int *);
	CUresult (*deviceGet)(CUdevice *, int);
	CUresult (*deviceGetName)(char *, int, CUdevice);
	CUresult (*deviceGetAttribute)(int *, int, CUdevice);
	CUresult (*primaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*primaryCtxRelease)(CUdevice);
	CUresult (*ctxSetCurrent)(CUcontext);
	CUresult (*memAlloc)(CUdeviceptr *, size_t);
	CUresult (*memFree)(CUdeviceptr);
	CUresult (*getHandleForAddressRange)(void *, CUdeviceptr, size_t, int, unsigned long long);
	CUresult (*getErrorName)(CUresult, const char **);
} cu;

static const char *cu_err(CUresult r)
{
	const char *name = NULL;
	if (cu.getErrorName)
		cu.getErrorName(r, &name);
	return name ? name : "?";
}

/* Versioned names (_v2) are the ones the CUDA headers map the plain names to. */
#define CU_SYM(field, name) (*(void **)&cu.field = dlsym(cu.lib, name))

static void load_cuda(void)
{
	cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!cu.lib)
		skip("no CUDA driver: dlopen(libcuda.so.1): %s", dlerror());
	if (!CU_SYM(init, "cuInit") || !CU_SYM(driverGetVersion, "cuDriverGetVersion") ||
	    !CU_SYM(deviceGet, "cuDeviceGet") || !CU_SYM(deviceGetName, "cuDeviceGetName") ||
	    !CU_SYM(deviceGetAttribute, "cuDeviceGetAttribute") ||
	    !CU_SYM(primaryCtxRetain, "cuDevicePrimaryCtxRetain") ||
	    !CU_SYM(primaryCtxRelease, "cuDevicePrimaryCtxRelease_v2") ||
	    !CU_SYM(ctxSetCurrent, "cuCtxSetCurrent") || !CU_SYM(memAlloc, "cuMemAlloc_v2") ||
	    !CU_SYM(memFree, "cuMemFree_v2") || !CU_SYM(getErrorName, "cuGetErrorName"))
		skip("libcuda.so.1 lacks a basic entry point (driver older than CUDA 11): %s", dlerror());
	if (!CU_SYM(getHandleForAddressRange, "cuMemGetHandleForAddressRange"))
		skip("libcuda.so.1 has no cuMemGetHandleForAddressRange (dma-buf export needs a CUDA 11.7+ driver)");
}

/* Exports [ptr, ptr + len) and checks the fd as ibv_reg_dmabuf_mr will use it: ferroce
 * registers [offset, offset + reg) of the dma-buf at iova = ptr, which the kernel refuses
 * unless offset + reg fits in the dma-buf. */
static void export_range(const char *what, CUdeviceptr ptr, size_t reg, size_t len)
{
	int fd = -1;
	CUresult r = cu.getHandleForAddressRange(&fd, ptr, len, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
	if (r != 0 || fd < 0) {
		check(0, "dma-buf export %s: ptr=%#llx size=%zu rounded=%zu: cuMemGetHandleForAddressRange = %d (%s), fd %d",
		      what, ptr, reg, len, r, cu_err(r), fd);
		return;
	}
	off_t end = lseek(fd, 0, SEEK_END);
	const size_t offset = 0;
	check(end >= 0 && (size_t)end >= offset + reg,
	      "dma-buf export %s: ptr=%#llx size=%zu rounded=%zu fd=%d fd_size=%lld offset=%zu (%s rounded size)",
	      what, ptr, reg, len, fd, (long long)end, offset,
	      end < 0 ? "lseek failed, no" : (size_t)end == len ? "exactly the" : (size_t)end > len ? "larger than the" : "SMALLER than the");
	int c = close(fd);
	check(c == 0, "close(dma-buf fd %d) = %d", fd, c);
}

static int run_dmabuf(void)
{
	load_cuda();
	CUresult r = cu.init(0);
	if (r != 0)
		skip("cuInit(0) = %d (%s): no usable GPU", r, cu_err(r));
	int drv = 0;
	CUdevice dev;
	char name[256] = "?";
	cu.driverGetVersion(&drv);
	if ((r = cu.deviceGet(&dev, 0)) != 0)
		skip("cuDeviceGet(0) = %d (%s)", r, cu_err(r));
	cu.deviceGetName(name, sizeof name, dev);
	printf("GPU 0: %s, CUDA driver API %d.%d\n", name, drv / 1000, drv % 1000 / 10);

	/* NCCL's proxy runs on the device's primary context, not a context of its own. */
	CUcontext ctx;
	if ((r = cu.primaryCtxRetain(&ctx, dev)) != 0 || (r = cu.ctxSetCurrent(ctx)) != 0)
		skip("primary context: %d (%s)", r, cu_err(r));

	int dmabuf = -1;
	r = cu.deviceGetAttribute(&dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev);
	printf("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = %d (query %d %s)\n", dmabuf, r, cu_err(r));
	if (r != 0 || dmabuf != 1)
		skip("device reports no dma-buf support, so NCCL never calls regMrDmaBuf here "
		     "(needs the open kernel modules or a recent driver, and a kernel with dma-buf)");

	const size_t page = (size_t)sysconf(_SC_PAGESIZE), gpu_page = 64 << 10;
	/* The last size is not a page multiple: NCCL rounds the export up to host pages. */
	const size_t sizes[] = { 1 << 20, (4 << 20) + 4096, (64 << 20) - 4096, (1 << 20) + 100 };
	printf("host page size %zu\n", page);
	for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
		size_t size = sizes[i], rounded = (size + page - 1) / page * page;
		CUdeviceptr ptr = 0;
		if ((r = cu.memAlloc(&ptr, size)) != 0) {
			check(0, "cuMemAlloc(%zu) = %d (%s)", size, r, cu_err(r));
			continue;
		}
		export_range("whole", ptr, size, rounded);
		export_range("from +64KiB", ptr + gpu_page, rounded - gpu_page, rounded - gpu_page);
		r = cu.memFree(ptr);
		check(r == 0, "cuMemFree(%#llx) = %d (%s)", ptr, r, cu_err(r));
	}
	cu.primaryCtxRelease(dev);
	return failures ? 1 : 0;
}

static int run_nccl(const char *libnccl)
{
	/* NCCL reads these when it first initializes, after this point. A forced NCCL_NET would
	 * turn the fallback this check expects into an error. */
	setenv("NCCL_NET_PLUGIN", "ferroce", 1);
	setenv("NCCL_DEBUG", "INFO", 1);
	setenv("NCCL_DEBUG_SUBSYS", "INIT,NET", 1);
	unsetenv("NCCL_NET");

	/* The same lookup NCCL does, done first so that a missing dependency (libibverbs) is
	 * named here rather than buried in NCCL's INFO lines. */
	void *plugin = dlopen("libnccl-net-ferroce.so", RTLD_NOW | RTLD_LOCAL);
	if (plugin) {
		char found[160] = "";
		for (int v = 12; v >= 6; v--) {
			char sym[32];
			snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
			if (dlsym(plugin, sym))
				snprintf(found + strlen(found), sizeof found - strlen(found), " v%d", v);
		}
		check(found[0] != 0, "dlopen(libnccl-net-ferroce.so) through LD_LIBRARY_PATH; exports ncclNetPlugin:%s",
		      found[0] ? found : " none");
		dlclose(plugin);
	} else {
		check(0, "dlopen(libnccl-net-ferroce.so): %s", dlerror());
	}

	void *lib = dlopen(libnccl, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		check(0, "dlopen(%s): %s", libnccl, dlerror());
		return 1;
	}
	ncclResult_t (*getVersion)(int *) = (ncclResult_t (*)(int *))dlsym(lib, "ncclGetVersion");
	ncclResult_t (*getUniqueId)(ncclUniqueId *) = (ncclResult_t (*)(ncclUniqueId *))dlsym(lib, "ncclGetUniqueId");
	ncclResult_t (*commInitRank)(ncclComm_t *, int, ncclUniqueId, int) =
		(ncclResult_t (*)(ncclComm_t *, int, ncclUniqueId, int))dlsym(lib, "ncclCommInitRank");
	ncclResult_t (*commDestroy)(ncclComm_t) = (ncclResult_t (*)(ncclComm_t))dlsym(lib, "ncclCommDestroy");
	const char *(*errorString)(ncclResult_t) = (const char *(*)(ncclResult_t))dlsym(lib, "ncclGetErrorString");
	const char *(*lastError)(ncclComm_t) = (const char *(*)(ncclComm_t))dlsym(lib, "ncclGetLastError"); /* 2.13+ */
	if (!getVersion || !getUniqueId || !commInitRank || !commDestroy || !errorString) {
		check(0, "%s lacks an NCCL entry point (ncclGetVersion, ncclGetUniqueId, ncclCommInitRank, "
		      "ncclCommDestroy, ncclGetErrorString)", libnccl);
		return 1;
	}

	int code = 0;
	ncclResult_t r = getVersion(&code);
	/* The encoding changed in 2.9: major*10000 + minor*100 + patch, before it major*1000. */
	int major = code >= 10000 ? code / 10000 : code / 1000;
	int minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
	check(r == 0, "ncclGetVersion = %d: NCCL version %d.%d.%d (code %d)", r, major, minor, code % 100, code);

	/* NCCL needs the driver too; without it there is nothing more to learn. */
	void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!cuda)
		skip("no CUDA driver: dlopen(libcuda.so.1): %s", dlerror());
	dlclose(cuda);

	ncclUniqueId id;
	memset(&id, 0, sizeof id);
	r = getUniqueId(&id);
	check(r == 0, "ncclGetUniqueId = %d (%s)", r, errorString(r));
	if (r != 0)
		return 1;

	/* Success or a clean error are both fine: the point is that loading ferroce on a host
	 * without RDMA devices neither crashes NCCL nor stops its fallback. */
	ncclComm_t comm = NULL;
	fflush(stdout);
	r = commInitRank(&comm, 1, id, 0);
	check(1, "ncclCommInitRank(nranks 1, rank 0) returned %d (%s)%s%s", r, errorString(r),
	      r && lastError ? ": " : "", r && lastError ? lastError(comm) : "");
	if (comm) {
		r = commDestroy(comm);
		check(r == 0, "ncclCommDestroy = %d (%s)", r, errorString(r));
	}
	return failures ? 1 : 0;
}

int main(int argc, char **argv)
{
	/* NCCL logs to the same stdout; line buffering keeps the order if the process dies. */
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 2 && strcmp(argv[1], "dmabuf") == 0)
		return run_dmabuf();
	if (argc == 3 && strcmp(argv[1], "nccl") == 0)
		return run_nccl(argv[2]);
	fprintf(stderr, "usage: %s dmabuf | nccl /path/to/libnccl.so.2\n", argv[0]);
	return 64;
}
