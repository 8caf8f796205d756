// SPDX-License-Identifier: Apache-2.0
//
// test_raii_noexcept: devshare.hpp built with -fno-exceptions, through its non-throwing forms
// (try_* returning devshare::Result<T>). The throwing forms are compiled out (checked here at
// compile time), and so is everything that would need exceptions.
//
//  - the header builds with -fno-exceptions: DEVSHARE_HPP_EXCEPTIONS is 0 and the throwing
//    forms (share(desc), send(...), as<T>(), the Import(handle) constructor, ...) do not exist;
//    an Import is two pointers (moves are cheap);
//  - Result<T>: value, error with status and message, error_code, value_or; value() of an error
//    aborts (checked in a child process), after printing the error with this header's own
//    Result (C++17; std::expected's value() aborts without a message);
//  - the checked accessors without exceptions: v(i) of a 2-d view, at() past an extent,
//    data<T>() of another dtype and a view used after its Import was released each print the
//    Error and abort (in a child process); try_data / try_at return it;
//  - host round trip with try_ forms: try_host_alloc, try_share(describe(p, shape)),
//    try_to_text, Import::try_from_text, try_as<T> (a dtype mismatch is an error, not a
//    reinterpret; read-only needs const T), TensorView indexing; description problems and
//    addresses outside the range are reported by try_share, naming it;
//  - try_share_encoded / Import::try_from_encoded, try_discard, try_host_adopt, DLPack, the
//    torch conversions, probe / local_pid / allow_ptrace, try_wait / try_close;
//  - ~Exporter without exceptions (CUDA stand-in): the default DestroyPolicy is OnDestroy::wait
//    with no limit, and a busy device export whose reference another thread gives back while
//    the destructor waits closes (no leak handler); OnDestroy::leak_and_report given at
//    construction hands a busy export to the leak handler (the default one reports it on
//    stderr); {OnDestroy::wait, 20ms} past its limit does too; OnDestroy::force forces;
//    try_export_segments.
//  - channels with try_ forms, the consumer a forked process: try_listen, try_wait_peers,
//    try_peers, Pool::try_create over try_channel_host_alloc, try_acquire (an empty Slot on
//    timeout, ~Slot gives an unsent slot back), try_send(slot, peer, describe(...)); the
//    consumer's try_connect, try_recv (an empty Import on timeout), try_pool_slot, try_as; after
//    the producer's try_close the consumer's try_recv is a Result with DEVSHARE_STATUS_CLOSED.
//
// Builds as C++17 (Result is this header's class) and as C++23 (Result is std::expected: the
// checks read r.error() only after a failure). Prints "ok - ..." / "FAIL - ..." per case; exit
// status 0 when all passed.

#include "devshare.hpp"

#include "cuda_standin.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
#error "test_raii_noexcept must be built with -fno-exceptions"
#endif

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

// `r` failed with `status` and a message starting with `prefix` (error() is read only after a
// failure: with std::expected it has no Error otherwise).
template <typename R>
bool failed_with(const R& r, int32_t status, const char* prefix) {
    if (r.has_value()) {
        std::printf("    succeeded; expected status %d: %s\n", static_cast<int>(status), prefix);
        return false;
    }
    const devshare::Error& e = r.error();
    bool ok = e.status() == status && std::strncmp(e.what(), prefix, std::strlen(prefix)) == 0 &&
              e.code() == devshare::make_error_code(status);
#if !DEVSHARE_HPP_STD_EXPECTED
    ok = ok && r.status() == status && r.code() == e.code();  // this header's Result's own shortcuts
#endif
    if (!ok) {
        std::printf("    got status %d: %s\n", static_cast<int>(e.status()), e.what());
    }
    return ok;
}

// --- The throwing forms are not there.

template <typename T, typename = void>
struct has_share : std::false_type {};
template <typename T>
struct has_share<T, std::void_t<decltype(std::declval<const T&>().share(devshare::bytes()))>> : std::true_type {};
template <typename T, typename = void>
struct has_share_encoded : std::false_type {};
template <typename T>
struct has_share_encoded<T, std::void_t<decltype(std::declval<const T&>().share_encoded(devshare::bytes()))>>
    : std::true_type {};
template <typename T, typename = void>
struct has_as : std::false_type {};
template <typename T>
struct has_as<T, std::void_t<decltype(std::declval<const T&>().template as<float>())>> : std::true_type {};
template <typename T, typename = void>
struct has_to_text : std::false_type {};
template <typename T>
struct has_to_text<T, std::void_t<decltype(std::declval<const T&>().to_text())>> : std::true_type {};
template <typename T, typename = void>
struct has_close : std::false_type {};
template <typename T>
struct has_close<T, std::void_t<decltype(std::declval<T&>().close())>> : std::true_type {};

static_assert(DEVSHARE_HPP_EXCEPTIONS == 0, "-fno-exceptions: the header offers only the try_ forms");
static_assert(!has_share<devshare::Exporter>::value && !has_share_encoded<devshare::Exporter>::value,
              "Exporter::share(desc) and share_encoded(desc) (throwing) are compiled out");
