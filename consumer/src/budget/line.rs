//! Device memory the worker keeps between jobs beside its models: the LoRA pool's merged sets.
//! The budget counts it as a line of its own, as it counts the models (the room subtracts it),
//! and asks for what no render holds back before it refuses a job. The budget knows it only
//! through this trait; the worker hands it the pool.

/// A line of device memory the budget counts beside the models and may ask back.
pub trait DeviceLine: Send + Sync {
    /// Bytes the line holds on the device now.
    fn device_bytes(&self) -> u64;

    /// Of those, the bytes it could give back now (what no render holds).
    fn reclaimable_bytes(&self) -> u64;

    /// Gives back at least `bytes` where it can; returns the bytes given back.
    fn reclaim(&self, bytes: u64) -> u64;
}
