//! Euler discrete sampling, as diffusers 0.42.1's `EulerDiscreteScheduler` computes it.
//!
//! The arithmetic follows diffusers operation by operation and in the same precision (f32
//! tensors, with torch's f64 accumulation in `cumprod` and numpy's f64 `interp`/`linspace`), so
//! the sigmas and every latent step agree with the Python reference to float rounding. Only the
//! options SDXL checkpoints use are supported; the others are refused when the folder loads rather
//! than silently sampled differently.

use serde::Deserialize;

/// `scheduler/scheduler_config.json`, with diffusers' defaults for absent keys. Unknown keys
/// (options of other schedulers that share the file) are ignored. The sampler is always Euler
/// discrete, on the file's noise schedule: a folder naming another (`_class_name`, DDIM or
/// DPM-Solver in many fine-tunes) loads, with a warning that says so.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    #[serde(rename = "_class_name")]
    pub class_name: Option<String>,
    pub num_train_timesteps: u32,
    pub beta_start: f64,
    pub beta_end: f64,
    pub beta_schedule: String,
    pub trained_betas: Option<Vec<f32>>,
    pub prediction_type: String,
    pub interpolation_type: String,
    pub use_karras_sigmas: bool,
    pub use_exponential_sigmas: bool,
    pub use_beta_sigmas: bool,
    pub timestep_spacing: String,
    pub timestep_type: String,
    pub steps_offset: u32,
    pub rescale_betas_zero_snr: bool,
    pub final_sigmas_type: String,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        // diffusers' EulerDiscreteScheduler.__init__ defaults.
        SchedulerConfig {
            class_name: None,
            num_train_timesteps: 1000,
            beta_start: 0.0001,
            beta_end: 0.02,
            beta_schedule: "linear".into(),
            trained_betas: None,
            prediction_type: "epsilon".into(),
            interpolation_type: "linear".into(),
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            timestep_spacing: "linspace".into(),
            timestep_type: "discrete".into(),
            steps_offset: 0,
            rescale_betas_zero_snr: false,
            final_sigmas_type: "zero".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spacing {
    Linspace,
    Leading,
    Trailing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    Epsilon,
    VPrediction,
}

/// The training noise schedule, validated. Cheap to keep; [`EulerDiscrete::plan`] makes the
/// per-render sigmas.
#[derive(Debug, Clone)]
pub struct EulerDiscrete {
    spacing: Spacing,
    steps_offset: u32,
    prediction: Prediction,
    /// `((1 - alphas_cumprod) / alphas_cumprod) ** 0.5` over the training timesteps, in f32.
    train_sigmas: Vec<f32>,
}

impl EulerDiscrete {
    /// Checks the configuration and precomputes the training sigmas.
    ///
    /// # Errors
    /// A description of the first unsupported option.
    pub fn new(config: &SchedulerConfig) -> Result<Self, String> {
        let unsupported = |what: &str| Err(format!("unsupported scheduler option {what}"));
        if config.use_karras_sigmas || config.use_exponential_sigmas || config.use_beta_sigmas {
            return unsupported("karras/exponential/beta sigmas");
        }
        if config.rescale_betas_zero_snr {
            return unsupported("rescale_betas_zero_snr");
        }
        if config.interpolation_type != "linear" {
            return unsupported(&format!("interpolation_type {:?}", config.interpolation_type));
        }
        if config.timestep_type != "discrete" {
            return unsupported(&format!("timestep_type {:?}", config.timestep_type));
        }
        if config.final_sigmas_type != "zero" {
            return unsupported(&format!("final_sigmas_type {:?}", config.final_sigmas_type));
        }
        let spacing = match config.timestep_spacing.as_str() {
            "linspace" => Spacing::Linspace,
            "leading" => Spacing::Leading,
            "trailing" => Spacing::Trailing,
            other => return unsupported(&format!("timestep_spacing {other:?}")),
        };
        let prediction = match config.prediction_type.as_str() {
            "epsilon" => Prediction::Epsilon,
            "v_prediction" => Prediction::VPrediction,
            other => return unsupported(&format!("prediction_type {other:?}")),
        };
        let n = config.num_train_timesteps as usize;
        if n < 2 {
            return Err("num_train_timesteps must be at least 2".into());
        }
        let betas: Vec<f32> = match (&config.trained_betas, config.beta_schedule.as_str()) {
            (Some(betas), _) if betas.len() == n => betas.clone(),
            (Some(_), _) => return Err("trained_betas must have num_train_timesteps entries".into()),
            (None, "linear") => torch_linspace_f32(config.beta_start as f32, config.beta_end as f32, n),
            (None, "scaled_linear") => {
                torch_linspace_f32(config.beta_start.sqrt() as f32, config.beta_end.sqrt() as f32, n)
                    .into_iter()
                    .map(|b| b * b)
                    .collect()
            }
            (None, other) => return unsupported(&format!("beta_schedule {other:?}")),
        };
        // Each beta is a variance added per step: outside (0, 1) the schedule has no meaning,
        // and its NaNs would surface only at the decoder.
        if let Some((t, beta)) = betas.iter().enumerate().find(|(_, b)| !(**b > 0.0 && **b < 1.0)) {
            return Err(format!(
                "beta at timestep {t} is {beta}: every beta must lie in (0, 1) (beta_start {}, beta_end {}, {})",
                config.beta_start, config.beta_end, config.beta_schedule
            ));
        }
        // torch.cumprod on the CPU accumulates f32 in f64 and stores each partial product as f32.
        let mut acc = 1.0f64;
        let train_sigmas = betas
            .iter()
            .map(|&beta| {
                acc *= f64::from(1.0f32 - beta);
                let alpha_cumprod = acc as f32;
                ((1.0f32 - alpha_cumprod) / alpha_cumprod).sqrt()
            })
            .collect();
        Ok(EulerDiscrete { spacing, steps_offset: config.steps_offset, prediction, train_sigmas })
    }

    /// The sampler a folder's `_class_name` names when it is not this one, for the load warning.
    pub fn other_sampler(config: &SchedulerConfig) -> Option<&str> {
        config.class_name.as_deref().filter(|name| !matches!(*name, "EulerDiscreteScheduler"))
    }

    pub fn prediction(&self) -> Prediction {
        self.prediction
    }

    /// The timesteps and sigmas of a render with `steps` inference steps (`set_timesteps`).
    pub fn plan(&self, steps: u32) -> Schedule {
        let n_train = self.train_sigmas.len();
        let steps_usize = steps.max(1) as usize;
        let timesteps: Vec<f32> = match self.spacing {
            Spacing::Linspace => {
                let mut t = numpy_linspace_f64(0.0, (n_train - 1) as f64, steps_usize);
                t.reverse();
                t.into_iter().map(|x| x as f32).collect()
            }
            Spacing::Leading => {
                let ratio = n_train / steps_usize;
                (0..steps_usize)
                    .rev()
                    .map(|i| (i * ratio) as f32 + self.steps_offset as f32)
                    .collect()
            }
            Spacing::Trailing => {
                // np.arange(n_train, 0, -ratio).round() - 1, with numpy's half-to-even rounding.
                let ratio = n_train as f64 / steps_usize as f64;
                let len = (n_train as f64 / ratio).ceil() as usize;
                (0..len)
                    .map(|i| ((n_train as f64 + i as f64 * -ratio).round_ties_even() as f32) - 1.0)
                    .collect()
            }
        };
        let mut sigmas: Vec<f32> =
            timesteps.iter().map(|&t| numpy_interp(f64::from(t), &self.train_sigmas) as f32).collect();
        sigmas.push(0.0);
        let max_sigma = sigmas.iter().copied().fold(f32::MIN, f32::max);
        let init_noise_sigma = match self.spacing {
            Spacing::Linspace | Spacing::Trailing => max_sigma,
            Spacing::Leading => (max_sigma * max_sigma + 1.0).sqrt(),
        };
        Schedule { timesteps, sigmas, init_noise_sigma, prediction: self.prediction }
    }
}

/// The sigmas of one render: `timesteps[i]` goes to the UNet at step `i`, which moves the latents
/// from `sigmas[i]` to `sigmas[i + 1]` (the last sigma is zero).
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub timesteps: Vec<f32>,
    pub sigmas: Vec<f32>,
    /// The factor applied to unit-variance noise to make the first latents.
    pub init_noise_sigma: f32,
    prediction: Prediction,
}

