//! Names of the objects the agent owns on PostgreSQL nodes.

/// Replication origin on the subscriber for changes that came from `node`.
pub fn origin_name(node: &str) -> String {
    format!("mm_{node}")
}

/// Slot on `from`'s node that holds `from`'s changes for `to`.
///
/// Slot names allow only `[a-z0-9_]` and 63 bytes, while node names may
/// contain '-' and be 32 bytes long, so '-' becomes '_' and an over-long
/// name is cut and suffixed with a hash of the real names to stay unique.
pub fn slot_name(from: &str, to: &str) -> String {
    let clean = |s: &str| s.replace('-', "_");
    let full = format!("mm_{}_to_{}", clean(from), clean(to));
    let needs_hash = full.len() > 63 || from.contains('-') || to.contains('-');
    if !needs_hash {
        return full;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in from.bytes().chain([0u8]).chain(to.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let suffix = format!("_{:08x}", h as u32);
    let mut base = full;
    base.truncate(63 - suffix.len());
    base + &suffix
}

/// Application name of the stream's replication connection (visible in
/// `pg_stat_replication` on the publisher).
pub fn application_name(from: &str, to: &str) -> String {
    format!("mm_{from}_to_{to}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_valid_and_distinct() {
        assert_eq!(slot_name("n1", "n2"), "mm_n1_to_n2");
        let a = slot_name("a-b", "c");
        let b = slot_name("a_b", "c");
        assert_ne!(a, b);
        let long = "x".repeat(32);
        let s = slot_name(&long, &long);
        assert!(s.len() <= 63, "{s}");
        assert_ne!(s, slot_name(&long, &"x".repeat(31)));
        for s in [a, b, s] {
            assert!(
                s.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_'),
                "{s}"
            );
        }
    }
}
