/*
 * acl_standin.h - declarations of the TEST-ONLY stand-in for Huawei's Ascend ACL runtime
 * (libascendcl.so). See tests/standin/README.md.
 *
 * The ACL part below mirrors what a C program using the real ACL headers sees (same types,
 * enum values, constants and function signatures, so the same ABI). The stand-in models device
 * memory with host POSIX shared memory and records every documented rule a caller breaks.
 *
 * The aclsi_* functions at the end exist only in the stand-in: tests use them to inspect the
 * runtime's shared state.
 */
#ifndef ACL_STANDIN_H
#define ACL_STANDIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- types (acl_base.h / acl_rt.h) ---- */
typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void *aclrtContext;

/* Interprocess event handle: 64 opaque bytes, passed BY VALUE to aclrtIpcOpenEventHandle. */
typedef struct aclrtIpcEventHandle {
    char reserved[64];
} aclrtIpcEventHandle;

typedef enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
    ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
    ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
    ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5
} aclrtMemMallocPolicy;

typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3
} aclrtMemcpyKind;

/* Event flags for aclrtCreateEventExWithFlag. */
#define ACL_EVENT_SYNC 0x00000001u
#define ACL_EVENT_CAPTURE_STREAM_PROGRESS 0x00000002u
#define ACL_EVENT_TIME_LINE 0x00000008u
#define ACL_EVENT_IPC 0x00000040u

/* IPC memory flags. */
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT 0x0ull               /* pid whitelist enforced */
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1ull /* anyone may import */
#define ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT 0x0ull      /* cross-device needs EnablePeerAccess */
#define ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS 0x1ull /* runtime enables P2P itself */

/* Length of the key buffer of aclrtIpcMemGetExportKey (a NUL-terminated string inside). */
#define ACL_IPC_MEM_KEY_LEN 65

/* ---- VMM (virtual memory management; torch_npu "expandable segments") ---- */
typedef void *aclrtDrvMemHandle; /* physical memory handle */

typedef enum aclrtMemAttr {
    ACL_DDR_MEM,
    ACL_HBM_MEM,
    ACL_DDR_MEM_HUGE,
    ACL_DDR_MEM_NORMAL,
    ACL_HBM_MEM_HUGE,
    ACL_HBM_MEM_NORMAL,
    ACL_DDR_MEM_P2P_HUGE,
    ACL_DDR_MEM_P2P_NORMAL,
    ACL_HBM_MEM_P2P_HUGE,
    ACL_HBM_MEM_P2P_NORMAL,
    ACL_HBM_MEM_HUGE1G,
    ACL_HBM_MEM_P2P_HUGE1G,
    ACL_MEM_NORMAL,
    ACL_MEM_HUGE,
    ACL_MEM_HUGE1G,
    ACL_MEM_P2P_NORMAL,
    ACL_MEM_P2P_HUGE,
    ACL_MEM_P2P_HUGE1G
} aclrtMemAttr;

typedef enum aclrtMemLocationType {
    ACL_MEM_LOCATION_TYPE_HOST = 0, /* reserved: not supported */
    ACL_MEM_LOCATION_TYPE_DEVICE,
    ACL_MEM_LOCATION_TYPE_UNREGISTERED,
    ACL_MEM_LOCATION_TYPE_MANAGED,
    ACL_MEM_LOCATION_TYPE_HOST_NUMA = 4
} aclrtMemLocationType;

typedef struct aclrtMemLocation {
    uint32_t id;
    aclrtMemLocationType type;
} aclrtMemLocation;

typedef enum aclrtMemAllocationType {
    ACL_MEM_ALLOCATION_TYPE_PINNED = 0
} aclrtMemAllocationType;

typedef enum aclrtMemHandleType {
    ACL_MEM_HANDLE_TYPE_NONE = 0,
    ACL_MEM_HANDLE_TYPE_POSIX = 2
} aclrtMemHandleType;

typedef struct aclrtPhysicalMemProp {
    aclrtMemHandleType handleType;         /* ACL_MEM_HANDLE_TYPE_NONE */
    aclrtMemAllocationType allocationType; /* ACL_MEM_ALLOCATION_TYPE_PINNED */
    aclrtMemAttr memAttr;                  /* e.g. ACL_HBM_MEM_HUGE */
    aclrtMemLocation location;             /* {device id, ACL_MEM_LOCATION_TYPE_DEVICE} */
    uint64_t reserve;
} aclrtPhysicalMemProp;

typedef enum aclrtMemGranularityOptions {
    ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
    ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF = 0xFFFF
} aclrtMemGranularityOptions;

