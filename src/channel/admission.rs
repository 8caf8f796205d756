//! Who may wait for a handshake: connections that have not proved themselves yet are limited per
//! source (a pid on a Unix channel, an address over TCP) as well as in all, so one source that
//! opens connections and never finishes them cannot keep another source's consumer out.
//!
//! A new connection is refused when its source already has
//! [`DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE`] connections waiting, or its source's group (an
//! IPv6 address's /64, which one host may hold whole; elsewhere the source itself) has
//! [`MAX_PENDING_PER_GROUP`]. When every one of the [`DEVSHARE_CHANNEL_MAX_PENDING`] places is
//! taken, the oldest waiting connection of the group holding the most places gives its place up
//! (it is dropped), so a group with no connection waiting always gets in. Handshakes are bounded in time
//! ([`DEVSHARE_CHANNEL_HANDSHAKE_MS`]), so a waiting connection never holds a place for longer.
//!
//! [`DEVSHARE_CHANNEL_MAX_PENDING`]: super::limits::DEVSHARE_CHANNEL_MAX_PENDING
//! [`DEVSHARE_CHANNEL_HANDSHAKE_MS`]: super::limits::DEVSHARE_CHANNEL_HANDSHAKE_MS

use super::limits::{DEVSHARE_CHANNEL_MAX_PENDING, DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE};
use std::time::Instant;

/// Most connections of one group (an IPv6 /64) waiting at once: half of all places, so that
/// hosts of one subnet connecting together are not held to one host's share, and one host
/// with a whole /64 cannot take every place.
pub(crate) const MAX_PENDING_PER_GROUP: usize = DEVSHARE_CHANNEL_MAX_PENDING / 2;

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
/// order; `group` says which group a source belongs to; [`Admission::Evict`] names one of those
/// indexes.
pub(crate) fn admit<S: PartialEq + Copy, G: PartialEq + Copy>(
    waiting: impl IntoIterator<Item = (usize, S, Instant)>,
    source: S,
    group: impl Fn(S) -> G,
) -> Admission {
    let waiting: Vec<(usize, G, S, Instant)> = waiting.into_iter().map(|(i, s, t)| (i, group(s), s, t)).collect();
    let of = |s: S| waiting.iter().filter(|(_, _, w, _)| *w == s).count();
    let of_group = |g: G| waiting.iter().filter(|(_, w, _, _)| *w == g).count();
    if of(source) >= DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE {
        return Admission::Refuse(format!(
            "{DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE} connections from this source are waiting for their \
             handshake already; try again shortly"
        ));
    }
    if of_group(group(source)) >= MAX_PENDING_PER_GROUP {
        return Admission::Refuse(format!(
            "{MAX_PENDING_PER_GROUP} connections from this source's network are waiting for their handshake \
             already; try again shortly"
        ));
    }
    if waiting.len() < DEVSHARE_CHANNEL_MAX_PENDING {
        return Admission::Admit;
    }
    // Full: the group that holds the most places gives up its oldest one.
    let most = waiting.iter().map(|(_, g, _, _)| of_group(*g)).max().unwrap_or(0);
    let victim =
        waiting.iter().filter(|(_, g, _, _)| of_group(*g) == most).min_by_key(|(_, _, _, at)| *at).map(|(i, ..)| *i);
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
            assert_eq!(admit(waiting.clone(), 1, |s| s), Admission::Admit);
            waiting.push((i, 1, t + Duration::from_millis(i as u64)));
        }
        assert!(matches!(admit(waiting.clone(), 1, |s| s), Admission::Refuse(r) if r.contains("from this source")));
        assert_eq!(admit(waiting, 2, |s| s), Admission::Admit, "another source still gets in");
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
        assert_eq!(admit(waiting, 500, |s| s), Admission::Evict(first_of_99 + 2));
        // With every source holding one place, the oldest of all gives way.
        let ones = (0..DEVSHARE_CHANNEL_MAX_PENDING as u32)
            .map(|s| (1000 + s as usize, s, t + Duration::from_millis(100 - u64::from(s))));
        assert_eq!(admit(ones, 1000, |s| s), Admission::Evict(1000 + DEVSHARE_CHANNEL_MAX_PENDING - 1));
    }

    #[test]
    fn a_group_of_sources_gets_at_most_half_the_places_and_gives_way_as_one() {
        let t = Instant::now();
        let group = |s: u32| s / 100; // sources 100..199 are one group (a /64), others alone
        let mut waiting = Vec::new();
        // Sources of group 1, up to their own bound each, until the group's bound.
        for i in 0..MAX_PENDING_PER_GROUP {
            let s = 100 + (i / DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE) as u32;
            assert_eq!(admit(waiting.clone(), s, group), Admission::Admit);
            waiting.push((i, s, t + Duration::from_millis(i as u64)));
        }
        assert!(
            matches!(admit(waiting.clone(), 199, group), Admission::Refuse(r) if r.contains("network")),
            "a fresh source of the full group is refused"
        );
        // Sources elsewhere fill the rest: then the group holding the most gives way, oldest first.
        let n = waiting.len();
        for i in n..DEVSHARE_CHANNEL_MAX_PENDING {
            waiting.push((i, 1000 + i as u32, t));
        }
        assert_eq!(admit(waiting, 5000, group), Admission::Evict(0));
    }
}
