/* SPDX-License-Identifier: Apache-2.0 */

// devshare.hpp: a small header-only C++17 wrapper over the devshare C API (devshare.h).
//
// - devshare::Error    an exception carrying a DEVSHARE_STATUS_* code and the library's message.
// - devshare::Handle   a value type around DevshareHandle (copyable, 616 bytes, no heap).
// - devshare::Exporter owns one DevshareExporter (move-only); closes it when destroyed.
// - devshare::Import   owns one DevshareImport (move-only); releases it when destroyed.
//
// Costs: each function is one call into the C library (the Import constructor: two), plus at
// most one std::string or std::vector for results that are text or bytes. Nothing is cached behind your back except
// what is stated (Exporter caches its address and size, Import caches its DevshareImportInfo;
// neither changes during the object's life). Functions that report failure throw
// devshare::Error; functions marked noexcept never fail.
//
// Threading follows devshare.h: an Exporter may be used from several threads except for
// close() and destruction; an Import is released once, by whoever owns it.
//
// Structs that cross the C boundary start with struct_size (see "Versions and evolution" in
// devshare.h). The helpers here (tensor_desc, import_options, probe, Import) initialise them with
// the C *_init functions and this header's sizeof; a struct you fill yourself needs the same:
// value-initialise it and call its *_init function (or at least set struct_size = sizeof).

#ifndef DEVSHARE_HPP
#define DEVSHARE_HPP

#include "devshare.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace devshare {

// ---------------------------------------------------------------------------------------------
// Errors

// A failed devshare call. status() is the DEVSHARE_STATUS_* code the C function returned;
// what() is the library's message for it (devshare_last_error: the function that failed and
// why), or the status name when the library left no message.
class Error : public std::runtime_error {
public:
    Error(int32_t status, const std::string& message) : std::runtime_error(message), status_(status) {}

    // The DEVSHARE_STATUS_* code (negative).
    int32_t status() const noexcept { return status_; }

    // Fixed name of the status (devshare_status_str); static storage, never freed.
    const char* status_name() const noexcept { return devshare_status_str(status_); }

    // Build an Error for `status` from the calling thread's devshare_last_error text. Call it
    // right after the failing C function, before any other devshare call on this thread.
    static Error from_last(int32_t status) {
        const size_t len = devshare_last_error(nullptr, 0);
        if (len == 0) {
            return Error(status, devshare_status_str(status));
        }
        std::vector<char> buf(len + 1);
        devshare_last_error(buf.data(), buf.size());
        return Error(status, std::string(buf.data(), len));
    }

private:
    int32_t status_;
};

// Throw devshare::Error unless `status` is DEVSHARE_STATUS_OK. Use right after a C call.
inline void check(int32_t status) {
    if (status != DEVSHARE_STATUS_OK) {
        throw Error::from_last(status);
    }
}

// ---------------------------------------------------------------------------------------------
// Library-wide helpers

// The linked library's version, (major << 16) | (minor << 8) | patch.
inline uint32_t version() noexcept { return devshare_version(); }

// Whether `backend` (DEVSHARE_BACKEND_*) is usable in this process, and why not. Throws for
// unknown backend ids.
inline DevshareBackendInfo probe(uint16_t backend) {
    DevshareBackendInfo info{};
    check(devshare_backend_info_init(&info, sizeof info));
    check(devshare_probe(backend, &info));
    return info;
}

// A DevshareTensorDesc of this header's size with the defaults (devshare_tensor_desc_init:
// struct_size set, storage_size DEVSHARE_STORAGE_TO_END, everything else zero). Set dtype, ndim
// and shape (and whatever else differs), then pass it to Exporter::share.
inline DevshareTensorDesc tensor_desc() noexcept {
    DevshareTensorDesc d{};
    d.struct_size = sizeof d;
    d.storage_size = DEVSHARE_STORAGE_TO_END;
    (void)devshare_tensor_desc_init(&d, sizeof d);  // cannot fail for a non-NULL pointer and sizeof
    return d;
}

