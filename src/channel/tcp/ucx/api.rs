//! The typed wrapper of UCP: `Ucp`, the only caller of UCX's raw symbols (one method per call,
//! named after it), loaded once per process.

use super::*;

// ---------------------------------------------------------------------------------------------
// The typed wrapper: the only caller of raw symbols

/// The UCP functions devshare calls, with their C signatures from `ucp.h` / `status.h`.
pub(super) struct Fns {
    pub(super) get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub(super) get_version_string: unsafe extern "C" fn() -> *const c_char,
    pub(super) status_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(super) config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut Handle) -> Status,
    pub(super) config_modify: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> Status,
    pub(super) config_release: unsafe extern "C" fn(Handle),
    pub(super) init_version: unsafe extern "C" fn(c_uint, c_uint, *const UcpParams, Handle, *mut Handle) -> Status,
    pub(super) cleanup: unsafe extern "C" fn(Handle),
    pub(super) worker_create: unsafe extern "C" fn(Handle, *const WorkerParams, *mut Handle) -> Status,
    pub(super) worker_destroy: unsafe extern "C" fn(Handle),
    pub(super) worker_query: unsafe extern "C" fn(Handle, *mut WorkerAttr) -> Status,
    pub(super) worker_release_address: unsafe extern "C" fn(Handle, *mut c_void),
    pub(super) worker_progress: unsafe extern "C" fn(Handle) -> c_uint,
    pub(super) worker_get_efd: unsafe extern "C" fn(Handle, *mut c_int) -> Status,
    pub(super) worker_arm: unsafe extern "C" fn(Handle) -> Status,
    pub(super) ep_create: unsafe extern "C" fn(Handle, *const EpParams, *mut Handle) -> Status,
    pub(super) ep_close_nbx: unsafe extern "C" fn(Handle, *const RequestParam) -> StatusPtr,
    pub(super) ep_flush_nbx: unsafe extern "C" fn(Handle, *const RequestParam) -> StatusPtr,
    pub(super) put_nbx:
        unsafe extern "C" fn(Handle, *const c_void, usize, u64, Handle, *const RequestParam) -> StatusPtr,
    pub(super) request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    pub(super) request_free: unsafe extern "C" fn(*mut c_void),
    pub(super) mem_map: unsafe extern "C" fn(Handle, *const MemMapParams, *mut Handle) -> Status,
    pub(super) mem_unmap: unsafe extern "C" fn(Handle, Handle) -> Status,
    pub(super) rkey_pack: unsafe extern "C" fn(Handle, Handle, *mut *mut c_void, *mut usize) -> Status,
    pub(super) rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub(super) ep_rkey_unpack: unsafe extern "C" fn(Handle, *const c_void, *mut Handle) -> Status,
    pub(super) rkey_destroy: unsafe extern "C" fn(Handle),
}

/// The loaded UCP library.
pub(super) struct Ucp {
    pub(super) fns: Fns,
    /// The file it was loaded from (`dladdr`), else the name it loaded by.
    pub(super) path: String,
    /// `ucp_get_version_string`.
    pub(super) version: String,
    /// Keeps the functions above loaded.
    pub(super) _lib: libloading::Library,
}

/// What a non-blocking call started.
pub(super) enum Started {
    /// Done already (`UCS_OK`).
    Done,
    /// A request to wait for, then free.
    Pending(*mut c_void),
}

pub(super) static UCP: OnDemand<Ucp> = OnDemand::new(Ucp::load);

/// The UCP library, loaded on first use.
pub(super) fn api() -> Result<&'static Ucp> {
    UCP.get()
}

