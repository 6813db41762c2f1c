/*
 * GPU-side checks for ferroce, run by ci/gpu-check.sh on a machine with an NVIDIA GPU.
 * Needs no CUDA or NCCL headers: the ncclNet types come from ferroce's own
 * include/ferroce_net.h (build with -I include), the few CUDA and NCCL types and prototypes
 * are declared here, and every entry point is resolved with dlsym, so it builds with a bare
 * C compiler.
 *
 *   gpu_check dmabuf        export real GPU memory as dma-buf the way NCCL's core does
 *                           before it calls a plugin's regMrDmaBuf, and check the fd
 *   gpu_check nccl LIBNCCL  load ferroce under the real NCCL (one rank) and let NCCL fall back
 *   gpu_check send PLUGIN   send from real GPU memory through the plugin to itself (needs an
 *                           RDMA NIC; without one it skips)
 *
 * Prints one PASS or FAIL line per check. Exit: 0 all passed, 1 a check failed,
 * 2 something needed is absent (a "SKIP-REASON:" line says what).
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ferroce_net.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

enum {
	CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
	CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
};

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
	CUresult (*memcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*ctxSynchronize)(void);
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
	    !CU_SYM(memFree, "cuMemFree_v2") || !CU_SYM(memcpyHtoD, "cuMemcpyHtoD_v2") ||
	    !CU_SYM(ctxSynchronize, "cuCtxSynchronize") || !CU_SYM(getErrorName, "cuGetErrorName"))
		skip("libcuda.so.1 lacks a basic entry point (driver older than CUDA 11): %s", dlerror());
	/* Optional here: only dma-buf needs it, and the send case can do without. */
	CU_SYM(getHandleForAddressRange, "cuMemGetHandleForAddressRange");
}

/* Loads the driver and makes GPU 0's primary context current: NCCL's proxy runs on the
 * device's primary context, not a context of its own. */
static CUdevice gpu0(void)
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

	CUcontext ctx;
	if ((r = cu.primaryCtxRetain(&ctx, dev)) != 0 || (r = cu.ctxSetCurrent(ctx)) != 0)
		skip("primary context: %d (%s)", r, cu_err(r));
	return dev;
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
	CUdevice dev = gpu0();
	if (!cu.getHandleForAddressRange)
		skip("libcuda.so.1 has no cuMemGetHandleForAddressRange (dma-buf export needs a CUDA 11.7+ driver)");

	int dmabuf = -1;
	CUresult r = cu.deviceGetAttribute(&dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev);
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

/* ---- (c) send from GPU memory through the plugin ------------------------------------- */

enum { SEND_BYTES = 4096, DEADLINE_S = 30 };
#define NO_NIC "no RDMA device: this case needs a GPU host with an RDMA NIC (or run it on a " \
	"GPUDirect-capable cluster node)"

/* The plugin's last warning: on a host without an RDMA NIC, init fails and says why here. */
static char last_warn[512];

