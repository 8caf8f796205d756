// SPDX-License-Identifier: Apache-2.0
//
// test_raii_nodiscard: never run, only compiled (-fsyntax-only) by tests/c/nodiscard_check.sh.
// Every line marked "probe" discards the result of one devshare.hpp function that returns
// something; the check passes when the compiler warns (-Wunused-result, i.e. [[nodiscard]]) on
// exactly the probe lines and nowhere else. Built twice: with exceptions (PROBE_THROWING: the
// throwing forms too) and with -fno-exceptions (the try_ forms only). Only the current spellings
// appear here (devshare::describe(...) / describe_at(...) / bytes() and the one share / send that
// takes a TensorDesc); the deprecated 1.x forwarders of devshare/compat.hpp do not. It also
// compiles as C++23, where Result is std::expected (without this header's status() / code()).

#include "devshare.hpp"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

void probes(devshare::Exporter& e, devshare::Import& i, const devshare::Handle& h, devshare::TensorView<float>& v,
            devshare::DLPackVersioned& d, devshare::Result<int>& r, const DevshareTorchArgs& a, devshare::Channel& ch,
            devshare::Connection& conn, devshare::Pool& pool, devshare::Slot& slot) {
    const float* p = nullptr;
    const std::vector<uint8_t> bytes;
    const devshare::TensorDesc td;
    const DevshareTensorDesc cd = devshare::tensor_desc();
    const devshare::Span<const int64_t> dims;
    const devshare::TorchStorage storage;
    const std::chrono::milliseconds ms(0);
    // Library-wide helpers and types.
    devshare::version();  // probe
    devshare::try_probe(1);  // probe
    devshare::try_local_pid(1);  // probe
    devshare::try_allow_ptrace(0);  // probe
    devshare::tensor_desc();  // probe
    devshare::import_options();  // probe
    devshare::torch_args();  // probe
    devshare::torch_args(1, storage, devshare::kFloat16, dims);  // probe
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
    devshare::Error(0, "x").status_name();  // probe
    devshare::Error(0, "x").message();  // probe
    devshare::Error::from_last(0);  // probe
    r.has_value();  // probe
    r.value();  // probe
    r.value_or(1);  // probe
    r.error();  // probe
#if !DEVSHARE_HPP_STD_EXPECTED
    r.status();  // probe
    r.code();  // probe
#endif
    *r;  // probe
    dims.size();  // probe
    dims.data();  // probe
    dims.empty();  // probe
    dims.begin();  // probe
    dims.end();  // probe
    dims[0];  // probe
    dims.to_vector();  // probe
    // Describing a tensor: the one way (TensorDesc, describe, describe_at, bytes).
    devshare::TensorDesc::make(devshare::kFloat16, dims);  // probe
    devshare::TensorDesc::try_make(devshare::kFloat16, dims);  // probe
    td.raw();  // probe
    devshare::describe(p, {1});  // probe
    devshare::describe<float>(e.data(), {1});  // probe
    devshare::describe(devshare::kBFloat16, p, {1});  // probe
    devshare::describe_at<float>(0, {1});  // probe
    devshare::describe_at(devshare::kFloat16, 0, {1});  // probe
    devshare::bytes();  // probe
    // Handle.
    h.raw();  // probe
    h.dtype();  // probe
    h.ndim();  // probe
    h.shape();  // probe
    h.strides();  // probe
    h.numel();  // probe
    h.element_size();  // probe
    h.backend();  // probe
    h.device();  // probe
    h.storage_offset();  // probe
    h.storage_size();  // probe
    h.alloc_size();  // probe
    h.tensor_offset();  // probe
    h.flags();  // probe
    h.segmented();  // probe
    h.has_event();  // probe
    h.producer_pid();  // probe
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
    devshare::try_torch_format_for_version(1, "2.11.0");  // probe
    devshare::try_torch_handle_convert(1, bytes, 0);  // probe
    devshare::try_torch_discard(a);  // probe
    // Exporter.
    devshare::Exporter::try_host_alloc(1);  // probe
    devshare::Exporter::try_channel_host_alloc(1);  // probe
    devshare::Exporter::try_host_adopt("/x", 1);  // probe
    devshare::Exporter::try_export_memory(1, 0, nullptr, 1);  // probe
    devshare::Exporter::try_export_segments(1, 0, nullptr, {}, 1);  // probe
    devshare::Exporter::try_adopt(nullptr);  // probe
    devshare::Close::force | devshare::Close::unlink;  // probe
    e.data();  // probe
    e.size();  // probe
    e.get();  // probe
    e.release();  // probe
    e.on_destroy();  // probe
    e.destroy_policy();  // probe
    e.try_share(devshare::describe(p, {1}));  // probe
    e.try_share(devshare::describe_at<float>(0, {1}));  // probe
    e.try_share(devshare::bytes());  // probe
    e.try_share(td);  // probe
    e.try_share(cd);  // probe
    e.try_share_encoded(td);  // probe
    e.try_share_encoded(devshare::bytes());  // probe
    e.try_segment_table();  // probe
    e.try_allow_pid(1);  // probe
    e.try_outstanding();  // probe
    e.try_wait(ms);  // probe
    e.try_close();  // probe
    // Import, views, DLPack.
    devshare::Import::try_from(h);  // probe
    devshare::Import::try_from_encoded(bytes);  // probe
    devshare::Import::try_from_text("x");  // probe
    devshare::Import::try_from_torch(a);  // probe
    devshare::Import::try_adopt(nullptr);  // probe
    i.data();  // probe
    i.data<float>();  // probe
    i.try_data<float>();  // probe
    i.try_as<float>();  // probe
    i.try_to_dlpack_versioned();  // probe
    i.try_to_dlpack();  // probe
    i.try_pool_slot();  // probe
    i.try_give_back();  // probe
    i.info();  // probe
    i.handle();  // probe
    i.dtype();  // probe
    i.ndim();  // probe
    i.shape();  // probe
    i.strides();  // probe
    i.numel();  // probe
    i.element_size();  // probe
    i.read_only();  // probe
    i.device();  // probe
    i.backend();  // probe
    i.get();  // probe
    i.try_release();  // probe
    v(0);  // probe
    v.at({0});  // probe
    v.try_at({0});  // probe
    v.unchecked(0);  // probe
    v.valid();  // probe
    v.data();  // probe
    v.ndim();  // probe
    v.shape();  // probe
    v.strides();  // probe
    v.extent(0);  // probe
    v.stride(0);  // probe
    v.numel();  // probe
    v.is_contiguous();  // probe
    v.try_flat();  // probe
    d.get();  // probe
    d.release();  // probe
    d.data();  // probe
    d.ndim();  // probe
    d.shape();  // probe
    d.strides();  // probe
    d.dtype();  // probe
    d.byte_offset();  // probe
    d.device_type();  // probe
    d.device_id();  // probe
    d.version_major();  // probe
    d.version_minor();  // probe
    d.flags();  // probe
    d.read_only();  // probe
    // Channel, Connection.
    devshare::Channel::try_listen("@x");  // probe
    devshare::Channel::adopt(nullptr);  // probe
    ch.get();  // probe
    ch.release();  // probe
    ch.fd();  // probe
    ch.try_restrict({}, {});  // probe
    ch.try_service(ms);  // probe
    ch.try_wait_peers(1, ms);  // probe
    ch.try_peers();  // probe
    ch.try_peer_info(1);  // probe
    ch.try_trust_announced_pids(true);  // probe
    ch.try_disconnect(1);  // probe
    ch.try_send(1, e, td);  // probe
    ch.try_send(1, e, devshare::describe(p, {1}));  // probe
    ch.try_send(1, e, devshare::bytes());  // probe
    ch.try_send(1, e, cd);  // probe
    ch.try_close();  // probe
    devshare::Connection::try_connect("@x", ms);  // probe
    devshare::Connection::adopt(nullptr);  // probe
    conn.get();  // probe
    conn.release();  // probe
    conn.fd();  // probe
    conn.try_peer_id();  // probe
    conn.try_producer_pid();  // probe
    conn.try_recv(ms);  // probe
    conn.try_close();  // probe
    // Pool, Slot.
    devshare::Pool::try_create(ch, e, 1, 1);  // probe
    devshare::Pool::try_adopt(nullptr);  // probe
    pool.get();  // probe
    pool.slot_size();  // probe
    pool.count();  // probe
    pool.try_id();  // probe
    pool.try_acquire(ms);  // probe
    pool.try_send(slot, 1, td);  // probe
    pool.try_send(slot, 1, devshare::describe(slot.data<float>(), {1}));  // probe
    pool.try_send(slot, 1, devshare::describe_at<float>(0, {1}));  // probe
    pool.try_send(slot, 1, devshare::bytes());  // probe
    pool.try_release(slot);  // probe
    pool.try_info();  // probe
    pool.try_close();  // probe
    slot.index();  // probe
    slot.data();  // probe
    slot.data<float>();  // probe
    slot.size();  // probe
    slot.pool();  // probe
    slot.disown();  // probe
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
    devshare::torch_format_for_version(1, "2.11.0");  // probe
    devshare::torch_handle_convert(1, bytes, 0);  // probe
    devshare::Exporter::host_alloc(1);  // probe
    devshare::Exporter::channel_host_alloc(1);  // probe
    devshare::Exporter::host_adopt("/x", 1);  // probe
    devshare::Exporter::export_memory(1, 0, nullptr, 1);  // probe
    devshare::Exporter::export_segments(1, 0, nullptr, {}, 1);  // probe
    e.share(devshare::describe(p, {1}));  // probe
    e.share(devshare::describe<float>(e.data(), {1}));  // probe
    e.share(devshare::describe(devshare::kBFloat16, p, {1}));  // probe
    e.share(devshare::describe_at<float>(0, {1}));  // probe
    e.share(devshare::bytes());  // probe
    e.share(td);  // probe
    e.share(cd);  // probe
    e.share_encoded(td);  // probe
    e.share_encoded(devshare::bytes());  // probe
    e.segment_table();  // probe
    e.outstanding();  // probe
    e.wait(ms);  // probe
    devshare::Import::from(h);  // probe
    devshare::Import::from_encoded(bytes);  // probe
    devshare::Import::from_text("x");  // probe
    devshare::Import::from_torch(a);  // probe
    i.as<float>();  // probe
    i.to_dlpack_versioned();  // probe
    i.to_dlpack();  // probe
    i.pool_slot();  // probe
    v.flat();  // probe
    devshare::Channel::listen("@x");  // probe
    ch.wait_peers(1, ms);  // probe
    ch.peers();  // probe
    ch.peer_info(1);  // probe
    devshare::Connection::connect("@x", ms);  // probe
    conn.peer_id();  // probe
    conn.producer_pid();  // probe
    conn.recv(ms);  // probe
    devshare::Pool::create(ch, e, 1, 1);  // probe
    pool.id();  // probe
    pool.acquire(ms);  // probe
    pool.info();  // probe
    // The throwing forms that return nothing: no warning.
    ch.send(1, e, td);
    ch.send(1, e, devshare::describe(p, {1}));
    ch.send(1, e, devshare::bytes());
    pool.send(slot, 1, devshare::describe(slot.data<float>(), {1}));
    pool.send(slot, 1, devshare::bytes());
    pool.release(slot);
    e.allow_pid(1);
    h.validate();
    h.discard();
    i.give_back();
#endif
    // Calls that return nothing: no warning.
    e.set_on_destroy(devshare::OnDestroy::force);
    e.set_on_destroy(devshare::OnDestroy::wait, std::chrono::milliseconds(20));
    e.set_on_destroy({devshare::OnDestroy::leak_and_report});
    d.reset();
    // Not [[nodiscard]]: it returns the previous handler, which a caller installing its own for
    // good has no use for.
    devshare::set_exporter_leak_handler(nullptr);
}