impl Schedule {
    pub fn len(&self) -> usize {
        self.timesteps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.timesteps.is_empty()
    }

    /// The factor `scale_model_input` divides the latents by before step `i`'s UNet call.
    pub fn input_scale(&self, i: usize) -> f32 {
        let sigma = self.sigmas[i];
        (sigma * sigma + 1.0).sqrt()
    }

    /// The step graph's parameters for step `i` (guidance, sigma, dt, the next sample's divisor),
    /// or `None` where only the host step applies (v-prediction).
    pub fn device_step_params(&self, i: usize, guidance: f32) -> Option<[f32; 4]> {
        if self.prediction != Prediction::Epsilon {
            return None;
        }
        let sigma = self.sigmas[i];
        let next = if i + 1 < self.len() { self.input_scale(i + 1) } else { 1.0 };
        Some([guidance, sigma, self.sigmas[i + 1] - sigma, next])
    }

    /// `scale_model_input`: latents / sqrt(sigma^2 + 1).
    pub fn scale_model_input(&self, i: usize, latents: &[f32], out: &mut [f32]) {
        let scale = self.input_scale(i);
        for (o, &x) in out.iter_mut().zip(latents) {
            *o = x / scale;
        }
    }

    /// One Euler step in place (`step` with s_churn = 0, so sigma_hat = sigma).
    pub fn step(&self, i: usize, model_output: &[f32], latents: &mut [f32]) {
        let sigma = self.sigmas[i];
        let dt = self.sigmas[i + 1] - sigma;
        match self.prediction {
            Prediction::Epsilon => {
                for (x, &eps) in latents.iter_mut().zip(model_output) {
                    // Written as diffusers does (not simplified to x + eps * dt): the rounding
                    // then matches the reference bit for bit in most elements.
                    let pred_original = *x - sigma * eps;
                    let derivative = (*x - pred_original) / sigma;
                    *x += derivative * dt;
                }
            }
            Prediction::VPrediction => {
                let s2 = sigma * sigma + 1.0;
                let c_out = -sigma / s2.sqrt();
                for (x, &v) in latents.iter_mut().zip(model_output) {
                    let pred_original = v * c_out + *x / s2;
                    let derivative = (*x - pred_original) / sigma;
                    *x += derivative * dt;
                }
            }
        }
    }
}

