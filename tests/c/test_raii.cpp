// SPDX-License-Identifier: Apache-2.0
//
// test_raii: the C++ API devshare.hpp, built with exceptions (its throwing forms; the try_ forms
// under -fno-exceptions are test_raii_noexcept.cpp).
//
//  - type traits: Exporter and Import are move-only with noexcept moves, Handle is a trivially
//    copyable value, Result and every value-returning function are [[nodiscard]];
//  - struct helpers: tensor_desc(), import_options(), torch_args() carry struct_size and defaults;
//  - round trip: host_alloc -> share -> text -> from_text -> Import -> data, encode/decode;
//  - move semantics: moved-from objects are empty and their destructors do nothing; move
//    assignment closes / releases what the target held;
//  - errors: devshare::Error with the right status and the library's message; its error_code;
//  - typed share<T>: dtype_of<T>, pointer / byte offset / explicit dtype forms, strides, storage
//    options, and what they refuse; Handle accessors;
//  - Import::as<T>: a dtype mismatch is an error (no reinterpretation), read-only imports need
//    const T, TensorView indexing (strided), flat(), mdspan when the library has it;
//  - checked accessors in every build: data<T>() of another dtype, an index list of the wrong
//    length or outside the shape throw (try_data / try_at return the Error, unchecked() checks
//    nothing); a view whose Import was released, destroyed or assigned over throws
//    ALREADY_RELEASED instead of reading unmapped memory;
//  - Result<T> next to the throwing forms: try_ calls never throw;
//  - share_encoded / Import::from_encoded / Import::from_text, discard, host_adopt, DLPack;
//  - PyTorch tuples: handle_to_torch / handle_from_torch / torch_storage_handle /
//    handle_from_torch_encoded / torch_discard / Import::from_torch;
//  - destruction: an Import returns its reference; ~Exporter never forces unless asked: host
//    closes, a busy device export (CUDA stand-in) is left open and reported to the leak handler,
//    OnDestroy::wait_then_close waits for the consumer, OnDestroy::force forces; export_segments.
//
// Prints "ok - ..." / "FAIL - ..." per case; exit status 0 when all passed. The device cases
// need DEVSHARE_CUDA_LIBRARY pointing at the CUDA stand-in (CTest sets it); without it they are
// skipped with a "# SKIP" line.

#include "devshare.hpp"

#include <complex>

#include "cuda_standin.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

int n_cases = 0;
int n_failed = 0;

bool check(bool ok, const std::string& what) {
    n_cases++;
    std::printf("%s - %s\n", ok ? "ok" : "FAIL", what.c_str());
    std::fflush(stdout);
    if (!ok) {
        n_failed++;
    }
    return ok;
}

// Runs `f`, which must throw devshare::Error with `status` and a message starting with
// `function` + ":".
template <typename F>
void expect_error(int32_t status, const char* function, const std::string& what, F&& f) {
    try {
        f();
        check(false, what + ": no exception");
    } catch (const devshare::Error& e) {
        const std::string msg = e.what();
        const bool ok = e.status() == status && msg.rfind(std::string(function) + ":", 0) == 0 &&
                        std::strcmp(e.status_name(), devshare_status_str(status)) == 0;
        check(ok, what + " throws devshare::Error(" + devshare_status_str(status) + ")");
        if (!ok) {
            std::printf("    got status %d: %s\n", static_cast<int>(e.status()), e.what());
        }
    } catch (const std::exception& e) {
        check(false, what + ": unexpected exception " + e.what());
    }
}

bool shm_exists(const uint8_t* name, uint32_t len) {
    const std::string path = "/dev/shm" + std::string(reinterpret_cast<const char*>(name), len);
    struct stat st;
    return stat(path.c_str(), &st) == 0;
}

bool data_name_exists(const devshare::Handle& h) { return shm_exists(h.raw().key, h.raw().key_len); }

bool names_gone(const devshare::Handle& h) {
    return !data_name_exists(h) && !shm_exists(h.raw().ref_name, h.raw().ref_name_len);
}

// Where a test stores an element it reads, so that the read happens.
volatile double sink = 0;

constexpr int kRows = 3;
constexpr int kCols = 4;
constexpr uint64_t kStorageOffset = 64;
constexpr int64_t kTensorOffset = 2;
const int64_t kShape[2] = {kRows, kCols};

DevshareTensorDesc float_desc() {
    DevshareTensorDesc d = devshare::tensor_desc(devshare::dtype_of<float>(), 2, kShape);
    d.storage_offset = kStorageOffset;
    d.tensor_offset = kTensorOffset;
    return d;
}

float* tensor_in(const devshare::Exporter& e) {
    return reinterpret_cast<float*>(static_cast<char*>(e.data()) + kStorageOffset) + kTensorOffset;
}

devshare::Exporter make_exporter() {
    devshare::Exporter e = devshare::Exporter::host_alloc(1024);
    float* t = tensor_in(e);
    for (int i = 0; i < kRows * kCols; i++) {
        t[i] = static_cast<float>(i) + 0.5f;
    }
    return e;
}

// ---------------------------------------------------------------------------------------------

static_assert(DEVSHARE_HPP_EXCEPTIONS == 1, "this test is built with exceptions");
static_assert(!std::is_copy_constructible<devshare::Exporter>::value, "Exporter is move-only");
static_assert(!std::is_copy_assignable<devshare::Exporter>::value, "Exporter is move-only");
static_assert(std::is_nothrow_move_constructible<devshare::Exporter>::value, "Exporter moves are noexcept");
static_assert(std::is_nothrow_move_assignable<devshare::Exporter>::value, "Exporter moves are noexcept");
static_assert(std::is_nothrow_destructible<devshare::Exporter>::value, "Exporter destructor never throws");
static_assert(std::is_nothrow_default_constructible<devshare::Exporter>::value, "empty Exporter is free");
static_assert(!std::is_copy_constructible<devshare::Import>::value, "Import is move-only");
static_assert(!std::is_copy_assignable<devshare::Import>::value, "Import is move-only");
static_assert(std::is_nothrow_move_constructible<devshare::Import>::value, "Import moves are noexcept");
static_assert(std::is_nothrow_move_assignable<devshare::Import>::value, "Import moves are noexcept");
static_assert(std::is_nothrow_destructible<devshare::Import>::value, "Import destructor never throws");
static_assert(!std::is_copy_constructible<devshare::DLPackVersioned>::value, "DLPack owners are move-only");
static_assert(std::is_nothrow_destructible<devshare::DLPackVersioned>::value, "DLPack owners never throw");
static_assert(std::is_trivially_copyable<devshare::Handle>::value, "Handle is plain data");
static_assert(sizeof(devshare::Handle) == sizeof(DevshareHandle), "Handle adds nothing to DevshareHandle");
static_assert(std::is_base_of<std::runtime_error, devshare::Error>::value, "Error is a std::runtime_error");
static_assert(noexcept(std::declval<const devshare::Import&>().data()), "Import::data() is noexcept");
static_assert(!noexcept(std::declval<const devshare::Import&>().data<float>()), "Import::data<T>() checks, and throws");
static_assert(noexcept(std::declval<const devshare::Exporter&>().data()), "Exporter::data is noexcept");
static_assert(noexcept(std::declval<const devshare::Handle&>().shape()), "Handle accessors are noexcept");

// dtype_of<T>: the DLPack codes of the arithmetic types.
static_assert(devshare::same_dtype(devshare::dtype_of<int8_t>(), {DEVSHARE_DTYPE_INT, 8, 1}), "int8");
static_assert(devshare::same_dtype(devshare::dtype_of<int16_t>(), {DEVSHARE_DTYPE_INT, 16, 1}), "int16");
static_assert(devshare::same_dtype(devshare::dtype_of<int32_t>(), {DEVSHARE_DTYPE_INT, 32, 1}), "int32");
static_assert(devshare::same_dtype(devshare::dtype_of<int64_t>(), {DEVSHARE_DTYPE_INT, 64, 1}), "int64");
static_assert(devshare::same_dtype(devshare::dtype_of<long long>(), {DEVSHARE_DTYPE_INT, 64, 1}), "long long");
static_assert(devshare::same_dtype(devshare::dtype_of<uint8_t>(), {DEVSHARE_DTYPE_UINT, 8, 1}), "uint8");
static_assert(devshare::same_dtype(devshare::dtype_of<uint16_t>(), {DEVSHARE_DTYPE_UINT, 16, 1}), "uint16");
static_assert(devshare::same_dtype(devshare::dtype_of<uint32_t>(), {DEVSHARE_DTYPE_UINT, 32, 1}), "uint32");
static_assert(devshare::same_dtype(devshare::dtype_of<uint64_t>(), {DEVSHARE_DTYPE_UINT, 64, 1}), "uint64");
static_assert(devshare::same_dtype(devshare::dtype_of<bool>(), {DEVSHARE_DTYPE_BOOL, 8, 1}), "bool");
static_assert(devshare::same_dtype(devshare::dtype_of<float>(), {DEVSHARE_DTYPE_FLOAT, 32, 1}), "float");
static_assert(devshare::same_dtype(devshare::dtype_of<const double>(), {DEVSHARE_DTYPE_FLOAT, 64, 1}), "double");
static_assert(devshare::same_dtype(devshare::dtype_of<std::complex<float>>(), {DEVSHARE_DTYPE_COMPLEX, 64, 1}),
              "complex64");
