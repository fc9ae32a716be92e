//! Names of the objects the agent owns on PostgreSQL nodes.

/// Replication origin on the subscriber for changes that came from `node`,
/// applied by its stream's first apply lane; also the stream's key in
/// `mm.apply_progress` (one progress row per peer, whatever the lanes).
pub fn origin_name(node: &str) -> String {
    format!("mm_{node}")
}

/// The origin apply lane `lane` of the stream from `node` binds. PostgreSQL
/// 18 binds an origin to one session at a time, so every lane after the
/// first has its own; '#' cannot occur in a node name, so the node stays
/// readable from the name (`node_of_origin`).
pub fn lane_origin_name(node: &str, lane: usize) -> String {
    match lane {
        0 => origin_name(node),
        k => format!("mm_{node}#{k}"),
    }
}

/// The node whose changes an origin created by the agent tags, whatever
/// lane applied them; `None` for an origin the agent does not own. Every
/// place that maps a commit's origin to a node goes through here, so a row
/// written by any lane of a stream counts as that node's.
pub fn node_of_origin(roname: &str) -> Option<&str> {
    let rest = roname.strip_prefix("mm_")?;
    Some(rest.split_once('#').map_or(rest, |(node, _)| node))
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
    fn every_lane_origin_maps_back_to_its_node() {
        for node in ["n1", "a-b", "a_b_1", &"x".repeat(32)] {
            assert_eq!(lane_origin_name(node, 0), origin_name(node));
            for lane in 0..8 {
                let o = lane_origin_name(node, lane);
                assert_eq!(node_of_origin(&o), Some(node), "{o}");
            }
        }
        // A node named like another's lane cannot exist ('#' is refused).
        assert_ne!(lane_origin_name("n1", 1), origin_name("n1_1"));
        assert_eq!(node_of_origin("pg_16384"), None);
    }

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
