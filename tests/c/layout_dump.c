/* SPDX-License-Identifier: Apache-2.0 */
/*
 * layout_dump: what the C compiler makes of include/devshare.h, for the ctypes mirror test
 * (tests/python/test_abi_layout.py compiles and runs it at test time; nothing links it to the
 * library). Output, one item a line:
 *
 *     struct <Name> size=<sizeof> align=<_Alignof>
 *     field <Name> <field> offset=<offsetof> size=<sizeof>     (every field, in declaration order)
 *     macro <DEVSHARE_NAME> <value>
 *     status <DEVSHARE_STATUS_NAME> <value>
 *
 * The test parses devshare.h itself too and fails when this file misses a struct, a field or a
 * status code the header has (or lists one it lacks), so keep the lists below complete: for a
 * new struct add a STRUCT(...) block, for a new field a FIELD(...) line in its struct's block.
 * A misspelt or removed field does not compile. Macros: those the Python package mirrors.
 */

#include <stddef.h>
#include <stdio.h>

#include "devshare.h"

#define STRUCT(T) printf("struct %s size=%zu align=%zu\n", #T, sizeof(T), _Alignof(T))
#define FIELD(T, f) \
    printf("field %s %s offset=%zu size=%zu\n", #T, #f, offsetof(T, f), sizeof(((T *)0)->f))
/* Negative values print signed, others unsigned (DEVSHARE_STORAGE_TO_END is UINT64_MAX).
 * `< 1 && != 0` rather than `< 0`: no "always false" warning for unsigned macros. */
#define MACRO(m)                                                      \
    do {                                                              \
        if ((m) < 1 && (m) != 0)                                      \
            printf("macro %s %lld\n", #m, (long long)(m));            \
        else                                                          \
            printf("macro %s %llu\n", #m, (unsigned long long)(m));   \
    } while (0)
#define STATUS(s) printf("status %s %d\n", #s, (int)(s))

int main(void) {
    STRUCT(DevshareDType);
    FIELD(DevshareDType, code);
    FIELD(DevshareDType, bits);
    FIELD(DevshareDType, lanes);

    STRUCT(DevshareTensorDesc);
    FIELD(DevshareTensorDesc, struct_size);
    FIELD(DevshareTensorDesc, dtype);
    FIELD(DevshareTensorDesc, ndim);
    FIELD(DevshareTensorDesc, flags);
    FIELD(DevshareTensorDesc, shape);
    FIELD(DevshareTensorDesc, strides);
    FIELD(DevshareTensorDesc, storage_offset);
    FIELD(DevshareTensorDesc, storage_size);
    FIELD(DevshareTensorDesc, tensor_offset);
    FIELD(DevshareTensorDesc, stream);

    STRUCT(DevshareHandle);
    FIELD(DevshareHandle, struct_size);
    FIELD(DevshareHandle, layout_version);
    FIELD(DevshareHandle, backend);
    FIELD(DevshareHandle, flags);
    FIELD(DevshareHandle, device_index);
    FIELD(DevshareHandle, device_uuid);
    FIELD(DevshareHandle, host_id);
    FIELD(DevshareHandle, producer_pid);
    FIELD(DevshareHandle, ndim);
    FIELD(DevshareHandle, alloc_size);
    FIELD(DevshareHandle, storage_offset);
    FIELD(DevshareHandle, storage_size);
    FIELD(DevshareHandle, tensor_offset);
    FIELD(DevshareHandle, dtype);
    FIELD(DevshareHandle, key_len);
    FIELD(DevshareHandle, shape);
    FIELD(DevshareHandle, strides);
    FIELD(DevshareHandle, key);
    FIELD(DevshareHandle, ref_slot);
    FIELD(DevshareHandle, ref_name_len);
    FIELD(DevshareHandle, reserved0);
    FIELD(DevshareHandle, ref_name);
    FIELD(DevshareHandle, event_handle);
    FIELD(DevshareHandle, layout_minor);
    FIELD(DevshareHandle, ext_len);
    FIELD(DevshareHandle, reserved1);
    FIELD(DevshareHandle, ext);

    STRUCT(DevshareImportOptions);
    FIELD(DevshareImportOptions, struct_size);
    FIELD(DevshareImportOptions, flags);
    FIELD(DevshareImportOptions, device);
    FIELD(DevshareImportOptions, reserved);
    FIELD(DevshareImportOptions, stream);

    STRUCT(DevshareImportInfo);
    FIELD(DevshareImportInfo, struct_size);
    FIELD(DevshareImportInfo, device);
    FIELD(DevshareImportInfo, data);
    FIELD(DevshareImportInfo, storage);
    FIELD(DevshareImportInfo, base);
    FIELD(DevshareImportInfo, alloc_size);
    FIELD(DevshareImportInfo, storage_size);
    FIELD(DevshareImportInfo, numel);
    FIELD(DevshareImportInfo, element_size);
    FIELD(DevshareImportInfo, backend);
    FIELD(DevshareImportInfo, read_only);
    FIELD(DevshareImportInfo, reserved);

    STRUCT(DevshareBackendInfo);
    FIELD(DevshareBackendInfo, struct_size);
    FIELD(DevshareBackendInfo, backend);
    FIELD(DevshareBackendInfo, usable);
    FIELD(DevshareBackendInfo, name);
    FIELD(DevshareBackendInfo, detail);

    STRUCT(DevshareTorchArgs);
    FIELD(DevshareTorchArgs, struct_size);
    FIELD(DevshareTorchArgs, backend);
    FIELD(DevshareTorchArgs, reserved0);
    FIELD(DevshareTorchArgs, dtype);
    FIELD(DevshareTorchArgs, ndim);
    FIELD(DevshareTorchArgs, shape);
    FIELD(DevshareTorchArgs, strides);
    FIELD(DevshareTorchArgs, tensor_offset);
    FIELD(DevshareTorchArgs, device);
    FIELD(DevshareTorchArgs, producer_pid);
    FIELD(DevshareTorchArgs, handle);
    FIELD(DevshareTorchArgs, handle_len);
    FIELD(DevshareTorchArgs, storage_size);
    FIELD(DevshareTorchArgs, storage_offset);
    FIELD(DevshareTorchArgs, ref_name);
    FIELD(DevshareTorchArgs, ref_name_len);
    FIELD(DevshareTorchArgs, ref_slot);
    FIELD(DevshareTorchArgs, event_handle);
    FIELD(DevshareTorchArgs, event_handle_len);
    FIELD(DevshareTorchArgs, event_sync_required);
    FIELD(DevshareTorchArgs, reserved1);

    STRUCT(DevshareTorchStorage);
    FIELD(DevshareTorchStorage, struct_size);
    FIELD(DevshareTorchStorage, device);
    FIELD(DevshareTorchStorage, handle_len);
    FIELD(DevshareTorchStorage, ref_name_len);
    FIELD(DevshareTorchStorage, handle);
    FIELD(DevshareTorchStorage, storage_size);
    FIELD(DevshareTorchStorage, storage_offset);
    FIELD(DevshareTorchStorage, ref_slot);
    FIELD(DevshareTorchStorage, ref_name);
    FIELD(DevshareTorchStorage, event_handle);
    FIELD(DevshareTorchStorage, event_sync_required);
    FIELD(DevshareTorchStorage, reserved);

    STRUCT(DevsharePeerInfo);
    FIELD(DevsharePeerInfo, struct_size);
    FIELD(DevsharePeerInfo, pid);
    FIELD(DevsharePeerInfo, uid);
    FIELD(DevsharePeerInfo, gid);
    FIELD(DevsharePeerInfo, id);
    FIELD(DevsharePeerInfo, tgid);
    FIELD(DevsharePeerInfo, reserved);
    FIELD(DevsharePeerInfo, leases);
    FIELD(DevsharePeerInfo, protocol_errors);

    /* Macros: the version, and every one the Python package mirrors (_abi.C_MACROS; the test
     * requires them here). Listing only those keeps this file compiling when the header
     * drops a macro nobody mirrors. */
    MACRO(DEVSHARE_VERSION_MAJOR);
    MACRO(DEVSHARE_VERSION_MINOR);
    MACRO(DEVSHARE_VERSION_PATCH);
    MACRO(DEVSHARE_MAX_NDIM);
    MACRO(DEVSHARE_KEY_CAPACITY);
    MACRO(DEVSHARE_REF_NAME_CAPACITY);
    MACRO(DEVSHARE_EVENT_HANDLE_SIZE);
    MACRO(DEVSHARE_HANDLE_EXT_CAPACITY);
    MACRO(DEVSHARE_HANDLE_SIZE);
    MACRO(DEVSHARE_HANDLE_LAYOUT_VERSION);
    MACRO(DEVSHARE_HANDLE_MAX_ENCODED_SIZE);
    MACRO(DEVSHARE_HANDLE_MAX_TEXT_SIZE);
    MACRO(DEVSHARE_TORCH_HANDLE_CAPACITY);
    MACRO(DEVSHARE_BACKEND_HOST);
    MACRO(DEVSHARE_BACKEND_ACL);
    MACRO(DEVSHARE_BACKEND_CUDA);
    MACRO(DEVSHARE_HANDLE_FLAG_EVENT);
    MACRO(DEVSHARE_HANDLE_FLAG_INFLIGHT);
    MACRO(DEVSHARE_SHARE_INFLIGHT);
    MACRO(DEVSHARE_SHARE_EVENT);
    MACRO(DEVSHARE_EXPORT_NO_PID_CHECK);
    MACRO(DEVSHARE_IMPORT_READ_ONLY);
    MACRO(DEVSHARE_IMPORT_PEER_ACCESS_CALL);
    MACRO(DEVSHARE_IMPORT_NO_PEER_ACCESS);
    MACRO(DEVSHARE_DEVICE_FROM_HANDLE);
    MACRO(DEVSHARE_STORAGE_TO_END);
    MACRO(DEVSHARE_CLOSE_FORCE);
    MACRO(DEVSHARE_CLOSE_UNLINK);
    MACRO(DEVSHARE_HANDLE_FLAG_CHANNEL);

    STATUS(DEVSHARE_STATUS_OK);
    STATUS(DEVSHARE_STATUS_NULL_ARGUMENT);
    STATUS(DEVSHARE_STATUS_INVALID_ARGUMENT);
    STATUS(DEVSHARE_STATUS_BUFFER_TOO_SMALL);
    STATUS(DEVSHARE_STATUS_TRUNCATED);
    STATUS(DEVSHARE_STATUS_BAD_MAGIC);
    STATUS(DEVSHARE_STATUS_UNSUPPORTED_VERSION);
    STATUS(DEVSHARE_STATUS_CHECKSUM_MISMATCH);
    STATUS(DEVSHARE_STATUS_BAD_TEXT);
    STATUS(DEVSHARE_STATUS_BAD_LENGTH);
    STATUS(DEVSHARE_STATUS_INVALID_HANDLE);
    STATUS(DEVSHARE_STATUS_STORAGE_OUT_OF_BOUNDS);
    STATUS(DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS);
    STATUS(DEVSHARE_STATUS_BAD_NDIM);
    STATUS(DEVSHARE_STATUS_BAD_DTYPE);
    STATUS(DEVSHARE_STATUS_BAD_KEY);
    STATUS(DEVSHARE_STATUS_BAD_SIZE);
    STATUS(DEVSHARE_STATUS_WRONG_HOST);
    STATUS(DEVSHARE_STATUS_BACKEND_UNAVAILABLE);
    STATUS(DEVSHARE_STATUS_UNSUPPORTED);
    STATUS(DEVSHARE_STATUS_NOT_FOUND);
    STATUS(DEVSHARE_STATUS_OS);
    STATUS(DEVSHARE_STATUS_VENDOR);
    STATUS(DEVSHARE_STATUS_TIMEOUT);
    STATUS(DEVSHARE_STATUS_BUSY);
    STATUS(DEVSHARE_STATUS_ALREADY_RELEASED);
    STATUS(DEVSHARE_STATUS_MISMATCH);
    STATUS(DEVSHARE_STATUS_UNTRUSTED);
    STATUS(DEVSHARE_STATUS_CLOSED);
    STATUS(DEVSHARE_STATUS_INTERNAL);
    return 0;
}
