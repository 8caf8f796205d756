/* SPDX-License-Identifier: Apache-2.0 */
/*
 * abi_fields.h: the one list of devshare.h's ABI that the layout checks are built from: every
 * struct with every field in declaration order (ABI_STRUCTS), every DEVSHARE_* macro
 * (ABI_MACROS) and every status code (ABI_STATUSES), as X-macros, and abi_layout_print(), which
 * prints what the C compiler makes of them, one item a line:
 *
 *     struct <Name> size=<sizeof> align=<_Alignof>
 *     field <Name> <field> offset=<offsetof> size=<sizeof>     (every field, in declaration order)
 *     macro <DEVSHARE_NAME> <value>
 *     status <DEVSHARE_STATUS_NAME> <value>
 *
 * Its users: tests/c/layout_dump.c (compiled and run by tests/python/abi_check.py, which checks
 * the output against the header's text and the ctypes mirrors of python/devshare/_abi.py) and
 * `gpu_tool layout` (tests/gpu; the GPU suite's dry run checks the bundle's output the same way).
 * abi_check also reads this file's text: the lists must name exactly the header's structs, fields
 * (in order), macros and status codes, so a header change fails the test until this file follows.
 * For a new struct add a STRUCT(...) line followed by its FIELD(...) lines; for a new field a
 * FIELD(...) line at its place in its struct; macros and statuses likewise. A misspelt or
 * removed name does not compile. Keep one entry a line (abi_check parses them).
 *
 * Needs only devshare.h and the C library (no devshare library to link): C11.
 */
#ifndef DEVSHARE_TEST_ABI_FIELDS_H
#define DEVSHARE_TEST_ABI_FIELDS_H

#include "devshare.h"

#include <stddef.h>
#include <stdio.h>