static_assert(!devshare::has_dtype_v<char> && !devshare::has_dtype_v<long double> && !devshare::has_dtype_v<void*>,
              "no dtype for char, long double, pointers");
static_assert(devshare::same_dtype(devshare::kBFloat16, {DEVSHARE_DTYPE_BFLOAT, 16, 1}), "kBFloat16");
#if defined(__FLT16_MAX__) && !defined(__STDCPP_FLOAT16_T__) && (defined(__GNUC__) || defined(__clang__))
static_assert(devshare::same_dtype(devshare::dtype_of<_Float16>(), devshare::kFloat16), "_Float16 is float16");
#endif

// [[nodiscard]]: a discarded Result or handle does not compile with -Werror=unused-result; here
// the attribute is checked where the language exposes it: Result is a [[nodiscard]] type.
static_assert(std::is_same<decltype(std::declval<const devshare::Exporter&>().try_share(devshare::bytes())),
                           devshare::Result<devshare::Handle>>::value,
              "try_share_bytes returns Result<Handle>");

void test_struct_helpers_set_struct_size_and_the_defaults() {
    const DevshareTensorDesc d = devshare::tensor_desc();
    check(d.struct_size == sizeof(DevshareTensorDesc) && d.storage_size == DEVSHARE_STORAGE_TO_END && d.ndim == 0 &&
              d.flags == 0 && d.shape == nullptr && d.strides == nullptr && d.storage_offset == 0 &&
              d.tensor_offset == 0 && d.stream == nullptr,
          "devshare::tensor_desc() has struct_size sizeof(DevshareTensorDesc), storage_size "
          "DEVSHARE_STORAGE_TO_END, the rest zero");
    const int64_t shape[1] = {8};
    const DevshareTensorDesc f = devshare::tensor_desc(DevshareDType{DEVSHARE_DTYPE_FLOAT, 32, 1}, 1, shape);
    check(f.struct_size == sizeof(DevshareTensorDesc) && f.dtype.code == DEVSHARE_DTYPE_FLOAT && f.dtype.bits == 32 &&
              f.ndim == 1 && f.shape == shape && f.strides == nullptr && f.storage_size == DEVSHARE_STORAGE_TO_END,
          "devshare::tensor_desc(dtype, ndim, shape) sets those on top of the defaults");
    const DevshareImportOptions o = devshare::import_options(DEVSHARE_IMPORT_READ_ONLY, 0);
    check(o.struct_size == sizeof(DevshareImportOptions) && o.flags == DEVSHARE_IMPORT_READ_ONLY && o.device == 0 &&
              o.reserved == 0 && o.stream == nullptr,
          "devshare::import_options has struct_size sizeof(DevshareImportOptions) and the given fields");
    const DevshareImportOptions def = devshare::import_options();
    check(def.struct_size == sizeof(DevshareImportOptions) && def.flags == 0 &&
              def.device == DEVSHARE_DEVICE_FROM_HANDLE,
          "devshare::import_options() is read-write on the handle's device");
    const DevshareTorchArgs a = devshare::torch_args(DEVSHARE_BACKEND_CUDA);
    check(a.struct_size == sizeof(DevshareTorchArgs) && a.backend == DEVSHARE_BACKEND_CUDA && a.ndim == 0 &&
              a.handle == nullptr && a.ref_name == nullptr,
          "devshare::torch_args(backend) has struct_size sizeof(DevshareTorchArgs), the backend, the rest zero");
    const devshare::TensorDesc td = devshare::TensorDesc::make(devshare::dtype_of<int16_t>(), {2, 5}, {1, 2});
    const DevshareTensorDesc raw = td.raw();
    check(raw.struct_size == sizeof(DevshareTensorDesc) && raw.ndim == 2 && raw.shape == td.shape &&
              raw.strides == td.strides && raw.shape[1] == 5 && raw.strides[1] == 2 &&
              raw.storage_size == DEVSHARE_STORAGE_TO_END,
          "TensorDesc::make copies shape and strides; raw() points at them with struct_size set");
    check(devshare::TensorDesc::make(devshare::dtype_of<int16_t>(), {2, 5}).raw().strides == nullptr,
          "TensorDesc without strides is C-contiguous (strides nullptr)");
}

void test_a_host_allocation_round_trips_through_handle_text_and_bytes() {
    devshare::Exporter exp = make_exporter();
    check(exp && exp.data() != nullptr && exp.size() == 1024, "Exporter::host_alloc gives memory and its size");
    const devshare::Handle h = exp.share(float_desc());
    check(exp.outstanding() == 1, "Exporter::share hands out one reference");
    const std::string text = h.to_text();
    check(text.rfind("devshare1:", 0) == 0 && text.size() + 1 <= DEVSHARE_HANDLE_MAX_TEXT_SIZE,
          "Handle::to_text gives \"devshare1:...\" (" + std::to_string(text.size()) + " characters)");
    const devshare::Handle parsed = devshare::Handle::from_text(text);
    check(parsed == h, "Handle::from_text(to_text()) == the handle");
    const std::vector<uint8_t> bytes = h.encode();
    check(!bytes.empty() && bytes.size() <= DEVSHARE_HANDLE_MAX_ENCODED_SIZE && devshare::Handle::decode(bytes) == h,
          "Handle::decode(encode()) == the handle (" + std::to_string(bytes.size()) + " bytes)");
    bool valid = true;
    try {
        parsed.validate();
    } catch (const devshare::Error&) {
        valid = false;
    }
    check(valid, "Handle::validate accepts a shared handle");

    devshare::Import imp(parsed);
    check(static_cast<bool>(imp) && imp.get() != nullptr, "Import from a parsed handle holds an import");
    const DevshareImportInfo& info = imp.info();
    check(info.struct_size == sizeof(DevshareImportInfo) && info.numel == kRows * kCols && info.element_size == 4 &&
              info.read_only == 0 &&
              static_cast<char*>(info.data) == static_cast<char*>(info.storage) + kTensorOffset * 4,
          "Import::info describes the tensor");
    const float* v = imp.data<const float>();
    bool same = v != nullptr;
    for (int i = 0; same && i < kRows * kCols; i++) {
        same = v[i] == static_cast<float>(i) + 0.5f;
    }
    check(same, "Import::data<const float>() reads what the exporter wrote");
    imp.data<float>()[5] = -7.0f;
    check(tensor_in(exp)[5] == -7.0f, "a write through Import::data is seen in Exporter::data");
    check(imp.handle() == h, "Import::handle() is the imported handle");
    imp.release();
    check(!imp && imp.data() == nullptr && exp.outstanding() == 0 && imp.handle().ndim() == 0,
          "Import::release empties the import and returns the reference");
    imp.release();
    check(!imp, "Import::release on an empty Import does nothing");

    const devshare::Handle whole = exp.share(devshare::bytes());
    check(whole.ndim() == 1 && whole.shape()[0] == 1024 && whole.is<uint8_t>(),
          "Exporter::share_bytes shares the whole allocation as 1-D uint8");
    const DevshareImportOptions ro = devshare::import_options(DEVSHARE_IMPORT_READ_ONLY);
    devshare::Import rimp(whole, ro);
    check(rimp.read_only() && rimp.data<const unsigned char>()[0] == 0,
          "Import with import_options(DEVSHARE_IMPORT_READ_ONLY) is read-only and readable");
    rimp.release();
    check(exp.outstanding() == 0, "the read-only import returned its reference");
    exp.close();
    check(!exp && exp.data() == nullptr && exp.size() == 0, "Exporter::close empties the exporter");
    check(names_gone(h), "after Exporter::close nothing of it is left in /dev/shm");
    exp.close();
    check(!exp, "Exporter::close on an empty Exporter does nothing");
}

