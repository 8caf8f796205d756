// SPDX-License-Identifier: Apache-2.0
//
// test_raii: the C++ wrapper devshare.hpp.
//
//  - type traits: Exporter and Import are move-only with noexcept moves, Handle is a trivially
//    copyable value;
//  - struct helpers: tensor_desc() and import_options() carry struct_size and the defaults;
//  - round trip: host_alloc -> share -> text -> from_text -> Import -> data, encode/decode;
//  - move semantics: moved-from objects are empty and their destructors do nothing; move
//    assignment closes / releases what the target held;
//  - errors: devshare::Error with the right status and the library's message;
//  - Exporter::wait: false on timeout, true once released;
//  - destructors: an Import going out of scope returns its reference, an Exporter going out of
//    scope closes (and its objects leave /dev/shm), an Import may outlive its Exporter.
//
// Prints "ok - ..." / "FAIL - ..." per case; exit status 0 when all passed.

#include "devshare.hpp"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
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

// Runs `f`, which must throw devshare::Error with `status` and a message naming `function`.
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

constexpr int kRows = 3;
constexpr int kCols = 4;
constexpr uint64_t kStorageOffset = 64;
constexpr int64_t kTensorOffset = 2;
const int64_t kShape[2] = {kRows, kCols};

DevshareTensorDesc float_desc() {
    DevshareTensorDesc d = devshare::tensor_desc(DevshareDType{DEVSHARE_DTYPE_FLOAT, 32, 1}, 2, kShape);
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
static_assert(std::is_trivially_copyable<devshare::Handle>::value, "Handle is plain data");
static_assert(sizeof(devshare::Handle) == sizeof(DevshareHandle), "Handle adds nothing to DevshareHandle");
static_assert(std::is_base_of<std::runtime_error, devshare::Error>::value, "Error is a std::runtime_error");
static_assert(noexcept(std::declval<const devshare::Import&>().data<float>()), "Import::data is noexcept");
static_assert(noexcept(std::declval<const devshare::Exporter&>().data()), "Exporter::data is noexcept");

void test_struct_helpers() {
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
}

void test_round_trip() {
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
    bool same = true;
    for (int i = 0; i < kRows * kCols; i++) {
        same = same && v[i] == static_cast<float>(i) + 0.5f;
    }
    check(same, "Import::data<float>() reads what the exporter wrote");
    imp.data<float>()[5] = -7.0f;
    check(tensor_in(exp)[5] == -7.0f, "a write through Import::data is seen in Exporter::data");
    check(imp.handle() == h, "Import::handle() is the imported handle");
    imp.release();
    check(!imp && imp.data() == nullptr && exp.outstanding() == 0,
          "Import::release empties the import and returns the reference");
    imp.release();
    check(!imp, "Import::release on an empty Import does nothing");

    const devshare::Handle whole = exp.share_bytes();
    check(whole.raw().ndim == 1 && whole.raw().shape[0] == 1024 && whole.raw().dtype.code == DEVSHARE_DTYPE_UINT,
          "Exporter::share_bytes shares the whole allocation as 1-D uint8");
    const DevshareImportOptions ro = devshare::import_options(DEVSHARE_IMPORT_READ_ONLY);
    devshare::Import rimp(whole, ro);
    check(rimp.info().read_only == 1 && rimp.data<const unsigned char>()[0] == 0,
          "Import with import_options(DEVSHARE_IMPORT_READ_ONLY) is read-only and readable");
    rimp.release();
    check(exp.outstanding() == 0, "the read-only import returned its reference");
    exp.close();
    check(!exp && exp.data() == nullptr && exp.size() == 0, "Exporter::close empties the exporter");
    check(names_gone(h), "after Exporter::close nothing of it is left in /dev/shm");
    exp.close();
    check(!exp, "Exporter::close on an empty Exporter does nothing");
}

void test_moves() {
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
        target = std::move(src);
    }
    const devshare::Handle th = target.share(float_desc());
    check(target.outstanding() == 1 && data_name_exists(th) && tensor_in(target)[1] == 1.5f,
          "a moved-from Exporter going out of scope leaves the target open");

    // Move assignment into a non-empty Exporter closes what it held.
    const devshare::Handle bh = b.share_bytes();
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
        check(!src && src.data() == nullptr && src.info().data == nullptr,
              "moved-from Import (move construction) is empty");
        held = std::move(mid);
        check(!mid && held, "moved-from Import (move assignment) is empty, the target holds the import");
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

    // Exporter::release hands ownership back to C.
    const devshare::Handle last = b.share_bytes();
    DevshareExporter* raw = b.release();
    check(raw != nullptr && !b && data_name_exists(last), "Exporter::release gives up ownership without closing");
    check(devshare_exporter_close(raw, DEVSHARE_CLOSE_FORCE) == DEVSHARE_STATUS_OK && !data_name_exists(last),
          "the released C exporter is closed by its new owner");
    devshare::Exporter adopted(nullptr);
    check(!adopted, "Exporter(nullptr) is empty");
}