/* STRUCT(T) opens struct T; FIELD(T, f) is its field f (in declaration order). */
#define ABI_STRUCTS(STRUCT, FIELD)                   \
    STRUCT(DevsharePeerInfo)                         \
    FIELD(DevsharePeerInfo, struct_size)             \
    FIELD(DevsharePeerInfo, pid)                     \
    FIELD(DevsharePeerInfo, uid)                     \
    FIELD(DevsharePeerInfo, gid)                     \
    FIELD(DevsharePeerInfo, id)                      \
    FIELD(DevsharePeerInfo, tgid)                    \
    FIELD(DevsharePeerInfo, reserved)                \
    FIELD(DevsharePeerInfo, leases)                  \
    FIELD(DevsharePeerInfo, protocol_errors)         \
    FIELD(DevsharePeerInfo, transport)               \
    FIELD(DevsharePeerInfo, reserved2)               \
    FIELD(DevsharePeerInfo, slots)                   \
    STRUCT(DevshareItem)                             \
    FIELD(DevshareItem, struct_size)                 \
    FIELD(DevshareItem, reserved)                    \
    FIELD(DevshareItem, import)                      \
    FIELD(DevshareItem, pool)                        \
    FIELD(DevshareItem, slot)                        \
    FIELD(DevshareItem, device)                      \
    FIELD(DevshareItem, backend)                     \
    FIELD(DevshareItem, read_only)                   \
    FIELD(DevshareItem, ndim)                        \
    FIELD(DevshareItem, dtype)                       \
    FIELD(DevshareItem, data)                        \
    FIELD(DevshareItem, nbytes)                      \
    FIELD(DevshareItem, shape)                       \
    FIELD(DevshareItem, strides)                     \
    FIELD(DevshareItem, layout_id)                   \
    FIELD(DevshareItem, name)                        \
    FIELD(DevshareItem, name_len)                    \
    STRUCT(DevshareRecvArgs)                         \
    FIELD(DevshareRecvArgs, struct_size)             \
    FIELD(DevshareRecvArgs, timeout_ms)              \
    FIELD(DevshareRecvArgs, conn)                    \
    FIELD(DevshareRecvArgs, release)                 \
    FIELD(DevshareRecvArgs, item)                    \
    STRUCT(DevshareDType)                            \
    FIELD(DevshareDType, code)                       \
    FIELD(DevshareDType, bits)                       \
    FIELD(DevshareDType, lanes)                      \
    STRUCT(DevshareTensorDesc)                       \
    FIELD(DevshareTensorDesc, struct_size)           \
    FIELD(DevshareTensorDesc, dtype)                 \
    FIELD(DevshareTensorDesc, ndim)                  \
    FIELD(DevshareTensorDesc, flags)                 \
    FIELD(DevshareTensorDesc, shape)                 \
    FIELD(DevshareTensorDesc, strides)               \
    FIELD(DevshareTensorDesc, storage_offset)        \
    FIELD(DevshareTensorDesc, storage_size)          \
    FIELD(DevshareTensorDesc, tensor_offset)         \
    FIELD(DevshareTensorDesc, stream)                \
    STRUCT(DevshareHandle)                           \
    FIELD(DevshareHandle, struct_size)               \
    FIELD(DevshareHandle, layout_version)            \
    FIELD(DevshareHandle, backend)                   \
    FIELD(DevshareHandle, flags)                     \
    FIELD(DevshareHandle, device_index)              \
    FIELD(DevshareHandle, device_uuid)               \
    FIELD(DevshareHandle, host_id)                   \
    FIELD(DevshareHandle, producer_pid)              \
    FIELD(DevshareHandle, ndim)                      \
    FIELD(DevshareHandle, alloc_size)                \
    FIELD(DevshareHandle, storage_offset)            \
    FIELD(DevshareHandle, storage_size)              \
    FIELD(DevshareHandle, tensor_offset)             \
    FIELD(DevshareHandle, dtype)                     \
    FIELD(DevshareHandle, key_len)                   \
    FIELD(DevshareHandle, shape)                     \
    FIELD(DevshareHandle, strides)                   \
    FIELD(DevshareHandle, key)                       \
    FIELD(DevshareHandle, ref_slot)                  \
    FIELD(DevshareHandle, ref_name_len)              \
    FIELD(DevshareHandle, reserved0)                 \
    FIELD(DevshareHandle, ref_name)                  \
    FIELD(DevshareHandle, event_handle)              \
    FIELD(DevshareHandle, layout_minor)              \
    FIELD(DevshareHandle, ext_len)                   \
    FIELD(DevshareHandle, reserved1)                 \
    FIELD(DevshareHandle, ext)                       \
    STRUCT(DevshareImportOptions)                    \
    FIELD(DevshareImportOptions, struct_size)        \
    FIELD(DevshareImportOptions, flags)              \
    FIELD(DevshareImportOptions, device)             \
    FIELD(DevshareImportOptions, reserved)           \
    FIELD(DevshareImportOptions, stream)             \
    STRUCT(DevshareImportInfo)                       \
    FIELD(DevshareImportInfo, struct_size)           \
    FIELD(DevshareImportInfo, device)                \
    FIELD(DevshareImportInfo, data)                  \
    FIELD(DevshareImportInfo, storage)               \
    FIELD(DevshareImportInfo, base)                  \
    FIELD(DevshareImportInfo, alloc_size)            \
    FIELD(DevshareImportInfo, storage_size)          \
    FIELD(DevshareImportInfo, numel)                 \
    FIELD(DevshareImportInfo, element_size)          \
    FIELD(DevshareImportInfo, backend)               \
    FIELD(DevshareImportInfo, read_only)             \
    FIELD(DevshareImportInfo, reserved)              \
    STRUCT(DevshareBackendInfo)                      \
    FIELD(DevshareBackendInfo, struct_size)          \
    FIELD(DevshareBackendInfo, backend)              \
    FIELD(DevshareBackendInfo, usable)               \
    FIELD(DevshareBackendInfo, name)                 \
    FIELD(DevshareBackendInfo, detail)               \
    STRUCT(DevshareTorchArgs)                        \
    FIELD(DevshareTorchArgs, struct_size)            \
    FIELD(DevshareTorchArgs, backend)                \
    FIELD(DevshareTorchArgs, reserved0)              \
    FIELD(DevshareTorchArgs, dtype)                  \
    FIELD(DevshareTorchArgs, ndim)                   \
    FIELD(DevshareTorchArgs, shape)                  \
    FIELD(DevshareTorchArgs, strides)                \
    FIELD(DevshareTorchArgs, tensor_offset)          \
    FIELD(DevshareTorchArgs, device)                 \
    FIELD(DevshareTorchArgs, producer_pid)           \
    FIELD(DevshareTorchArgs, handle)                 \
    FIELD(DevshareTorchArgs, handle_len)             \
    FIELD(DevshareTorchArgs, storage_size)           \
    FIELD(DevshareTorchArgs, storage_offset)         \
    FIELD(DevshareTorchArgs, ref_name)               \
    FIELD(DevshareTorchArgs, ref_name_len)           \
    FIELD(DevshareTorchArgs, ref_slot)               \
    FIELD(DevshareTorchArgs, event_handle)           \
    FIELD(DevshareTorchArgs, event_handle_len)       \
    FIELD(DevshareTorchArgs, event_sync_required)    \
    FIELD(DevshareTorchArgs, reserved1)              \
    STRUCT(DevshareTorchStorage)                     \
    FIELD(DevshareTorchStorage, struct_size)         \
    FIELD(DevshareTorchStorage, device)              \
    FIELD(DevshareTorchStorage, handle_len)          \
    FIELD(DevshareTorchStorage, ref_name_len)        \
    FIELD(DevshareTorchStorage, handle)              \
    FIELD(DevshareTorchStorage, storage_size)        \
    FIELD(DevshareTorchStorage, storage_offset)      \
    FIELD(DevshareTorchStorage, ref_slot)            \
    FIELD(DevshareTorchStorage, ref_name)            \
    FIELD(DevshareTorchStorage, event_handle)        \
    FIELD(DevshareTorchStorage, event_sync_required) \
    FIELD(DevshareTorchStorage, reserved)