impl Ucp {
    /// Load the library, read its symbols and check its version.
    pub(super) fn load() -> Result<Ucp> {
        let lib = Symbols::open(LIBRARY_ENV, &["libucp.so.0".to_string(), "libucp.so".to_string()])?;
        // SAFETY: each field's type is the C signature of the symbol named next to it, from the
        // UCX 1.13 headers (unchanged through 1.22; `ucp_rkey_pack`, `ucp_rkey_buffer_release`
        // are deprecated there but exported). `ucs_status_string` is `libucs`'s, found through
        // `libucp`'s dependencies.
        let fns = unsafe {
            Fns {
                get_version: lib.required("ucp_get_version")?,
                get_version_string: lib.required("ucp_get_version_string")?,
                status_string: lib.required("ucs_status_string")?,
                config_read: lib.required("ucp_config_read")?,
                config_modify: lib.required("ucp_config_modify")?,
                config_release: lib.required("ucp_config_release")?,
                init_version: lib.required("ucp_init_version")?,
                cleanup: lib.required("ucp_cleanup")?,
                worker_create: lib.required("ucp_worker_create")?,
                worker_destroy: lib.required("ucp_worker_destroy")?,
                worker_query: lib.required("ucp_worker_query")?,
                worker_release_address: lib.required("ucp_worker_release_address")?,
                worker_progress: lib.required("ucp_worker_progress")?,
                worker_get_efd: lib.required("ucp_worker_get_efd")?,
                worker_arm: lib.required("ucp_worker_arm")?,
                ep_create: lib.required("ucp_ep_create")?,
                ep_close_nbx: lib.required("ucp_ep_close_nbx")?,
                ep_flush_nbx: lib.required("ucp_ep_flush_nbx")?,
                put_nbx: lib.required("ucp_put_nbx")?,
                request_check_status: lib.required("ucp_request_check_status")?,
                request_free: lib.required("ucp_request_free")?,
                mem_map: lib.required("ucp_mem_map")?,
                mem_unmap: lib.required("ucp_mem_unmap")?,
                rkey_pack: lib.required("ucp_rkey_pack")?,
                rkey_buffer_release: lib.required("ucp_rkey_buffer_release")?,
                ep_rkey_unpack: lib.required("ucp_ep_rkey_unpack")?,
                rkey_destroy: lib.required("ucp_rkey_destroy")?,
            }
        };
        let path = loaded_from(fns.get_version_string as *const c_void).unwrap_or_else(|| lib.name().to_string());
        let (mut major, mut minor, mut release) = (0, 0, 0);
        // SAFETY: three valid out pointers.
        unsafe { (fns.get_version)(&mut major, &mut minor, &mut release) };
        // SAFETY: no arguments; the result is a static string (or NULL, read as empty).
        let version = unsafe { c_text((fns.get_version_string)()) };
        if major != MIN_VERSION.0 || minor < MIN_VERSION.1 {
            return Err(Error::BackendUnavailable(format!(
                "{path} is UCX {major}.{minor}.{release}; devshare needs UCX {}.{} or a later 1.x",
                MIN_VERSION.0, MIN_VERSION.1
            )));
        }
        Ok(Ucp { fns, path, version, _lib: lib.into_library() })
    }

    /// The error for `call` failing with `status`.
    pub(super) fn error(&self, call: &str, status: Status) -> Error {
        // SAFETY: `ucs_status_string` takes any value and returns a static string.
        let meaning = unsafe { c_text((self.fns.status_string)(status)) };
        let hint = match status {
            UCS_ERR_UNREACHABLE => {
                "no transport of this UCX reaches the peer's: compare UCX_TLS and UCX_NET_DEVICES on both hosts"
            }
            UCS_ERR_CONNECTION_RESET => "the peer closed its worker or its process exited",
            UCS_ERR_ENDPOINT_TIMEOUT => "the peer stopped answering",
            UCS_ERR_CANCELED => "the endpoint was closed",
            _ => "",
        };
        vendor_error(call, status.into(), &meaning, hint, "", "UCX")
    }

    pub(super) fn check(&self, call: &str, status: Status) -> Result<()> {
        if status == UCS_OK {
            Ok(())
        } else {
            Err(self.error(call, status))
        }
    }

    /// Decode a `ucs_status_ptr_t` (`UCS_PTR_IS_ERR`, `UCS_PTR_IS_PTR`).
    pub(super) fn started(&self, call: &str, p: StatusPtr) -> Result<Started> {
        if p.is_null() {
            Ok(Started::Done)
        } else if (p as usize) >= (UCS_ERR_LAST as usize) {
            Err(self.error(call, p as isize as Status))
        } else {
            Ok(Started::Pending(p))
        }
    }

