//! YaRN RoPE scaling (`rope_scaling.rope_type = "yarn"`, a GGUF's `rope.scaling.type = yarn`):
//! per frequency, a blend of the base frequency (extrapolated) and the base divided by the
//! scale factor (interpolated), ramped between the dimensions that turn `beta_fast` and
//! `beta_slow` times over the window the model was trained with, and an attention factor on
//! the rotary tables. Computed here, as Hugging Face transformers computes it, into the
//! divisors and the attention factor every RoPE of the graph applies.

use serde::Deserialize;

use super::RopeConfig;

/// YaRN's parameters, as `rope_scaling` names them (another is refused by name).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Yarn {
    /// Context extension factor (`None`: the window over the original one).
    factor: Option<f32>,
    /// The window the model was trained with (`None`: the model's window).
    original_max_position_embeddings: Option<usize>,
    beta_fast: Option<f32>,
    beta_slow: Option<f32>,
    /// Whether the ramp's ends are rounded out to whole dimensions (default: yes).
    truncate: Option<bool>,
    attention_factor: Option<f32>,
    mscale: Option<f32>,
    mscale_all_dim: Option<f32>,
}

impl Yarn {
    /// A GGUF's YaRN: its `factor` over the `original` window (llama.cpp rounds the ramp's
    /// ends out, as `truncate` does).
    pub(super) fn gguf(factor: f32, original: Option<usize>, betas: [Option<f32>; 2]) -> Self {
        Self {
            factor: Some(factor),
            original_max_position_embeddings: original,
            beta_fast: betas[0],
            beta_slow: betas[1],
            truncate: Some(true),
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
        }
    }

    /// The window the model was trained with where `rope_scaling` does not say it
    /// (`original`: the config's top-level field, if it has one).
    pub(super) fn default_original(&mut self, original: Option<usize>) {
        self.original_max_position_embeddings = self.original_max_position_embeddings.or(original);
    }

    /// Sets `rope`'s frequency divisors (`dim / 2` of them, over `base`) and attention factor
    /// for a model whose window is `window`.
    pub(super) fn apply(&self, rope: &mut RopeConfig, dim: usize, window: usize) {
        let original = self.original_max_position_embeddings.unwrap_or(window);
        let factor = self
            .factor
            .unwrap_or(window as f32 / original.max(1) as f32);
        let mscale = |scale: f32, m: f32| match scale <= 1.0 {
            true => 1.0,
            false => 0.1 * m * scale.ln() + 1.0,
        };
        rope.attention_factor = Some(self.attention_factor.unwrap_or(
            match (self.mscale, self.mscale_all_dim) {
                (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    mscale(factor, m) / mscale(factor, all)
                }
                _ => mscale(factor, 1.0),
            },
        ));
        let base = rope.base as f64;
        let correction = |rotations: f32| {
            let turns = original as f64 / (rotations as f64 * 2.0 * std::f64::consts::PI);
            dim as f64 * turns.ln() / (2.0 * base.ln())
        };
        let (mut low, mut high) = (
            correction(self.beta_fast.unwrap_or(32.0)),
            correction(self.beta_slow.unwrap_or(1.0)),
        );
        if self.truncate.unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        let span = if low == high { 0.001 } else { high - low };
        rope.freq_factors = Some(
            (0..dim / 2)
                .map(|i| {
                    // The share of the base frequency kept (1 below the ramp, 0 above it).
                    let kept = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
                    let scaled = (1.0 - kept) / factor as f64 + kept;
                    (1.0 / scaled) as f32
                })
                .collect(),
        );
    }
}
