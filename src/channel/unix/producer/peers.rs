//! The channel's peers: accepting connections (credentials, handshake places per source), the
//! handshake and its deadline, the messages a peer sends (releases, returns, detaches) and its
//! error budget, the send-patience deadline, and disconnecting a peer (its leases and slots come
//! back).

use super::*;

impl crate::channel::peers::Peer for Peer {
    type Source = i32;
    fn id(&self) -> u64 {
        self.info.id
    }
    fn ready(&self) -> bool {
        self.ready
    }
    fn waiting(&self) -> Option<(i32, Instant)> {
        (!self.ready && self.doomed.is_none()).then_some((self.info.pid, self.accepted))
    }
}

/// Most connections one look at the listener takes ([`Core::accept_all`]).
pub(super) const ACCEPTS_PER_PASS: usize = 64;

impl Core {
    /// The index of a connected peer (handshake done, not being disconnected).
    pub(super) fn index(&self, id: u64) -> Result<usize> {
        let i = self.peers.index(id)?;
        match self.peers[i].doomed {
            None => Ok(i),
            Some(_) => Err(Error::NotFound(format!("peer {id} is not connected to this channel"))),
        }
    }

    /// Disconnect the peers that are marked, past their handshake deadline, past their send
    /// patience, or past their error budget.
    pub(super) fn sweep(&mut self, epfd: BorrowedFd<'_>) {
        // Nothing to judge (the usual case, on every send): no clock read.
        if self.peers.iter().all(|p| {
            p.ready
                && p.doomed.is_none()
                && p.stalled_since.is_none()
                && p.info.protocol_errors <= DEVSHARE_CHANNEL_ERROR_BUDGET
        }) {
            return;
        }
        let now = Instant::now();
        let handshake = Duration::from_millis(DEVSHARE_CHANNEL_HANDSHAKE_MS);
        let patience = Duration::from_millis(DEVSHARE_CHANNEL_SEND_PATIENCE_MS);
        // Before a deadline is judged, look at the socket: a handshake that arrived, or a queue
        // the peer has made room for meanwhile, is progress (the caller may not have served).
        for i in 0..self.peers.len() {
            let p = &self.peers[i];
            if p.doomed.is_some() {
                continue;
            }
            if !p.ready && now.duration_since(p.accepted) >= handshake && !self.drain_peer(i) {
                self.peers[i].doomed.get_or_insert_with(|| "it hung up".into());
            } else if self.peers[i].stalled_since.is_some_and(|t| now.duration_since(t) >= patience) {
                self.flush(i, epfd);
            }
        }
        let mut i = 0;
        while i < self.peers.len() {
            let p = &self.peers[i];
            let out = p.doomed.is_some()
                || (!p.ready && now.duration_since(p.accepted) >= handshake)
                || p.stalled_since.is_some_and(|t| now.duration_since(t) >= patience)
                || p.info.protocol_errors > DEVSHARE_CHANNEL_ERROR_BUDGET;
            if out {
                self.drop_peer(i, epfd);
            } else {
                i += 1;
            }
        }
    }

