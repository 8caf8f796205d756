//! Authentication of the two ends of a remote (TCP) channel: a shared key file and a
//! challenge-response, so the key itself never crosses the wire.
//!
//! Both hosts hold the same key file ([`key_path`], checked by [`Key::load`]: a regular file of
//! this user, mode 0600 or stricter). Each end sends a fresh [`nonce`]; each then proves it holds
//! the key with an HMAC-SHA256 over its role's label and both nonces ([`Key::prove`]) and checks
//! the other's proof ([`Key::verify`], constant time). The role label and the nonce order differ
//! between the two proofs, so neither end's proof can be reflected back as the other's, and the
//! fresh nonces keep an old exchange from being replayed.
//!
//! HMAC-SHA256 comes from the RustCrypto `hmac` and `sha2` crates; the random nonces from the
//! kernel's `getrandom` (through rustix).

use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a challenge nonce.
pub(crate) const NONCE: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub(crate) const MAC: usize = 32;

/// The fewest bytes a key file may hold.
const MIN_KEY: usize = 16;
/// The most bytes a key file may hold.
const MAX_KEY: usize = 4096;

/// The environment variable naming the key file.
const KEY_FILE_VAR: &str = "DEVSHARE_CHANNEL_KEY_FILE";

const PRODUCER_LABEL: &[u8] = b"devshare-channel producer";
const CONSUMER_LABEL: &[u8] = b"devshare-channel consumer";

/// A channel key, read from a file only its owner can read.
///
/// `Debug` shows its length, never its bytes; the bytes are overwritten with zeros when the key
/// is dropped (best effort: copies the allocator or the HMAC state made are not reached).
pub(crate) struct Key {
    bytes: Vec<u8>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key").field("len", &self.bytes.len()).finish_non_exhaustive()
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        self.bytes.fill(0);
        std::hint::black_box(&self.bytes);
    }
}

/// Which end proves: the listening producer or the connecting consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Producer,
    Consumer,
}

impl Role {
    /// The label that starts this role's proofs. Both labels have the same length, and the
    /// nonces are fixed-size, so `label || first || second` is unambiguous.
    fn label(self) -> &'static [u8] {
        match self {
            Role::Producer => PRODUCER_LABEL,
            Role::Consumer => CONSUMER_LABEL,
        }
    }
}

/// The key file: `DEVSHARE_CHANNEL_KEY_FILE` when set (and not empty), else
/// `$XDG_CONFIG_HOME/devshare/channel.key` (when that is an absolute path, as the XDG base
/// directory spec requires), else `$HOME/.config/devshare/channel.key`. `NotFound` when none of
/// the three is set.
pub(crate) fn key_path() -> Result<PathBuf> {
    key_path_from(|name| std::env::var_os(name))
}

/// [`key_path`] with the environment given by `var` (for tests, without touching the process's
/// environment).
fn key_path_from(var: impl Fn(&str) -> Option<OsString>) -> Result<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(file) = set(KEY_FILE_VAR) {
        return Ok(PathBuf::from(file));
    }
    if let Some(config) = set("XDG_CONFIG_HOME").map(PathBuf::from).filter(|p| p.is_absolute()) {
        return Ok(config.join("devshare").join("channel.key"));
    }
    if let Some(home) = set("HOME") {
        return Ok(PathBuf::from(home).join(".config").join("devshare").join("channel.key"));
    }
    Err(Error::NotFound(format!(
        "no channel key file: none of {KEY_FILE_VAR}, XDG_CONFIG_HOME and HOME is set; set \
         {KEY_FILE_VAR} to a key file made with `head -c 32 /dev/urandom > PATH && chmod 600 \
         PATH` (the same file on both hosts)"
    )))
}

fn untrusted(path: &Path, why: impl fmt::Display) -> Error {
    Error::Untrusted(format!("channel key file {}: {why}", path.display()))
}