void test_moved_from_objects_are_empty_and_move_assignment_frees_the_target() {
    // Exporter: move construction.
    devshare::Exporter a = make_exporter();
    void* mem = a.data();
    devshare::Exporter b(std::move(a));
    check(!a && a.get() == nullptr && a.data() == nullptr && a.size() == 0,
          "moved-from Exporter (move construction) is empty");
    check(b && b.data() == mem && b.size() == 1024, "move-constructed Exporter owns the allocation");

    // A moved-from Exporter's destructor does nothing: the target stays usable.
    devshare::Exporter target;
    {
        devshare::Exporter src = make_exporter();
        src.set_on_destroy(devshare::OnDestroy::wait, std::chrono::milliseconds(5));
        target = std::move(src);
    }
    const devshare::Handle th = target.share(float_desc());
    check(target.outstanding() == 1 && data_name_exists(th) && tensor_in(target)[1] == 1.5f,
          "a moved-from Exporter going out of scope leaves the target open");
    check(target.on_destroy() == devshare::OnDestroy::wait && target.destroy_policy().limit.count() == 5,
          "a move carries the destroy policy");

    // Move assignment into a non-empty Exporter closes what it held.
    const devshare::Handle bh = b.share(devshare::bytes());
    check(data_name_exists(bh), "the first exporter's object exists");
    b = std::move(target);
    check(!data_name_exists(bh), "move-assigning into a non-empty Exporter closes what it held");
    check(!target && b.outstanding() == 1, "after move assignment the source is empty, the target has its state");
    devshare::Exporter& alias = b;
    b = std::move(alias);
    check(b && b.outstanding() == 1, "self move assignment leaves the Exporter as it was");

    // Import: move construction, and a moved-from Import's destructor does nothing.
    devshare::Import held;
    {
        devshare::Import src(th);
        check(b.outstanding() == 1, "one import of the handle: 1 outstanding");
        devshare::Import mid(std::move(src));
        check(!src && src.data() == nullptr && src.info().data == nullptr && src.handle().ndim() == 0,
              "moved-from Import (move construction) is empty");
        held = std::move(mid);
        check(!mid && held && held.handle() == th,
              "moved-from Import (move assignment) is empty, the target holds the import and its handle");
    }
    check(b.outstanding() == 1 && held.data<float>()[1] == 1.5f,
          "moved-from Imports going out of scope did not release: still outstanding and readable");

    // Move assignment into a non-empty Import releases what it held.
    const devshare::Handle th2 = b.share(float_desc());
    devshare::Import other(th2);
    check(b.outstanding() == 2, "two handles imported: 2 outstanding");
    held = std::move(other);
    check(b.outstanding() == 1, "move-assigning into a non-empty Import releases what it held");
    devshare::Import& ialias = held;
    held = std::move(ialias);
    check(held && b.outstanding() == 1, "self move assignment leaves the Import as it was");
    held = devshare::Import();
    check(!held && b.outstanding() == 0, "assigning an empty Import releases");

    // Exporter::release hands ownership back to C; the adopting constructor takes it again.
    const devshare::Handle last = b.share(devshare::bytes());
    DevshareExporter* raw = b.release();
    check(raw != nullptr && !b && data_name_exists(last), "Exporter::release gives up ownership without closing");
    {
        devshare::Exporter again(raw);
        check(again.get() == raw && again.size() == 1024 && again.data() != nullptr,
              "Exporter(DevshareExporter*) adopts a C exporter and reads its memory");
    }
    check(!data_name_exists(last), "the adopting Exporter closed it when destroyed");
    devshare::Exporter adopted(nullptr);
    check(!adopted, "Exporter(nullptr) is empty");
}

void test_failures_throw_devshare_error_with_the_status_and_message() {
    expect_error(DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text", "Handle::from_text(\"devshare1:not*base64\")",
                 [] { (void)devshare::Handle::from_text("devshare1:not*base64"); });
    expect_error(DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text", "Handle::from_text(\"hello\")",
                 [] { (void)devshare::Handle::from_text(std::string("hello")); });
    try {
        (void)devshare::Handle::from_text("nonsense");
        check(false, "invalid text is caught as std::runtime_error");
    } catch (const std::runtime_error& e) {
        check(std::strstr(e.what(), "devshare_handle_from_text") != nullptr,
              "devshare::Error is caught as std::runtime_error with the library's message");
    }
    try {
        (void)devshare::Handle::from_text("nonsense");
    } catch (const devshare::Error& e) {
        const std::error_code ec = e.code();
        check(ec.value() == DEVSHARE_STATUS_BAD_TEXT && &ec.category() == &devshare::error_category() &&
                  std::strcmp(ec.category().name(), "devshare") == 0 &&
                  ec.message() == devshare_status_str(DEVSHARE_STATUS_BAD_TEXT) &&
                  std::strcmp(e.message(), e.what()) == 0,
              "Error::code() is a std::error_code of the devshare category with the status and its text");
    }
    check(devshare::make_error_code(DEVSHARE_STATUS_TIMEOUT) == std::errc::timed_out &&
              devshare::make_error_code(DEVSHARE_STATUS_BUSY) == std::errc::device_or_resource_busy &&
              devshare::make_error_code(DEVSHARE_STATUS_INVALID_ARGUMENT) == std::errc::invalid_argument &&
              devshare::make_error_code(DEVSHARE_STATUS_BAD_TEXT) != std::errc::invalid_argument &&
              !devshare::make_error_code(DEVSHARE_STATUS_OK),
          "devshare error codes compare equal to the matching std::errc conditions; OK is no error");
    expect_error(DEVSHARE_STATUS_INVALID_HANDLE, "devshare_handle_validate", "Handle().validate()",
                 [] { devshare::Handle().validate(); });
    expect_error(DEVSHARE_STATUS_INVALID_HANDLE, "devshare_handle_to_text", "Handle().to_text()",
                 [] { (void)devshare::Handle().to_text(); });

    devshare::Exporter exp = make_exporter();
    const devshare::Handle h = exp.share(float_desc());
    std::vector<uint8_t> bytes = h.encode();
    bytes[bytes.size() / 2] ^= 0x10;
    expect_error(DEVSHARE_STATUS_CHECKSUM_MISMATCH, "devshare_handle_decode", "Handle::decode of a damaged encoding",
                 [&] { (void)devshare::Handle::decode(bytes); });
    bytes = h.encode();
    bytes.pop_back();
    expect_error(DEVSHARE_STATUS_TRUNCATED, "devshare_handle_decode", "Handle::decode of a cut encoding",
                 [&] { (void)devshare::Handle::decode(bytes); });

    DevshareTensorDesc d = float_desc();
    d.ndim = 9;
    expect_error(DEVSHARE_STATUS_BAD_NDIM, "devshare_exporter_share", "Exporter::share with ndim 9",
                 [&] { (void)exp.share(d); });
    DevshareTensorDesc unsized = float_desc();
    unsized.struct_size = 0;
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_exporter_share",
                 "Exporter::share with a desc whose struct_size is 0 (not initialised)",
                 [&] { (void)exp.share(unsized); });
    const DevshareImportOptions bad = devshare::import_options(0x80000000u);
    expect_error(DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_import",
                 "Import with an import flag this library does not know", [&] { devshare::Import imp(h, bad); });
    check(exp.outstanding() == 1, "a failed Import constructor leaves the reference outstanding");
    {
        devshare::Import imp(h);
    }
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare_import", "Import of a handle whose reference came back",
                 [&] { devshare::Import imp(h); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe", "devshare::probe(0)",
                 [] { (void)devshare::probe(0); });
    const DevshareBackendInfo host = devshare::probe(DEVSHARE_BACKEND_HOST);
    check(host.usable == 1 && host.struct_size == sizeof host && std::strcmp(host.name, "host") == 0,
          "devshare::probe(host) is usable, struct_size is sizeof(DevshareBackendInfo)");
    check(devshare::version() == DEVSHARE_VERSION, "devshare::version() == DEVSHARE_VERSION");
    check(devshare::local_pid(DEVSHARE_BACKEND_HOST) == static_cast<int32_t>(getpid()),
          "devshare::local_pid(host) is getpid()");
    devshare::allow_ptrace(0);
    check(true, "devshare::allow_ptrace(0) (nobody) succeeds");
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_host_alloc", "Exporter::host_alloc(UINT64_MAX)",
                 [] { (void)devshare::Exporter::host_alloc(UINT64_MAX); });
    const devshare::Exporter empty;
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_outstanding", "outstanding() of an empty Exporter",
                 [&] { (void)empty.outstanding(); });
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare::Import::as", "as<float>() of an empty Import",
                 [] { (void)devshare::Import().as<float>(); });
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_to_dlpack_versioned",
                 "to_dlpack_versioned() of an empty Import", [] { (void)devshare::Import().to_dlpack_versioned(); });
}

