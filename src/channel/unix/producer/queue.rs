//! The bounded send queue: what a peer's socket has no room for waits in its queue (bounded in
//! messages, bytes and descriptors, [`crate::channel::limits`]), goes out when the socket becomes
//! writable, and disconnects a peer that does not take it; a host pool item goes in the peer's
//! ring instead when it has one.

use super::*;

/// A message waiting for room in a peer's socket buffer, with duplicates of its descriptors.
pub(super) struct Queued {
    pub(super) msg: Vec<u8>,
    pub(super) fds: Vec<OwnedFd>,
}

pub(super) fn check_len(msg: Vec<u8>) -> Result<Vec<u8>> {
    if msg.len() > wire::MAX_MESSAGE {
        return Err(Error::Unsupported(format!(
            "a handle encoding of {} bytes does not fit one channel message ({} bytes)",
            msg.len(),
            wire::MAX_MESSAGE
        )));
    }
    Ok(msg)
}

impl Core {
    /// Send a message to peer `idx`, or queue it when its socket buffer is full. Never waits.
    /// A peer that is gone, or whose queue is past its bounds, is marked to be disconnected
    /// ([`Self::sweep`]) and the answer is `Closed`.
    pub(super) fn post(&mut self, idx: usize, msg: &[u8], fds: &[BorrowedFd<'_>], epfd: BorrowedFd<'_>) -> Result<()> {
        // What waits goes first (the peer may have read meanwhile), so that a producer that
        // sends without serving still moves the queue.
        if !self.peers[idx].queue.is_empty() {
            self.flush(idx, epfd);
        }
        let p = &mut self.peers[idx];
        if let Some(why) = &p.doomed {
            return Err(Error::Closed(why.clone()));
        }
        if p.queue.is_empty() {
            match wire::try_send(p.fd.as_fd(), msg, fds) {
                Ok(true) => {
                    p.posted += 1;
                    return Ok(());
                }
                Ok(false) => {}
                Err(e @ Error::Closed(_)) => {
                    p.doomed = Some(format!("peer {} is gone", p.info.id));
                    return Err(e);
                }
                // Out of kernel buffers or descriptors in flight: this send fails, the peer stays.
                Err(e) => return Err(e),
            }
        }
        if p.queue.len() >= DEVSHARE_CHANNEL_SEND_QUEUE
            || p.queued_bytes + msg.len() > DEVSHARE_CHANNEL_SEND_QUEUE_BYTES
            || p.queued_fds + fds.len() > DEVSHARE_CHANNEL_SEND_QUEUE_FDS
        {
            let why = format!(
                "peer {} was disconnected: it does not read its messages ({} waiting, {} bytes; at most \
                 {DEVSHARE_CHANNEL_SEND_QUEUE} messages, {DEVSHARE_CHANNEL_SEND_QUEUE_BYTES} bytes and \
                 {DEVSHARE_CHANNEL_SEND_QUEUE_FDS} descriptors may wait)",
                p.info.id,
                p.queue.len(),
                p.queued_bytes
            );
            p.doomed = Some(why.clone());
            return Err(Error::Closed(why));
        }
        let mut owned = Vec::with_capacity(fds.len());
        for f in fds {
            owned.push(rustix::io::fcntl_dupfd_cloexec(f, 0).map_err(|e| wire::os("dup of a descriptor to queue", e))?);
        }
        if p.queue.is_empty() {
            p.stalled_since = Some(Instant::now());
            // A send-patience deadline begins; tell us when it can take more.
            self.stir = true;
            let _ = epoll::modify(
                epfd,
                &p.fd,
                epoll::EventData::new_u64(p.info.id),
                epoll::EventFlags::IN | epoll::EventFlags::OUT,
            );
        }
        p.queued_bytes += msg.len();
        p.queued_fds += owned.len();
        p.queue.push_back(Queued { msg: msg.to_vec(), fds: owned });
        p.posted += 1;
        Ok(())
    }

    /// Send what waits for peer `idx` while its socket takes it.
    pub(super) fn flush(&mut self, idx: usize, epfd: BorrowedFd<'_>) {
        let p = &mut self.peers[idx];
        while let Some(q) = p.queue.front() {
            let fds: Vec<BorrowedFd<'_>> = q.fds.iter().map(|f| f.as_fd()).collect();
            match wire::try_send(p.fd.as_fd(), &q.msg, &fds) {
                Ok(true) => {
                    drop(fds);
                    let q = p.queue.pop_front().expect("a queued message");
                    p.queued_bytes -= q.msg.len();
                    p.queued_fds -= q.fds.len();
                    p.stalled_since = Some(Instant::now()); // it moved: patience starts again
                }
                Ok(false) => return,
                Err(Error::Closed(_)) => {
                    p.doomed = Some(format!("peer {} is gone", p.info.id));
                    return;
                }
                // A transient failure (no kernel buffers, too many descriptors in flight): try
                // again on the next writable event; the patience still counts.
                Err(_) => return,
            }
        }
        p.stalled_since = None;
        let _ = epoll::modify(epfd, &p.fd, epoll::EventData::new_u64(p.info.id), epoll::EventFlags::IN);
    }

    /// Send pool item `m` to peer `idx`: through its ring when it reads one (and the ring has
    /// room), else over the socket.
    pub(super) fn post_item(&mut self, idx: usize, m: &[u8], epfd: BorrowedFd<'_>) -> Result<()> {
        if self.ring_item(idx, m, epfd)? {
            return Ok(());
        }
        self.post(idx, m, &[], epfd)
    }

    /// [`Self::post_item`]'s ring part: whether `m` went into the peer's ring (made now if the
    /// peer reads one and has none yet); false: no ring, or it is full, and the socket must
    /// carry `m` (after anything queued before it).
    pub(super) fn ring_item(&mut self, idx: usize, m: &[u8], epfd: BorrowedFd<'_>) -> Result<bool> {
        let p = &mut self.peers[idx];
        if p.features & (wire::FEATURE_RING | wire::FEATURE_RING_PRIMED) != 0 && m.len() <= ring::MAX_ITEM && !p.no_ring
        {
            if p.ring.is_none() {
                match ProducerRing::create() {
                    Ok(r) => {
                        let msg = Message::Ring { capacity: ring::CAPACITY, record: ring::RECORD }.encode();
                        let data = epoll::EventData::new_u64(p.info.id | RING_EVENT);
                        let flags = epoll::EventFlags::IN | epoll::EventFlags::ET;
                        if epoll::add(epfd, r.wake_fd(), data, flags).is_err() {
                            p.no_ring = true;
                        } else {
                            let fds = r.fds();
                            let posted = self.post(idx, &msg, &fds, epfd);
                            let p = &mut self.peers[idx];
                            match posted {
                                Ok(()) => p.ring = Some(r),
                                Err(e) => {
                                    let _ = epoll::delete(epfd, r.wake_fd());
                                    return Err(e);
                                }
                            }
                        }
                    }
                    // No memfd or eventfd to spare: this peer's items go over the socket.
                    Err(_) => p.no_ring = true,
                }
            }
            let p = &mut self.peers[idx];
            if let Some(r) = p.ring.as_mut() {
                match r.push_item(p.posted, m) {
                    Ok(true) => return Ok(true),
                    Ok(false) => {} // full: the socket carries it, in order
                    Err(e) => {
                        let why = format!("peer {} broke its ring: {e}", p.info.id);
                        p.doomed = Some(why.clone());
                        return Err(Error::Closed(why));
                    }
                }
            }
        }
        Ok(false)
    }
}