void test_errors() {
    expect_error(DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text", "Handle::from_text(\"devshare1:not*base64\")",
                 [] { devshare::Handle::from_text("devshare1:not*base64"); });
    expect_error(DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text", "Handle::from_text(\"hello\")",
                 [] { devshare::Handle::from_text(std::string("hello")); });
    try {
        devshare::Handle::from_text("nonsense");
        check(false, "invalid text is caught as std::runtime_error");
    } catch (const std::runtime_error& e) {
        check(std::strstr(e.what(), "devshare_handle_from_text") != nullptr,
              "devshare::Error is caught as std::runtime_error with the library's message");
    }
    expect_error(DEVSHARE_STATUS_INVALID_HANDLE, "devshare_handle_validate", "Handle().validate()",
                 [] { devshare::Handle().validate(); });
    expect_error(DEVSHARE_STATUS_INVALID_HANDLE, "devshare_handle_to_text", "Handle().to_text()",
                 [] { devshare::Handle().to_text(); });

    devshare::Exporter exp = make_exporter();
    const devshare::Handle h = exp.share(float_desc());
    std::vector<uint8_t> bytes = h.encode();
    bytes[bytes.size() / 2] ^= 0x10;
    expect_error(DEVSHARE_STATUS_CHECKSUM_MISMATCH, "devshare_handle_decode", "Handle::decode of a damaged encoding",
                 [&] { devshare::Handle::decode(bytes); });
    bytes = h.encode();
    bytes.pop_back();
    expect_error(DEVSHARE_STATUS_TRUNCATED, "devshare_handle_decode", "Handle::decode of a cut encoding",
                 [&] { devshare::Handle::decode(bytes); });

    DevshareTensorDesc d = float_desc();
    d.ndim = 9;
    expect_error(DEVSHARE_STATUS_BAD_NDIM, "devshare_exporter_share", "Exporter::share with ndim 9",
                 [&] { exp.share(d); });
    DevshareTensorDesc unsized = float_desc();
    unsized.struct_size = 0;
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_exporter_share",
                 "Exporter::share with a desc whose struct_size is 0 (not initialised)", [&] { exp.share(unsized); });
    const DevshareImportOptions bad = devshare::import_options(0x80000000u);
    expect_error(DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_import",
                 "Import with an import flag this library does not know", [&] { devshare::Import imp(h, bad); });
    check(exp.outstanding() == 1, "a failed Import constructor leaves the reference outstanding");
    {
        devshare::Import imp(h);
    }
    expect_error(DEVSHARE_STATUS_ALREADY_RELEASED, "devshare_import", "Import of a handle whose reference came back",
                 [&] { devshare::Import imp(h); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe", "devshare::probe(0)", [] { devshare::probe(0); });
    const DevshareBackendInfo host = devshare::probe(DEVSHARE_BACKEND_HOST);
    check(host.usable == 1 && host.struct_size == sizeof host && std::strcmp(host.name, "host") == 0,
          "devshare::probe(host) is usable, struct_size is sizeof(DevshareBackendInfo)");
    check(devshare::version() == DEVSHARE_VERSION, "devshare::version() == DEVSHARE_VERSION");
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_host_alloc", "Exporter::host_alloc(UINT64_MAX)",
                 [] { devshare::Exporter::host_alloc(UINT64_MAX); });
    const devshare::Exporter empty;
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_outstanding", "outstanding() of an empty Exporter",
                 [&] { empty.outstanding(); });
    expect_error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_handle", "handle() of an empty Import",
                 [] { devshare::Import().handle(); });
}

void test_wait_and_destructors() {
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

    // The Exporter's destructor closes; an Import may outlive its Exporter.
    devshare::Handle outliving;
    devshare::Import survivor;
    {
        devshare::Exporter scoped = make_exporter();
        outliving = scoped.share(float_desc());
        survivor = devshare::Import(outliving);
        (void)scoped.share_bytes();
        check(scoped.outstanding() == 2, "the scoped exporter has 2 references out (one never imported)");
    }
    check(survivor.data<float>()[kRows * kCols - 1] == static_cast<float>(kRows * kCols - 1) + 0.5f,
          "an Import stays readable after its Exporter was destroyed (forced close)");
    survivor.data<float>()[0] = 9.0f;
    check(survivor.data<float>()[0] == 9.0f, "and writable");
    survivor = devshare::Import();
    check(names_gone(outliving), "after the Exporter's destructor and the last release, nothing is left in /dev/shm");
}

// No devshare_<pid>_* / devshare_rc_<pid>_* object of this process is left.
void check_dev_shm() {
    const std::string p1 = "devshare_" + std::to_string(getpid()) + "_";
    const std::string p2 = "devshare_rc_" + std::to_string(getpid()) + "_";
    int left = 0;
    if (DIR* d = opendir("/dev/shm")) {
        while (const dirent* e = readdir(d)) {
            const std::string name = e->d_name;
            if (name.rfind(p1, 0) == 0 || name.rfind(p2, 0) == 0) {
                std::printf("    left over: /dev/shm/%s\n", name.c_str());
                left++;
            }
        }
        closedir(d);
    }
    check(left == 0, "no /dev/shm object of this process is left");
}

}  // namespace

int main() {
    try {
        test_struct_helpers();
        test_round_trip();
        test_moves();
        test_errors();
        test_wait_and_destructors();
    } catch (const devshare::Error& e) {
        check(false, std::string("unexpected devshare::Error: ") + e.what());
    }
    check_dev_shm();
    std::printf("1..%d\n# %d passed, %d failed\n", n_cases, n_cases - n_failed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
