// SPDX-License-Identifier: Apache-2.0
//
// test_raii_nodiscard: never run, only compiled (-fsyntax-only) by tests/c/nodiscard_check.sh.
// Every line marked "probe" discards the result of one devshare.hpp function that returns
// something; the check passes when the compiler warns (-Wunused-result, i.e. [[nodiscard]]) on
// exactly the probe lines and nowhere else. Built twice: with exceptions (PROBE_THROWING: the
// throwing forms too) and with -fno-exceptions (the try_ forms only).

#include "devshare.hpp"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

void probes(devshare::Exporter& e, devshare::Import& i, const devshare::Handle& h, devshare::TensorView<float>& v,
            devshare::DLPackVersioned& d, devshare::Result<int>& r, const DevshareTorchArgs& a) {
    const float* p = nullptr;
    const std::vector<uint8_t> bytes;
    const devshare::TensorDesc td;
    const DevshareTensorDesc cd = devshare::tensor_desc();
    const devshare::Span<const int64_t> dims;
    // Library-wide helpers and types.
    devshare::version();  // probe
    devshare::try_probe(1);  // probe
    devshare::try_local_pid(1);  // probe
    devshare::try_allow_ptrace(0);  // probe
    devshare::tensor_desc();  // probe
    devshare::import_options();  // probe
    devshare::torch_args();  // probe
    devshare::status_result(0);  // probe
    devshare::make_error_code(0);  // probe
    devshare::error_category();  // probe
    devshare::dtype_of<float>();  // probe
    devshare::dtype_name(devshare::kFloat16);  // probe
    devshare::element_size(devshare::kFloat16);  // probe
    devshare::same_dtype(devshare::kFloat16, devshare::kBFloat16);  // probe
    devshare::make_dtype(2, 32);  // probe
    devshare::Error(0, "x").code();  // probe
    devshare::Error(0, "x").status();  // probe
    devshare::Error::from_last(0);  // probe
    r.has_value();  // probe
    r.value();  // probe
    r.value_or(1);  // probe
    r.error();  // probe
    r.code();  // probe
    *r;  // probe
    dims.size();  // probe
    dims.data();  // probe
    dims.to_vector();  // probe
    devshare::TensorDesc::try_make(devshare::kFloat16, dims);  // probe
    td.raw();  // probe
    // Handle.
    h.raw();  // probe
    h.dtype();  // probe
    h.ndim();  // probe
    h.shape();  // probe
    h.strides();  // probe
    h.numel();  // probe
    h.backend();  // probe
    h.device();  // probe
    h.storage_offset();  // probe
    h.storage_size();  // probe
    h.alloc_size();  // probe
    h.tensor_offset();  // probe
    h.segmented();  // probe
    h.is<float>();  // probe
    h.try_validate();  // probe
    h.try_to_text();  // probe
    h.try_encode();  // probe
    h.try_discard();  // probe
    devshare::Handle::try_from_text("x");  // probe
    devshare::Handle::try_decode(bytes);  // probe
    // Torch.
    devshare::try_handle_from_torch(a);  // probe
    devshare::try_handle_from_torch_encoded(a);  // probe
    devshare::try_handle_to_torch(h);  // probe
    devshare::try_torch_storage_handle(h);  // probe
    devshare::try_torch_discard(a);  // probe
    // Exporter.
    devshare::Exporter::try_host_alloc(1);  // probe
    devshare::Exporter::try_host_adopt("/x", 1);  // probe
    devshare::Exporter::try_export_memory(1, 0, nullptr, 1);  // probe
    devshare::Exporter::try_export_segments(1, 0, nullptr, {}, 1);  // probe
    devshare::Exporter::try_adopt(nullptr);  // probe
    e.data();  // probe
    e.size();  // probe
    e.get();  // probe
    e.release();  // probe
    e.on_destroy();  // probe
    e.try_share(p, {1});  // probe
    e.try_share<float>(e.data(), {1});  // probe
    e.try_share(devshare::kBFloat16, p, {1});  // probe
    e.try_share_at<float>(0, {1});  // probe
    e.try_share(td);  // probe
    e.try_share(cd);  // probe
    e.try_share_bytes();  // probe
    e.try_share_encoded(td);  // probe
    e.try_share_bytes_encoded();  // probe
    e.try_describe(p, {1});  // probe
    e.try_describe_at(devshare::kFloat16, 0, {1});  // probe
    e.try_segment_table();  // probe
    e.try_allow_pid(1);  // probe
    e.try_outstanding();  // probe
    e.try_wait(std::chrono::milliseconds(0));  // probe
    e.try_close();  // probe
    // Import, views, DLPack.
    devshare::Import::try_from(h);  // probe
    devshare::Import::try_from_encoded(bytes);  // probe
    devshare::Import::try_from_text("x");  // probe
    devshare::Import::try_from_torch(a);  // probe
    devshare::Import::try_adopt(nullptr);  // probe
    i.data();  // probe
    i.data<float>();  // probe
    i.try_as<float>();  // probe
    i.try_to_dlpack_versioned();  // probe
    i.try_to_dlpack();  // probe
    i.info();  // probe
    i.handle();  // probe
    i.shape();  // probe
    i.numel();  // probe
    i.read_only();  // probe
    i.get();  // probe
    i.try_release();  // probe
    v(0);  // probe
    v.at({0});  // probe
    v.data();  // probe
    v.shape();  // probe
    v.is_contiguous();  // probe
    v.try_flat();  // probe
    d.get();  // probe
    d.release();  // probe
    d.data();  // probe
    d.read_only();  // probe
#if defined(PROBE_THROWING)
    devshare::probe(1);  // probe
    devshare::local_pid(1);  // probe
    h.to_text();  // probe
    h.encode();  // probe
    devshare::Handle::from_text("x");  // probe
    devshare::Handle::decode(bytes);  // probe
    devshare::handle_from_torch(a);  // probe
    devshare::handle_from_torch_encoded(a);  // probe
    devshare::handle_to_torch(h);  // probe
    devshare::torch_storage_handle(h);  // probe
    devshare::Exporter::host_alloc(1);  // probe
    devshare::Exporter::host_adopt("/x", 1);  // probe
    devshare::Exporter::export_memory(1, 0, nullptr, 1);  // probe
    devshare::Exporter::export_segments(1, 0, nullptr, {}, 1);  // probe
    e.share(p, {1});  // probe
    e.share<float>(e.data(), {1});  // probe
    e.share(devshare::kBFloat16, p, {1});  // probe
    e.share_at<float>(0, {1});  // probe
    e.share(td);  // probe
    e.share(cd);  // probe
    e.share_bytes();  // probe
    e.share_encoded(td);  // probe
    e.share_bytes_encoded();  // probe
    e.describe(p, {1});  // probe
    e.segment_table();  // probe
    e.outstanding();  // probe
    e.wait(std::chrono::milliseconds(0));  // probe
    devshare::Import::from(h);  // probe
    devshare::Import::from_encoded(bytes);  // probe
    devshare::Import::from_text("x");  // probe
    devshare::Import::from_torch(a);  // probe
    i.as<float>();  // probe
    i.to_dlpack_versioned();  // probe
    i.to_dlpack();  // probe
    v.flat();  // probe
    devshare::TensorDesc::make(devshare::kFloat16, dims);  // probe
#endif
    // Calls that return nothing: no warning.
    e.set_on_destroy(devshare::OnDestroy::force);
    d.reset();
}