/* Every DEVSHARE_* macro of the header (its include guard aside). */
#define ABI_MACROS(MACRO)                        \
    MACRO(DEVSHARE_VERSION_MAJOR)                \
    MACRO(DEVSHARE_VERSION_MINOR)                \
    MACRO(DEVSHARE_VERSION_PATCH)                \
    MACRO(DEVSHARE_VERSION)                      \
    MACRO(DEVSHARE_STORAGE_TO_END)               \
    MACRO(DEVSHARE_CLOSE_FORCE)                  \
    MACRO(DEVSHARE_CLOSE_UNLINK)                 \
    MACRO(DEVSHARE_SHARE_INFLIGHT)               \
    MACRO(DEVSHARE_SHARE_EVENT)                  \
    MACRO(DEVSHARE_EXPORT_NO_PID_CHECK)          \
    MACRO(DEVSHARE_EXPORT_FABRIC)                \
    MACRO(DEVSHARE_IMPORT_READ_ONLY)             \
    MACRO(DEVSHARE_IMPORT_PEER_ACCESS_CALL)      \
    MACRO(DEVSHARE_IMPORT_NO_PEER_ACCESS)        \
    MACRO(DEVSHARE_DEVICE_FROM_HANDLE)           \
    MACRO(DEVSHARE_TORCH_HANDLE_CAPACITY)        \
    MACRO(DEVSHARE_TORCH_FORMAT_DEFAULT)         \
    MACRO(DEVSHARE_TORCH_FORMAT_V1)              \
    MACRO(DEVSHARE_TORCH_FORMAT_V2)              \
    MACRO(DEVSHARE_TORCH_FORMAT_V3)              \
    MACRO(DEVSHARE_TORCH_FORMAT_UNVERSIONED)     \
    MACRO(DEVSHARE_CHANNEL_MAX_PEERS)            \
    MACRO(DEVSHARE_CHANNEL_MAX_PENDING)          \
    MACRO(DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE) \
    MACRO(DEVSHARE_TRANSPORT_UNIX)               \
    MACRO(DEVSHARE_TRANSPORT_STREAM)             \
    MACRO(DEVSHARE_TRANSPORT_UCX)                \
    MACRO(DEVSHARE_MAX_NAME_LEN)                 \
    MACRO(DEVSHARE_CHANNEL_HANDSHAKE_MS)         \
    MACRO(DEVSHARE_CHANNEL_SEND_QUEUE)           \
    MACRO(DEVSHARE_CHANNEL_SEND_QUEUE_BYTES)     \
    MACRO(DEVSHARE_CHANNEL_SEND_QUEUE_FDS)       \
    MACRO(DEVSHARE_CHANNEL_SEND_PATIENCE_MS)     \
    MACRO(DEVSHARE_CHANNEL_ERROR_BUDGET)         \
    MACRO(DEVSHARE_CHANNEL_MAX_POOLS)            \
    MACRO(DEVSHARE_POOL_MAX_SLOTS)               \
    MACRO(DEVSHARE_MAX_SPIN_US)                  \
    MACRO(DEVSHARE_PROBE_REMOTE)                 \
    MACRO(DEVSHARE_DTYPE_INT)                    \
    MACRO(DEVSHARE_DTYPE_UINT)                   \
    MACRO(DEVSHARE_DTYPE_FLOAT)                  \
    MACRO(DEVSHARE_DTYPE_OPAQUE_HANDLE)          \
    MACRO(DEVSHARE_DTYPE_BFLOAT)                 \
    MACRO(DEVSHARE_DTYPE_COMPLEX)                \
    MACRO(DEVSHARE_DTYPE_BOOL)                   \
    MACRO(DEVSHARE_DTYPE_FLOAT8_FIRST)           \
    MACRO(DEVSHARE_DTYPE_FLOAT8_LAST)            \
    MACRO(DEVSHARE_MAX_NDIM)                     \
    MACRO(DEVSHARE_KEY_CAPACITY)                 \
    MACRO(DEVSHARE_REF_NAME_CAPACITY)            \
    MACRO(DEVSHARE_EVENT_HANDLE_SIZE)            \
    MACRO(DEVSHARE_HANDLE_EXT_CAPACITY)          \
    MACRO(DEVSHARE_HANDLE_LAYOUT_VERSION)        \
    MACRO(DEVSHARE_HANDLE_LAYOUT_MINOR)          \
    MACRO(DEVSHARE_REF_SLOTS)                    \
    MACRO(DEVSHARE_BACKEND_HOST)                 \
    MACRO(DEVSHARE_BACKEND_ACL)                  \
    MACRO(DEVSHARE_BACKEND_CUDA)                 \
    MACRO(DEVSHARE_HANDLE_FLAG_EVENT)            \
    MACRO(DEVSHARE_HANDLE_FLAG_INFLIGHT)         \
    MACRO(DEVSHARE_HANDLE_FLAG_CHANNEL)          \
    MACRO(DEVSHARE_HANDLE_FLAGS_MUST_UNDERSTAND) \
    MACRO(DEVSHARE_HANDLE_FLAGS_MAY_IGNORE)      \
    MACRO(DEVSHARE_EXT_MUST_UNDERSTAND)          \
    MACRO(DEVSHARE_HANDLE_SIZE)                  \
    MACRO(DEVSHARE_ENCODING_VERSION)             \
    MACRO(DEVSHARE_ENCODING_MINOR)               \
    MACRO(DEVSHARE_HANDLE_MAX_ENCODED_SIZE)      \
    MACRO(DEVSHARE_HANDLE_DECODE_LIMIT)          \
    MACRO(DEVSHARE_HANDLE_FLAG_SEGMENTED)        \
    MACRO(DEVSHARE_EXT_SEGMENTS)                 \
    MACRO(DEVSHARE_SEGMENTS_ACL)                 \
    MACRO(DEVSHARE_SEGMENTS_CUDA_FD)             \
    MACRO(DEVSHARE_SEGMENTS_CUDA_FABRIC)         \
    MACRO(DEVSHARE_SEGMENTS_INLINE)              \
    MACRO(DEVSHARE_SEGMENT_GRANULARITY)          \
    MACRO(DEVSHARE_MAX_SEGMENTS)                 \
    MACRO(DEVSHARE_HANDLE_MAX_TEXT_SIZE)