/* ferroce always logs with the format "%s"; WARN and INFO go to stderr, TRACE is dropped. */
static void plugin_log(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
		       const char *fmt, ...)
{
	char msg[sizeof last_warn];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (level == NCCL_LOG_WARN)
		memcpy(last_warn, msg, sizeof msg);
	if (level != NCCL_LOG_TRACE)
		fprintf(stderr, "%s %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}

/* A plugin call that must succeed; a FAIL line names it (the plugin's WARN above says why). */
static int ok(ncclResult_t r, const char *what)
{
	if (r != ncclSuccess)
		check(0, "%s = %d (ncclResult_t)", what, r);
	return r == ncclSuccess;
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* Sends the first `size` bytes of the GPU buffer into the host buffer and checks what arrived.
 * Returns 0 when the plugin failed or stalled: the comms are then in no state to go on with. */
static int transfer(ncclNet_v12_t *net, void *scomm, void *rcomm, CUdeviceptr gpu, void *gmh,
		    unsigned char *host, void *hmh, const unsigned char *pattern, size_t size)
{
	void *sreq = NULL, *rreq = NULL, *dst = host;
	size_t cap = SEND_BYTES;
	int tag = 1, sdone = 0, rdone = 0, ssize = -1, rsize = -1;
	memset(host, 0, SEND_BYTES);
	for (double end = now() + DEADLINE_S; !sdone || !rdone;) {
		if (now() > end) {
			check(0, "send %zu B from GPU memory: not done after %d s (irecv %s, isend %s)",
			      size, DEADLINE_S, !rreq ? "never posted" : rdone ? "done" : "pending",
			      !sreq ? "never posted" : sdone ? "done" : "pending");
			return 0;
		}
		/* A NULL request is "try again": the receiver's buffer has not reached the sender
		 * yet. The slot is NULL before irecv, which reads it for the optional-completion
		 * flag. */
		if (!rreq && !ok(net->irecv(rcomm, 1, &dst, &cap, &tag, &hmh, NULL, &rreq), "irecv"))
			return 0;
		if (!sreq && !ok(net->isend(scomm, (void *)(uintptr_t)gpu, size, tag, gmh, NULL, &sreq), "isend"))
			return 0;
		if (rreq && !rdone && !ok(net->test(rreq, &rdone, &rsize), "test(receive)"))
			return 0;
		if (sreq && !sdone && !ok(net->test(sreq, &sdone, &ssize), "test(send)"))
			return 0;
	}
	size_t diff = 0;
	while (diff < size && host[diff] == pattern[diff])
		diff++;
	char bytes[64] = "the bytes match";
	if (diff < size)
		snprintf(bytes, sizeof bytes, "first wrong byte at %zu", diff);
	check(rsize >= 0 && (size_t)rsize == size && diff == size,
	      "send %zu B from GPU memory (received %d B, the sender reports %d B, %s)", size, rsize, ssize, bytes);
	return 1;
}

static int run_send(const char *path)
{
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		check(0, "dlopen(%s): %s", path, dlerror());
		return 1;
	}
	ncclNet_v12_t *net = dlsym(lib, "ncclNetPlugin_v12");
	if (!net) {
		check(0, "%s exports no ncclNetPlugin_v12", path);
		return 1;
	}

	ncclNetCommConfig_v10_t config = { .trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF };
	void *ctx = NULL;
	int ndev = 0;
	ncclResult_t r = net->init(&ctx, 1, &config, plugin_log, NULL);
	/* ferroce fails init when it finds no usable port, which is how NCCL moves on to another
	 * network; any other init failure is a failure. */
	if (r != ncclSuccess && strstr(last_warn, "no usable RDMA device"))
		skip(NO_NIC "; the plugin says: %s", last_warn);
	if (!ok(r, "init") || !ok(net->devices(&ndev), "devices"))
		return 1;
	if (ndev == 0)
		skip(NO_NIC "; the plugin reports 0 devices");
	ncclNetProperties_v12_t props;
	memset(&props, 0, sizeof props);
	if (!ok(net->getProperties(0, &props), "getProperties(0)"))
		return 1;
	const int ptrs = props.ptrSupport;
	printf("%s: %d device(s); device 0: %s, ptrSupport %#x (HOST %d, CUDA %d, DMABUF %d)\n",
	       net->name ? net->name : "?", ndev, props.name ? props.name : "?", ptrs, !!(ptrs & NCCL_PTR_HOST), !!(ptrs & NCCL_PTR_CUDA),
	       !!(ptrs & NCCL_PTR_DMABUF));

	/* NCCL prefers dma-buf when both the plugin and the GPU can do it, else peer memory. */
	CUdevice dev = gpu0();
	int gpu_dmabuf = 0;
	cu.deviceGetAttribute(&gpu_dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev);
	const int dmabuf = (ptrs & NCCL_PTR_DMABUF) && gpu_dmabuf == 1 && cu.getHandleForAddressRange;
	if (!dmabuf && !(ptrs & NCCL_PTR_CUDA) && (ptrs & NCCL_PTR_DMABUF))
		skip("device 0 offers DMABUF but not CUDA in ptrSupport (%#x), and this GPU or driver cannot "
		     "export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = %d%s)", ptrs, gpu_dmabuf,
		     cu.getHandleForAddressRange ? "" : ", no cuMemGetHandleForAddressRange");
	if (!dmabuf && !(ptrs & NCCL_PTR_CUDA))
		skip("device 0 offers neither CUDA nor DMABUF in ptrSupport (%#x)", ptrs);

	char handle[NCCL_NET_HANDLE_MAXSIZE] = { 0 }, peer[NCCL_NET_HANDLE_MAXSIZE];
	void *lcomm = NULL, *scomm = NULL, *rcomm = NULL;
	ncclNetDeviceHandle_v7_t *sdev = NULL, *rdev = NULL;
	if (!ok(net->listen(ctx, 0, handle, &lcomm), "listen(dev 0)"))
		return 1;
	/* The copy NCCL would ship to the peer: connect keeps its progress in it between calls. */
	memcpy(peer, handle, sizeof peer);
	for (double end = now() + DEADLINE_S; !scomm || !rcomm;) {
		if (now() > end) {
			check(0, "connect/accept on dev 0 to itself: not done after %d s (send comm %s, receive comm %s)",
			      DEADLINE_S, scomm ? "up" : "pending", rcomm ? "up" : "pending");
			return 1;
		}
		if (!scomm && !ok(net->connect(ctx, 0, peer, &scomm, &sdev), "connect(dev 0)"))
			return 1;
		if (!rcomm && !ok(net->accept(lcomm, &rcomm, &rdev), "accept"))
			return 1;
	}
	check(1, "connect/accept on dev 0 to itself");

	/* cuMemAlloc may place a small buffer inside a larger GPU page, and dma-buf export wants
	 * host pages: take a page-aligned buffer from an allocation one page larger. */
	const size_t page = (size_t)sysconf(_SC_PAGESIZE), span = (SEND_BYTES + page - 1) / page * page;
	CUdeviceptr base = 0;
	CUresult cr = cu.memAlloc(&base, span + page);
	if (cr != 0) {
		check(0, "cuMemAlloc(%zu) = %d (%s)", span + page, cr, cu_err(cr));
		return 1;
	}
	const CUdeviceptr gpu = (base + page - 1) / page * page;
	unsigned char pattern[SEND_BYTES];
	for (size_t i = 0; i < SEND_BYTES; i++)
		pattern[i] = (unsigned char)(i * 131 + (i >> 8) + 1);
	/* A copy from pageable memory may still be in flight when cuMemcpyHtoD returns. */
	if ((cr = cu.memcpyHtoD(gpu, pattern, SEND_BYTES)) != 0 || (cr = cu.ctxSynchronize()) != 0) {
		check(0, "cuMemcpyHtoD(%#llx, %d B) = %d (%s)", gpu, SEND_BYTES, cr, cu_err(cr));
		return 1;
	}

	void *gmh = NULL, *hmh = NULL;
	if (dmabuf) {
		int fd = -1;
		cr = cu.getHandleForAddressRange(&fd, gpu, span, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
		if (cr != 0 || fd < 0) {
			check(0, "cuMemGetHandleForAddressRange(%#llx, %zu) = %d (%s), fd %d", gpu, span, cr, cu_err(cr), fd);
			return 1;
		}
		r = net->regMrDmaBuf(scomm, (void *)(uintptr_t)gpu, SEND_BYTES, NCCL_PTR_CUDA, 0, fd, &gmh);
		/* The fd stays the caller's: NCCL's core closes its own once the plugin registered. */
		close(fd);
	} else {
		r = net->regMr(scomm, (void *)(uintptr_t)gpu, SEND_BYTES, NCCL_PTR_CUDA, &gmh);
	}
	if (!ok(r, dmabuf ? "regMrDmaBuf(GPU buffer)" : "regMr(GPU buffer, NCCL_PTR_CUDA)"))
		return 1;
	printf("GPU buffer %#llx (%d B) registered on the send comm with %s\n", gpu, SEND_BYTES,
	       dmabuf ? "regMrDmaBuf" : "regMr(NCCL_PTR_CUDA)");
	unsigned char *host = malloc(SEND_BYTES);
	if (!host || !ok(net->regMr(rcomm, host, SEND_BYTES, NCCL_PTR_HOST, &hmh), "regMr(host buffer, NCCL_PTR_HOST)"))
		return 1;

	/* 8 and 256 B are the sizes a plugin is tempted to inline by reading them with the CPU,
	 * which faults on GPU memory: a SIGSEGV here is the bug this case exists to catch. */
	const size_t sizes[] = { 8, 256, SEND_BYTES };
	for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
		if (!transfer(net, scomm, rcomm, gpu, gmh, host, hmh, pattern, sizes[i]))
			return 1;

	/* Every step runs even after one fails, so one bad close does not hide another. */
	int torn = ok(net->deregMr(scomm, gmh), "deregMr(GPU buffer)");
	torn &= ok(net->deregMr(rcomm, hmh), "deregMr(host buffer)");
	torn &= ok(net->closeSend(scomm), "closeSend");
	torn &= ok(net->closeRecv(rcomm), "closeRecv");
	torn &= ok(net->closeListen(lcomm), "closeListen");
	torn &= ok(net->finalize(ctx), "finalize");
	if (torn)
		check(1, "teardown: deregMr, closeSend, closeRecv, closeListen, finalize");
	free(host);
	cr = cu.memFree(base);
	check(cr == 0, "cuMemFree(%#llx) = %d (%s)", base, cr, cu_err(cr));
	cu.primaryCtxRelease(dev);
	/* No dlclose: a Rust library's thread-local destructors may still point into it. */
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
	if (argc == 3 && strcmp(argv[1], "send") == 0)
		return run_send(argv[2]);
	fprintf(stderr, "usage: %s dmabuf | nccl /path/to/libnccl.so.2 | send /path/to/libnccl-net-ferroce.so\n",
		argv[0]);
	return 64;
}