static_assert(!has_close<devshare::Exporter>::value, "Exporter::close() (throwing) is compiled out");
static_assert(!has_as<devshare::Import>::value, "Import::as<T>() (throwing) is compiled out");
static_assert(!has_to_text<devshare::Handle>::value, "Handle::to_text() (throwing) is compiled out");
static_assert(!std::is_constructible<devshare::Import, const devshare::Handle&>::value,
              "the throwing Import(handle) constructor is compiled out");
static_assert(!std::is_constructible<devshare::Exporter, DevshareExporter*>::value,
              "the throwing Exporter(DevshareExporter*) constructor is compiled out");
template <typename T, typename = void>
struct has_recv : std::false_type {};
template <typename T>
struct has_recv<T, std::void_t<decltype(std::declval<T&>().recv(std::chrono::milliseconds(0)))>> : std::true_type {};
template <typename T, typename = void>
struct has_acquire : std::false_type {};
template <typename T>
struct has_acquire<T, std::void_t<decltype(std::declval<T&>().acquire(std::chrono::milliseconds(0)))>>
    : std::true_type {};
template <typename T, typename = void>
struct has_peers : std::false_type {};
template <typename T>
struct has_peers<T, std::void_t<decltype(std::declval<const T&>().peers())>> : std::true_type {};
template <typename T, typename = void>
struct has_channel_send : std::false_type {};
template <typename T>
struct has_channel_send<T, std::void_t<decltype(std::declval<T&>().send(
                               uint64_t{1}, std::declval<const devshare::Exporter&>(), devshare::bytes()))>>
    : std::true_type {};
template <typename T, typename = void>
struct has_pool_send : std::false_type {};
template <typename T>
struct has_pool_send<T, std::void_t<decltype(std::declval<T&>().send(std::declval<devshare::Slot&>(), uint64_t{1},
                                                                     devshare::bytes()))>> : std::true_type {};

static_assert(!has_close<devshare::Channel>::value && !has_peers<devshare::Channel>::value &&
                  !has_channel_send<devshare::Channel>::value,
              "Channel::close(), peers() and send(peer, exporter, desc) (throwing) are compiled out");
static_assert(!has_recv<devshare::Connection>::value && !has_close<devshare::Connection>::value,
              "Connection::recv() and close() (throwing) are compiled out");
static_assert(!has_acquire<devshare::Pool>::value && !has_close<devshare::Pool>::value &&
                  !has_pool_send<devshare::Pool>::value,
              "Pool::acquire(), close() and send(slot, peer, desc) (throwing) are compiled out");
static_assert(std::is_move_constructible<devshare::Result<devshare::Slot>>::value &&
                  !std::is_copy_constructible<devshare::Result<devshare::Slot>>::value,
              "Result<Slot> is move-only, like Slot");
static_assert(std::is_move_constructible<devshare::Result<devshare::Import>>::value &&
                  !std::is_copy_constructible<devshare::Result<devshare::Import>>::value,
              "Result<Import> is move-only, like Import");
static_assert(sizeof(devshare::Import) <= 2 * sizeof(void*),
              "an Import is two pointers (the C import, and one heap block with its info and handle): moves are "
              "cheap, copying no DevshareHandle");
static_assert(std::is_nothrow_move_constructible<devshare::Import>::value &&
                  std::is_nothrow_move_assignable<devshare::Import>::value,
              "Import moves are noexcept");

constexpr int kRows = 3;
constexpr int kCols = 4;

devshare::Result<devshare::Exporter> make_exporter() {
    devshare::Result<devshare::Exporter> e = devshare::Exporter::try_host_alloc(1024);
    if (e) {
        float* t = static_cast<float*>(e->data());
        for (int i = 0; i < kRows * kCols; i++) {
            t[i] = static_cast<float>(i) + 0.5f;
        }
    }
    return e;
}