/* Every DEVSHARE_STATUS_* code. */
#define ABI_STATUSES(STATUS)                      \
    STATUS(DEVSHARE_STATUS_OK)                    \
    STATUS(DEVSHARE_STATUS_NULL_ARGUMENT)         \
    STATUS(DEVSHARE_STATUS_INVALID_ARGUMENT)      \
    STATUS(DEVSHARE_STATUS_BUFFER_TOO_SMALL)      \
    STATUS(DEVSHARE_STATUS_TRUNCATED)             \
    STATUS(DEVSHARE_STATUS_BAD_MAGIC)             \
    STATUS(DEVSHARE_STATUS_UNSUPPORTED_VERSION)   \
    STATUS(DEVSHARE_STATUS_CHECKSUM_MISMATCH)     \
    STATUS(DEVSHARE_STATUS_BAD_TEXT)              \
    STATUS(DEVSHARE_STATUS_BAD_LENGTH)            \
    STATUS(DEVSHARE_STATUS_INVALID_HANDLE)        \
    STATUS(DEVSHARE_STATUS_STORAGE_OUT_OF_BOUNDS) \
    STATUS(DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS)  \
    STATUS(DEVSHARE_STATUS_BAD_NDIM)              \
    STATUS(DEVSHARE_STATUS_BAD_DTYPE)             \
    STATUS(DEVSHARE_STATUS_BAD_KEY)               \
    STATUS(DEVSHARE_STATUS_BAD_SIZE)              \
    STATUS(DEVSHARE_STATUS_WRONG_HOST)            \
    STATUS(DEVSHARE_STATUS_BACKEND_UNAVAILABLE)   \
    STATUS(DEVSHARE_STATUS_UNSUPPORTED)           \
    STATUS(DEVSHARE_STATUS_NOT_FOUND)             \
    STATUS(DEVSHARE_STATUS_OS)                    \
    STATUS(DEVSHARE_STATUS_VENDOR)                \
    STATUS(DEVSHARE_STATUS_TIMEOUT)               \
    STATUS(DEVSHARE_STATUS_BUSY)                  \
    STATUS(DEVSHARE_STATUS_ALREADY_RELEASED)      \
    STATUS(DEVSHARE_STATUS_MISMATCH)              \
    STATUS(DEVSHARE_STATUS_UNTRUSTED)             \
    STATUS(DEVSHARE_STATUS_CLOSED)                \
    STATUS(DEVSHARE_STATUS_INTERNAL)