// The typed share: share<T>(first, shape, strides), share_at<T>(offset, ...), an explicit dtype.
void test_typed_shares_record_dtype_shape_and_offsets_and_refuse_bad_layouts() {
    devshare::Exporter exp = make_exporter();
    const float* first = tensor_in(exp);
    const devshare::Handle typed = exp.share(devshare::describe(first, {kRows, kCols}));
    check(typed.is<float>() && typed.ndim() == 2 && typed.shape() == devshare::Dims(kShape) &&
              typed.strides() == devshare::Dims({kCols, 1}) && typed.storage_offset() == 0 &&
              typed.tensor_offset() == static_cast<int64_t>((kStorageOffset / 4) + kTensorOffset) &&
              typed.storage_size() == 1024 && typed.alloc_size() == 1024,
          "share(const float*, {rows, cols}): float32, C-contiguous strides, storage the whole allocation, the "
          "tensor offset computed from the pointer");
    check(typed.backend() == DEVSHARE_BACKEND_HOST && typed.device() == 0 && !typed.segmented() &&
              !typed.has_event() && typed.producer_pid() == static_cast<int32_t>(getpid()) && typed.numel() == 12 &&
              typed.element_size() == 4 && typed.flags() == 0,
          "Handle accessors: backend host, device 0, not segmented, no event, this pid, 12 elements of 4 bytes");
    devshare::ShareOptions in_storage;
    in_storage.storage_offset = kStorageOffset;
    in_storage.storage_size = 256;
    const devshare::Handle same_as_desc = exp.share(devshare::describe(first, {kRows, kCols}, {}, in_storage));
    check(same_as_desc.storage_offset() == kStorageOffset && same_as_desc.storage_size() == 256 &&
              same_as_desc.tensor_offset() == kTensorOffset,
          "ShareOptions storage_offset / storage_size: the tensor offset is counted from the storage's start");
    const devshare::Handle at = exp.share(devshare::describe_at<float>(kStorageOffset + kTensorOffset * 4, {kRows, kCols}));
    check(at.tensor_offset() == typed.tensor_offset() && at.is<float>(),
          "share_at<float>(byte offset) is share(pointer) with the offset");
    const devshare::Handle from_void = exp.share(devshare::describe<float>(exp.data(), {4}));
    check(from_void.tensor_offset() == 0 && from_void.numel() == 4, "share<float>(void*) names T explicitly");
    const devshare::Handle bf16 = exp.share(devshare::describe(devshare::kBFloat16, exp.data(), {8, 2}, {1, 8}));
    check(devshare::same_dtype(bf16.dtype(), devshare::kBFloat16) && bf16.strides() == devshare::Dims({1, 8}),
          "share(kBFloat16, ptr, shape, strides): the explicit dtype and the strides given");
    const devshare::Handle transposed = exp.share(devshare::describe(first, {kCols, kRows}, {1, kCols}));
    check(transposed.strides()[0] == 1 && transposed.strides()[1] == kCols, "share with strides keeps them");
    const devshare::Handle scalar = exp.share(devshare::describe(reinterpret_cast<const int64_t*>(exp.data()) + 3, {}));
    check(scalar.ndim() == 0 && scalar.numel() == 1 && scalar.is<int64_t>() && scalar.tensor_offset() == 3,
          "share(const int64_t*, {}) shares a 0-d tensor");
    check(exp.outstanding() == 7, "each typed share is one reference (7)");

    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Exporter::share", "share of a pointer outside the "
                 "allocation", [&] { (void)exp.share(devshare::describe(first + 1000, {1})); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Exporter::share",
                 "share<float> of an address that is not a whole number of floats into the storage",
                 [&] { (void)exp.share(devshare::describe<float>(static_cast<const char*>(exp.data()) + 2, {1})); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Exporter::share: devshare::TensorDesc", "share with 1 stride for 2 dimensions",
                 [&] { (void)exp.share(devshare::describe(first, {kRows, kCols}, {1})); });
    expect_error(DEVSHARE_STATUS_BAD_NDIM, "devshare::Exporter::share: devshare::TensorDesc", "share with 9 dimensions",
                 [&] { (void)exp.share(devshare::describe(first, {1, 1, 1, 1, 1, 1, 1, 1, 1})); });
    expect_error(DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS, "devshare_exporter_share",
                 "share of a tensor running past the allocation (the library's check)",
                 [&] { (void)exp.share(devshare::describe(first, {1000})); });
    const devshare::Exporter empty;
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare::Exporter::share", "share of an empty Exporter",
                 [&] { (void)empty.share(devshare::describe(first, {1})); });
    check(exp.outstanding() == 7, "refused shares handed out nothing");
    const devshare::TensorDesc desc = devshare::describe(first, {kRows, kCols});
    check(desc.first == devshare::TensorDesc::First::address && desc.address == first && desc.ndim == 2 &&
              !desc.has_strides && desc.problem == DEVSHARE_STATUS_OK,
          "describe records the first element's address, the shape and no strides");
    const devshare::Handle again = exp.share(desc);
    check(again.tensor_offset() == typed.tensor_offset() && again.ndim() == 2 && exp.outstanding() == 8,
          "share(describe(...)) is what share with the same arguments was: one new reference");
    const devshare::Result<devshare::TensorDesc> bad = devshare::TensorDesc::try_make(devshare::dtype_of<float>(), {1, 2}, {1});
    check(!bad && bad.error().status() == DEVSHARE_STATUS_INVALID_ARGUMENT, "TensorDesc::try_make refuses at once");
    
}

void test_import_as_checks_the_dtype_and_views_index_the_tensor() {
    devshare::Exporter exp = make_exporter();
    const float* first = tensor_in(exp);
    devshare::Import imp(exp.share(devshare::describe(first, {kRows, kCols})));
    const devshare::TensorView<float> v = imp.as<float>();
    check(v.ndim() == 2 && v.shape() == devshare::Dims(kShape) && v.strides() == devshare::Dims({kCols, 1}) &&
              v.numel() == 12 && v.is_contiguous() && v.data() == imp.data(),
          "Import::as<float>() on a float32 tensor: a view with the handle's shape and strides");
    check(v(0, 0) == 0.5f && v(1, 2) == 6.5f && v(2, 3) == 11.5f && v.at({2, 1}) == 9.5f,
          "TensorView(i, j) and at({i, j}) index row-major");
    v(1, 1) = 42.0f;
    check(tensor_in(exp)[5] == 42.0f, "a write through the view reaches the exporter's memory");
    const devshare::Span<float> flat = v.flat();
    check(flat.size() == 12 && flat[5] == 42.0f, "flat() of a contiguous view spans every element");
    check(imp.dtype().bits == 32 && imp.ndim() == 2 && imp.shape()[1] == kCols && imp.strides()[0] == kCols &&
              imp.numel() == 12 && imp.element_size() == 4 && !imp.read_only() &&
              imp.backend() == DEVSHARE_BACKEND_HOST && imp.device() == 0,
          "Import accessors: dtype, ndim, shape, strides, numel, element size, read-only, backend, device");

    expect_error(DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::as<int32>", "as<int32_t>() of a float32 tensor",
                 [&] { (void)imp.as<int32_t>(); });
    expect_error(DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::as<float64>", "as<double>() of a float32 tensor",
                 [&] { (void)imp.as<double>(); });
    expect_error(DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::data<uint32>", "data<uint32_t>() of a float32 tensor",
                 [&] { (void)imp.data<uint32_t>(); });
    check(imp.data<float>() == imp.data() && imp.data<std::byte>() == imp.data(),
          "Import::data<T>() only for the tensor's T (no reinterpretation); std::byte is unchecked");

    devshare::Import t(exp.share(devshare::describe(first, {kCols, kRows}, {1, kCols})));
    const devshare::TensorView<const float> tv = t.as<const float>();
    check(tv(3, 2) == 11.5f && tv(1, 0) == 1.5f && !tv.is_contiguous(),
          "a transposed handle's view indexes through its strides");
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::TensorView::flat", "flat() of a transposed view",
                 [&] { (void)tv.flat(); });

    devshare::Import ro(exp.share(devshare::describe(first, {kRows, kCols})), devshare::import_options(DEVSHARE_IMPORT_READ_ONLY));
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Import::as<float32>",
                 "as<float>() (writable) of a read-only import", [&] { (void)ro.as<float>(); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Import::data<float32>",
                 "data<float>() (writable) of a read-only import", [&] { (void)ro.data<float>(); });
    check(ro.as<const float>()(2, 3) == 11.5f && ro.data<const float>() == ro.data(),
          "a read-only import gives as<const float>() and data<const float>(), not the writable forms");
#if defined(__cpp_lib_mdspan)
    const auto md = imp.as<float>().mdspan<2>();
    check(md.extent(0) == kRows && md.extent(1) == kCols && md[1, 2] == 6.5f, "TensorView::mdspan<2>() indexes alike");
    const auto mt = tv.mdspan<2>();
    check(mt.extent(0) == kCols && mt.stride(0) == 1 && mt.stride(1) == kCols && mt[3, 2] == 11.5f,
          "mdspan<2>() of a transposed view: layout_stride with the handle's strides");
    expect_error(DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorView::mdspan<3>", "mdspan<3>() of a 2-d view",
                 [&] { (void)imp.as<float>().mdspan<3>(); });
    devshare::Import bc(exp.share(devshare::describe(first, {kRows, kCols}, {0, 1})));
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::TensorView::mdspan",
                 "mdspan<2>() of a broadcast view (stride 0), which layout_stride cannot express",
                 [&] { (void)bc.as<float>().mdspan<2>(); });