/* aclrtMemExportToShareableHandle flags. */
#define ACL_RT_VMM_EXPORT_FLAG_DEFAULT 0x0ull                /* pid whitelist enforced */
#define ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1ull /* anyone may import */

/* ---- error codes ---- */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_NO_PERMISSION 207006
#define ACL_ERROR_RT_DRV_INTERNAL_ERROR 507899

/* ---- init / device ---- */
aclError aclInit(const char *configPath);
aclError aclFinalize(void);
aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion);
aclError aclrtGetDeviceCount(uint32_t *count);
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtGetDevice(int32_t *deviceId);
aclError aclrtResetDevice(int32_t deviceId);
aclError aclrtGetCurrentContext(aclrtContext *context);
aclError aclrtSetCurrentContext(aclrtContext context);

/* ---- memory ---- */
aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                     aclrtMemcpyKind kind);

/* ---- IPC memory ---- */
aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len,
                                 uint64_t flag);
aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num);
aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flag);
aclError aclrtIpcMemClose(const char *key);
aclError aclrtDeviceGetBareTgid(int32_t *pid);
aclError aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags);

/* ---- VMM ---- */
aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size,
                             const aclrtPhysicalMemProp *prop, uint64_t flags);
aclError aclrtFreePhysical(aclrtDrvMemHandle handle);
aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop,
                                          aclrtMemGranularityOptions option,
                                          size_t *granularity);
aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                uint64_t flags);
aclError aclrtReleaseMemAddress(void *virPtr);
aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                     uint64_t flags);
aclError aclrtUnmapMem(void *virPtr);
aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle, aclrtMemHandleType handleType,
                                         uint64_t flags, uint64_t *shareableHandle);
aclError aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t *pid, size_t pidNum);
aclError aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId,
                                           aclrtDrvMemHandle *handle);

/* ---- streams ---- */
aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtSynchronizeDevice(void);

/* ---- events ---- */
aclError aclrtCreateEvent(aclrtEvent *event);
aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag);
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtSynchronizeEvent(aclrtEvent event);
aclError aclrtDestroyEvent(aclrtEvent event);
aclError aclrtIpcGetEventHandle(aclrtEvent event, aclrtIpcEventHandle *handle);
aclError aclrtIpcOpenEventHandle(aclrtIpcEventHandle handle, aclrtEvent *event);
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);

/* Thread-local text of the last failure on this thread ("" when none; never NULL). */
const char *aclGetRecentErrMsg(void);

/* ---- test-only queries (stand-in only) ---- */

/* Violations recorded by this process so far. */
int aclsi_violation_count(void);
/* Global count of open imports of a key, from any process; -1 if the key is unknown or gone. */
int aclsi_open_imports(const char *key);
/* Shared waits counter of an IPC event (producer's or opened one); -1 if not an IPC event. */
int aclsi_event_waits(aclrtEvent event);
/* Shared records counter of an IPC event (producer's or opened one); -1 if not an IPC event. */
int aclsi_event_records(aclrtEvent event);
/* 1 if the exporter closed the key, 0 if it is open, -1 if unknown. */
int aclsi_key_closed(const char *key);
/* aclrtSetDevice calls made in this process (devshare binds default contexts instead). */
int aclsi_set_device_calls(void);

/* VMM, this process: live reservations (aclrtReserveMemAddress not yet released), live
 * mappings (aclrtMapMem not yet unmapped), live physical handles from aclrtMallocPhysical, and
 * live handles from aclrtMemImportFromShareableHandle (each not yet aclrtFreePhysical'd). */
int aclsi_vmm_reservations(void);
int aclsi_vmm_mappings(void);
int aclsi_vmm_physical_handles(void);
int aclsi_vmm_imported_handles(void);
/* Live imported handles of a shareable handle in all processes; -1 if unknown or destroyed
 * (the exporter freed its physical handle). Callable from any process. */
int aclsi_vmm_open_imports(uint64_t shareableHandle);
/* 1 if the exporter freed the physical handle behind a shareable handle (it can no longer be
 * imported), 0 if it is live, -1 if it was never issued (or its exporter is gone). */
int aclsi_vmm_freed(uint64_t shareableHandle);

/* Test hook: every later call of `call` in this process ("aclrtIpcMemClose",
 * "aclrtIpcMemImportByKey" or "aclrtSynchronizeDevice") sleeps `ms` milliseconds before it acts,
 * outside the stand-in's lock (0: no delay). Returns 0, or -1 for another name. */
int aclsi_set_delay(const char *call, unsigned ms);

#ifdef __cplusplus
}
#endif

#endif /* ACL_STANDIN_H */
