//! Random bits: for fencing tokens, whose collision bound rests on them, and for
//! jitter. From `rand`'s thread-local generator, seeded by the operating system.

/// 64 random bits.
pub(crate) fn u64() -> u64 {
    rand::random()
}