#else
    std::printf("# SKIP std::mdspan: this standard library has no __cpp_lib_mdspan\n");
#endif
}

// The typed accessors check in every build, NDEBUG or not: no pointer of another dtype, no
// element read with too few or too many indices, none outside the shape.
void test_typed_accessors_refuse_a_wrong_dtype_rank_or_index_in_every_build() {
    devshare::Exporter exp = devshare::Exporter::host_alloc(1024);
    double* d = exp.data<double>();
    for (int i = 0; i < 24; i++) {
        d[i] = i;
    }
    devshare::Import f64(exp.share(devshare::describe(static_cast<const double*>(d), {24})));
    expect_error(DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::data<float32>",
                 "data<const float>() of a float64 tensor", [&] { (void)f64.data<const float>(); });
    expect_error(DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::data<int64>", "data<int64_t>() of a float64 tensor",
                 [&] { (void)f64.data<int64_t>(); });
    check(f64.data<const double>() == f64.data() && f64.data<double>() == f64.data(),
          "data<const double>() and data<double>() of a float64 tensor: its first element");

    devshare::Import cube(exp.share(devshare::describe(static_cast<const double*>(d), {2, 3, 4})));
    const devshare::TensorView<const double> v = cube.as<const double>();
    check(v(1, 2, 3) == 23.0 && v.at({1, 0, 2}) == 14.0, "a 3-d view indexed with three indices");
    expect_error(DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorView::operator()", "v(i, j) of a 3-d view",
                 [&] { sink = v(1, 2); });
    expect_error(DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorView::operator()", "v(i, j, k, l) of a 3-d view",
                 [&] { sink = v(1, 2, 3, 0); });
    expect_error(DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorView::at", "at({i, j}) of a 3-d view",
                 [&] { sink = v.at({1, 2}); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::TensorView::operator()",
                 "v(0, 0, 4) of a [2, 3, 4] view (index past the extent)", [&] { sink = v(0, 0, 4); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::TensorView::at", "at({-1, 0, 0}) (a negative index)",
                 [&] { sink = v.at({-1, 0, 0}); });
    const devshare::Result<const double*> two = v.try_at({1, 2});
    check(!two && two.error().status() == DEVSHARE_STATUS_BAD_NDIM && v.try_at({1, 2, 3}).value() == &v(1, 2, 3),
          "try_at({i, j}) of a 3-d view is a BAD_NDIM Result; try_at({i, j, k}) the element's address");
    check(v.unchecked(1, 2, 3) == 23.0 && &v.unchecked(0, 1, 2) == &v(0, 1, 2),
          "unchecked(i, j, k) is the element v(i, j, k) is, without the checks");
    const devshare::Result<const float*> as_float = f64.try_data<const float>();
    check(!as_float && as_float.error().status() == DEVSHARE_STATUS_BAD_DTYPE &&
              f64.try_data<const double>().value() == f64.data(),
          "try_data<const float>() of a float64 tensor is a BAD_DTYPE Result; try_data<const double>() its data");
    const devshare::TensorView<float> none;
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare::TensorView::operator()", "v() of an empty view",
                 [&] { sink = none(); });
}

// A view outlives the Import it came from without reading unmapped memory: once the Import is
// released, destroyed or assigned over, its views report ALREADY_RELEASED.
void test_a_view_used_after_its_import_was_released_fails_cleanly() {
    devshare::Exporter exp = make_exporter();
    const float* first = tensor_in(exp);
    devshare::Import imp(exp.share(devshare::describe(first, {kRows, kCols})));
    const devshare::TensorView<const float> v = imp.as<const float>();
    devshare::Import moved = std::move(imp);
    check(v(2, 3) == 11.5f, "a view stays valid when its Import is moved");
    moved.release();
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare::TensorView::operator()",
                 "v(i, j) after its Import was released", [&] { sink = v(2, 3); });
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare::TensorView::at",
                 "at({i, j}) after its Import was released", [&] { sink = v.at({0, 0}); });
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare::TensorView::flat",
                 "flat() after its Import was released", [&] { sink = v.flat()[0]; });

    devshare::TensorView<const float> outlived;
    {
        devshare::Import scoped(exp.share(devshare::describe(first, {kRows, kCols})));
        outlived = scoped.as<const float>();
    }
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare::TensorView::operator()",
                 "v(i, j) after its Import was destroyed", [&] { sink = outlived(0, 1); });

    devshare::Import reused(exp.share(devshare::describe(first, {kRows, kCols})));
    const devshare::TensorView<const float> old = reused.as<const float>();
    reused = devshare::Import(exp.share(devshare::describe(first, {kRows, kCols})));
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare::TensorView::operator()",
                 "v(i, j) after its Import was assigned another import", [&] { sink = old(0, 1); });
    check(reused.as<const float>()(0, 1) == 1.5f, "the new import's view reads it");
    check(!old.valid() && old.data() == nullptr && old.ndim() == 2 && reused.as<const float>().valid(),
          "a released view is not valid() and its data() is nullptr; its shape stays readable");
    const devshare::Result<const float*> gone = old.try_at({0, 1});
    check(!gone && gone.error().status() == DEVSHARE_STATUS_ALREADY_RELEASED,
          "try_at of a released view is an ALREADY_RELEASED Result");
}

// Result<T> next to the throwing forms: the same calls, no exceptions.
void test_try_forms_return_errors_as_results_without_throwing() {
    devshare::Result<devshare::Exporter> exp = devshare::Exporter::try_host_alloc(256);
    check(exp.has_value() && static_cast<bool>(exp) && exp->size() == 256,
          "try_host_alloc: a Result holding the Exporter");
#if !DEVSHARE_HPP_STD_EXPECTED
    check(exp.status() == DEVSHARE_STATUS_OK && !exp.code() && exp.error().status() == DEVSHARE_STATUS_OK,
          "devshare's own Result (C++17): status OK and an empty error_code on success");
#else
    static_assert(std::is_same<devshare::Result<int>, std::expected<int, devshare::Error>>::value,
                  "Result is std::expected where the standard library has it");
#endif
    devshare::Result<devshare::Exporter> bad = devshare::Exporter::try_host_alloc(UINT64_MAX);
    check(!bad && bad.error().status() == DEVSHARE_STATUS_INVALID_ARGUMENT &&
              bad.error().code() == std::errc::invalid_argument &&
              std::strncmp(bad.error().what(), "devshare_host_alloc:", 20) == 0,
          "try_host_alloc(UINT64_MAX): an error Result with the status and the library's message");
    bool threw = false;
    try {
        (void)devshare::Exporter::host_alloc(UINT64_MAX);
    } catch (const devshare::Error& e) {
        threw = e.status() == DEVSHARE_STATUS_INVALID_ARGUMENT;
    }
    check(threw, "the throwing form throws the devshare::Error itself (also where Result is std::expected)");
#if !DEVSHARE_HPP_STD_EXPECTED
    threw = false;
    try {
        (void)std::move(bad).value();
    } catch (const devshare::Error& e) {
        threw = e.status() == DEVSHARE_STATUS_INVALID_ARGUMENT;
    }
    check(threw, "Result::value() of an error throws its devshare::Error");
#endif
    const devshare::Result<uint64_t> n = exp->try_outstanding();
    check(n && *n == 0 && n.value_or(7) == 0, "try_outstanding: Result<uint64_t>");
    const devshare::Result<uint64_t> none = devshare::Exporter().try_outstanding();
    check(!none && none.value_or(7) == 7, "Result::value_or gives the fallback on error");
    const devshare::Result<devshare::Handle> h = exp->try_share(devshare::describe<uint8_t>(exp->data(), {16}));
    check(h && h->numel() == 16, "try_share<uint8_t>");
    const devshare::Result<void> discarded = h->try_discard();
    const devshare::Result<void> again = h->try_discard();
    check(discarded && !again && again.error().status() == DEVSHARE_STATUS_ALREADY_RELEASED,
          "Result<void>: try_discard succeeds once, then ALREADY_RELEASED");
    const devshare::Result<bool> w = exp->try_wait(std::chrono::milliseconds(0));
    check(w && *w, "try_wait: Result<bool> true once nothing is outstanding");
    check(exp->try_close().has_value() && !*exp, "try_close closes");
}

