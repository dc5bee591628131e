//! Initial latent noise, reproducible per (seed, image index).
//!
//! Each image draws from its own ChaCha8 stream, keyed by the job seed and selected by the image
//! index, so image 3 of a job is the same whether it was rendered in a batch of four, alone, or
//! on another worker after a degrade split the batch. The noise is unit variance; the scheduler's
//! `init_noise_sigma` is applied by the caller.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// Fills `out` with standard normal noise for image `index` of a job seeded with `seed`.
pub fn fill_image_noise(seed: u64, index: u32, out: &mut [f32]) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // One stream per image: independent of how images are grouped and of their order.
    rng.set_stream(u64::from(index));
    for x in out.iter_mut() {
        *x = StandardNormal.sample(&mut rng);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_index_same_noise() {
        let mut a = vec![0.0; 64];
        let mut b = vec![0.0; 64];
        fill_image_noise(42, 1, &mut a);
        fill_image_noise(42, 1, &mut b);
        assert_eq!(a, b);
        fill_image_noise(42, 2, &mut b);
        assert_ne!(a, b);
        fill_image_noise(43, 1, &mut b);
        assert_ne!(a, b);
    }

    #[test]
    fn roughly_standard_normal() {
        let mut v = vec![0.0f32; 100_000];
        fill_image_noise(7, 0, &mut v);
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }
}