// The same with the element type and a C-contiguous (strides nullptr) or strided layout; `shape`
// and `strides` (ndim entries each) are read by Exporter::share, so they must outlive that call.
inline DevshareTensorDesc tensor_desc(DevshareDType dtype, uint32_t ndim, const int64_t* shape,
                                      const int64_t* strides = nullptr) noexcept {
    DevshareTensorDesc d = tensor_desc();
    d.dtype = dtype;
    d.ndim = ndim;
    d.shape = shape;
    d.strides = strides;
    return d;
}

// Import options with the given DEVSHARE_IMPORT_* flags, device and stream (defaults:
// read-write, the handle's device, no stream: event waits block).
inline DevshareImportOptions import_options(uint32_t flags = 0,
                                            int32_t device = DEVSHARE_DEVICE_FROM_HANDLE,
                                            void* stream = nullptr) noexcept {
    DevshareImportOptions o{};
    o.struct_size = sizeof o;
    (void)devshare_import_options_init(&o, sizeof o);  // cannot fail for a non-NULL pointer and sizeof
    o.flags = flags;
    o.device = device;
    o.stream = stream;
    return o;
}

// The pid an exporter must allow (Exporter::allow_pid) for this process to import on `backend`
// and `device` (devshare_local_pid: the bare tgid on Ascend, getpid() elsewhere).
inline int32_t local_pid(uint16_t backend, int32_t device = 0) {
    int32_t pid = 0;
    check(devshare_local_pid(backend, device, &pid));
    return pid;
}

// ---------------------------------------------------------------------------------------------
// Handle

// One shared tensor's handle: plain data, copy it freely. A handle produced by
// Exporter::share() is one reference owed to the exporter; give each consumer its own (copies
// of one handle are the same reference, returned once by the first release).
class Handle {
public:
    // An empty handle of this library's layout (devshare_handle_init); not valid until filled.
    Handle() noexcept { devshare_handle_init(&raw_); }

    // Wrap a C handle (copied; not validated: call validate()).
    explicit Handle(const DevshareHandle& raw) noexcept : raw_(raw) {}

    // The C struct, for reading fields (shape, strides, dtype, ...) or passing to C code.
    const DevshareHandle& raw() const noexcept { return raw_; }
    DevshareHandle& raw() noexcept { return raw_; }

    // Throws devshare::Error naming the first invalid field.
    void validate() const { check(devshare_handle_validate(&raw_)); }

    // Text form ("devshare1:..."), safe for command lines, environment variables and JSON.
    std::string to_text() const {
        char buf[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
        size_t len = 0;
        check(devshare_handle_to_text(&raw_, buf, sizeof buf, &len));
        return std::string(buf, len);
    }

    // Parse and validate handle text (surrounding whitespace is ignored).
    static Handle from_text(const char* text) {
        Handle h;
        check(devshare_handle_from_text(text, &h.raw_));
        return h;
    }
    static Handle from_text(const std::string& text) { return from_text(text.c_str()); }

    // Canonical byte encoding (at most DEVSHARE_HANDLE_MAX_ENCODED_SIZE bytes).
    std::vector<uint8_t> encode() const {
        uint8_t buf[DEVSHARE_HANDLE_MAX_ENCODED_SIZE];
        size_t len = 0;
        check(devshare_handle_encode(&raw_, buf, sizeof buf, &len));
        return std::vector<uint8_t>(buf, buf + len);
    }

    // Decode and validate encoded bytes; each kind of damage throws with its own status.
    static Handle decode(const uint8_t* bytes, size_t len) {
        Handle h;
        check(devshare_handle_decode(bytes, len, &h.raw_));
        return h;
    }
    static Handle decode(const std::vector<uint8_t>& bytes) { return decode(bytes.data(), bytes.size()); }

    // Byte-wise equality (every unused byte of a valid handle is zero).
    friend bool operator==(const Handle& a, const Handle& b) noexcept {
        return std::memcmp(&a.raw_, &b.raw_, sizeof(DevshareHandle)) == 0;
    }
    friend bool operator!=(const Handle& a, const Handle& b) noexcept { return !(a == b); }

private:
    DevshareHandle raw_;
};

// ---------------------------------------------------------------------------------------------
// Exporter

// Owns one exported allocation (DevshareExporter). Move-only; a moved-from or default-constructed
// Exporter is empty: data() is nullptr, size() is 0, and destroying it does nothing.
// The destructor closes with DEVSHARE_CLOSE_FORCE and never throws: for host memory, importers
// that still map the buffer keep it valid; for device memory, they lose it. Call close() first
// to be told about outstanding references instead.
class Exporter {
public:
    Exporter() noexcept = default;