/// `torch.linspace(start, end, n, dtype=float32)` as the CPU kernel computes it: from the start
/// for the first half, from the end for the second.
fn torch_linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| if i < half { start + step * i as f32 } else { end - step * (n - i - 1) as f32 })
        .collect()
}

/// `np.linspace(start, stop, n)` in f64, endpoint included.
fn numpy_linspace_f64(start: f64, stop: f64, n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![start];
    }
    let step = (stop - start) / (n - 1) as f64;
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * step + start).collect();
    v[n - 1] = stop;
    v
}

/// `np.interp(x, arange(len(fp)), fp)` in f64.
fn numpy_interp(x: f64, fp: &[f32]) -> f64 {
    let last = fp.len() - 1;
    if x <= 0.0 {
        return f64::from(fp[0]);
    }
    if x >= last as f64 {
        return f64::from(fp[last]);
    }
    let j = x.floor() as usize;
    if x == j as f64 {
        return f64::from(fp[j]);
    }
    let slope = f64::from(fp[j + 1]) - f64::from(fp[j]);
    slope * (x - j as f64) + f64::from(fp[j])
}

#[cfg(test)]
// The expected values are diffusers' f32 output printed with 10 significant digits.
#[allow(clippy::excessive_precision)]
mod tests {
    use super::*;