    /// `ucp_config_read` (the `UCX_*` environment), `ucp_config_modify` with each setting,
    /// `ucp_init_version` for RMA with wake-ups, shared by workers of several threads.
    pub(super) fn init(&self, settings: &[(&str, &str)]) -> Result<Handle> {
        let mut config: Handle = null_mut();
        // SAFETY: NULL prefix and file read the defaults and the `UCX_` environment; valid out
        // pointer.
        self.check("ucp_config_read", unsafe { (self.fns.config_read)(null(), null(), &mut config) })?;
        let release = Release(|| {
            // SAFETY: `config` came from `ucp_config_read` and is released once, here.
            unsafe { (self.fns.config_release)(config) }
        });
        for (name, value) in settings {
            let text = |s: &str| {
                CString::new(s).map_err(|_| Error::InvalidArgument(format!("UCX setting {name}={value}: contains NUL")))
            };
            let (n, v) = (text(name)?, text(value)?);
            // SAFETY: a live config and two NUL-terminated strings that UCX copies.
            let status = unsafe { (self.fns.config_modify)(config, n.as_ptr(), v.as_ptr()) };
            self.check(&format!("ucp_config_modify({name}={value})"), status)?;
        }
        let params = UcpParams {
            field_mask: UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME,
            features: UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
            mt_workers_shared: 1,
            name: c"devshare".as_ptr(),
            ..UcpParams::unset()
        };
        let mut context: Handle = null_mut();
        // SAFETY: `params` has 1.13's layout with only the fields in its mask set (the name is a
        // static string); the config is live; valid out pointer.
        let status = unsafe { (self.fns.init_version)(MIN_VERSION.0, MIN_VERSION.1, &params, config, &mut context) };
        drop(release);
        self.check("ucp_init_version", status)?;
        Ok(context)
    }