/* --- The printer --------------------------------------------------------------------------- */

#define ABI_PRINT_STRUCT_(T) fprintf(out, "struct %s size=%zu align=%zu\n", #T, sizeof(T), _Alignof(T));
#define ABI_PRINT_FIELD_(T, f)                                                                                   \
    fprintf(out, "field %s %s offset=%zu size=%zu\n", #T, #f, offsetof(T, f), sizeof(((T *)0)->f));
/* Negative values print signed, others unsigned (DEVSHARE_STORAGE_TO_END is UINT64_MAX).
 * `< 1 && != 0` rather than `< 0`: no "always false" warning for unsigned macros. */
#define ABI_PRINT_MACRO_(m)                                                                                      \
    if ((m) < 1 && (m) != 0) {                                                                                   \
        fprintf(out, "macro %s %lld\n", #m, (long long)(m));                                                    \
    } else {                                                                                                     \
        fprintf(out, "macro %s %llu\n", #m, (unsigned long long)(m));                                           \
    }
#define ABI_PRINT_STATUS_(s) fprintf(out, "status %s %d\n", #s, (int)(s));

/* Every struct and field, then every macro, then every status code, in list order. */
static inline void abi_layout_print(FILE *out) {
    ABI_STRUCTS(ABI_PRINT_STRUCT_, ABI_PRINT_FIELD_)
    ABI_MACROS(ABI_PRINT_MACRO_)
    ABI_STATUSES(ABI_PRINT_STATUS_)
}

#endif /* DEVSHARE_TEST_ABI_FIELDS_H */