    fn sdxl() -> SchedulerConfig {
        SchedulerConfig {
            beta_start: 0.00085,
            beta_end: 0.012,
            beta_schedule: "scaled_linear".into(),
            timestep_spacing: "leading".into(),
            steps_offset: 1,
            ..SchedulerConfig::default()
        }
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol * y.abs().max(1.0), "{a:?} vs {b:?}");
        }
    }

    // Expected values printed by diffusers 0.42.1:
    // s = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    //     timestep_spacing=..., steps_offset=...); s.set_timesteps(n); print(s.timesteps, s.sigmas,
    //     s.init_noise_sigma)
    #[test]
    fn a_schedule_outside_its_range_is_refused_and_another_sampler_is_named() {
        let wrong = SchedulerConfig { beta_schedule: "linear".into(), beta_end: 2.0, ..sdxl() };
        let refused = EulerDiscrete::new(&wrong).unwrap_err();
        assert!(refused.contains("must lie in (0, 1)") && refused.contains("beta_end 2"), "{refused}");
        let ddim = SchedulerConfig { class_name: Some("DDIMScheduler".into()), ..sdxl() };
        assert!(EulerDiscrete::new(&ddim).is_ok());
        assert_eq!(EulerDiscrete::other_sampler(&ddim), Some("DDIMScheduler"));
        let euler = SchedulerConfig { class_name: Some("EulerDiscreteScheduler".into()), ..sdxl() };
        assert_eq!(EulerDiscrete::other_sampler(&euler), None);
    }

    #[test]
    fn diffusers_leading_4() {
        let config = SchedulerConfig { timestep_spacing: "leading".into(), steps_offset: 1, ..sdxl() };
        let plan = EulerDiscrete::new(&config).unwrap().plan(4);
        close(&plan.timesteps, &[7.510000000e+02, 5.010000000e+02, 2.510000000e+02, 1.000000000e+00], 0.0);
        close(&plan.sigmas, &[4.116698265e+00, 1.623692989e+00, 6.983985901e-01, 4.131447896e-02, 0.000000000e+00], 1e-6);
        close(&[plan.init_noise_sigma], &[4.236413956e+00], 1e-6);
    }

    #[test]
    fn diffusers_leading_30() {
        let config = SchedulerConfig { timestep_spacing: "leading".into(), steps_offset: 1, ..sdxl() };
        let plan = EulerDiscrete::new(&config).unwrap().plan(30);
        close(&plan.timesteps, &[9.580000000e+02, 9.250000000e+02, 8.920000000e+02, 8.590000000e+02, 8.260000000e+02, 7.930000000e+02, 7.600000000e+02, 7.270000000e+02, 6.940000000e+02, 6.610000000e+02, 6.280000000e+02, 5.950000000e+02, 5.620000000e+02, 5.290000000e+02, 4.960000000e+02, 4.630000000e+02, 4.300000000e+02, 3.970000000e+02, 3.640000000e+02, 3.310000000e+02, 2.980000000e+02, 2.650000000e+02, 2.320000000e+02, 1.990000000e+02, 1.660000000e+02, 1.330000000e+02, 1.000000000e+02, 6.700000000e+01, 3.400000000e+01, 1.000000000e+00], 0.0);
        close(&plan.sigmas, &[1.147685051e+01, 9.543585777e+00, 8.004313469e+00, 6.768384457e+00, 5.767774105e+00, 4.951041698e+00, 4.279001713e+00, 3.721591711e+00, 3.255588293e+00, 2.862931728e+00, 2.529487371e+00, 2.244122267e+00, 1.998015046e+00, 1.784132123e+00, 1.596831918e+00, 1.431561112e+00, 1.284621835e+00, 1.152988672e+00, 1.034166932e+00, 9.260795116e-01, 8.269737959e-01, 7.353430986e-01, 6.498568058e-01, 5.692853928e-01, 4.924096763e-01, 4.178798795e-01, 3.439318240e-01, 2.676529884e-01, 1.821663678e-01, 4.131447896e-02, 0.000000000e+00], 1e-6);
        close(&[plan.init_noise_sigma], &[1.152033424e+01], 1e-6);
    }

    #[test]
    fn diffusers_trailing_7() {
        let config = SchedulerConfig { timestep_spacing: "trailing".into(), steps_offset: 0, ..sdxl() };
        let plan = EulerDiscrete::new(&config).unwrap().plan(7);
        close(&plan.timesteps, &[9.990000000e+02, 8.560000000e+02, 7.130000000e+02, 5.700000000e+02, 4.280000000e+02, 2.850000000e+02, 1.420000000e+02], 0.0);
        close(&plan.sigmas, &[1.461464691e+01, 6.668572903e+00, 3.513879538e+00, 2.054476738e+00, 1.276235819e+00, 7.900615335e-01, 4.380623102e-01, 0.000000000e+00], 1e-6);
        close(&[plan.init_noise_sigma], &[1.461464691e+01], 1e-6);
    }

    #[test]
    fn diffusers_linspace_5() {
        let config = SchedulerConfig { timestep_spacing: "linspace".into(), steps_offset: 0, ..sdxl() };
        let plan = EulerDiscrete::new(&config).unwrap().plan(5);
        close(&plan.timesteps, &[9.990000000e+02, 7.492500000e+02, 4.995000000e+02, 2.497500000e+02, 0.000000000e+00], 0.0);
        close(&plan.sigmas, &[1.461464691e+01, 4.086089611e+00, 1.615583420e+00, 6.951509714e-01, 2.916753478e-02, 0.000000000e+00], 1e-6);
        close(&[plan.init_noise_sigma], &[1.461464691e+01], 1e-6);
    }

    #[test]
    fn diffusers_leading_3() {
        let config = SchedulerConfig { timestep_spacing: "leading".into(), steps_offset: 1, ..sdxl() };
        let plan = EulerDiscrete::new(&config).unwrap().plan(3);
        close(&plan.timesteps, &[6.670000000e+02, 3.340000000e+02, 1.000000000e+00], 0.0);
        close(&plan.sigmas, &[2.929549932e+00, 9.355102181e-01, 4.131447896e-02, 0.000000000e+00], 1e-6);
        close(&[plan.init_noise_sigma], &[3.095523119e+00], 1e-6);
    }

    #[test]
    fn diffusers_step_leading_4() {
        let plan = EulerDiscrete::new(&sdxl()).unwrap().plan(4);
        let mut x = [0.5f32, -1.25, 3.0, 0.001];
        let mut scaled = [0.0f32; 4];
        plan.scale_model_input(0, &x, &mut scaled);
        close(&scaled, &[1.180243492e-01, -2.950608730e-01, 7.081460953e-01, 2.360487124e-04], 1e-6);
        plan.step(0, &[0.1, -0.7, 1.5, 2.0], &mut x);
        close(&x, &[2.506994605e-01, 4.951037169e-01, -7.395079136e-01, -4.985010624e+00], 1e-6);
    }
}
