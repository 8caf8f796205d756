//! The identity of this machine: the kernel's boot id. Two processes that can share `/dev/shm`
//! run under one kernel and see the same boot id; a handle carried to another machine does not.

use std::sync::OnceLock;

fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.trim().bytes().filter(|&c| c != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// This machine's boot id, or all zero when the kernel does not tell it.
pub fn host_id() -> [u8; 16] {
    static ID: OnceLock<[u8; 16]> = OnceLock::new();
    *ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().and_then(|s| parse_uuid(&s)).unwrap_or([0; 16])
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn boot_id_parses_as_uuid() {
        assert_eq!(super::parse_uuid("00112233-4455-6677-8899-aabbccddeeff\n").unwrap()[15], 0xff);
        assert!(super::parse_uuid("zz").is_none());
        assert_ne!(super::host_id(), [0; 16], "this kernel exposes a boot id");
    }
}