    // Take ownership of a C exporter (NULL gives an empty Exporter). Throws only if the exporter's
    // memory cannot be queried, in which case it is left to the caller.
    explicit Exporter(DevshareExporter* adopt) : exp_(adopt) {
        if (exp_ != nullptr) {
            check(devshare_exporter_memory(exp_, &data_, &size_));
        }
    }

    // Allocate `size` bytes of zero-filled shareable host memory (devshare_host_alloc).
    static Exporter host_alloc(uint64_t size) {
        Exporter e;
        check(devshare_host_alloc(size, &e.exp_, &e.data_));
        e.size_ = size;
        return e;
    }

    // Export existing device memory [ptr, ptr + size) on `backend` and `device`
    // (devshare_export, DEVSHARE_EXPORT_* `flags`). The memory stays owned by the caller and
    // must outlive the Exporter.
    static Exporter export_memory(uint16_t backend, int32_t device, void* ptr, uint64_t size,
                                  uint32_t flags = 0) {
        DevshareExporter* raw = nullptr;
        check(devshare_export(backend, device, ptr, size, flags, &raw));
        Exporter e;
        e.exp_ = raw;
        e.data_ = ptr;
        e.size_ = size;
        return e;
    }

    Exporter(const Exporter&) = delete;
    Exporter& operator=(const Exporter&) = delete;

    Exporter(Exporter&& other) noexcept
        : exp_(std::exchange(other.exp_, nullptr)),
          data_(std::exchange(other.data_, nullptr)),
          size_(std::exchange(other.size_, 0)) {}

    // Closes (forced) what this Exporter held, then takes over `other`.
    Exporter& operator=(Exporter&& other) noexcept {
        if (this != &other) {
            close_quietly();
            exp_ = std::exchange(other.exp_, nullptr);
            data_ = std::exchange(other.data_, nullptr);
            size_ = std::exchange(other.size_, 0);
        }
        return *this;
    }

    ~Exporter() { close_quietly(); }

    // Address of the allocation in this process (valid until close), nullptr when empty.
    void* data() const noexcept { return data_; }
    // Size of the allocation in bytes, 0 when empty.
    uint64_t size() const noexcept { return size_; }
    // The C exporter, still owned by this object (nullptr when empty).
    DevshareExporter* get() const noexcept { return exp_; }
    explicit operator bool() const noexcept { return exp_ != nullptr; }

    // Give up ownership: the caller must devshare_exporter_close the result. Leaves this empty.
    DevshareExporter* release() noexcept {
        data_ = nullptr;
        size_ = 0;
        return std::exchange(exp_, nullptr);
    }

    // A new handle (one new reference) for a tensor in the allocation. Start `desc` from
    // devshare::tensor_desc() (or devshare_tensor_desc_init): a desc without struct_size is refused.
    Handle share(const DevshareTensorDesc& desc) const {
        Handle h;
        check(devshare_exporter_share(exp_, &desc, &h.raw()));
        return h;
    }

    // A new handle for the whole allocation as a 1-D uint8 tensor.
    Handle share_bytes() const {
        Handle h;
        check(devshare_exporter_share(exp_, nullptr, &h.raw()));
        return h;
    }

    // Let the importer with this pid import (acl pid whitelist; devshare_exporter_allow_pid).
    // The importer learns its pid with devshare::local_pid().
    void allow_pid(int32_t pid) const {
        check(devshare_exporter_allow_pid(exp_, pid));
    }

    // References handed out and not yet released.
    uint64_t outstanding() const {
        uint64_t n = 0;
        check(devshare_exporter_outstanding(exp_, &n));
        return n;
    }

    // Wait until every reference was released: true when they were, false when `timeout` passed
    // first (a negative timeout waits forever). Other failures throw.
    bool wait(std::chrono::milliseconds timeout) const {
        const int32_t s = devshare_exporter_wait(exp_, timeout.count());
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return false;
        }
        check(s);
        return true;
    }