    /// The next time [`Self::sweep`] has something to do (a handshake or send-patience deadline).
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let handshake = Duration::from_millis(DEVSHARE_CHANNEL_HANDSHAKE_MS);
        let patience = Duration::from_millis(DEVSHARE_CHANNEL_SEND_PATIENCE_MS);
        self.peers
            .iter()
            .filter_map(|p| if !p.ready { Some(p.accepted + handshake) } else { p.stalled_since.map(|t| t + patience) })
            .min()
    }

    /// The pid ACL exports sent to `p` are whitelisted for: the one it announced when that is
    /// its kernel pid or announced pids are trusted, else its kernel pid.
    pub(super) fn whitelist_pid(&self, p: &Peer) -> i32 {
        if p.info.tgid == p.info.pid || self.trust_announced {
            p.info.tgid
        } else {
            p.info.pid
        }
    }

    /// Whitelist the peer on `exp` once (ACL; a no-op elsewhere).
    pub(super) fn allow(&mut self, peer: u64, exp: &Exporter) -> Result<()> {
        exp.allow_pid_once(self.whitelist_pid(self.peers.get(peer)?))
    }

    /// Take the connections waiting on the listener, at most [`ACCEPTS_PER_PASS`] (the listener
    /// stays readable in the epoll set while more wait: the next look takes them, so a flood
    /// of connections cannot hold the channel's lock for long); returns how many were taken.
    pub(super) fn accept_all(&mut self, epfd: BorrowedFd<'_>) -> usize {
        let mut taken = 0;
        while taken < ACCEPTS_PER_PASS {
            let fd = match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => break, // EAGAIN, or a connection that died before we took it
            };
            taken += 1;
            // Consumers send no descriptors: where the kernel can (Linux 6.16, SO_PASSRIGHTS),
            // a consumer's attempt to send one fails at its end instead of reaching us (older
            // kernels say no: what arrives anyway is closed outside the channel's lock).
            refuse_descriptors(&fd);
            let cred = match rustix::net::sockopt::socket_peercred(&fd) {
                Ok(c) => c,
                Err(_) => {
                    self.unwanted_fds.push(fd); // (closed after the lock: see below)
                    continue;
                }
            };
            let pid = cred.pid.as_raw_nonzero().get();
            let uid = cred.uid.as_raw();
            let refuse = if !self.uids.contains(&uid) {
                Some(format!("uid {uid} may not connect to this channel (allowed: {:?})", self.uids))
            } else if !self.pids.is_empty() && !self.pids.contains(&pid) {
                Some(format!("pid {pid} may not connect to this channel (allowed: {:?})", self.pids))
            } else if self.peers.ready_count() >= DEVSHARE_CHANNEL_MAX_PEERS {
                Some(format!("the channel already serves {DEVSHARE_CHANNEL_MAX_PEERS} peers"))
            } else {
                // Limits per process: connections of one process that never say hello cannot
                // keep another's consumer out.
                match self.peers.admit(pid) {
                    Admission::Admit => None,
                    Admission::Evict(victim) => {
                        self.peers[victim].doomed = Some("its place was given to another process's connection".into());
                        self.drop_peer(victim, epfd);
                        None
                    }
                    Admission::Refuse(why) => Some(why),
                }
            };
            if let Some(why) = refuse {
                let _ = wire::try_send(fd.as_fd(), &Message::Refused { reason: why.as_bytes() }.encode(), &[]);
                // Closed after the lock: descriptors queued in it before it was accepted close
                // with it, and closing one can block.
                self.unwanted_fds.push(fd);
                continue;
            }
            let id = self.next_peer;
            self.next_peer += 1;
            if epoll::add(epfd, &fd, epoll::EventData::new_u64(id), epoll::EventFlags::IN).is_err() {
                self.unwanted_fds.push(fd);
                continue;
            }
            self.peers.push(Peer {
                info: PeerInfo { id, pid, uid, gid: cred.gid.as_raw(), ..Default::default() },
                fd,
                ready: false,
                accepted: Instant::now(),
                queue: VecDeque::new(),
                queued_bytes: 0,
                queued_fds: 0,
                stalled_since: None,
                doomed: None,
                leases: FxHashMap::default(),
                attached: FxHashMap::default(),
                features: 0,
                posted: 0,
                ring: None,
                no_ring: false,
                kept: FxHashSet::default(),
                pins: FxHashMap::default(),
            });
            self.stir = true; // a handshake deadline begins
        }
        taken
    }

    /// Take up to [`PEER_BATCH`] queued messages of peer `idx`; false when it is gone or past
    /// its error budget.
    pub(super) fn drain_peer(&mut self, idx: usize) -> bool {
        // Descriptors a peer sent wait for the end of the lock to be closed: past one message's
        // worth, the peers' messages wait for the next look (the epoll set reports them again),
        // so that they cannot pile up.
        if self.unwanted_fds.len() >= crate::export::MAX_PASSED_FDS {
            return true;
        }
        let mut buf = std::mem::take(&mut self.buf);
        let mut fds = std::mem::take(&mut self.fds);
        let mut taken = 0;
        let alive = loop {
            if taken == PEER_BATCH {
                break true;
            }
            taken += 1;
            if self.peers[idx].info.protocol_errors > DEVSHARE_CHANNEL_ERROR_BUDGET {
                break false;
            }
            match wire::recv(self.peers[idx].fd.as_fd(), &mut buf, &mut fds) {
                Ok(Received::Empty) => break true,
                Ok(Received::Closed) => break false,
                Err(_) => {
                    // (A message refused whole, too long, keeps its descriptors for us.)
                    self.unwanted_fds.append(&mut fds);
                    break false;
                }
                Ok(Received::Refused(..)) => {
                    // A socket or a file that is not shared memory came (taken out and closed
                    // elsewhere): an error, like any descriptor a consumer sends.
                    self.unwanted_fds.append(&mut fds);
                    self.peers[idx].info.protocol_errors += 1;
                    break true;
                }
                Ok(Received::Message(n)) => {
                    if !fds.is_empty() {
                        // Consumers send no descriptors: count the error; they are closed
                        // after the lock (closing one can block), and this peer's next
                        // messages wait for the next look.
                        self.unwanted_fds.append(&mut fds);
                        self.peers[idx].info.protocol_errors += 1;
                        break true;
                    }
                    match self.message(idx, &buf[..n]) {
                        Ok(true) => {}
                        Ok(false) => break false,
                        Err(_) => self.peers[idx].info.protocol_errors += 1,
                    }
                }
            }
        };
        self.buf = buf;
        self.fds = fds;
        alive
    }

    /// Handle one message from peer `idx`; `Ok(false)`: drop the peer.
    pub(super) fn message(&mut self, idx: usize, b: &[u8]) -> Result<bool> {
        let msg = Message::decode(b)?;
        let peer = &mut self.peers[idx];
        if !peer.ready {
            let Message::Hello { magic, version, features, tgid } = msg else {
                return Ok(false);
            };
            let bad = if magic != wire::MAGIC {
                Some("the handshake is not a devshare channel's".to_string())
            } else if version != wire::VERSION {
                Some(format!("channel protocol version {version} is not this producer's {}", wire::VERSION))
            } else if tgid <= 0 {
                Some(format!("tgid {tgid} is not a process id"))
            } else {
                None
            };
            if let Some(why) = bad {
                let m = Message::Refused { reason: why.as_bytes() }.encode();
                let _ = wire::try_send(peer.fd.as_fd(), &m, &[]);
                return Ok(false);
            }
            peer.info.tgid = tgid;
            peer.features = features;
            let m = Message::Welcome {
                magic: wire::MAGIC,
                version: wire::VERSION,
                features: wire::PRODUCER_RELEASES | wire::PRODUCER_PINS | wire::PRODUCER_KEEPS_EVENTS,
                peer_id: peer.info.id,
                producer_pid: std::process::id() as i32,
            }
            .encode();
            // A fresh socket has room for it; one that has not is not worth waiting for.
            if !matches!(wire::try_send(peer.fd.as_fd(), &m, &[]), Ok(true)) {
                return Ok(false);
            }
            peer.ready = true;
            return Ok(true);
        }
        match msg {
            Message::Release { lease } => self.take_release(idx, lease)?,
            Message::Releases { leases } => {
                // Every lease the peer holds comes back; the others make one protocol error.
                let mut unknown = 0usize;
                for &lease in &leases {
                    unknown += usize::from(self.take_release(idx, lease).is_err());
                }
                if unknown > 0 {
                    return Err(Error::Untrusted(format!(
                        "{unknown} of the {} leases released in one message are not held by this peer",
                        leases.len()
                    )));
                }
            }
            Message::Return { pool, slot } => {
                let id = peer.info.id;
                self.take_return(id, pool, slot)?;
            }
            Message::Pinned { entries } => {
                // Answers to offers this channel still stands by; one to an offer it has
                // withdrawn since (the export unregistered, perhaps registered again) changes
                // nothing.
                for (export, pin) in entries {
                    if let Some(p) = peer.pins.get_mut(&export).filter(|p| p.0 == pin) {
                        p.1 = true;
                    }
                }
            }
            Message::Detach { pool } => {
                let book = peer
                    .attached
                    .remove(&pool)
                    .ok_or_else(|| Error::Untrusted(format!("pool {pool} is not attached by this peer")))?;
                book.sub(1);
            }
            other => return Err(Error::Untrusted(format!("{other:?} is not a message a consumer sends"))),
        }
        Ok(true)
    }

    /// Lease `lease` given back by peer `idx` (over the socket or its ring): it stops counting,
    /// when the peer holds it.
    pub(super) fn take_release(&mut self, idx: usize, lease: u64) -> Result<()> {
        let (book, _event) = self.peers[idx]
            .leases
            .remove(&lease)
            .ok_or_else(|| Error::Untrusted(format!("lease {lease} is not held by this peer")))?;
        book.sub(1);
        Ok(())
    }

    /// Forget peer `idx`: its leases and attachments stop counting, its slots come back.
    pub(super) fn drop_peer(&mut self, idx: usize, epfd: BorrowedFd<'_>) {
        let peer = self.peers.remove(idx);
        let _ = epoll::delete(epfd, &peer.fd);
        if let Some(r) = &peer.ring {
            // The consumer holds the same eventfd: the registration would outlive our copy.
            let _ = epoll::delete(epfd, r.wake_fd());
        }
        for book in peer.leases.values().map(|(b, _)| b).chain(peer.attached.values()) {
            book.sub(1);
        }
        for p in self.pools.values_mut() {
            for (i, s) in p.slots.iter_mut().enumerate() {
                if *s == SlotState::Sent(peer.info.id) {
                    *s = SlotState::Free;
                    p.out -= 1;
                    p.events[i] = None;
                    p.free.push(i as u32);
                    self.stir = true;
                }
            }
        }
        // Its socket is closed after the lock too: descriptors still queued in it are closed
        // with it. So are its idle events (events are reused only for the peer they went to).
        self.gone_peers.push(peer.info.id);
        self.unwanted_fds.push(peer.fd);
    }
}

/// Turn `SO_PASSRIGHTS` off on a peer's socket (Linux 6.16 and later; a no-op elsewhere).
fn refuse_descriptors(fd: &OwnedFd) {
    /// `SO_PASSRIGHTS` (asm-generic/socket.h), not yet in the libc crate.
    const SO_PASSRIGHTS: libc::c_int = 83;
    let off: libc::c_int = 0;
    // SAFETY: a valid socket and a c_int option value of its size.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(fd),
            libc::SOL_SOCKET,
            SO_PASSRIGHTS,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