impl Key {
    /// Read the key at `path`.
    ///
    /// Refused with `Untrusted` (naming the path and the reason) unless it is a regular file —
    /// not a symbolic link (opened with `O_NOFOLLOW`; links among the directories above it are
    /// followed) — owned by this process's effective uid, with no group or other permission bits
    /// (`mode & 0o077 == 0`), holding 16 to 4096 bytes. The whole file is the key, its bytes as
    /// they are (a trailing newline is part of it). The checks are made on the opened
    /// descriptor, so the file checked is the file read. A missing file is `NotFound`, naming
    /// the path and how to make one. Other failures to open or read it are `Os`.
    pub(crate) fn load(path: &Path) -> Result<Key> {
        let os = |call: &str, e: std::io::Error| Error::Os {
            call: format!("{call}({})", path.display()),
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        };
        // O_NONBLOCK: a FIFO planted at the path must not block the open; it is refused below.
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
        {
            Ok(file) => file,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                return Err(Error::NotFound(format!(
                    "channel key file {shown}: no such file; make one with `mkdir -p \"$(dirname \
                     {shown})\" && head -c 32 /dev/urandom > {shown} && chmod 600 {shown}` and \
                     copy the same file to the other host (or set {KEY_FILE_VAR} to where it is)",
                    shown = path.display()
                )))
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(untrusted(path, "is a symbolic link; name the key file itself"))
            }
            Err(e) => return Err(os("open", e)),
        };
        let meta = file.metadata().map_err(|e| os("fstat", e))?;
        if !meta.file_type().is_file() {
            return Err(untrusted(path, format_args!("is not a regular file (mode {:o})", meta.mode())));
        }
        let euid = rustix::process::geteuid().as_raw();
        if meta.uid() != euid {
            return Err(untrusted(
                path,
                format_args!(
                    "belongs to uid {}, not to this process's user (euid {euid}); a channel key \
                     must be its user's own file",
                    meta.uid()
                ),
            ));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(untrusted(
                path,
                format_args!(
                    "has mode {:04o}: group or others may access it; make it readable by its \
                     owner only (chmod 600)",
                    meta.mode() & 0o7777
                ),
            ));
        }
        // Read at most one byte more than a key may hold, into a buffer that never grows (no
        // copy of the key is left behind by a reallocation); a file that grew after the fstat
        // is caught by the length check on what was read.
        let mut bytes = Vec::with_capacity(MAX_KEY + 1);
        (&file).take(MAX_KEY as u64 + 1).read_to_end(&mut bytes).map_err(|e| os("read", e))?;
        let key = Key { bytes };
        let len = key.bytes.len();
        if !(MIN_KEY..=MAX_KEY).contains(&len) {
            let size = if len > MAX_KEY { format!("more than {MAX_KEY}") } else { len.to_string() };
            return Err(untrusted(
                path,
                format_args!(
                    "holds {size} bytes; a channel key is {MIN_KEY} to {MAX_KEY} bytes (make one \
                     with `head -c 32 /dev/urandom`)"
                ),
            ));
        }
        Ok(key)
    }

    /// HMAC-SHA256 under this key over `parts`, one after the other.
    fn mac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.bytes).expect("HMAC takes a key of any length");
        for part in parts {
            mac.update(part);
        }
        mac
    }

    /// The proof that `role` holds this key, bound to the handshake: HMAC-SHA256(key,
    /// label(role) || first || second || bound), label `devshare-channel producer` or
    /// `devshare-channel consumer`. `bound` is every field of the handshake the proof vouches
    /// for (what the consumer said in its hello, what it sends after its proof), so an on-path
    /// relay without the key cannot change any of them unnoticed. The label and nonces have
    /// fixed sizes, so the concatenation is unambiguous.
    ///
    /// The nonce order: the **producer** proves with `first` = the consumer's nonce, `second` =
    /// its own (producer) nonce; the **consumer** proves with `first` = the producer's nonce,
    /// `second` = its own (consumer) nonce. That is, each end puts the other's nonce (its
    /// challenge) first and its own second.
    pub(crate) fn prove(&self, role: Role, first: &[u8; NONCE], second: &[u8; NONCE], bound: &[u8]) -> [u8; MAC] {
        self.mac(&[role.label(), first, second, bound]).finalize().into_bytes().into()
    }

    /// Whether `mac` is the proof [`Key::prove`] makes for `role` with `first`, `second` and
    /// `bound` (the same order as there), compared in constant time. A `mac` of any length
    /// other than [`MAC`] is refused.
    pub(crate) fn verify(
        &self,
        role: Role,
        first: &[u8; NONCE],
        second: &[u8; NONCE],
        bound: &[u8],
        mac: &[u8],
    ) -> bool {
        self.mac(&[role.label(), first, second, bound]).verify_slice(mac).is_ok()
    }
}