    // Close the export; afterwards this Exporter is empty. Without `force`, a device backend with
    // outstanding references throws DEVSHARE_STATUS_BUSY and this Exporter stays usable. Host
    // memory closes at once: importers keep their mapping until they release. An empty
    // Exporter's close() does nothing.
    void close(bool force = false) {
        if (exp_ == nullptr) {
            return;
        }
        check(devshare_exporter_close(exp_, force ? DEVSHARE_CLOSE_FORCE : 0u));
        exp_ = nullptr;
        data_ = nullptr;
        size_ = 0;
    }

private:
    void close_quietly() noexcept {
        if (exp_ != nullptr) {
            (void)devshare_exporter_close(exp_, DEVSHARE_CLOSE_FORCE);
            exp_ = nullptr;
            data_ = nullptr;
            size_ = 0;
        }
    }

    DevshareExporter* exp_ = nullptr;
    void* data_ = nullptr;
    uint64_t size_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Import

// Owns one import of a handle (DevshareImport). Move-only; a moved-from or default-constructed
// Import is empty: data() is nullptr and destroying or releasing it does nothing. Destroying a
// non-empty Import releases it (errors are ignored); the reference goes back to the exporter
// when this was the process's last import of that handle.
class Import {
public:
    Import() noexcept = default;

    // Import `handle` (options nullptr: read-write, the handle's device). The handle is not kept.
    explicit Import(const Handle& handle, const DevshareImportOptions* options = nullptr) {
        check(devshare_import(&handle.raw(), options, &imp_));
        (void)devshare_import_info_init(&info_, sizeof info_);  // cannot fail: non-NULL, sizeof
        const int32_t s = devshare_import_info(imp_, &info_);
        if (s != DEVSHARE_STATUS_OK) {
            Error e = Error::from_last(s);
            (void)devshare_import_release(imp_);
            imp_ = nullptr;
            info_ = DevshareImportInfo{};
            throw e;
        }
    }
    Import(const Handle& handle, const DevshareImportOptions& options) : Import(handle, &options) {}

    Import(const Import&) = delete;
    Import& operator=(const Import&) = delete;

    Import(Import&& other) noexcept : imp_(std::exchange(other.imp_, nullptr)), info_(other.info_) {
        other.info_ = DevshareImportInfo{};
    }

    // Releases what this Import held, then takes over `other`.
    Import& operator=(Import&& other) noexcept {
        if (this != &other) {
            release_quietly();
            imp_ = std::exchange(other.imp_, nullptr);
            info_ = std::exchange(other.info_, DevshareImportInfo{});
        }
        return *this;
    }

    ~Import() { release_quietly(); }

    // The tensor's first element as T* (no dtype check: compare handle().raw().dtype first).
    // nullptr when empty. Valid until release.
    template <typename T = void>
    T* data() const noexcept {
        return static_cast<T*>(info_.data);
    }

    // Pointers and sizes of the import (cached at construction; all zero when empty).
    const DevshareImportInfo& info() const noexcept { return info_; }

    // A copy of the handle this import was made from (shape, strides, dtype, ...).
    Handle handle() const {
        Handle h;
        check(devshare_import_handle(imp_, &h.raw()));
        return h;
    }

    // The C import, still owned by this object (nullptr when empty).
    DevshareImport* get() const noexcept { return imp_; }
    explicit operator bool() const noexcept { return imp_ != nullptr; }

    // Release now (see the class comment); afterwards this Import is empty and its pointers are
    // invalid. Releasing an empty Import does nothing.
    void release() {
        if (imp_ == nullptr) {
            return;
        }
        DevshareImport* imp = std::exchange(imp_, nullptr);
        info_ = DevshareImportInfo{};
        check(devshare_import_release(imp));
    }

private:
    void release_quietly() noexcept {
        if (imp_ != nullptr) {
            (void)devshare_import_release(std::exchange(imp_, nullptr));
            info_ = DevshareImportInfo{};
        }
    }

    DevshareImport* imp_ = nullptr;
    DevshareImportInfo info_{};
};

}  // namespace devshare

#endif  // DEVSHARE_HPP
