//! Who may wait for a handshake: connections that have not proved themselves yet are limited per
//! source (a pid on a Unix channel, an address over TCP) as well as in all, so one source that
//! opens connections and never finishes them cannot keep another source's consumer out.
//!
//! A new connection is refused when its source already has
//! [`DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE`] connections waiting. When every one of the
//! [`DEVSHARE_CHANNEL_MAX_PENDING`] places is taken by other sources, the oldest waiting
//! connection of the source holding the most places gives its place up (it is dropped), so a
//! source with no connection waiting always gets in. Handshakes are bounded in time
//! ([`DEVSHARE_CHANNEL_HANDSHAKE_MS`]), so a waiting connection never holds a place for longer.
//!
//! [`DEVSHARE_CHANNEL_MAX_PENDING`]: super::limits::DEVSHARE_CHANNEL_MAX_PENDING
//! [`DEVSHARE_CHANNEL_HANDSHAKE_MS`]: super::limits::DEVSHARE_CHANNEL_HANDSHAKE_MS

use super::limits::{DEVSHARE_CHANNEL_MAX_PENDING, DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE};
use std::time::Instant;

/// What to do with a new connection from a source, given the connections waiting for their
/// handshake.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Take it.
    Admit,
    /// Take it, after dropping the waiting connection the caller gave this index.
    Evict(usize),
    /// Refuse it, for this reason.
    Refuse(String),
}

/// Decide on a connection from `source`; `waiting` lists the connections that wait for their
/// handshake as (the caller's index of the connection, its source, when it was accepted), in any
/// order; [`Admission::Evict`] names one of those indexes.
pub(crate) fn admit<S: PartialEq + Copy>(
    waiting: impl IntoIterator<Item = (usize, S, Instant)>,
    source: S,
) -> Admission {
    let waiting: Vec<(usize, S, Instant)> = waiting.into_iter().collect();
    let of = |s: S| waiting.iter().filter(|(_, w, _)| *w == s).count();
    if of(source) >= DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE {
        return Admission::Refuse(format!(
            "{DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE} connections from this source are waiting for their \
             handshake already; try again shortly"
        ));
    }
    if waiting.len() < DEVSHARE_CHANNEL_MAX_PENDING {
        return Admission::Admit;
    }
    // Full: the source that holds the most places gives up its oldest one.
    let most = waiting.iter().map(|(_, s, _)| of(*s)).max().unwrap_or(0);
    let victim = waiting.iter().filter(|(_, s, _)| of(*s) == most).min_by_key(|(_, _, at)| *at).map(|(i, _, _)| *i);
    match victim {
        Some(i) => Admission::Evict(i),
        None => Admission::Refuse(format!(
            "{DEVSHARE_CHANNEL_MAX_PENDING} connections are waiting for their handshake already; try again shortly"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_source_gets_at_most_its_share_of_the_waiting_places() {
        let t = Instant::now();
        let mut waiting = Vec::new();
        for i in 0..DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE {
            assert_eq!(admit(waiting.clone(), 1), Admission::Admit);
            waiting.push((i, 1, t + Duration::from_millis(i as u64)));
        }
        assert!(matches!(admit(waiting.clone(), 1), Admission::Refuse(r) if r.contains("from this source")));
        assert_eq!(admit(waiting, 2), Admission::Admit, "another source still gets in");
    }

    #[test]
    fn when_every_place_is_taken_the_biggest_sources_oldest_connection_makes_room() {
        let t = Instant::now();
        // Sources 0..n hold one place each, source 99 a full share, and the oldest place of
        // source 99 is the third of its entries.
        let share = DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE;
        // (Indexes as a caller's: 1000 and up, in order.)
        let mut waiting: Vec<(usize, u32, Instant)> =
            (0..(DEVSHARE_CHANNEL_MAX_PENDING - share) as u32).map(|s| (1000 + s as usize, s, t)).collect();
        let first_of_99 = 1000 + waiting.len();
        for i in 0..share {
            let age = if i == 2 { 0 } else { 10 + i as u64 };
            waiting.push((first_of_99 + i, 99, t + Duration::from_millis(age)));
        }
        assert_eq!(waiting.len(), DEVSHARE_CHANNEL_MAX_PENDING);
        assert_eq!(admit(waiting, 500), Admission::Evict(first_of_99 + 2));
        // With every source holding one place, the oldest of all gives way.
        let ones = (0..DEVSHARE_CHANNEL_MAX_PENDING as u32)
            .map(|s| (1000 + s as usize, s, t + Duration::from_millis(100 - u64::from(s))));
        assert_eq!(admit(ones, 1000), Admission::Evict(1000 + DEVSHARE_CHANNEL_MAX_PENDING - 1));
    }
}