/// [`NONCE`] random bytes from the kernel (`getrandom(2)`, blocking only until the kernel's
/// pool is first initialized at boot).
pub(crate) fn nonce() -> Result<[u8; NONCE]> {
    let mut out = [0u8; NONCE];
    let mut filled = 0;
    while filled < NONCE {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                return Err(Error::Os {
                    call: "getrandom".into(),
                    errno: e.raw_os_error(),
                    message: std::io::Error::from(e).to_string(),
                })
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A private directory for one test, removed when dropped.
    struct Dir(PathBuf);

    impl Dir {
        fn new() -> Dir {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "devshare-remote-auth-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::DirBuilder::new().mode(0o700).create(&path).unwrap();
            Dir(path)
        }

        /// A file `name` holding `bytes` with `mode`.
        fn file(&self, name: &str, bytes: &[u8], mode: u32) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, bytes).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn untrusted_text(r: Result<Key>) -> String {
        match r {
            Err(Error::Untrusted(text)) => text,
            other => panic!("expected Untrusted, got {other:?}"),
        }
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn loads_a_private_key_file() {
        let dir = Dir::new();
        let bytes: Vec<u8> = (0..32).collect();
        let path = dir.file("channel.key", &bytes, 0o600);
        let key = Key::load(&path).unwrap();
        assert_eq!(key.bytes, bytes);
        // 0400 and the bounds 16 and 4096 are accepted too.
        Key::load(&dir.file("ro.key", &bytes, 0o400)).unwrap();
        assert_eq!(Key::load(&dir.file("min.key", &[7; MIN_KEY], 0o600)).unwrap().bytes.len(), MIN_KEY);
        assert_eq!(Key::load(&dir.file("max.key", &[7; MAX_KEY], 0o600)).unwrap().bytes.len(), MAX_KEY);
    }

    #[test]
    fn debug_does_not_show_the_key() {
        let key = Key { bytes: b"a secret key, not to be printed".to_vec() };
        let shown = format!("{key:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(!shown.contains("97"), "{shown}"); // no bytes as numbers either ('a' is 97)
        assert!(shown.contains("len"), "{shown}");
    }

    #[test]
    fn refuses_group_or_other_access() {
        let dir = Dir::new();
        for mode in [0o644, 0o640, 0o604, 0o660] {
            let path = dir.file(&format!("k{mode:o}"), &[1; 32], mode);
            let text = untrusted_text(Key::load(&path));
            assert!(text.contains(&path.display().to_string()), "{text}");
            assert!(text.contains(&format!("mode 0{mode:o}")) && text.contains("group or others"), "{text}");
        }
    }

    #[test]
    fn refuses_another_users_file() {
        if rustix::process::geteuid().as_raw() != 0 {
            eprintln!("skipped: not root, cannot give a file to another uid");
            return;
        }
        let dir = Dir::new();
        let path = dir.file("theirs.key", &[1; 32], 0o600);
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        let text = untrusted_text(Key::load(&path));
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("belongs to uid 65534"), "{text}");
    }

    #[test]
    fn refuses_a_symlink() {
        let dir = Dir::new();
        let target = dir.file("real.key", &[1; 32], 0o600);
        let link = dir.0.join("link.key");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let text = untrusted_text(Key::load(&link));
        assert!(text.contains(&link.display().to_string()), "{text}");
        assert!(text.contains("symbolic link"), "{text}");
        // A dangling one too.
        let dangling = dir.0.join("dangling.key");
        std::os::unix::fs::symlink(dir.0.join("nothing"), &dangling).unwrap();
        assert!(untrusted_text(Key::load(&dangling)).contains("symbolic link"));
    }

    #[test]
    fn refuses_what_is_not_a_regular_file() {
        let dir = Dir::new();
        let sub = dir.0.join("sub");
        std::fs::DirBuilder::new().mode(0o700).create(&sub).unwrap();
        let text = untrusted_text(Key::load(&sub));
        assert!(text.contains("not a regular file"), "{text}");
    }

    #[test]
    fn refuses_a_short_or_long_key() {
        let dir = Dir::new();
        for (len, shown) in [(8, "8"), (0, "0"), (MIN_KEY - 1, "15"), (MAX_KEY + 1, "more than 4096")] {
            let path = dir.file(&format!("k{len}"), &vec![1; len], 0o600);
            let text = untrusted_text(Key::load(&path));
            assert!(text.contains(&path.display().to_string()), "{text}");
            assert!(text.contains(&format!("holds {shown} bytes")) && text.contains("16 to 4096"), "{text}");
        }
    }

    #[test]
    fn a_missing_file_says_how_to_make_one() {
        let dir = Dir::new();
        let path = dir.0.join("missing.key");
        match Key::load(&path) {
            Err(Error::NotFound(text)) => {
                assert!(text.contains(&path.display().to_string()), "{text}");
                assert!(text.contains("head -c 32 /dev/urandom") && text.contains("chmod 600"), "{text}");
                assert!(text.contains("other host"), "{text}");
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
    }

    #[test]
    fn key_path_order() {
        fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
            move |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| OsString::from(v))
        }
        let all = [("DEVSHARE_CHANNEL_KEY_FILE", "/k/file"), ("XDG_CONFIG_HOME", "/xdg"), ("HOME", "/home/u")];
        assert_eq!(key_path_from(env(&all)).unwrap(), PathBuf::from("/k/file"));
        assert_eq!(key_path_from(env(&all[1..])).unwrap(), PathBuf::from("/xdg/devshare/channel.key"));
        assert_eq!(key_path_from(env(&all[2..])).unwrap(), PathBuf::from("/home/u/.config/devshare/channel.key"));
        // Empty counts as unset; a relative XDG_CONFIG_HOME is ignored, as the XDG spec says.
        let empty = [("DEVSHARE_CHANNEL_KEY_FILE", ""), ("XDG_CONFIG_HOME", "rel"), ("HOME", "/home/u")];
        assert_eq!(key_path_from(env(&empty)).unwrap(), PathBuf::from("/home/u/.config/devshare/channel.key"));
        match key_path_from(env(&[])) {
            Err(Error::NotFound(text)) => assert!(text.contains("DEVSHARE_CHANNEL_KEY_FILE"), "{text}"),
            other => panic!("expected NotFound, got {other:?}"),
        }
    }

    #[test]
    fn prove_verify_round_trip() {
        let key = Key { bytes: vec![0x5a; 32] };
        let (pn, cn) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(pn, cn);
        let by_producer = key.prove(Role::Producer, &cn, &pn, &[]);
        let by_consumer = key.prove(Role::Consumer, &pn, &cn, &[]);
        assert_ne!(by_producer, by_consumer);
        assert!(key.verify(Role::Producer, &cn, &pn, &[], &by_producer));
        assert!(key.verify(Role::Consumer, &pn, &cn, &[], &by_consumer));
        // Deterministic: the same inputs make the same proof.
        assert_eq!(key.prove(Role::Producer, &cn, &pn, &[]), by_producer);
    }

    #[test]
    fn verify_refuses_wrong_key_role_order_or_length() {
        let key = Key { bytes: vec![0x5a; 32] };
        let other = Key { bytes: vec![0x5b; 32] };
        let (pn, cn) = (nonce().unwrap(), nonce().unwrap());
        let mac = key.prove(Role::Producer, &cn, &pn, &[]);
        assert!(key.verify(Role::Producer, &cn, &pn, &[], &mac));
        assert!(!other.verify(Role::Producer, &cn, &pn, &[], &mac), "wrong key");
        assert!(!key.verify(Role::Consumer, &cn, &pn, &[], &mac), "swapped role");
        assert!(!key.verify(Role::Producer, &pn, &cn, &[], &mac), "swapped nonces");
        assert!(!key.verify(Role::Producer, &cn, &pn, &[], &mac[..MAC - 1]), "truncated");
        assert!(!key.verify(Role::Producer, &cn, &pn, &[], &mac[..16]), "truncated to half");
        assert!(!key.verify(Role::Producer, &cn, &pn, &[], &[]), "empty");
        let mut long = mac.to_vec();
        long.push(0);
        assert!(!key.verify(Role::Producer, &cn, &pn, &[], &long), "extended");
        let mut flipped = mac;
        flipped[MAC - 1] ^= 1;
        assert!(!key.verify(Role::Producer, &cn, &pn, &[], &flipped), "one bit flipped");
        // A consumer's proof is not a producer's, even with the nonces in the producer's order.
        let reflected = key.prove(Role::Consumer, &cn, &pn, &[]);
        assert!(!key.verify(Role::Producer, &cn, &pn, &[], &reflected), "reflected");
    }

    #[test]
    fn a_proof_vouches_for_the_bound_fields_and_nothing_else() {
        let key = Key { bytes: vec![0x5a; 32] };
        let (pn, cn) = (nonce().unwrap(), nonce().unwrap());
        let mac = key.prove(Role::Consumer, &pn, &cn, b"worker address");
        assert!(key.verify(Role::Consumer, &pn, &cn, b"worker address", &mac));
        assert!(!key.verify(Role::Consumer, &pn, &cn, b"worker addresS", &mac), "one field changed");
        assert!(!key.verify(Role::Consumer, &pn, &cn, b"worker", &mac), "a field cut");
        assert!(!key.verify(Role::Consumer, &pn, &cn, &[], &mac), "the field dropped");
    }

    /// RFC 4231, test case 2: key "Jefe", data "what do ya want for nothing?", through the same
    /// HMAC path `prove` and `verify` use (the data given in two parts).
    #[test]
    fn rfc4231_test_case_2() {
        let key = Key { bytes: b"Jefe".to_vec() };
        let expected = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        let tag = key.mac(&[b"what do ya want ", b"for nothing?"]).finalize().into_bytes();
        assert_eq!(hex(&tag), expected);
        let whole = key.mac(&[b"what do ya want for nothing?"]);
        assert!(whole.verify_slice(&tag).is_ok());
    }

    /// The proof's exact input (label, then first, then second), pinned by tags computed
    /// independently with Python's `hmac` module, so both ends of any build agree.
    #[test]
    fn prove_known_answers() {
        let key = Key { bytes: (0..32).collect() };
        let (first, second) = ([0x11; NONCE], [0x22; NONCE]);
        assert_eq!(
            hex(&key.prove(Role::Producer, &first, &second, &[])),
            "24abd385928aaeb3b1b1d09ca858735e85a94d800eb1e6321d5784f95447ec6c"
        );
        assert_eq!(
            hex(&key.prove(Role::Consumer, &first, &second, &[])),
            "d01807ca4cb756f002eb5d8315c6ef11070bddce3850d6b3bfcdef895838bc5b"
        );
        assert_eq!(PRODUCER_LABEL.len(), CONSUMER_LABEL.len());
    }

    #[test]
    fn nonces_are_fresh() {
        let a = nonce().unwrap();
        let b = nonce().unwrap();
        assert_ne!(a, b);
        assert_ne!(a, [0; NONCE]);
    }
}
