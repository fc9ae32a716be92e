//! Seeded randomness for property-style end-to-end suites: `MM_SEED=<n>`
//! replays a run, otherwise a fresh seed is drawn (suites print it).

use anyhow::{Context, Result};

/// splitmix64: small, seedable, good enough to pick keys and names.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-enough in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// An index in `0..n` (`n > 0`).
    pub fn pick(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }
}

/// `MM_SEED` when set, else a random seed below 10^9.
pub fn seed() -> Result<u64> {
    if let Ok(s) = std::env::var("MM_SEED") {
        return s.trim().parse().with_context(|| format!("MM_SEED={s}"));
    }
    let mut buf = [0u8; 8];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(u64::from_le_bytes(buf) % 1_000_000_000)
}