// Byte encoding and text: share_encoded, Import::from_encoded, Import::from_text.
void test_imports_from_encoded_bytes_and_text_return_their_reference() {
    devshare::Exporter exp = make_exporter();
    const std::vector<uint8_t> enc = exp.share_encoded(devshare::describe(tensor_in(exp), {kRows, kCols}));
    check(!enc.empty() && enc.size() <= DEVSHARE_HANDLE_MAX_ENCODED_SIZE && exp.outstanding() == 1,
          "Exporter::share_encoded gives the encoding of one new reference");
    {
        devshare::Import imp = devshare::Import::from_encoded(enc);
        check(imp.as<const float>()(2, 3) == 11.5f && imp.handle() == devshare::Handle::decode(enc),
              "Import::from_encoded imports it");
    }
    check(exp.outstanding() == 0, "its release returned the reference");
    const std::vector<uint8_t> whole = exp.share_encoded(devshare::bytes());
    const std::string text = devshare::Handle::decode(whole).to_text();
    {
        devshare::Import imp = devshare::Import::from_text(text);
        check(imp.numel() == 1024 && imp.as<const uint8_t>().ndim() == 1, "Import::from_text imports handle text");
    }
    expect_error(DEVSHARE_STATUS_BAD_MAGIC, "devshare_import_encoded", "Import::from_encoded of other bytes",
                 [] { (void)devshare::Import::from_encoded(std::vector<uint8_t>(64, 0x55)); });
    expect_error(DEVSHARE_STATUS_BAD_TEXT, "devshare_import_text", "Import::from_text of other text",
                 [] { (void)devshare::Import::from_text("devshare1:@@"); });
    check(exp.segment_table().empty(), "Exporter::segment_table() of a host export is empty");
}

// Returning references without importing: Handle::discard, torch_discard.
void test_discard_returns_an_unused_handles_reference_and_refuses_a_held_one() {
    devshare::Exporter exp = make_exporter();
    const devshare::Handle h = exp.share(devshare::bytes());
    const devshare::Handle held = exp.share(devshare::bytes());
    h.discard();
    check(exp.outstanding() == 1, "Handle::discard returns exactly that handle's reference");
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare_handle_discard", "Handle::discard again",
                 [&] { h.discard(); });
    devshare::Import imp(held);
    expect_error(DEVSHARE_STATUS_BUSY, "devshare_handle_discard", "Handle::discard of a handle an import holds",
                 [&] { held.discard(); });
    imp.release();
    check(exp.outstanding() == 0, "the refused discard left the reference to the release");

    const devshare::Handle t = exp.share(devshare::bytes());
    DevshareTorchArgs a = devshare::torch_args();
    a.ref_name = t.raw().ref_name;
    a.ref_name_len = t.raw().ref_name_len;
    a.ref_slot = t.raw().ref_slot;
    devshare::torch_discard(a);
    check(exp.outstanding() == 0, "devshare::torch_discard returns a tuple's reference");
    a.ref_slot = DEVSHARE_REF_SLOTS;
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_torch_discard", "torch_discard of slot 10000",
                 [&] { devshare::torch_discard(a); });
}

// Exporter::host_adopt: export an existing object (here another exporter's) without copying.
void test_host_adopt_maps_the_same_object_and_refuses_a_wrong_size() {
    devshare::Exporter exp = make_exporter();
    const devshare::Handle h = exp.share(devshare::bytes());
    const std::string name(reinterpret_cast<const char*>(h.raw().key), h.raw().key_len);
    devshare::Exporter adopted = devshare::Exporter::host_adopt(name, 1024);
    check(adopted && adopted.size() == 1024 && adopted.data() != exp.data() &&
              std::memcmp(adopted.data(), exp.data(), 1024) == 0,
          "Exporter::host_adopt maps the same object: the same bytes at another address");
    expect_error(DEVSHARE_STATUS_MISMATCH, "devshare_host_adopt", "host_adopt with the wrong size",
                 [&] { (void)devshare::Exporter::host_adopt(name, 1025); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_host_adopt", "host_adopt of a name without '/'",
                 [] { (void)devshare::Exporter::host_adopt("no-slash", 64); });
    h.discard();
}

void test_dlpack_tensors_hold_the_reference_until_their_last_deleter() {
    devshare::Exporter exp = make_exporter();
    devshare::DLPackVersioned v;
    devshare::DLPackLegacy l;
    {
        devshare::Import imp(exp.share(devshare::describe(tensor_in(exp), {kRows, kCols})),
                             devshare::import_options(DEVSHARE_IMPORT_READ_ONLY));
        v = imp.to_dlpack_versioned();
        l = imp.to_dlpack();
        check(v && v.get() != nullptr && v.version_major() == 1 && v.read_only() && v.data() == imp.data() &&
                  v.ndim() == 2 && v.shape() == devshare::Dims(kShape) &&
                  v.strides() == devshare::Dims({kCols, 1}) && devshare::same_dtype(v.dtype(), imp.dtype()) &&
                  v.device_type() == 1 && v.device_id() == 0 && v.byte_offset() == 0,
              "Import::to_dlpack_versioned: DLPack 1.x, read-only, the tensor's data, shape, strides, dtype, kDLCPU");
        check(l && l.data() == imp.data() && l.shape()[1] == kCols, "Import::to_dlpack (legacy) describes the same");
    }
    check(exp.outstanding() == 1, "the DLPack tensors keep the reference after the Import is released");
    v.reset();
    check(!v && exp.outstanding() == 1, "reset() runs one deleter: the other tensor still holds it");
    DLManagedTensor* raw = l.release();
    check(!l && raw != nullptr && exp.outstanding() == 1, "release() hands the tensor over without its deleter");
    {
        devshare::DLPackLegacy back(raw);
    }
    check(exp.outstanding() == 0, "the owner's destructor ran the last deleter: the reference is back");
}

// PyTorch tuples without a device: a CUDA storage handle and a torch_npu segmented 'e' handle.
void test_torch_tuples_convert_to_handles_and_back() {
    // A PyTorch CUDA tuple's storage part: the raw 64-byte IPC handle.
    devshare::TorchStorage s;
    s.device = 0;
    s.handle.assign(64, 0);
    for (size_t i = 0; i < 64; i++) {
        s.handle[i] = static_cast<uint8_t>(i * 3 + 1);
    }
    s.storage_size = 4096;
    s.storage_offset = 8192;
    s.ref_name = "/torch_777_99_1";
    s.ref_slot = 3;
    const int64_t shape[2] = {16, 64};
    const DevshareTorchArgs a = devshare::torch_args(DEVSHARE_BACKEND_CUDA, s, devshare::dtype_of<float>(), shape);
    const devshare::Handle h = devshare::handle_from_torch(a);
    check(h.backend() == DEVSHARE_BACKEND_CUDA && h.is<float>() && h.shape() == devshare::Dims(shape) &&
              h.storage_offset() == 8192 && h.storage_size() == 4096 && h.producer_pid() == 777,
          "handle_from_torch: a cuda handle with the tuple's dtype, shape, offsets and the pid of its ref name");
    const devshare::TorchStorage back = devshare::handle_to_torch(h);
    check(back.handle == s.handle && back.storage_size == 4096 && back.storage_offset == 8192 &&
              back.ref_name == s.ref_name && back.ref_slot == 3 && !back.event_sync_required &&
              back.raw.struct_size == sizeof(DevshareTorchStorage),
          "handle_to_torch gives the tuple back: the 64-byte handle, offsets, ref name and slot");
    check(devshare::torch_storage_handle(h) == s.handle, "torch_storage_handle gives the raw 64-byte handle");
    const std::vector<uint8_t> enc = devshare::handle_from_torch_encoded(a);
    check(devshare::Handle::decode(enc) == h, "handle_from_torch_encoded is the encoding of that handle");

    // torch_npu 'e': [1]['e'][u64 segment size][u64 n][n x u64 handles].
    std::vector<uint8_t> e = {1, 'e'};
    auto put64 = [&e](uint64_t x) {
        const uint8_t* p = reinterpret_cast<const uint8_t*>(&x);
        e.insert(e.end(), p, p + 8);
    };
    put64(DEVSHARE_SEGMENT_GRANULARITY);
    put64(2);
    put64(0x1111);
    put64(0x2222);
    devshare::TorchStorage ns;
    ns.handle = e;
    ns.storage_size = 4096;
    ns.ref_name = "/torch_777_99_1";
    const int64_t n16[1] = {16};
    const devshare::Handle seg =
        devshare::handle_from_torch(devshare::torch_args(DEVSHARE_BACKEND_ACL, ns, devshare::kFloat16, n16));
    check(seg.segmented() && seg.backend() == DEVSHARE_BACKEND_ACL &&
              devshare::same_dtype(seg.dtype(), devshare::kFloat16),
          "handle_from_torch of a torch_npu 'e' handle: a segmented acl handle (float16 as kFloat16)");
    check(devshare::handle_to_torch(seg).handle == e, "handle_to_torch writes the same 'e' bytes back");
    check(devshare::handle_to_torch(seg, {}, DEVSHARE_TORCH_FORMAT_V1).handle == e &&
              devshare::torch_storage_handle(seg, {}, DEVSHARE_TORCH_FORMAT_V1) == e,
          "with torch_npu's format named: the same bytes");
    expect_error(DEVSHARE_STATUS_UNSUPPORTED, "devshare_handle_to_torch_as", "a torch_npu 'e' handle as version 3",
                 [&] { (void)devshare::handle_to_torch(seg, {}, DEVSHARE_TORCH_FORMAT_V3); });

    // The version bridge: a torch 2.13 'c' handle for a torch 2.11 consumer, and back.
    std::vector<uint8_t> c3 = {3, 'c'};
    c3.resize(66, 0x42);
    const uint32_t f211 = devshare::torch_format_for_version(DEVSHARE_BACKEND_CUDA, "2.11.0+cu128");
    const std::vector<uint8_t> c2 = devshare::torch_handle_convert(DEVSHARE_BACKEND_CUDA, c3, f211);
    check(f211 == DEVSHARE_TORCH_FORMAT_V2 && c2.size() == 66 && c2[0] == 2 && c2[1] == 'c' &&
              std::equal(c2.begin() + 2, c2.end(), c3.begin() + 2),
          "torch_handle_convert: [3]['c'] to torch 2.11's [2]['c'], same key");
    check(devshare::torch_handle_convert(DEVSHARE_BACKEND_CUDA, c2, DEVSHARE_TORCH_FORMAT_V3) == c3,
          "and back to version 3");
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_torch_format_for_version", "a version without a minor",
                 [&] { (void)devshare::torch_format_for_version(DEVSHARE_BACKEND_CUDA, "2"); });
    const devshare::Result<std::vector<uint8_t>> refused =
        devshare::try_torch_handle_convert(DEVSHARE_BACKEND_ACL, e, DEVSHARE_TORCH_FORMAT_V2);
    check(!refused && refused.error().status() == DEVSHARE_STATUS_UNSUPPORTED,
          "try_torch_handle_convert of a torch_npu 'e' handle to version 2: UNSUPPORTED, no throw");

    DevshareTorchArgs broken = a;
    broken.dtype = devshare::make_dtype(DEVSHARE_DTYPE_OPAQUE_HANDLE, 64);
    expect_error(DEVSHARE_STATUS_BAD_DTYPE, "devshare_handle_from_torch", "handle_from_torch with an opaque dtype",
                 [&] { (void)devshare::handle_from_torch(broken); });
    expect_error(DEVSHARE_STATUS_BAD_DTYPE, "devshare_import_torch", "Import::from_torch with an opaque dtype",
                 [&] { (void)devshare::Import::from_torch(broken); });
    devshare::Exporter exp = make_exporter();
    const devshare::Handle host = exp.share(devshare::bytes());
    expect_error(DEVSHARE_STATUS_UNSUPPORTED, "devshare_handle_to_torch", "handle_to_torch of a host handle",
                 [&] { (void)devshare::handle_to_torch(host); });
    host.discard();
}