    /// `ucp_cleanup`.
    ///
    /// # Safety
    /// `context` is live, without workers or registrations, and not used again.
    pub(super) unsafe fn cleanup(&self, context: Handle) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.cleanup)(context) }
    }

    /// `ucp_worker_create`, serialized.
    ///
    /// # Safety
    /// `context` is live.
    pub(super) unsafe fn worker_create(&self, context: Handle) -> Result<Handle> {
        let params = WorkerParams {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: UCS_THREAD_MODE_SERIALIZED,
            ..WorkerParams::unset()
        };
        let mut worker: Handle = null_mut();
        // SAFETY: live context (the caller's promise); `params` has 1.13's layout with only the
        // thread mode set; valid out pointer.
        self.check("ucp_worker_create", unsafe { (self.fns.worker_create)(context, &params, &mut worker) })?;
        Ok(worker)
    }

    /// `ucp_worker_destroy`.
    ///
    /// # Safety
    /// `worker` is live, without endpoints or remote keys, and not used again.
    pub(super) unsafe fn worker_destroy(&self, worker: Handle) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.worker_destroy)(worker) }
    }

    /// `ucp_worker_query` for the address, copied, then `ucp_worker_release_address`.
    ///
    /// # Safety
    /// `worker` is live.
    pub(super) unsafe fn worker_address(&self, worker: Handle) -> Result<Vec<u8>> {
        let mut attr = WorkerAttr { field_mask: UCP_WORKER_ATTR_FIELD_ADDRESS, ..WorkerAttr::unset() };
        // SAFETY: live worker; `attr` has 1.13's layout and asks only for the address.
        self.check("ucp_worker_query", unsafe { (self.fns.worker_query)(worker, &mut attr) })?;
        if attr.address.is_null() || attr.address_length == 0 {
            return Err(Error::Internal("ucp_worker_query returned no address".into()));
        }
        // SAFETY: UCX returned `address_length` bytes at `address`, ours until released below.
        let bytes = unsafe { std::slice::from_raw_parts(attr.address as *const u8, attr.address_length) }.to_vec();
        // SAFETY: the address this worker's query returned, released once.
        unsafe { (self.fns.worker_release_address)(worker, attr.address) };
        Ok(bytes)
    }

    /// `ucp_worker_progress`.
    ///
    /// # Safety
    /// `worker` is live and no other thread is in a call on it.
    pub(super) unsafe fn worker_progress(&self, worker: Handle) -> u32 {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.worker_progress)(worker) }
    }

    /// `ucp_worker_get_efd`.
    ///
    /// # Safety
    /// `worker` is live.
    pub(super) unsafe fn worker_get_efd(&self, worker: Handle) -> Result<RawFd> {
        let mut fd: c_int = -1;
        // SAFETY: live worker; valid out pointer.
        self.check("ucp_worker_get_efd", unsafe { (self.fns.worker_get_efd)(worker, &mut fd) })?;
        Ok(fd)
    }

    /// `ucp_worker_arm`: `UCS_OK` is armed, `UCS_ERR_BUSY` has events to progress first.
    ///
    /// # Safety
    /// `worker` is live and no other thread is in a call on it.
    pub(super) unsafe fn worker_arm(&self, worker: Handle) -> Result<Arm> {
        // SAFETY: the caller's promise.
        match unsafe { (self.fns.worker_arm)(worker) } {
            UCS_OK => Ok(Arm::Armed),
            UCS_ERR_BUSY => Ok(Arm::Busy),
            status => Err(self.error("ucp_worker_arm", status)),
        }
    }

    /// `ucp_ep_create` to the worker at `address`, with peer error handling: `failed` is set to
    /// the endpoint's error status when UCX reports one.
    ///
    /// # Safety
    /// `worker` is live; `address` is a whole worker address from `ucp_worker_query` of a
    /// compatible UCX (UCX reads it without a length); `failed` outlives the endpoint.
    pub(super) unsafe fn ep_create(&self, worker: Handle, address: &[u8], failed: *const AtomicI8) -> Result<Handle> {
        let params = EpParams {
            field_mask: UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: UCP_ERR_HANDLING_MODE_PEER,
            err_handler: ErrHandler { cb: Some(on_endpoint_error), arg: failed as *mut c_void },
            ..EpParams::unset()
        };
        let mut ep: Handle = null_mut();
        // SAFETY: the caller's promises; `params` has 1.13's layout with only its mask's fields
        // set; valid out pointer.
        self.check("ucp_ep_create", unsafe { (self.fns.ep_create)(worker, &params, &mut ep) })?;
        Ok(ep)
    }

    /// `ucp_ep_close_nbx`: flushing first, or at once with `force` (outstanding requests then
    /// complete with `UCS_ERR_CANCELED`).
    ///
    /// # Safety
    /// `ep` is live; it is not used again.
    pub(super) unsafe fn ep_close_nbx(&self, ep: Handle, force: bool) -> Result<Started> {
        let mut param = RequestParam::unset();
        if force {
            param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: the caller's promise; `param` has 1.13's layout with only its mask's fields.
        self.started("ucp_ep_close_nbx", unsafe { (self.fns.ep_close_nbx)(ep, &param) })
    }

    /// `ucp_ep_flush_nbx`: completes when every operation on `ep` completed at the target.
    ///
    /// # Safety
    /// `ep` is live.
    pub(super) unsafe fn ep_flush_nbx(&self, ep: Handle) -> Result<Started> {
        let param = RequestParam::unset();
        // SAFETY: the caller's promise; no field set.
        self.started("ucp_ep_flush_nbx", unsafe { (self.fns.ep_flush_nbx)(ep, &param) })
    }

    /// `ucp_put_nbx` of `len` bytes at `local` to `remote` in the region of `rkey`.
    ///
    /// # Safety
    /// `ep` and `rkey` (unpacked on `ep`) are live; `local..local + len` stays readable until the
    /// returned request completes.
    pub(super) unsafe fn put_nbx(
        &self,
        ep: Handle,
        local: *const u8,
        len: usize,
        remote: u64,
        rkey: Handle,
    ) -> Result<Started> {
        let param = RequestParam::unset();
        // SAFETY: the caller's promises; no field set (contiguous bytes, no callback).
        self.started("ucp_put_nbx", unsafe { (self.fns.put_nbx)(ep, local.cast(), len, remote, rkey, &param) })
    }

    /// `ucp_request_check_status`.
    ///
    /// # Safety
    /// `request` came from a call above and was not freed.
    pub(super) unsafe fn request_check_status(&self, request: *mut c_void) -> Status {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.request_check_status)(request) }
    }

    /// `ucp_request_free` (a request still running is freed when it completes).
    ///
    /// # Safety
    /// `request` came from a call above and is not used again.
    pub(super) unsafe fn request_free(&self, request: *mut c_void) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.request_free)(request) }
    }

    /// `ucp_mem_map` of an existing buffer (memory type detected by UCX).
    ///
    /// # Safety
    /// `context` is live; the buffer stays allocated until the memory handle is unmapped.
    pub(super) unsafe fn mem_map(&self, context: Handle, address: *mut u8, len: usize) -> Result<Handle> {
        let params = MemMapParams {
            field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            address: address.cast(),
            length: len,
            ..MemMapParams::unset()
        };
        let mut memh: Handle = null_mut();
        // SAFETY: the caller's promises; `params` has 1.13's layout with only its mask's fields.
        self.check("ucp_mem_map", unsafe { (self.fns.mem_map)(context, &params, &mut memh) })?;
        Ok(memh)
    }

    /// `ucp_mem_unmap`.
    ///
    /// # Safety
    /// `context` and `memh` (mapped in it) are live; `memh` is not used again.
    pub(super) unsafe fn mem_unmap(&self, context: Handle, memh: Handle) -> Result<()> {
        // SAFETY: the caller's promise.
        self.check("ucp_mem_unmap", unsafe { (self.fns.mem_unmap)(context, memh) })
    }

    /// `ucp_rkey_pack`, copied, then `ucp_rkey_buffer_release`.
    ///
    /// # Safety
    /// `context` and `memh` (mapped in it) are live.
    pub(super) unsafe fn rkey_pack(&self, context: Handle, memh: Handle) -> Result<Vec<u8>> {
        let mut buffer: *mut c_void = null_mut();
        let mut len = 0usize;
        // SAFETY: the caller's promise; valid out pointers.
        self.check("ucp_rkey_pack", unsafe { (self.fns.rkey_pack)(context, memh, &mut buffer, &mut len) })?;
        let bytes = if buffer.is_null() {
            Vec::new()
        } else {
            // SAFETY: UCX returned `len` bytes at `buffer`, ours until released below.
            let b = unsafe { std::slice::from_raw_parts(buffer as *const u8, len) }.to_vec();
            // SAFETY: the buffer `ucp_rkey_pack` returned, released once.
            unsafe { (self.fns.rkey_buffer_release)(buffer) };
            b
        };
        if bytes.is_empty() {
            return Err(Error::Internal("ucp_rkey_pack returned an empty key".into()));
        }
        Ok(bytes)
    }

    /// `ucp_ep_rkey_unpack`.
    ///
    /// # Safety
    /// `ep` is live; `packed` is a whole key from `ucp_rkey_pack` of a compatible UCX (UCX reads
    /// it without a length).
    pub(super) unsafe fn ep_rkey_unpack(&self, ep: Handle, packed: &[u8]) -> Result<Handle> {
        let mut rkey: Handle = null_mut();
        // SAFETY: the caller's promises; valid out pointer.
        self.check("ucp_ep_rkey_unpack", unsafe { (self.fns.ep_rkey_unpack)(ep, packed.as_ptr().cast(), &mut rkey) })?;
        Ok(rkey)
    }

    /// `ucp_rkey_destroy`.
    ///
    /// # Safety
    /// `rkey` is live, no operation using it is running, and it is not used again.
    pub(super) unsafe fn rkey_destroy(&self, rkey: Handle) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.rkey_destroy)(rkey) }
    }
}

/// Runs its closure when dropped.
pub(super) struct Release<F: FnMut()>(F);

impl<F: FnMut()> Drop for Release<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// The file the function at `f` was loaded from.
pub(super) fn loaded_from(f: *const c_void) -> Option<String> {
    // SAFETY: `Dl_info` is plain data (pointers and integers): all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `f` is the address of a function of a loaded library; valid out pointer.
    if unsafe { libc::dladdr(f, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: `dli_fname` is the library's NUL-terminated name, valid while it is loaded.
    Some(unsafe { c_text(info.dli_fname) })
}

/// The endpoint error handler: records the status in the endpoint's flag.
unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: Handle, status: Status) {
    // SAFETY: `arg` is the endpoint's `failed` flag, which outlives the endpoint in UCX (it is
    // leaked when a close does not finish).
    if let Some(flag) = unsafe { (arg as *const AtomicI8).as_ref() } {
        flag.store(if status == UCS_OK { UCS_ERR_IO_ERROR } else { status }, Ordering::Release);
    }
}