void test_result_holds_a_value_or_an_error_and_value_of_an_error_aborts() {
    const devshare::Result<devshare::Handle> bad = devshare::Handle::try_from_text("hello");
    check(failed_with(bad, DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text:") &&
              std::strcmp(bad.error().status_name(), devshare_status_str(DEVSHARE_STATUS_BAD_TEXT)) == 0,
          "Handle::try_from_text(\"hello\"): an error Result (BAD_TEXT, the library's message)");
    check(!bad.has_value() && &bad.error().code().category() == &devshare::error_category() &&
              devshare::make_error_code(DEVSHARE_STATUS_TIMEOUT) == std::errc::timed_out &&
              devshare::make_error_code(DEVSHARE_STATUS_BUSY) == std::errc::device_or_resource_busy,
          "Error::code() is a std::error_code of the devshare category; std::errc equivalents hold");
    const devshare::Result<uint64_t> none = devshare::Exporter().try_outstanding();
    check(failed_with(none, DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_outstanding:") &&
              none.value_or(5) == 5,
          "try_outstanding() of an empty Exporter: NULL_ARGUMENT; value_or gives the fallback");
    const devshare::Result<void> ok_void;
#if DEVSHARE_HPP_STD_EXPECTED
    check(ok_void.has_value() && static_cast<bool>(ok_void), "a default Result<void> (std::expected) is success");
#else
    check(ok_void.has_value() && ok_void.status() == DEVSHARE_STATUS_OK && !ok_void.code(),
          "a default Result<void> is success (status() OK, code() empty)");
#endif
    ok_void.value();  // no-op on success
    const devshare::Result<int32_t> pid = devshare::try_local_pid(DEVSHARE_BACKEND_HOST);
    check(pid && pid.value() == static_cast<int32_t>(getpid()), "try_local_pid(host) is getpid(); value() gives it");
    const devshare::Result<DevshareBackendInfo> probe = devshare::try_probe(DEVSHARE_BACKEND_HOST);
    check(probe && probe->usable == 1 && failed_with(devshare::try_probe(0), DEVSHARE_STATUS_INVALID_ARGUMENT,
                                                     "devshare_probe:"),
          "try_probe: host usable, backend 0 an error");
    check(devshare::try_allow_ptrace(0).has_value(), "try_allow_ptrace(0) succeeds");

    // value() of an error without exceptions: the error on stderr, then abort().
    int fds[2];
    if (pipe(fds) != 0) {
        check(false, "pipe");
        return;
    }
    const pid_t child = fork();
    if (child == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        (void)devshare::Handle::try_from_text("hello").value();
        _exit(0);
    }
    close(fds[1]);
    std::string err;
    char buf[256];
    ssize_t got;
    while ((got = read(fds[0], buf, sizeof buf)) > 0) {
        err.append(buf, static_cast<size_t>(got));
    }
    close(fds[0]);
    int status = 0;
    waitpid(child, &status, 0);
#if DEVSHARE_HPP_STD_EXPECTED
    // std::expected::value() would throw std::bad_expected_access; without exceptions the
    // standard library aborts, printing nothing of its own.
    check(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
          "Result::value() (std::expected) of an error aborts (no exceptions to throw)");
#else
    check(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT &&
              err.find("devshare: value() of a failed Result") != std::string::npos &&
              err.find("devshare_handle_from_text") != std::string::npos,
          "Result::value() of an error aborts after printing the error (no exceptions to throw)");
#endif
}

// What `f` writes to stderr in a child process, and how the child ended.
template <typename F>
std::string in_child(F&& f, int* status) {
    int fds[2];
    if (pipe(fds) != 0) {
        *status = -1;
        return "pipe failed";
    }
    const pid_t child = fork();
    if (child == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        f();
        _exit(0);
    }
    close(fds[1]);
    std::string err;
    char buf[256];
    ssize_t got;
    while ((got = read(fds[0], buf, sizeof buf)) > 0) {
        err.append(buf, static_cast<size_t>(got));
    }
    close(fds[0]);
    waitpid(child, status, 0);
    return err;
}

// Without exceptions the checked accessors still check, NDEBUG or not: a failed check prints the
// Error and aborts instead of reading a wrong element or another dtype's bytes.
void test_checked_accessors_abort_with_the_error_without_exceptions() {
    devshare::Result<devshare::Exporter> exp = make_exporter();
    const devshare::Result<devshare::Handle> h =
        exp->try_share(devshare::describe(static_cast<const float*>(exp->data()), {kRows, kCols}));
    devshare::Result<devshare::Import> imp = devshare::Import::try_from(*h);
    if (!check(imp.has_value(), "a float32 [3, 4] import")) {
        return;
    }
    const devshare::TensorView<const float> v = imp->try_as<const float>().value();
    int status = 0;
    std::string err = in_child([&] { std::printf("%f\n", static_cast<double>(v(1))); }, &status);
    check(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT &&
              err.find("devshare: a checked access failed") != std::string::npos &&
              err.find("devshare::TensorView::operator(): 1 indices for a view of 2 dimensions") != std::string::npos,
          "v(i) of a 2-d view aborts, printing the BAD_NDIM error");
    err = in_child([&] { std::printf("%f\n", static_cast<double>(v.at({kRows, 0}))); }, &status);
    check(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT &&
              err.find("index 3 of dimension 0 is outside [0, 3)") != std::string::npos,
          "at({3, 0}) of a [3, 4] view aborts, naming the index and the extent");
    err = in_child([&] { std::printf("%p\n", static_cast<const void*>(imp->data<const double>())); }, &status);
    check(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT &&
              err.find("devshare::Import::data<float64>: the tensor's dtype is float32") != std::string::npos,
          "data<const double>() of a float32 tensor aborts, printing the BAD_DTYPE error");
    check(imp->try_release().has_value(), "Import::try_release");
    err = in_child([&] { std::printf("%f\n", static_cast<double>(v(0, 0))); }, &status);
    check(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT &&
              err.find("the Import this view was made from was released") != std::string::npos,
          "v(i, j) after the Import was released aborts with ALREADY_RELEASED, not a fault");
}

void test_a_host_round_trip_through_try_forms_reports_errors_as_results() {
    devshare::Result<devshare::Exporter> exp = make_exporter();
    if (!check(exp.has_value(), "try_host_alloc")) {
        return;
    }
    const float* first = static_cast<const float*>(exp->data());
    const devshare::Result<devshare::Handle> h = exp->try_share(devshare::describe(first, {kRows, kCols}));
    check(h && h->is<float>() && h->ndim() == 2 && h->shape()[1] == kCols && h->strides()[0] == kCols &&
              h->tensor_offset() == 0,
          "try_share(describe(const float*, {rows, cols})): a float32 handle with shape and strides");
    const devshare::Result<std::string> text = h->try_to_text();
    check(text && text->rfind("devshare1:", 0) == 0, "Handle::try_to_text");
    devshare::Result<devshare::Import> imp = devshare::Import::try_from_text(*text);
    check(imp && imp->numel() == 12 && exp->try_outstanding().value_or(9) == 1, "Import::try_from_text imports it");
    const devshare::Result<devshare::TensorView<float>> v = imp->try_as<float>();
    check(v && (*v)(0, 0) == 0.5f && (*v)(2, 3) == 11.5f && v->shape()[0] == kRows,
          "Import::try_as<float>(): a view indexing the tensor");
    check(failed_with(imp->try_as<int32_t>(), DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::as<int32>:"),
          "Import::try_as<int32_t>() of a float32 tensor: BAD_DTYPE, no reinterpretation");
    check(failed_with(imp->try_data<int32_t>(), DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::data<int32>:") &&
              imp->data<float>() == imp->data(),
          "Import::data<T>() only for the tensor's T; try_data<int32_t>() of a float32 tensor is BAD_DTYPE");
    check(failed_with(v->try_at({1}), DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorView::at:") &&
              failed_with(v->try_at({0, kCols}), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::TensorView::at:") &&
              *v->try_at({2, 3}).value() == 11.5f,
          "TensorView::try_at: BAD_NDIM for too few indices, INVALID_ARGUMENT past the extent");
    const devshare::Result<devshare::DLPackVersioned> dl = imp->try_to_dlpack_versioned();
    check(dl && dl->data() == imp->data() && dl->ndim() == 2, "Import::try_to_dlpack_versioned");
#if defined(__cpp_lib_mdspan)
    const auto md = v->try_mdspan<2>();
    check(md && (*md)[2, 3] == 11.5f && failed_with(v->try_mdspan<1>(), DEVSHARE_STATUS_BAD_NDIM,
                                                    "devshare::TensorView::mdspan<1>:"),
          "TensorView::try_mdspan<2>() indexes alike; try_mdspan<1>() of a 2-d view is BAD_NDIM");
#else
    std::printf("# SKIP std::mdspan: this standard library has no __cpp_lib_mdspan\n");
#endif
    check(imp->try_release().has_value() && !*imp, "Import::try_release");
    check(exp->try_outstanding().value_or(9) == 1, "the DLPack tensor still holds the reference");

    const devshare::Result<devshare::Handle> ro_h = exp->try_share(devshare::describe_at<float>(0, {kRows, kCols}));
    devshare::Result<devshare::Import> ro =
        devshare::Import::try_from(*ro_h, devshare::import_options(DEVSHARE_IMPORT_READ_ONLY));
    check(ro && failed_with(ro->try_as<float>(), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Import::as<float32>:") &&
              ro->try_as<const float>().has_value(),
          "a read-only import: try_as<float>() refused, try_as<const float>() given");

    check(failed_with(exp->try_share(devshare::describe(first + 10000, {1})), DEVSHARE_STATUS_INVALID_ARGUMENT,
                      "devshare::Exporter::share: the first element's address is outside the range [data(), "
                      "data() + 1024)"),
          "try_share of a pointer outside the allocation: INVALID_ARGUMENT from the header, naming the range");
    check(failed_with(exp->try_share(devshare::describe(first, {1, 1, 1, 1, 1, 1, 1, 1, 1})),
                      DEVSHARE_STATUS_BAD_NDIM,
                      "devshare::Exporter::share: devshare::TensorDesc: more dimensions than DEVSHARE_MAX_NDIM"),
          "try_share with 9 dimensions: BAD_NDIM, reported by try_share");
    check(failed_with(devshare::TensorDesc::try_make(devshare::dtype_of<float>(), {1, 1, 1, 1, 1, 1, 1, 1, 1}),
                      DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorDesc: more dimensions than DEVSHARE_MAX_NDIM"),
          "TensorDesc::try_make with 9 dimensions: BAD_NDIM at once");

    const devshare::TensorDesc desc = devshare::describe(first + 4, {kCols});
    const devshare::Result<std::vector<uint8_t>> enc = exp->try_share_encoded(desc);
    devshare::Result<devshare::Import> from_enc = devshare::Import::try_from_encoded(*enc);
    check(enc && from_enc && from_enc->try_as<const float>().has_value() &&
              from_enc->try_as<const float>()->operator()(0) == 4.5f,
          "describe + try_share_encoded + Import::try_from_encoded");
    check(failed_with(devshare::Import::try_from_encoded(std::vector<uint8_t>(64, 0x55)), DEVSHARE_STATUS_BAD_MAGIC,
                      "devshare_import_encoded:"),
          "Import::try_from_encoded of other bytes: BAD_MAGIC");

    const devshare::Result<devshare::Handle> unused = exp->try_share(devshare::bytes());
    check(unused && unused->try_discard().has_value() &&
              failed_with(unused->try_discard(), DEVSHARE_STATUS_ALREADY_RELEASED, "devshare_handle_discard:"),
          "Handle::try_discard once, then ALREADY_RELEASED");

    const devshare::Result<devshare::Handle> whole = exp->try_share(devshare::bytes());
    const std::string name(reinterpret_cast<const char*>(whole->raw().key), whole->raw().key_len);
    const devshare::Result<devshare::Exporter> adopted = devshare::Exporter::try_host_adopt(name, 1024);
    check(adopted && std::memcmp(adopted->data(), exp->data(), 1024) == 0,
          "Exporter::try_host_adopt maps the same object");
    DevshareTorchArgs a = devshare::torch_args();
    a.ref_name = whole->raw().ref_name;
    a.ref_name_len = whole->raw().ref_name_len;
    a.ref_slot = whole->raw().ref_slot;
    check(devshare::try_torch_discard(a).has_value(), "try_torch_discard returns a tuple's reference");
    check(failed_with(devshare::try_handle_to_torch(*whole), DEVSHARE_STATUS_UNSUPPORTED, "devshare_handle_to_torch:"),
          "try_handle_to_torch of a host handle: UNSUPPORTED");

    check(exp->try_wait(std::chrono::milliseconds(0)).value_or(true) == false,
          "try_wait(0) with the read-only import and the DLPack tensor holding references: false");
}

void test_torch_conversions_through_try_forms_report_errors_as_results() {
    devshare::TorchStorage s;
    s.handle.assign(64, 7);
    s.storage_size = 4096;
    s.ref_name = "/torch_777_99_1";
    const int64_t shape[1] = {1024};
    const DevshareTorchArgs a = devshare::torch_args(DEVSHARE_BACKEND_CUDA, s, devshare::dtype_of<float>(), shape);
    const devshare::Result<devshare::Handle> h = devshare::try_handle_from_torch(a);
    check(h && h->backend() == DEVSHARE_BACKEND_CUDA && h->numel() == 1024, "try_handle_from_torch");
    const devshare::Result<devshare::TorchStorage> back = devshare::try_handle_to_torch(*h);
    check(back && back->handle == s.handle && back->ref_name == s.ref_name, "try_handle_to_torch gives it back");
    const devshare::Result<std::vector<uint8_t>> raw = devshare::try_torch_storage_handle(*h);
    check(raw && *raw == s.handle, "try_torch_storage_handle");
    const devshare::Result<std::vector<uint8_t>> enc = devshare::try_handle_from_torch_encoded(a);
    check(enc && devshare::Handle::try_decode(*enc).has_value() && *devshare::Handle::try_decode(*enc) == *h,
          "try_handle_from_torch_encoded decodes to the same handle");
    DevshareTorchArgs broken = a;
    broken.ndim = 9;
    check(failed_with(devshare::Import::try_from_torch(broken), DEVSHARE_STATUS_BAD_NDIM, "devshare_import_torch:"),
          "Import::try_from_torch of a 9-d tuple: BAD_NDIM");
}

// One line from `fd` (without its newline); empty at end of file.
std::string read_line(int fd) {
    std::string line;
    char c;
    while (read(fd, &c, 1) == 1 && c != '\n') {
        line += c;
    }
    return line;
}

// Channels through the try_ forms; the consumer is a child forked before the channel exists. It
// answers on a pipe with "1 what" / "0 what" lines ("ready" once it is connected).
void test_channels_and_pools_work_through_try_forms_across_processes() {
    const std::string addr = "@devshare_test_raii_noexcept_" + std::to_string(getpid());
    const std::chrono::milliseconds wait(20000);  // bound on every wait for the other process
    int go[2];
    int rep[2];
    if (pipe(go) != 0 || pipe(rep) != 0) {
        check(false, "pipe");
        return;
    }
    std::fflush(stdout);
    const pid_t child = fork();
    if (child == 0) {
        close(go[1]);
        close(rep[0]);
        std::string out;
        const auto say = [&](bool ok, const char* what) { out += std::string(ok ? "1 " : "0 ") + what + "\n"; };
        char c;
        if (read(go[0], &c, 1) != 1) {
            _exit(2);
        }
        {
            devshare::Result<devshare::Connection> conn = devshare::Connection::try_connect(addr, wait);
            say(conn.has_value() && conn->fd() >= 0, "consumer: Connection::try_connect");
            if (!conn) {
                std::fprintf(stderr, "    %s\n", conn.error().what());
                _exit(3);
            }
            const devshare::Result<devshare::Import> nothing = conn->try_recv(std::chrono::milliseconds(0));
            say(nothing && !*nothing, "consumer: try_recv(0ms) with nothing queued: an empty Import, no error");
            const std::string ready = out + "ready\n";
            (void)!write(rep[1], ready.data(), ready.size());
            out.clear();
            const devshare::Result<devshare::Import> item = conn->try_recv(wait);
            say(item && *item, "consumer: try_recv gives the item");
            if (item && *item) {
                const devshare::Result<devshare::PoolSlot> ps = item->try_pool_slot();
                say(ps && ps->pool > 0, "consumer: try_pool_slot names its pool");
                const devshare::Result<devshare::TensorView<const int32_t>> v = item->try_as<const int32_t>();
                say(v && v->shape()[0] == 8 && (*v)(0) == 40 && (*v)(7) == 47,
                    "consumer: try_as<const int32_t>() reads what the producer wrote");
            }
            const devshare::Result<devshare::Import> closed = conn->try_recv(wait);
            say(!closed && closed.error().status() == DEVSHARE_STATUS_CLOSED &&
                    std::strncmp(closed.error().what(), "devshare_connection_recv:", 25) == 0,
                "consumer: try_recv after the producer's close: a Result with DEVSHARE_STATUS_CLOSED");
            say(conn->try_close().has_value() && !*conn, "consumer: Connection::try_close empties it");
        }
        (void)!write(rep[1], out.data(), out.size());
        _exit(0);
    }
    close(go[0]);
    close(rep[1]);
    {
        devshare::Result<devshare::Channel> ch = devshare::Channel::try_listen(addr);
        check(ch.has_value(), "Channel::try_listen");
        devshare::Result<devshare::Exporter> exp = devshare::Exporter::try_channel_host_alloc(4 * 256);
        check(exp && failed_with(exp->try_share(devshare::bytes()), DEVSHARE_STATUS_UNSUPPORTED,
                                 "devshare_exporter_share:"),
              "Exporter::try_channel_host_alloc; its try_share(bytes()) is UNSUPPORTED");
        devshare::Result<devshare::Pool> pool = devshare::Pool::try_create(*ch, *exp, 256, 4);
        check(pool && failed_with(devshare::Pool::try_create(*ch, *exp, 256, 5), DEVSHARE_STATUS_INVALID_ARGUMENT,
                                  "devshare_pool_create:"),
              "Pool::try_create; 5 slots of 256 in 1024 bytes: INVALID_ARGUMENT");
        {
            devshare::Result<devshare::Slot> s = pool->try_acquire(std::chrono::milliseconds(0));
            check(s && *s && pool->try_info()->free_slots == 3, "Pool::try_acquire gives a Slot");
        }
        check(pool->try_info()->free_slots == 4, "~Slot gives the unsent slot back");
        (void)!write(go[1], "g", 1);
        check(ch->try_wait_peers(1, wait).value_or(false), "try_wait_peers(1) sees the consumer");
        const devshare::Result<std::vector<uint64_t>> peers = ch->try_peers();
        check(peers && peers->size() == 1, "try_peers: one peer");
        std::string line;
        while (!(line = read_line(rep[0])).empty() && line != "ready") {
            check(line[0] == '1', line.substr(2));
        }
        devshare::Result<devshare::Slot> s = pool->try_acquire(wait);
        int32_t* v = s->data<int32_t>();
        for (int i = 0; i < 8; i++) {
            v[i] = 40 + i;
        }
        const devshare::Result<void> sent = pool->try_send(*s, peers->at(0), devshare::describe(v, {8}));
        check(sent && !*s, "Pool::try_send(slot, peer, describe(int32_t*, {8})) hands the slot over (the Slot is empty)");
        check(ch->try_close().has_value() && !*ch, "Channel::try_close empties it");
        check(failed_with(pool->try_acquire(std::chrono::milliseconds(0)), DEVSHARE_STATUS_CLOSED,
                          "devshare_pool_acquire:"),
              "a Pool that outlives its Channel: try_acquire is CLOSED");
    }
    close(go[1]);
    std::string line;
    while (!(line = read_line(rep[0])).empty()) {
        check(line[0] == '1', line.substr(2));
    }
    close(rep[0]);
    int status = 0;
    waitpid(child, &status, 0);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the consumer exited normally");
}

DevshareExporter* g_leaked = nullptr;
int32_t g_leak_status = 0;
int g_leaks = 0;

void record_leak(DevshareExporter* e, int32_t status, const char*) {
    g_leaked = e;
    g_leak_status = status;
    g_leaks++;
}

void* device_ptr(CUdeviceptr b) { return reinterpret_cast<void*>(static_cast<uintptr_t>(b)); }

// The CUDA stand-in's primary context made current and `n` blocks of 1 MiB.
bool cuda_blocks(CUdeviceptr* blocks, int n) {
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        return false;
    }
    for (int i = 0; i < n; i++) {
        if (cuMemAlloc(&blocks[i], 1 << 20) != CUDA_SUCCESS) {
            return false;
        }
    }
    return true;
}

// Unlink the /dev/shm names that process `pid` (now gone) left on purpose: those carrying its pid
// between '_' and '_' (devshare's ref-counter, the CUDA stand-in's memory and handle objects).
int unlink_shm_of(pid_t pid) {
    const std::string token = "_" + std::to_string(pid) + "_";
    int n = 0;
    DIR* d = opendir("/dev/shm");
    for (dirent* e; d != nullptr && (e = readdir(d)) != nullptr;) {
        if (std::strstr(e->d_name, token.c_str()) != nullptr && shm_unlink(e->d_name) == 0) {
            n++;
        }
    }
    if (d != nullptr) {
        closedir(d);
    }
    return n;
}

// The default leak handler, in a child process (forked before this process touches CUDA): a
// busy device export destroyed under OnDestroy::leak_and_report (given at construction; the
// default policy would wait for it) is reported on stderr.
void test_the_default_leak_handler_reports_a_busy_export_on_stderr() {
    if (std::getenv("DEVSHARE_CUDA_LIBRARY") == nullptr) {
        std::printf("# SKIP default leak report: DEVSHARE_CUDA_LIBRARY does not name the CUDA stand-in\n");
        return;
    }
    int fds[2];
    if (pipe(fds) != 0) {
        check(false, "pipe");
        return;
    }
    const pid_t child = fork();
    if (child == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        CUdeviceptr b = 0;
        if (!cuda_blocks(&b, 1)) {
            _exit(3);
        }
        {
            devshare::Result<devshare::Exporter> e = devshare::Exporter::try_export_memory(
                DEVSHARE_BACKEND_CUDA, 0, device_ptr(b), 1 << 20, 0, devshare::OnDestroy::leak_and_report);
            if (!e || e->on_destroy() != devshare::OnDestroy::leak_and_report || !e->try_share(devshare::bytes())) {
                _exit(4);
            }
        }
        _exit(0);
    }
    close(fds[1]);
    std::string err;
    char buf[512];
    ssize_t got;
    while ((got = read(fds[0], buf, sizeof buf)) > 0) {
        err.append(buf, static_cast<size_t>(got));
    }
    close(fds[0]);
    int status = 0;
    waitpid(child, &status, 0);
    // The export the child left is its memory, its handle and its ref-counter, all named after it.
    const int left = unlink_shm_of(child);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
              err.find("devshare: ~Exporter left the export") != std::string::npos &&
              err.find(devshare_status_str(DEVSHARE_STATUS_BUSY)) != std::string::npos &&
              err.find("references outstanding: 1") != std::string::npos,
          "the default leak handler reports a busy device export left open by ~Exporter "
          "(OnDestroy::leak_and_report) on stderr");
    check(left >= 1, "the export the child left open still had its ref-counter in /dev/shm (now unlinked)");
    if (err.find("~Exporter") == std::string::npos) {
        std::printf("    child stderr: %s\n", err.c_str());
    }
}

void test_exporter_destruction_waits_by_default_and_follows_its_policy() {
    using std::chrono::milliseconds;
    using Clock = std::chrono::steady_clock;
    const devshare::Result<DevshareBackendInfo> cuda = devshare::try_probe(DEVSHARE_BACKEND_CUDA);
    if (std::getenv("DEVSHARE_CUDA_LIBRARY") == nullptr || !cuda || !cuda->usable) {
        std::printf("# SKIP device cases: DEVSHARE_CUDA_LIBRARY does not name the CUDA stand-in\n");
        return;
    }
    const devshare::ExporterLeakHandler mine = &record_leak;
    check(devshare::set_exporter_leak_handler(mine) != mine && devshare::set_exporter_leak_handler(nullptr) == mine,
          "set_exporter_leak_handler returns the previous handler; nullptr restores the default");
    CUdeviceptr b[4] = {};
    if (!cuda_blocks(b, 4)) {
        check(false, "CUDA stand-in: a context and four blocks");
        return;
    }
    const devshare::ExporterLeakHandler previous = devshare::set_exporter_leak_handler(&record_leak);
    void* p[4];
    for (int i = 0; i < 4; i++) {
        p[i] = device_ptr(b[i]);
    }

    // The default policy: wait, with no limit.
    const devshare::DestroyPolicy by_default;
    check(by_default.action == devshare::OnDestroy::wait && by_default.limit == devshare::kForever,
          "DestroyPolicy{}: OnDestroy::wait with no limit (kForever)");
    g_leaks = 0;
    {
        Clock::time_point start{};
        std::thread giver;
        bool given = false;
        {
            devshare::Result<devshare::Exporter> e0 =
                devshare::Exporter::try_export_memory(DEVSHARE_BACKEND_CUDA, 0, p[0], 1 << 20);
            if (!check(e0.has_value(), "try_export_memory (CUDA stand-in)")) {
                return;
            }
            check(e0->on_destroy() == devshare::OnDestroy::wait && e0->destroy_policy().limit == devshare::kForever,
                  "an Exporter made without a policy has the default: OnDestroy::wait, no limit");
            const devshare::Result<devshare::Handle> h0 = e0->try_share(devshare::describe<float>(p[0], {256}));
            if (!check(h0.has_value(), "try_share(describe<float>(device pointer, {256}))")) {
                return;
            }
            check(failed_with(e0->try_close(), DEVSHARE_STATUS_BUSY, "devshare_exporter_close:") && *e0,
                  "try_close() of a busy device export: BUSY, the Exporter stays open");
            // Another thread gives the reference back while ~Exporter waits for it.
            giver = std::thread([&given, h = *h0] {
                std::this_thread::sleep_for(milliseconds(200));
                given = h.try_discard().has_value();
            });
            start = Clock::now();
        }  // ~Exporter: waits for the reference, then closes
        const Clock::duration waited = Clock::now() - start;
        giver.join();
        check(given && g_leaks == 0,
              "default OnDestroy::wait: ~Exporter of a busy device export waits while another thread gives the "
              "reference back (Handle::try_discard), then closes: the leak handler is not called");
        check(waited >= milliseconds(100),
              "and the destructor returned only after that (it waited " +
                  std::to_string(std::chrono::duration_cast<milliseconds>(waited).count()) + " ms)");
    }

    // OnDestroy::leak_and_report given at construction.
    g_leaked = nullptr;
    g_leaks = 0;
    devshare::Handle h1;
    DevshareExporter* raw1 = nullptr;
    {
        devshare::Result<devshare::Exporter> e1 = devshare::Exporter::try_export_memory(
            DEVSHARE_BACKEND_CUDA, 0, p[1], 1 << 20, 0, devshare::OnDestroy::leak_and_report);
        if (!check(e1 && e1->on_destroy() == devshare::OnDestroy::leak_and_report,
                   "try_export_memory(..., OnDestroy::leak_and_report): the policy given at construction")) {
            return;
        }
        h1 = e1->try_share(devshare::describe<float>(p[1], {256})).value();
        raw1 = e1->get();
    }
    check(g_leaks == 1 && g_leaked == raw1 && g_leak_status == DEVSHARE_STATUS_BUSY,
          "OnDestroy::leak_and_report: ~Exporter does not force a busy device export: the leak handler gets it");
    check(h1.try_discard().has_value() && devshare_exporter_close(g_leaked, 0) == DEVSHARE_STATUS_OK,
          "once its reference is back the leaked export closes normally");

    // {OnDestroy::wait, 20 ms}: past its limit, as leak_and_report.
    g_leaked = nullptr;
    g_leaks = 0;
    devshare::Handle h2;
    DevshareExporter* raw2 = nullptr;
    Clock::time_point start{};
    {
        devshare::Result<devshare::Exporter> e2 = devshare::Exporter::try_export_memory(
            DEVSHARE_BACKEND_CUDA, 0, p[2], 1 << 20, 0, {devshare::OnDestroy::wait, milliseconds(20)});
        if (!check(e2 && e2->destroy_policy().action == devshare::OnDestroy::wait &&
                       e2->destroy_policy().limit == milliseconds(20),
                   "try_export_memory(..., {OnDestroy::wait, 20ms}): the policy given at construction")) {
            return;
        }
        h2 = e2->try_share(devshare::bytes()).value();
        raw2 = e2->get();
        start = Clock::now();
    }
    const Clock::duration waited = Clock::now() - start;
    check(g_leaks == 1 && g_leaked == raw2 && g_leak_status == DEVSHARE_STATUS_BUSY && waited >= milliseconds(20),
          "{OnDestroy::wait, 20ms}: ~Exporter waits 20 ms for a busy device export, then hands it to the leak "
          "handler (waited " +
              std::to_string(std::chrono::duration_cast<milliseconds>(waited).count()) + " ms)");
    check(h2.try_discard().has_value() && devshare_exporter_close(g_leaked, 0) == DEVSHARE_STATUS_OK,
          "once its reference is back that export closes normally too");

    // OnDestroy::force, set after construction.
    g_leaked = nullptr;
    g_leaks = 0;
    {
        devshare::Result<devshare::Exporter> e3 =
            devshare::Exporter::try_export_memory(DEVSHARE_BACKEND_CUDA, 0, p[3], 1 << 20);
        if (!check(e3.has_value(), "try_export_memory (CUDA stand-in)")) {
            return;
        }
        e3->set_on_destroy(devshare::OnDestroy::leak_and_report, milliseconds(5));
        const bool two_args = e3->on_destroy() == devshare::OnDestroy::leak_and_report &&
                              e3->destroy_policy().limit == milliseconds(5);
        e3->set_on_destroy(devshare::OnDestroy::force);
        check(two_args && e3->on_destroy() == devshare::OnDestroy::force &&
                  e3->destroy_policy().limit == devshare::kForever,
              "set_on_destroy(action, limit) and set_on_destroy(policy) change the policy; on_destroy() and "
              "destroy_policy() read it");
        (void)e3->try_share(devshare::bytes());
    }
    check(g_leaks == 0, "OnDestroy::force: the destructor forces (nothing leaked)");
    devshare::set_exporter_leak_handler(previous);

    check(failed_with(devshare::Exporter::try_export_segments(DEVSHARE_BACKEND_CUDA, 0, nullptr, {}, 2 << 20),
                      DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_export_segments:"),
          "try_export_segments without a base: NULL_ARGUMENT");
    for (CUdeviceptr block : b) {
        (void)cuMemFree(block);
    }
    check(cusi_violation_count() == 0, "the CUDA stand-in recorded no driver rule broken");
}

}  // namespace

int main() {
    test_the_default_leak_handler_reports_a_busy_export_on_stderr();  // first: it forks, which CUDA allows only before cuInit
    test_result_holds_a_value_or_an_error_and_value_of_an_error_aborts();
    test_checked_accessors_abort_with_the_error_without_exceptions();
    test_a_host_round_trip_through_try_forms_reports_errors_as_results();
    test_torch_conversions_through_try_forms_report_errors_as_results();
    test_channels_and_pools_work_through_try_forms_across_processes();  // before test_exporter_destruction_waits_by_default_and_follows_its_policy: it forks
    test_exporter_destruction_waits_by_default_and_follows_its_policy();
    std::printf("1..%d\n# %d passed, %d failed\n", n_cases, n_cases - n_failed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