// The destructor policy, and the other device-only wrappers, over the CUDA stand-in.
DevshareExporter* g_leaked = nullptr;
int32_t g_leak_status = 0;
std::string g_leak_message;

void record_leak(DevshareExporter* e, int32_t status, const char* message) {
    g_leaked = e;
    g_leak_status = status;
    g_leak_message = message;
}

void test_exporter_destruction_never_forces_a_busy_device_export_unless_asked() {
    const char* lib = std::getenv("DEVSHARE_CUDA_LIBRARY");
    if (lib == nullptr || !devshare::probe(DEVSHARE_BACKEND_CUDA).usable) {
        std::printf("# SKIP device cases: DEVSHARE_CUDA_LIBRARY does not name the CUDA stand-in\n");
        return;
    }
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        check(false, "CUDA stand-in: a current context");
        return;
    }
    constexpr size_t kBlock = 1 << 20;
    CUdeviceptr blocks[5] = {};
    for (CUdeviceptr& b : blocks) {
        if (cuMemAlloc(&b, kBlock) != CUDA_SUCCESS) {
            check(false, "CUDA stand-in: cuMemAlloc");
            return;
        }
    }
    auto ptr = [](CUdeviceptr p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); };
    const devshare::ExporterLeakHandler previous = devshare::set_exporter_leak_handler(&record_leak);

    // close(): a busy device export is refused and stays usable.
    devshare::Exporter e0 = devshare::Exporter::export_memory(DEVSHARE_BACKEND_CUDA, 0, ptr(blocks[0]), kBlock, 0,
                                                              devshare::OnDestroy::leak_and_report);
    const devshare::Handle h0 = e0.share(devshare::describe(static_cast<const float*>(e0.data()) + 16, {8, 8}));
    check(h0.backend() == DEVSHARE_BACKEND_CUDA && h0.tensor_offset() == 16 && e0.outstanding() == 1,
          "export_memory (cuda) + share<float>(device pointer): a cuda handle with the offset");
    expect_error(DEVSHARE_STATUS_BUSY, "devshare_exporter_close", "Exporter::close() of a busy device export",
                 [&] { e0.close(); });
    check(static_cast<bool>(e0), "the refused close left the Exporter open");
    const devshare::TorchStorage ts = devshare::handle_to_torch(h0);
    check(ts.handle.size() == 64 && std::memcmp(ts.handle.data(), h0.raw().key, 64) == 0 &&
              ts.storage_offset == h0.storage_offset(),
          "handle_to_torch of a cuda handle: the raw 64-byte IPC handle");

    // OnDestroy::leak_and_report (chosen at construction): the destructor does not force; the busy
    // export is left open and reported.
    g_leaked = nullptr;
    check(devshare::Exporter().on_destroy() == devshare::OnDestroy::wait &&
              devshare::Exporter().destroy_policy().limit == devshare::kForever &&
              e0.on_destroy() == devshare::OnDestroy::leak_and_report,
          "the default destroy policy is wait (no limit); leak_and_report when chosen at construction");
    DevshareExporter* raw0 = e0.get();
    { devshare::Exporter gone = std::move(e0); }
    check(g_leaked == raw0 && g_leak_status == DEVSHARE_STATUS_BUSY &&
              g_leak_message.find("devshare_exporter_close") != std::string::npos,
          "~Exporter of a busy device export does not force: it hands the open export to the leak handler "
          "with BUSY and the library's message");
    uint64_t n = 0;
    check(devshare_exporter_outstanding(g_leaked, &n) == DEVSHARE_STATUS_OK && n == 1,
          "the leaked export is still open with its reference outstanding");
    h0.discard();
    check(devshare_exporter_close(g_leaked, 0) == DEVSHARE_STATUS_OK,
          "after the reference came back the handler's owner closes it normally");

    // The default policy, OnDestroy::wait: the destructor waits for the consumer, then closes.
    g_leaked = nullptr;
    {
        devshare::Exporter e1 = devshare::Exporter::export_memory(DEVSHARE_BACKEND_CUDA, 0, ptr(blocks[1]), kBlock);
        const devshare::Handle h1 = e1.share(devshare::bytes());
        std::thread consumer([h1] {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            (void)h1.try_discard();
        });
        const auto t0 = std::chrono::steady_clock::now();
        e1 = devshare::Exporter();  // disposes of the export by its policy
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
        consumer.join();
        check(g_leaked == nullptr && ms >= 80,
              "the default OnDestroy::wait waited for the reference (" + std::to_string(ms) + " ms), then closed");
    }
    // ... and after its timeout it does not force either.
    {
        devshare::Exporter e2 = devshare::Exporter::export_memory(DEVSHARE_BACKEND_CUDA, 0, ptr(blocks[2]), kBlock, 0,
                                                                  {devshare::OnDestroy::wait, std::chrono::milliseconds(20)});
        const devshare::Handle h2 = e2.share(devshare::bytes());
        DevshareExporter* raw2 = e2.get();
        e2 = devshare::Exporter();
        check(g_leaked == raw2 && g_leak_status == DEVSHARE_STATUS_BUSY,
              "OnDestroy::wait past its limit leaves the export open and reports it, without forcing");
        h2.discard();
        check(devshare_exporter_close(g_leaked, 0) == DEVSHARE_STATUS_OK, "which then closes normally");
    }

    // OnDestroy::force and close(Close::force): asked for, they force.
    g_leaked = nullptr;
    {
        devshare::Exporter e3 = devshare::Exporter::export_memory(DEVSHARE_BACKEND_CUDA, 0, ptr(blocks[3]), kBlock, 0,
                                                                  devshare::OnDestroy::force);
        (void)e3.share(devshare::bytes());
    }
    check(g_leaked == nullptr, "OnDestroy::force closes a busy export when destroyed (nothing leaked)");
    devshare::Exporter e4 = devshare::Exporter::export_memory(DEVSHARE_BACKEND_CUDA, 0, ptr(blocks[4]), kBlock);
    (void)e4.share(devshare::bytes());
    e4.close(devshare::Close::force);
    check(!e4, "close(Close::force) closes a busy export");
    devshare::set_exporter_leak_handler(previous);

    // export_segments: a VMM buffer of two segments.
    constexpr size_t kSeg = DEVSHARE_SEGMENT_GRANULARITY;
    CUmemAllocationProp prop;
    std::memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle seg[2] = {};
    CUdeviceptr va = 0;
    CUmemAccessDesc acc;
    std::memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (cuMemCreate(&seg[0], kSeg, &prop, 0) != CUDA_SUCCESS || cuMemCreate(&seg[1], kSeg, &prop, 0) != CUDA_SUCCESS ||
        cuMemAddressReserve(&va, 2 * kSeg, 0, 0, 0) != CUDA_SUCCESS ||
        cuMemMap(va, kSeg, 0, seg[0], 0) != CUDA_SUCCESS || cuMemMap(va + kSeg, kSeg, 0, seg[1], 0) != CUDA_SUCCESS ||
        cuMemSetAccess(va, 2 * kSeg, &acc, 1) != CUDA_SUCCESS) {
        check(false, "CUDA stand-in: a two-segment VMM buffer");
    } else {
        const uint64_t physical[2] = {static_cast<uint64_t>(seg[0]), static_cast<uint64_t>(seg[1])};
        {
            devshare::Exporter es =
                devshare::Exporter::export_segments(DEVSHARE_BACKEND_CUDA, 0, ptr(va), physical, kSeg);
            check(es.data() == ptr(va) && es.size() == 2 * kSeg, "Exporter::export_segments: the buffer and its size");
            const devshare::Handle hs = es.share(devshare::describe_at<uint32_t>(kSeg, {1024}));
            check(hs.segmented() && hs.is<uint32_t>() && es.segment_table().empty(),
                  "its handles are segmented; a two-entry table is inline (segment_table() empty)");
            const devshare::TorchStorage st = devshare::handle_to_torch(hs);
            check(st.handle.size() == 26 + 4 * 2 && st.handle[0] == 2 && st.handle[1] == 'e',
                  "handle_to_torch of a segmented cuda handle: PyTorch's version-2 'e' form (26 + 4n bytes)");
            hs.discard();
            // adopt_torch: a handle shared in this process (as PyTorch's allocator shares one)
            // becomes an Exporter over its storage; its reference goes back when it is destroyed.
            const devshare::Handle ht = es.share(devshare::describe_at<uint32_t>(kSeg - 4096, {2048}));
            {
                devshare::Exporter ad = devshare::Exporter::adopt_torch(ht);
                check(ad.data() == nullptr && ad.size() == ht.raw().storage_size && es.outstanding() == 1,
                      "Exporter::adopt_torch: no address, the storage's size, the reference held (" +
                          std::to_string(ad.size()) + " bytes, " + std::to_string(es.outstanding()) + " out)");
                const devshare::Handle hb = ad.share(devshare::describe_at<uint32_t>(4096, {1024}));
                check(hb.raw().storage_offset + hb.raw().tensor_offset * 4 == ht.raw().storage_offset + 4096,
                      "a share of the adopted export counts from the adopted storage (" +
                          std::to_string(hb.raw().storage_offset) + " + " + std::to_string(hb.raw().tensor_offset) +
                          " elements)");
                hb.discard();
            }
            check(es.outstanding() == 0, "destroying the adopted Exporter returned the reference once");
            expect_error(DEVSHARE_STATUS_INVALID_HANDLE, "devshare_exporter_adopt", "adopt_torch of a default handle (no backend)",
                         [&] { (void)devshare::Exporter::adopt_torch(devshare::Handle()); });
        }
        check(cuMemUnmap(va, kSeg) == CUDA_SUCCESS && cuMemUnmap(va + kSeg, kSeg) == CUDA_SUCCESS &&
                  cuMemRelease(seg[0]) == CUDA_SUCCESS && cuMemRelease(seg[1]) == CUDA_SUCCESS &&
                  cuMemAddressFree(va, 2 * kSeg) == CUDA_SUCCESS,
              "the VMM buffer is freed after its exporter closed");
    }
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_export_segments", "export_segments without a base",
                 [&] { (void)devshare::Exporter::export_segments(DEVSHARE_BACKEND_CUDA, 0, nullptr, {}, kSeg); });

    for (CUdeviceptr b : blocks) {
        (void)cuMemFree(b);
    }
    check(cusi_violation_count() == 0,
          "the CUDA stand-in recorded no driver rule broken (" + std::to_string(cusi_violation_count()) + ")");
}

