/* SPDX-License-Identifier: Apache-2.0 */

// devshare.hpp: the header-only C++17 API over the devshare C API (devshare.h). It includes
// every header under devshare/; include just the ones you use to compile less:
//
//   devshare/error.hpp     Error (a DEVSHARE_STATUS_* code + the library's message; what the
//                          throwing API throws), Result<T> (std::expected<T, Error> where the
//                          standard library has it), kForever
//   devshare/dtype.hpp     Span / Dims, DevshareDType helpers, dtype_traits<T>, dtype_of<T>()
//   devshare/view.hpp      TensorView<T>: a strided view, std::mdspan where available
//   devshare/handle.hpp    Handle; TensorDesc and describe(...) / describe_at(...) / bytes(), the
//                          one way to say which tensor to share or send; version, probe,
//                          local_pid, allow_ptrace
//   devshare/torch.hpp     PyTorch / torch_npu tuples: TorchStorage, torch_args, handle_from_torch,
//                          handle_to_torch, torch_storage_handle, the version bridge
//   devshare/exporter.hpp  Exporter (owns an export; its destructor follows a DestroyPolicy
//                          chosen at construction), the exporter-leak handler
//   devshare/dlpack.hpp    DLPackVersioned / DLPackLegacy (own a DLPack managed tensor)
//   devshare/import.hpp    Import (owns an import: as<T>(), DLPack, pool_slot), import_options
//   devshare/channel.hpp   Channel (producer end: listen, serve, leased sends), Connection
//                          (consumer end: recv gives Imports)
//   devshare/pool.hpp      Pool (fixed-address slots on a channel) and Slot
//   devshare/owner.hpp     (detail) the one owner template every owner class uses
//   devshare/compat.hpp    the 1.0-1.2 share/send spellings, [[deprecated]] forwarders until 2.0
//
// Two forms of every call that can fail: try_name(...) returns Result<T> and never throws;
// name(...) returns T and throws devshare::Error, and exists only with exceptions
// (DEVSHARE_HPP_EXCEPTIONS; -fno-exceptions builds get the try_ forms). Functions marked
// noexcept never fail. Every function that returns something is [[nodiscard]]: a handle dropped
// on the floor is a reference never returned.
//
// One way to describe, one way to send:
//     devshare::Exporter exp = devshare::Exporter::host_alloc(n * sizeof(float));
//     devshare::Handle h = exp.share(devshare::describe(exp.data<float>(), {rows, cols}));
//     ch.send(peer, exp, devshare::describe(p, {n}));
//     pool.send(slot, peer, devshare::describe(slot.data<float>(), {n}));
// describe<T>(void_ptr, ...) names the element type, describe(kBFloat16, p, ...) gives a
// DevshareDType, describe_at<T>(byte_offset, ...) places it by offset, bytes() is the whole range,
// and a C DevshareTensorDesc is accepted where a TensorDesc is.
//
// The C functions and their wrappers
//   devshare_host_alloc / host_adopt / export / export_segments / channel_host_alloc
//                                     Exporter::host_alloc / host_adopt / export_memory /
//                                     export_segments / channel_host_alloc
//   devshare_exporter_share(_encoded) Exporter::share(desc) / share_encoded(desc)
//   devshare_exporter_{segment_table,allow_pid,outstanding,wait,close}   Exporter members
//   devshare_import / import_encoded / import_text / import_torch
//                                     Import(handle) / Import::from / from_encoded / from_text / from_torch
//   devshare_import_info / import_handle     read once by Import: info(), handle(), dtype(), shape(), ...
//   devshare_import_to_dlpack_versioned / _to_dlpack   Import::to_dlpack_versioned / to_dlpack
//   devshare_import_pool_slot / import_give_back       Import::pool_slot / give_back
//   devshare_handle_{validate,encode,decode,to_text,from_text,discard}   Handle members
//   devshare_handle_from_torch(_encoded), _to_torch(_as), devshare_torch_storage_handle(_as),
//   devshare_torch_discard, devshare_torch_handle_convert, devshare_torch_format_for_version
//                                     handle_from_torch(_encoded) / handle_to_torch /
//                                     torch_storage_handle / torch_discard / torch_handle_convert /
//                                     torch_format_for_version (free functions, devshare/torch.hpp)
//   devshare_probe / local_pid / allow_ptrace / version      probe / local_pid / allow_ptrace / version
//   devshare_channel_{listen,restrict,fd,service,wait_peers,peer_ids,peer_info,disconnect,
//   trust_announced_pids,send,close}  Channel members (peer_ids: peers())
//   devshare_channel_connect, devshare_connection_{fd,info,recv,close}
//                                     Connection::connect / fd / peer_id, producer_pid / recv / close
//   devshare_pool_{create,id,acquire,send,release,info,close}   Pool members (acquire gives a Slot)
//
// Destruction: ~Import releases; ~Exporter closes by its DestroyPolicy (devshare/exporter.hpp:
// by default a busy device export is waited for, never forced or silently leaked); ~Channel,
// ~Connection and ~Pool close; ~Slot gives an acquired, unsent slot back. A move assignment does
// to the object it replaces what destruction would.
//
// Costs: each function is one call into the C library (an Import's construction: three, for its
// info and handle, kept in one heap block so that an Import moves as two pointers; Connection::recv
// one more), plus at most one std::string or std::vector for results that are text or bytes (or
// peer ids). Exporter caches its address and size, Pool its slot size and count, Slot its index,
// address and size.
//
// Threading follows devshare.h: an Exporter, a Channel, a Connection or a Pool may be used from
// several threads except for close() and destruction; an Import is released once, by whoever
// owns it; a Slot is one thread's at a time.
//
// Structs that cross the C boundary start with struct_size (see "Versions and evolution" in
// devshare.h). The helpers here (tensor_desc, import_options, torch_args, TensorDesc, probe,
// Import) initialise them with the C *_init functions and this header's sizeof; a struct you
// fill yourself needs the same: value-initialise it and call its *_init function.

#ifndef DEVSHARE_HPP
#define DEVSHARE_HPP

#include "devshare/channel.hpp"
#include "devshare/compat.hpp"
#include "devshare/dlpack.hpp"
#include "devshare/dtype.hpp"
#include "devshare/error.hpp"
#include "devshare/exporter.hpp"
#include "devshare/handle.hpp"
#include "devshare/import.hpp"
#include "devshare/owner.hpp"
#include "devshare/pool.hpp"
#include "devshare/torch.hpp"
#include "devshare/view.hpp"

#endif  // DEVSHARE_HPP