void test_wait_times_out_and_destructors_return_references() {
    devshare::Exporter exp = make_exporter();
    const devshare::Handle h = exp.share(float_desc());
    const auto t0 = std::chrono::steady_clock::now();
    const bool done = exp.wait(std::chrono::milliseconds(50));
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    check(!done && ms >= 45, "Exporter::wait returns false on timeout (after " + std::to_string(ms) + " ms)");
    {
        devshare::Import imp(h);
        check(exp.outstanding() == 1, "an Import in scope: 1 outstanding");
    }
    check(exp.outstanding() == 0, "the Import's destructor returned the reference");
    check(exp.wait(std::chrono::milliseconds(0)), "Exporter::wait returns true when nothing is outstanding");
    check(exp.wait(std::chrono::milliseconds(-1)), "Exporter::wait with a negative timeout returns true at once when "
                                                   "nothing is outstanding");

    // The Exporter's destructor closes (host memory: without force, at once); an Import may
    // outlive its Exporter.
    devshare::Handle outliving;
    devshare::Import survivor;
    g_leaked = nullptr;
    devshare::ExporterLeakHandler previous = devshare::set_exporter_leak_handler(&record_leak);
    {
        devshare::Exporter scoped = make_exporter();
        outliving = scoped.share(float_desc());
        survivor = devshare::Import(outliving);
        (void)scoped.share(devshare::bytes());
        check(scoped.outstanding() == 2, "the scoped exporter has 2 references out (one never imported)");
    }
    devshare::set_exporter_leak_handler(previous);
    check(g_leaked == nullptr, "~Exporter of host memory closes without force and leaks nothing");
    check(survivor.as<float>()(kRows - 1, kCols - 1) == static_cast<float>(kRows * kCols - 1) + 0.5f,
          "an Import stays readable after its Exporter was destroyed");
    survivor.as<float>()(0, 0) = 9.0f;
    check(survivor.data<float>()[0] == 9.0f, "and writable");
    survivor = devshare::Import();
    check(names_gone(outliving), "after the Exporter's destructor and the last release, nothing is left in /dev/shm");
}

// The devshare_<pid>_* / devshare_rc_<pid>_* names in /dev/shm carrying this process's pid.
std::set<std::string> own_shm_names() {
    const std::string p1 = "devshare_" + std::to_string(getpid()) + "_";
    const std::string p2 = "devshare_rc_" + std::to_string(getpid()) + "_";
    std::set<std::string> names;
    if (DIR* d = opendir("/dev/shm")) {
        while (const dirent* e = readdir(d)) {
            const std::string name = e->d_name;
            if (name.rfind(p1, 0) == 0 || name.rfind(p2, 0) == 0) {
                names.insert(name);
            }
        }
        closedir(d);
    }
    return names;
}

// No such object of this process is left: `stale` are those an earlier process with the same
// pid left before this one began.
void check_dev_shm(const std::set<std::string>& stale) {
    int left = 0;
    for (const std::string& name : own_shm_names()) {
        if (stale.count(name) == 0) {
            std::printf("    left over: /dev/shm/%s\n", name.c_str());
            left++;
        }
    }
    check(left == 0, "no /dev/shm object of this process is left");
}

}  // namespace

int main() {
    const std::set<std::string> stale = own_shm_names();  // an earlier process with this pid left them
    try {
        test_struct_helpers_set_struct_size_and_the_defaults();
        test_a_host_allocation_round_trips_through_handle_text_and_bytes();
        test_moved_from_objects_are_empty_and_move_assignment_frees_the_target();
        test_failures_throw_devshare_error_with_the_status_and_message();
        test_typed_shares_record_dtype_shape_and_offsets_and_refuse_bad_layouts();
        test_import_as_checks_the_dtype_and_views_index_the_tensor();
        test_typed_accessors_refuse_a_wrong_dtype_rank_or_index_in_every_build();
        test_a_view_used_after_its_import_was_released_fails_cleanly();
        test_try_forms_return_errors_as_results_without_throwing();
        test_imports_from_encoded_bytes_and_text_return_their_reference();
        test_discard_returns_an_unused_handles_reference_and_refuses_a_held_one();
        test_host_adopt_maps_the_same_object_and_refuses_a_wrong_size();
        test_dlpack_tensors_hold_the_reference_until_their_last_deleter();
        test_torch_tuples_convert_to_handles_and_back();
        test_exporter_destruction_never_forces_a_busy_device_export_unless_asked();
        test_wait_times_out_and_destructors_return_references();
    } catch (const devshare::Error& e) {
        check(false, std::string("unexpected devshare::Error: ") + e.what());
    }
    check_dev_shm(stale);
    std::printf("1..%d\n# %d passed, %d failed\n", n_cases, n_cases - n_failed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
